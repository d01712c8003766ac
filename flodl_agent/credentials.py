"""Credentials: the one rule for a run's join token, and where a token may come from.

A token is 32 hex characters (``secrets.token_hex(16)``). The schema's
``join.token``, ``fdl join``/``fdl start``'s ``--token -``/``FDL_TOKEN`` and
the launcher's agent spec all check it with ``TOKEN_RE``; the worker role's
assert spells the same regex in YAML (a unit test holds the two together).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping

TOKEN_HEX = 32  # characters: 16 random bytes
TOKEN_PATTERN = f"[0-9a-fA-F]{{{TOKEN_HEX}}}"
TOKEN_RE = re.compile(TOKEN_PATTERN)
# What `--token -` reads at most: a token, its newline and some blanks. stdin may be
# /dev/zero or a pipe that never ends; a longer line is refused, never buffered whole.
TOKEN_LINE_MAX = 256
# A fan-out key is the token, or a 32-byte salt/key derived for one launch (64 hex).
SPEC_KEY_PATTERN = f"^([0-9a-f]{{{TOKEN_HEX}}}|[0-9a-f]{{{2 * TOKEN_HEX}}})$"


def valid_token(value: str) -> bool:
    return TOKEN_RE.fullmatch(value) is not None


class CredentialError(ValueError):
    """A credential passed the wrong way or in the wrong shape: a usage error (exit 2)."""


def token_from(option: str | None, stdin_line: str | None, env: Mapping[str, str]) -> str | None:
    """The token from ``--token -`` (``stdin_line``, read by the caller) or FDL_TOKEN; pure.

    Credentials come from the environment or stdin, never argv.
    """
    if option == "-":
        token, source = (stdin_line or "").strip(), "stdin"
        if not token:
            # Asked for a token and got none: running on without one would fail later, worse.
            raise CredentialError(
                "--token - read no token: stdin was empty; pipe the run's join.token in "
                "(e.g. fdl join ADDRESS --token - < token.txt), or leave --token out for a run "
                "without one"
            )
    elif option is not None:
        raise CredentialError(
            "--token takes `-` (read the token from stdin); a token in argv is visible to every "
            "user of this box. Or set FDL_TOKEN."
        )
    else:
        token, source = env.get("FDL_TOKEN", "").strip(), "FDL_TOKEN"
    if token and not valid_token(token):
        raise CredentialError(
            f"the token from {source} is not {TOKEN_HEX} hex characters: pass the run's join.token"
        )
    return token or None


def read_token(option: str | None) -> str | None:
    """The IO shell of ``token_from``: stdin is read only for ``--token -``, one bounded line."""
    line = stdin_line(TOKEN_LINE_MAX, "--token -") if option == "-" else None
    return token_from(option, line, os.environ)


def stdin_line(limit: int, flag: str) -> str:
    """One line of stdin, at most ``limit`` characters (a closed stdin reads as empty): a longer
    line, or a stdin that cannot be read (a directory, bytes that are not text), is a
    ``CredentialError`` naming ``flag``."""
    if sys.stdin is None:  # fd 0 closed (`<&-`): nothing to read
        return ""
    try:
        line = sys.stdin.readline(limit + 1)
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else f"it is not {sys.stdin.encoding} text"
        raise CredentialError(f"{flag} cannot read stdin: {why}; pipe in one line of text") from None
    if len(line) > limit:
        raise CredentialError(
            f"{flag} read a line longer than {limit} characters from stdin: pipe in the one "
            "line it takes, not a stream"
        )
    return line

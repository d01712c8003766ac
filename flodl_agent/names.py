"""Names and text from users and peers: the one host-name rule, and text a terminal cannot act on.

A host name is a roster entry (``cluster.workers[].host``, ``join.host``), a walk-in's
``--host`` and the hello's ``host``: one rule for all of them, checked where each is
taken, so a name the config accepts is one the controller admits.

Peer-supplied text reaches operators' terminals and logs. A code point that is not
printable (C0 and C1 controls, DEL, the line and paragraph separators, the bidi
embeddings, overrides, isolates and marks, zero-width and other format characters)
can rewrite what a terminal shows: a C1 CSI starts an escape sequence, U+202E turns
the rest of a line around. Names with one are refused; other text is shown with each
such code point escaped (``printable``). "Printable" is Python's ``str.isprintable``:
every letter, digit, mark, punctuation and symbol, and the plain space.

Text that reaches a process (an argument, an environment entry, a path) must be text the
OS can pass: no NUL, which ends a C string (exec, putenv and open refuse it), and no lone
surrogate, which has no encoding at all (``os_problem``); an environment name is not empty
and holds no ``=`` either (``env_name_problem``). The schema and the wire both check it, so
what would crash a spawn is refused by name where it is written or received.

Pure: no IO.
"""

from __future__ import annotations

import re
from collections.abc import Callable

HOST_NAME_MAX = 253  # a full DNS name; the hello carries no longer one
SHOWN_MAX = 60  # characters of a bad value quoted back in a message
# A compose service (join.docker): compose's own rule, and never an option.
SERVICE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\Z")  # \Z: `$` would take "svc\n"
_FORBIDDEN = "/\\:@"  # a path, an address (host:port), a login (user@host)


def _escape(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: str) -> str:
    """``text`` with every code point a terminal would act on written as an escape (``\\u202e``)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def printable_lines(text: str) -> str:
    """``text`` line by line through :func:`printable`, its own line breaks kept (a failure and
    its ``fix:``); a line after the first is indented, so a peer's words cannot pass for a
    line of the log's own (a forged timestamp)."""
    first, *rest = text.split("\n")
    indented = (line if line.startswith("    ") else "    " + line for line in rest)
    return "\n".join([printable(first), *map(printable, indented)])


def unprintable(text: str) -> str | None:
    """The first code point of ``text`` a terminal would act on, escaped; ``None`` when none is."""
    if text.isprintable():
        return None
    return _escape(next(c for c in text if not c.isprintable()))


def safe_lines(log: Callable[[str], None]) -> Callable[[str], None]:
    """``log`` for lines that quote peers: each one written through :func:`printable`."""
    return lambda line: log(printable(line))


def shown(text: str, limit: int = SHOWN_MAX) -> str:
    """A value quoted back in a message: escaped, and cut to ``limit`` characters."""
    cut = text if len(text) <= limit else text[: limit - 1] + "…"
    return printable(cut)


def name_problem(name: str, what: str = "host name") -> tuple[str, str] | None:
    """Why ``name`` cannot be a ``what`` (a message and its fix), or ``None`` when it can.

    Not empty, at most 253 characters, printable, and no whitespace, ``/``, ``\\``,
    ``:`` or ``@``; nor a leading ``-`` (ssh, the default transport to a roster host,
    would read the name as an option)."""
    fix = "use letters, digits, `.`, `-` and `_`, e.g. box-7"
    if not name:
        return "is empty", f"give it a name ({fix})"
    if len(name) > HOST_NAME_MAX:
        return f"is {len(name)} characters long: a {what} has at most {HOST_NAME_MAX}", "shorten it"
    hidden = unprintable(name)  # every whitespace but the space is unprintable, too
    if hidden is not None:
        return (
            f"`{shown(name)}` is not a {what}: it holds {hidden}, a control, bidi or invisible character",
            f"type the name again by hand ({fix})",
        )
    bad = [c for c in name if c == " " or c in _FORBIDDEN]
    if bad:
        return f"`{shown(name)}` is not a {what}: no spaces, `/`, `\\`, `:` or `@`", fix
    if name.startswith("-"):
        return f"`{shown(name)}` is not a {what}: it starts with `-`, which ssh reads as an option", fix
    return None


NUL_FIX = "remove it (in YAML, a `\\0` or `\\x00` escape in a double-quoted string writes one)"


def os_problem(text: str) -> tuple[str, str] | None:
    """Why no process can be handed ``text`` as an argument, environment entry or path (a
    message and its fix), or ``None`` when one can: a NUL byte, or a lone surrogate (YAML's
    ``"\\ud800"``), which neither UTF-8 nor the file system encoding can write."""
    if text.isprintable():  # the common case; NUL and every surrogate are unprintable
        return None
    if "\x00" in text:
        return (
            "holds a NUL byte (\\x00), which no argument, environment entry or path can carry: "
            "the OS ends the text there",
            NUL_FIX,
        )
    lone = next((c for c in text if "\ud800" <= c <= "\udfff"), None)
    if lone is not None:
        return (
            f"holds {_escape(lone)}, a lone surrogate: no character, so it has no encoding a "
            "process can be passed",
            "write the character itself, or one `\\U` escape for it (e.g. \\U0001F600), not "
            "the halves of a UTF-16 pair",
        )
    return None


def env_name_problem(name: str) -> tuple[str, str] | None:
    """Why ``name`` cannot name an environment variable (a message and its fix), or ``None``:
    empty, holding ``=`` (the first ends the name, so the rest would be read as the value),
    or what :func:`os_problem` refuses."""
    if not name:
        return "an environment variable's name is empty", "name the variable, or drop the entry"
    if "=" in name:
        return (
            f"`{shown(name)}` holds `=`, which ends an environment variable's name (the rest "
            "would be read as its value)",
            "write the name alone as the key and the value after the colon (NAME: value)",
        )
    return os_problem(name)

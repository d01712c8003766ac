"""One token rule: 32 hex characters, wherever a token comes from or is checked."""

from __future__ import annotations

import errno
import io
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from flodl_agent.agent.spec import AgentSpec
from flodl_agent.config import Join
from flodl_agent.credentials import (
    TOKEN_LINE_MAX,
    TOKEN_PATTERN,
    CredentialError,
    read_token,
    token_from,
    valid_token,
)
from tests.support import hostile

ROOT = Path(__file__).parent.parent.parent
TOKEN = "0123456789abcdef" * 2

SAMPLES = [
    (TOKEN, True),
    (TOKEN.upper(), True),
    (TOKEN[:-1], False),
    (TOKEN + "0", False),
    (TOKEN[:-1] + "g", False),
    ("", False),
    (" " + TOKEN, False),
    (TOKEN + "\n", False),
    ("ab" * 32, False),  # a fan-out key, not a token
]


@pytest.mark.parametrize(("value", "valid"), SAMPLES)
def test_the_token_rule(value: str, valid: bool) -> None:
    assert valid_token(value) is valid


def _role_token_regex() -> str:
    tasks = yaml.safe_load((ROOT / "roles/flodl_worker/tasks/main.yml").read_text())
    for line in tasks[0]["ansible.builtin.assert"]["that"]:
        found = re.search(r"flodl_worker_token is match\('([^']+)'\)", line)
        if found:
            return found.group(1)
    raise AssertionError("the worker role no longer checks flodl_worker_token")


def test_the_worker_roles_assert_spells_the_same_pattern() -> None:
    assert _role_token_regex() == f"^{TOKEN_PATTERN}$"


@pytest.mark.parametrize(("value", "valid"), [s for s in SAMPLES if not s[0].endswith("\n")])
def test_the_worker_roles_assert_holds_the_same_rule(value: str, valid: bool) -> None:
    # Jinja's `match` is re.match: anchored at the start only, so the role's `^...$` matters
    # (the trailing-newline sample is left out: `$` before a final newline is a quirk of re).
    assert (re.match(_role_token_regex(), value) is not None) is valid


@pytest.mark.parametrize(("value", "valid"), SAMPLES)
def test_the_schema_holds_the_same_rule(value: str, valid: bool) -> None:
    try:
        Join.model_validate({"token": value})
    except ValueError:
        assert not valid
    else:
        assert valid


@pytest.mark.parametrize(
    ("key", "valid"),
    [(TOKEN, True), ("ab" * 32, True), ("ab" * 24, False), (TOKEN.upper(), False), ("ab" * 33, False)],
)
def test_an_agent_spec_key_is_a_token_or_a_fan_out_key(key: str, valid: bool) -> None:
    try:
        AgentSpec(key=key)
    except ValueError:
        assert not valid
    else:
        assert valid


@pytest.mark.parametrize(
    ("option", "stdin", "env", "expected"),
    [
        ("-", TOKEN + "\n", {"FDL_TOKEN": "ff" * 16}, TOKEN),  # --token - beats FDL_TOKEN
        (None, None, {"FDL_TOKEN": f" {TOKEN} "}, TOKEN),
        (None, None, {}, None),
    ],
)
def test_a_token_comes_from_stdin_then_the_environment(
    option: str | None, stdin: str | None, env: dict[str, str], expected: str | None
) -> None:
    assert token_from(option, stdin, env) == expected


@pytest.mark.parametrize(
    ("option", "stdin", "env", "words"),
    [
        (TOKEN, None, {}, "a token in argv is visible"),
        ("-", "short\n", {}, "the token from stdin is not 32 hex"),
        ("-", "\n", {}, "--token - read no token: stdin was empty"),  # asked for one, got none
        ("-", "", {"FDL_TOKEN": TOKEN}, "--token - read no token"),
        (None, None, {"FDL_TOKEN": "short"}, "the token from FDL_TOKEN is not 32 hex"),
    ],
)
def test_a_token_in_argv_or_of_the_wrong_shape_is_refused(
    option: str | None, stdin: str | None, env: dict[str, str], words: str
) -> None:
    with pytest.raises(CredentialError, match=words):
        token_from(option, stdin, env)


@pytest.mark.parametrize("byte", [b"0", b"\0"])
def test_token_dash_reads_one_bounded_line_and_refuses_a_stream(
    monkeypatch: pytest.MonkeyPatch, byte: bytes
) -> None:
    stdin = hostile.Endless(cap=1 << 20, byte=byte)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(stdin)))
    with pytest.raises(CredentialError, match="--token - read a line longer than 256 characters"):
        read_token("-")
    assert stdin.given <= 64 * 1024  # a buffer's worth, never the stream


def test_token_dash_takes_a_line_at_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    line = TOKEN + " " * (TOKEN_LINE_MAX - len(TOKEN) - 1) + "\n"  # TOKEN_LINE_MAX characters
    monkeypatch.setattr(sys, "stdin", io.StringIO(line + "more"))
    assert read_token("-") == TOKEN


class Directory(io.RawIOBase):
    """`< /`: the shell opens a directory, and every read of it fails."""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        raise IsADirectoryError(errno.EISDIR, "Is a directory")


def test_token_dash_on_a_closed_or_unreadable_stdin_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", None)  # `<&-`
    with pytest.raises(CredentialError, match="stdin was empty"):
        read_token("-")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(Directory())))
    with pytest.raises(CredentialError, match="--token - cannot read stdin: Is a directory"):
        read_token("-")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe\n"), encoding="utf-8"))
    with pytest.raises(CredentialError, match="cannot read stdin: it is not utf-8 text"):
        read_token("-")

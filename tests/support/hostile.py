"""Hostile input for the command line: strings, numbers, addresses and config files.

What a new user mistypes and what an attacker tries: empty and huge values, spaces and
path tricks, control and bidi code points, schemes and unbracketed IPv6 in addresses,
YAML that nests deep, repeats keys, chains anchors, carries tags or is not UTF-8 at all;
NUL bytes in values bound for a process; paths that are no regular file (a FIFO waits for
a writer, /dev/zero never ends); a stdin that never ends.

Nothing here resolves or reaches anything: every address that parses is an IP literal on
a port nobody listens on (a dial is refused at once).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import yaml
from hypothesis import strategies as st

CLOSED = ("127.0.0.1:1", "[::1]:1")  # parse, and are refused at once when dialled

TEXTS = (
    "",
    " ",
    "a b",
    "../../etc",
    "a\\b",
    "a" * 254,
    "x" * 5000,
    "ev\u202eil",  # right-to-left override
    "box\u009b31m",  # C1 CSI
    "line\u2028break",
    "zero\u200bwidth",
    "tab\there",
    "new\nline",
    "-",
    "--",
    "-x",
    "--bogus",
    "cpu:0",
    "cpu:1025",
    "cpu:100000",
    "cpu:" + "9" * 5000,
    "9" * 5000,
    "0,0",
    "0,,1",
    "²",
    "-1",
    "1e309",
    "é",
    "\U0001f600",
    "%s%n",
    "$(id)",
    "'",
    '"',
    "[red]markup[/red]",
    "sha256:xyz",
)
ADDRESSES = (
    *CLOSED,
    "http://127.0.0.1:1",
    "fd00::1",
    "fd00::1:1337",
    "[fd00::1",
    "[127.0.0.1]:1",
    "127.0.0.1:99999",
    "127.0.0.1:0",
    "127.0.0.1:",
    ":1",
    "127.0.0.1:²",
    "1337",
    "127.1:1",
    "user@127.0.0.1:1",
    "-oProxyCommand=x@127.0.0.1:1",
    "@127.0.0.1:1",
    "a" * 300 + ":1",
    "ev\u202eil:1",
)
NUMBERS = ("0", "-1", "65536", "99999999999999999999", "1e309", "nan", "inf", "x", "1", "0.5")
UNKNOWN_FLAGS = ("--bogus", "--max-failur", "--devcies", "--hots", "-Z", "--prot")

text = st.one_of(
    st.sampled_from(TEXTS),
    st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=40),
)
addresses = st.sampled_from(ADDRESSES + TEXTS[:12])
numbers = st.sampled_from(NUMBERS)

# --- config files --------------------------------------------------------------------------

# Valid as they stand: a loopback discovery window that fails at its 1 s hard cap (nobody
# walks in), a join block that dials a closed port, a command. Mutations only replace values
# and add unknown keys, so no mutant can point anything at a live address.
TEMPLATE: dict[str, Any] = {
    "cluster": {
        "controller": {
            "host": "127.0.0.1",
            "port": 1,
            "join": {
                "discovery": True,
                "min_rank_start": 1,
                "join_timeout": 1,
                "max_join_timeout": 1,
            },
        },
        "env": {"GLOO_SOCKET_IFNAME": "lo"},
    },
    "join": {"controller": CLOSED[0], "devices": "cpu:1", "host": "box-1", "bin": "true", "args": ["--x"]},
    "commands": {"train": ["python3", "-c", "pass"]},
}
DEEP = "__deep__"  # replaced by a flow collection nested past every parser's comfort


def _paths(data: Any, loc: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [loc] if loc else []
    if isinstance(data, dict):
        for key, value in data.items():
            found += _paths(value, (*loc, key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            found += _paths(value, (*loc, i))
    return found


# The window's timeouts stay: they are what ends a launch of a valid mutant within a second.
PATHS = [p for p in _paths(TEMPLATE) if p[-1] not in ("join_timeout", "max_join_timeout")]
HOSTILE_INTS = (0, -1, 65536, 2**63, 10**30)  # never a port anything listens on
NUL = "nul\x00byte"  # no argv, environment entry or path can carry it: the OS ends the text there
values = st.one_of(
    st.sampled_from(TEXTS),
    st.sampled_from([NUL, "\x00"]),
    st.sampled_from(HOSTILE_INTS),
    st.sampled_from([True, None, 1.5, float("inf"), float("nan"), [], {}, [1, [2]], {"a": {"b": 1}}]),
    st.just(DEEP),
)
UNKNOWN_KEYS = ("contoller", "hots", "devcies", "master_addr", "ssh_target", "x" * 300, "ev\u202eil")


def _set(data: Any, loc: tuple[Any, ...], value: Any) -> None:
    for part in loc[:-1]:
        data = data[part]
    data[loc[-1]] = value


@st.composite
def mutants(draw: st.DrawFn) -> bytes:
    """The template with a few values replaced by hostile ones and a few unknown keys."""
    data = yaml.safe_load(yaml.safe_dump(TEMPLATE))
    for loc in draw(st.lists(st.sampled_from(PATHS), max_size=3, unique=True)):
        try:
            _set(data, loc, draw(values))
        except (KeyError, IndexError, TypeError):
            continue  # an ancestor was replaced already
    for loc in draw(st.lists(st.sampled_from([p for p in PATHS if len(p) <= 3]), max_size=2)):
        try:
            _set(data, (*loc, draw(st.sampled_from(UNKNOWN_KEYS))), 1)
        except (KeyError, IndexError, TypeError):
            continue
    depth = draw(st.sampled_from([40, 1000, 5000]))
    out = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    return out.replace(DEEP, "[" * depth + "]" * depth).encode()


RAW = (
    b"cluster:\n  controller:\n    host: 127.0.0.1\n    host: 10.0.0.1\n    port: 1\n    port: 2\n",
    b"? [a, b]\n: 1\n? {x: 1}\n: 2\n3: x\n~: y\n",
    b"a: &a [1, 2]\nb: &b [*a, *a, *a, *a]\nc: &c [*b, *b, *b, *b]\nd: [*c, *c, *c, *c, *c]\n",
    b"base: &base {host: 127.0.0.1}\ncluster:\n  controller:\n    <<: *base\n    port: 1\n",
    b"cluster: !!python/object/apply:os.system [id]\n",
    b"x: " + b"{a: " * 3000 + b"1" + b"}" * 3000 + b"\n",
    b"x: " + b"- " * 2000 + b"1\n",
    b"cluster:\n  controller:\n    host: " + b"a" * 3_000_000 + b"\n",
    b"\xff\xfe\x00c\x00l",
    b"\xef\xbb\xbfcluster: {}\n",
    b"cluster:\n\tcontroller: {}\n",
    b"--- {}\n--- {}\n",
    b"port: 99999999999999999999999999999999\n",
    b"",
    b"[]",
    b"\x00\x01\x02",
)
configs = st.one_of(
    mutants(),
    st.sampled_from(RAW),
    st.builds(bytes.__add__, mutants(), st.sampled_from(RAW)),
    st.binary(max_size=200),
)


# --- NUL bound for a process ---------------------------------------------------------------

# Values that reach a rank's argv or environment: a NUL there would crash the spawn mid-run.
NUL_FIELDS: tuple[tuple[Any, ...], ...] = (
    ("cluster", "env", "GLOO_SOCKET_IFNAME"),
    ("cluster", "workers", 0, "env", "X"),
    ("join", "env", "X"),
    ("join", "args", 0),
)


def with_nul(loc: tuple[Any, ...]) -> bytes:
    """The template, with a worker and a join env, and a NUL in the value at ``loc``."""
    data = yaml.safe_load(yaml.safe_dump(TEMPLATE))
    data["cluster"]["workers"] = [{"host": "box-1", "local_devices": "cpu:1", "env": {"X": "1"}}]
    data["join"]["env"] = {"X": "1"}
    _set(data, loc, NUL)
    return yaml.safe_dump(data, sort_keys=False).encode()


# --- what is no regular file ---------------------------------------------------------------

# What each is, as a refusal names it.
ODD_KINDS = {
    "fifo": "a FIFO",
    "directory": "a directory",
    "socket": "a socket",
    "zero": "a character device",
    "proc": "a kernel file",
}


def refusal(kind: str) -> str:
    """How a config file of ``kind`` is refused (a directory as ever, the rest by what it is)."""
    return "is a directory, not a file" if kind == "directory" else f"not a regular file ({ODD_KINDS[kind]}"


def make_odd(kind: str, path: Path) -> Path:
    """``path`` made into what ``kind`` names: a FIFO nobody writes, a directory, a unix socket,
    /dev/zero (never ends), or /proc/self/status (size 0, its bytes made up as read)."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "socket":
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(path))
    else:
        path.symlink_to({"zero": "/dev/zero", "proc": "/proc/self/status"}[kind])
    return path


# --- a stdin that never ends ---------------------------------------------------------------


class Endless(io.RawIOBase):
    """`< /dev/zero`: bytes forever; a read past ``cap`` fails the test (stdin read whole)."""

    def __init__(self, cap: int = 32 << 20, byte: bytes = b"0") -> None:
        self.cap, self.byte, self.given = cap, byte, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self.given += len(buffer)
        assert self.given <= self.cap, "stdin read past any bound"
        buffer[:] = self.byte * len(buffer)
        return len(buffer)


class Hung(Exception):
    """An invocation or a read that outlived its deadline (a FIFO waited on, a hung command)."""


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail the test with Hung after ``seconds`` instead of hanging it (main thread only)."""

    def ring(_signum: int, _frame: FrameType | None) -> None:
        raise Hung(f"still running after {seconds}s")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)

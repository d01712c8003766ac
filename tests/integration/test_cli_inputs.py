"""Every `fdl` command under hostile input: generated flags, addresses, stdin and config files.

Whatever comes in, the exit code is one docs/control-plane.md ("Exit codes") lists for the
command, and nothing printed says "internal error" or shows a traceback: exit 70 is a bug,
never an answer to input. The commands are listed from the click group itself (a new one
fails ``test_every_command_is_driven`` until it is given its flags' limits here) and run
in-process through click's CliRunner, as `fdl` runs them, in a scratch directory and HOME.

Bounded: a few hundred examples, each under a deadline. Nothing leaves this box and nothing
waits on a network: every address that parses is an IP literal on a closed port, and name
lookups are answered "unknown host", as on a box without DNS. A few flags whose valid values
reach further are held to values that stay here (HELD, each with its reason).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import click
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from flodl_agent.cli.main import cli
from flodl_agent.protocol.tls import generate
from tests.support import hostile

# docs/control-plane.md, "Exit codes": per command, what an exit code may be.
EXITS: dict[str, set[int]] = {
    "config check": {0, 1, 2},
    "config show": {0, 1, 2},
    "config schema": {0, 2},
    "config example": {0, 2},
    "launch": {0, 1, 2},
    "@": {0, 1, 2},
    "join": {0, 1, 2},
    "status": {0, 1, 2},
    "start": {0, 1, 2},
    "probe": {0, 1, 2},
    "publish": {0, 1, 2},
    "deploy": {0, 1, 2, 4},  # ansible-playbook's own codes once it runs
    "nccl pin": {0, 1, 2},
    "tls generate": {0, 2},
    "tls fingerprint": {0, 2},
    "plan": {0, 1, 2},
    "placement node": {0, 2},
    "placement resources": {0, 1, 2},
    "libtorch list": {0, 1, 2},
    "libtorch which": {0, 1, 2},
    "libtorch acquire": {0, 1, 2},
    "help": {0, 2},
}
DEADLINE = 60  # seconds one invocation may take (a launch of a valid mutant takes about one)

# Flags held to what stays on this box, and why: put first or last in argv (click takes an
# option's last value, so `last` wins over anything drawn), drawn only from a pool of values
# that cannot reach further (`values`), or left out (`omit`).
HELD: dict[str, dict[str, Any]] = {
    # A valid mutant opens a real window on loopback (the template's port 1, or a --port drawn)
    # until its 1 s hard cap; fan-out would ssh to its workers.
    "launch": {"omit": {"fanout"}, "first": ["--no-fanout"]},
    "@": {
        "omit": {"fanout"},
        "first": ["--no-fanout"],
        # `fdl @x` reads ./fdl.x.yml (a generated file); `start` would POST to whatever
        # controller a mutant names, so only the read-only and local commands.
        "values": {
            "name": st.one_of(st.just("x"), hostile.text),
            "command_name": st.one_of(st.sampled_from(["train", "status", "probe"]), hostile.text),
        },
    },
    # --persist re-dials a closed port forever; --libtorch with a real variant acquires a torch
    # (pip) and re-execs this process into it.
    "join": {
        "omit": {"persist"},
        "values": {"libtorch": st.sampled_from(["", "cu1", "../x", "rocm", "auto;x"])},
    },
    # `fdl start` POSTs /start: only ever to a closed port, never to a window another run holds.
    "start": {"last": ["--addr", hostile.CLOSED[0]]},
    # A playbook that exists would run ansible-playbook against an inventory.
    "deploy": {"values": {"playbook": st.sampled_from(["missing.yml", "", "sub"])}},
    # New files in the scratch directory (an existing one is refused without --force).
    "tls generate": {"values": {"cert": st.sampled_from(["c.pem", "sub/c.pem", "cert.pem", ""])}},
    "tls fingerprint": {"values": {"cert": st.sampled_from(["cert.pem", "mangled.pem", "config-0.yml"])}},
    # pip would install into the venv that runs this test.
    "nccl pin": {"last": ["--venv", "venv-missing"]},
    # Without --dry-run, `ray start --block` replaces this process.
    "placement node": {"last": ["--dry-run"]},
    # A real variant is a torch download into a new venv (pip).
    "libtorch acquire": {"values": {"variant": st.sampled_from(["", "cu1", "../x", "rocm", "auto;x"])}},
    # --ray connects to a Ray cluster (its own retries, no deadline of ours).
    "plan": {"omit": {"ray_address"}},
}


@functools.cache
def shared() -> Path:
    """Made once per session: a file larger than any fdl reads whole (a config file's 4 MiB
    cap: the bounds must hold), and a real certificate for `fdl tls fingerprint`."""
    where = Path(tempfile.mkdtemp(prefix="fdl-inputs-"))
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    (where / "big.bin").write_bytes(os.urandom(5 * 1024 * 1024))
    generate(where / "cert.pem", where / "key.pem", ["127.0.0.1"])
    return where


def leaf_commands(group: click.Group, prefix: tuple[str, ...] = ()) -> dict[str, click.Command]:
    found: dict[str, click.Command] = {}
    ctx = click.Context(group)
    for name in group.list_commands(ctx):  # fdl's own commands load on first use
        command = group.get_command(ctx, name)
        assert command is not None, name
        if isinstance(command, click.Group):
            found |= leaf_commands(command, (*prefix, name))
        else:
            found[" ".join((*prefix, name))] = command
    return found


COMMANDS = leaf_commands(cli)


def test_every_command_is_driven() -> None:
    assert set(COMMANDS) == set(EXITS), "give a new command its exit codes (and HELD flags) here"


def _paths(scratch: Path) -> st.SearchStrategy[str]:
    """Files and directories inside the scratch directory, and a few of the box's own."""
    files = ["config-0.yml", "config-1.yml", "fdl.yml", "fdl.cluster.yml"]
    odd = ["missing.yml", "sub", ".", "", "sub/missing/deeper"]
    big = str(shared() / "big.bin")
    return st.sampled_from([*(str(scratch / n) for n in files * 3 + odd), "/dev/null", big])


def _value(param: click.Parameter, scratch: Path, held: dict[str, Any]) -> st.SearchStrategy[str]:
    pinned: st.SearchStrategy[str] | None = held.get("values", {}).get(param.name)
    if pinned is not None:
        return pinned
    kind = param.type
    if isinstance(kind, click.Choice):
        return st.one_of(st.sampled_from([str(c) for c in kind.choices]), hostile.text)
    if isinstance(kind, (click.types.IntParamType, click.types.FloatParamType)):
        return hostile.numbers
    if isinstance(kind, click.Path):
        return _paths(scratch)
    if param.name and any(word in param.name for word in ("addr", "ssh", "bind", "address")):
        return hostile.addresses
    return hostile.text


often = st.sampled_from([True] * 5 + [False])  # five times in six


@st.composite
def invocations(draw: st.DrawFn, name: str, scratch: Path) -> list[str]:
    """argv for one command: some of its options with hostile values, its arguments, stray
    flags, and what HELD pins."""
    command, held = COMMANDS[name], HELD.get(name, {})
    argv: list[str] = [*name.split(), *held.get("first", [])]
    options = [
        p for p in command.params if isinstance(p, click.Option) and p.name not in held.get("omit", ())
    ]
    tail: list[str] = []
    chosen = draw(st.lists(st.sampled_from(options), max_size=4)) if options else []
    for param in [p for p in options if p.required and draw(often)] + chosen:
        flag = draw(st.sampled_from([*param.opts, *param.secondary_opts]))
        if param.is_flag:
            argv.append(flag)
        else:
            argv += [flag, draw(_value(param, scratch, held))]
    for param in command.params:
        if isinstance(param, click.Argument) and draw(often):
            values = _value(param, scratch, held)
            if param.nargs == -1:
                tail = draw(
                    st.lists(st.one_of(hostile.text, st.sampled_from(hostile.UNKNOWN_FLAGS)), max_size=3)
                )
            else:
                argv.append(draw(values))
    if not draw(often):
        argv.insert(len(name.split()), draw(st.sampled_from(hostile.UNKNOWN_FLAGS)))
    if tail:
        argv += ["--", *tail] if draw(st.booleans()) else tail
    return argv + held.get("last", [])


class Hung(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    def ring(_signum: int, _frame: FrameType | None) -> None:
        raise Hung(f"still running after {seconds}s")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Name lookups fail as on a box without DNS; IP literals resolve as ever (no network is asked)."""
    real = socket.getaddrinfo

    def literal_only(host: Any, *rest: Any, **kw: Any) -> Any:
        text = host.decode() if isinstance(host, bytes) else host
        if text is not None and text not in ("localhost",):
            try:
                socket.inet_pton(socket.AF_INET6 if ":" in text else socket.AF_INET, text.split("%")[0])
            except OSError:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known") from None
        return real(host, *rest, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", literal_only)


def drive(name: str, draw_argv: Callable[[Path], st.SearchStrategy[list[str]]]) -> Any:
    """A property over one command: every generated invocation ends with a documented exit code."""

    @settings(
        max_examples=BUDGET.get(name, 12),
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(data=st.data(), files=st.lists(hostile.configs, min_size=4, max_size=4), stdin=hostile.text)
    def check(offline: None, data: st.DataObject, files: list[bytes], stdin: str) -> None:
        with tempfile.TemporaryDirectory() as tmp, _inside(Path(tmp)) as scratch:
            for i, content in enumerate(files[:2]):
                (scratch / f"config-{i}.yml").write_bytes(content)
            (scratch / "fdl.yml").write_bytes(files[2])
            (scratch / "fdl.cluster.yml").write_bytes(files[3])
            (scratch / "fdl.x.yml").write_bytes(files[3])  # `fdl @x`
            (scratch / "sub").mkdir()
            pem = (shared() / "cert.pem").read_text()  # a real certificate, and a mangled one
            (scratch / "cert.pem").write_text(pem)
            (scratch / "mangled.pem").write_text(pem.replace("A", "\u202e", 3))
            argv = data.draw(draw_argv(scratch), label="argv")
            env = {"HOME": str(scratch), "FDL_DEBUG": None, "FDL_TOKEN": None, "FDL_TLS_FINGERPRINT": None}
            if data.draw(st.booleans(), label="env"):
                env[data.draw(st.sampled_from(["FDL_TOKEN", "FDL_TLS_FINGERPRINT"]))] = data.draw(
                    hostile.text
                )
            with deadline(DEADLINE):
                result = CliRunner().invoke(cli, argv, input=stdin + "\n", env=env)
        said = result.output
        event(f"exit {result.exit_code}")  # --hypothesis-show-statistics: how the runs ended
        unexpected = result.exception is not None and not isinstance(result.exception, SystemExit)
        assert not unexpected, f"{argv!r} raised {result.exception!r} (exit 70 under `fdl`)"
        assert result.exit_code in EXITS[name], f"{argv!r} exited {result.exit_code}:\n{said[-2000:]}"
        assert "internal error" not in said and "Traceback" not in said, f"{argv!r}:\n{said[-2000:]}"

    return check


@contextlib.contextmanager
def _inside(path: Path) -> Iterator[Path]:
    before = Path.cwd()
    os.chdir(path)
    try:
        yield path
    finally:
        os.chdir(before)


# The config commands are cheap (pure): most of the budget. probe gathers the box's facts
# (tools, torch) on every run: a few. About 300 in all.
BUDGET = {"config check": 60, "config show": 40, "probe": 4, "join": 30, "launch": 20, "@": 12}

for _name in EXITS:
    globals()[f"test_{_name.replace(' ', '_').replace('@', 'at_cluster')}_answers_hostile_input"] = drive(
        _name, lambda scratch, name=_name: invocations(name, scratch)
    )


@settings(max_examples=40, deadline=None)
@given(argv=st.lists(st.one_of(hostile.text, st.sampled_from(hostile.UNKNOWN_FLAGS)), max_size=3))
def test_the_group_answers_unknown_commands_and_flags(argv: list[str]) -> None:
    result = CliRunner().invoke(cli, argv)
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert result.exit_code in {0, 2} and "Traceback" not in result.output

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
import concurrent.futures
import contextlib
import functools
import io
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from flodl_agent.cli.main import cli
from flodl_agent.config.problems import format_path
from flodl_agent.protocol.tls import generate
from tests.support import free_port, hostile

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
    # `fdl status --watch` with no controller waits, by design, for a launch to open its window
    # (tests/e2e/test_launch_join.py drives it); a plain status answers at once.
    "status": {"omit": {"watch"}},
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
    odd = ["missing.yml", "sub", ".", "", "sub/missing/deeper", *(f"odd-{k}" for k in hostile.ODD_KINDS)]
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
            _scratch(scratch, files, data)
            argv = data.draw(draw_argv(scratch), label="argv")
            env = {"HOME": str(scratch), "FDL_DEBUG": None, "FDL_TOKEN": None, "FDL_TLS_FINGERPRINT": None}
            if data.draw(st.booleans(), label="env"):
                env[data.draw(st.sampled_from(["FDL_TOKEN", "FDL_TLS_FINGERPRINT"]))] = data.draw(
                    hostile.text
                )
            # Now and then a stdin that never ends (`< /dev/zero`): read one bounded line, or not at all.
            endless = data.draw(st.sampled_from([False] * 5 + [True]), label="endless stdin")
            given = io.BufferedReader(hostile.Endless()) if endless else stdin + "\n"
            with hostile.deadline(DEADLINE):
                result = CliRunner().invoke(cli, argv, input=given, env=env)
        said = result.output
        event(f"exit {result.exit_code}")  # --hypothesis-show-statistics: how the runs ended
        unexpected = result.exception is not None and not isinstance(result.exception, SystemExit)
        assert not unexpected, f"{argv!r} raised {result.exception!r} (exit 70 under `fdl`)"
        assert result.exit_code in EXITS[name], f"{argv!r} exited {result.exit_code}:\n{said[-2000:]}"
        assert "internal error" not in said and "Traceback" not in said, f"{argv!r}:\n{said[-2000:]}"

    return check


PROJECT = ("fdl.yml", "fdl.cluster.yml", "fdl.x.yml")  # what commands read unasked (`fdl @x`: fdl.x.yml)


def _scratch(scratch: Path, files: list[bytes], data: st.DataObject) -> None:
    """The scratch directory of one example: config files, a certificate, what is no regular
    file (each kind, and now and then one of the project's files), a directory."""
    for i, content in enumerate(files[:2]):
        (scratch / f"config-{i}.yml").write_bytes(content)
    for name, content in zip(PROJECT, (files[2], files[3], files[3]), strict=True):
        (scratch / name).write_bytes(content)
    (scratch / "sub").mkdir()
    pem = (shared() / "cert.pem").read_text()  # a real certificate, and a mangled one
    (scratch / "cert.pem").write_text(pem)
    (scratch / "mangled.pem").write_text(pem.replace("A", "\u202e", 3))
    for kind in hostile.ODD_KINDS:
        hostile.make_odd(kind, scratch / f"odd-{kind}")
    odd = data.draw(st.sampled_from([None] * 4 + list(hostile.ODD_KINDS)), label="odd project file")
    if odd is not None:  # a FIFO or a directory where ./fdl.yml is: refused by name, never waited on
        name = data.draw(st.sampled_from(PROJECT), label="which")
        (scratch / name).unlink()
        hostile.make_odd(odd, scratch / name)


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


# --- each class of hostile input, against every command that reads it ---------------------
#
# Deterministic, beside the generated runs above: NUL in values bound for a process, a path
# that is no regular file, a stdin that never ends, a stream on a full disk. Each list is
# checked against the group, so a new command that reads a file or stdin must join it.

ENV = {"FDL_DEBUG": None, "FDL_TOKEN": None, "FDL_TLS_FINGERPRINT": None}


def _project(scratch: Path, port: int = 1) -> None:
    """The template where commands look unasked (./fdl.yml, ./fdl.cluster.yml, ./fdl.x.yml),
    as c.yml, and a real certificate; its window on ``port`` (runs side by side: a port each,
    or one's walk-in dials the other's window)."""
    data = yaml.safe_load(yaml.safe_dump(hostile.TEMPLATE))
    data["cluster"]["controller"]["port"] = port
    template = yaml.safe_dump(data).encode()
    for name in (*PROJECT, "c.yml"):
        (scratch / name).write_bytes(template)
    shutil.copy(shared() / "cert.pem", scratch / "cert.pem")


def _invoke(name: str, argv: list[str], scratch: Path) -> Any:
    """One in-process run, under the deadline, held to the command's exit codes."""
    with hostile.deadline(DEADLINE):
        result = CliRunner().invoke(cli, argv, input="", env={**ENV, "HOME": str(scratch)})
    said = result.output
    unexpected = result.exception is not None and not isinstance(result.exception, SystemExit)
    assert not unexpected, f"{argv!r} raised {result.exception!r} (exit 70 under `fdl`)"
    assert result.exit_code in EXITS[name], f"{argv!r} exited {result.exit_code}:\n{said[-2000:]}"
    assert "internal error" not in said and "Traceback" not in said, f"{argv!r}:\n{said[-2000:]}"
    return result


# Every command that reads a config file, and how (c.yml: the flag's file; join and `@x`
# read ./fdl.yml and ./fdl.x.yml unasked). Left out: `libtorch acquire` reads its --config
# only for a variant it can acquire (a download); status and start take an invalid
# ./fdl.cluster.yml for none (their defaults), as documented.
READERS: dict[str, tuple[list[str], str]] = {
    "config check": (["config", "check", "c.yml"], "c.yml"),
    "config show": (["config", "show", "c.yml"], "c.yml"),
    "launch": (["launch", "--no-fanout", "--config", "c.yml", "--", "true"], "c.yml"),
    "@": (["@", "x", "train"], "fdl.x.yml"),
    "join": (["join"], "fdl.yml"),
    "probe": (["probe", "--no-dial", "--config", "c.yml"], "c.yml"),
    "publish": (["publish", "--config", "c.yml"], "c.yml"),
    "plan": (["plan", "--config", "c.yml"], "c.yml"),
    "libtorch list": (["libtorch", "list", "--config", "c.yml"], "c.yml"),
    "libtorch which": (["libtorch", "which", "--config", "c.yml"], "c.yml"),
}


def _config_readers() -> set[str]:
    """The commands with a --config, a --base or a FILE, and those that read ./fdl.yml unasked."""
    found = {"@", "join"}
    for name, command in COMMANDS.items():
        if any(p.name in ("config_file", "base", "file", "cluster_file") for p in command.params):
            found.add(name)
    return found


def test_every_config_reader_is_given_hostile_values() -> None:
    assert _config_readers() - set(READERS) == {"libtorch acquire"}, "add the new reader to READERS"


@pytest.mark.parametrize("loc", hostile.NUL_FIELDS, ids=format_path)
@pytest.mark.parametrize("name", READERS)
def test_a_nul_bound_for_a_process_is_an_invalid_file_for_every_reader(
    offline: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, loc: tuple[Any, ...]
) -> None:
    monkeypatch.chdir(tmp_path)
    _project(tmp_path)
    argv, where = READERS[name]
    (tmp_path / where).write_bytes(hostile.with_nul(loc))
    result = _invoke(name, argv, tmp_path)
    # Refused as the file loads, naming the field: never a rank spawned with it, never exit 70.
    assert result.exit_code == 1 and format_path(loc) in result.output, result.output[-2000:]


SLOW = {"probe"}  # it gathers the box's facts on every run (seconds): fewer kinds
FILL = {
    "file": "c.yml",
    "command": "true",
    "version": "2.21.5",
    "variant": "cu1",
    "cert": "c.pem",
    "key": "k.pem",
}


def _file_params() -> list[tuple[str, str]]:
    """(command, parameter) for every path a command takes, as a flag or an argument."""
    return [
        (name, p.name)
        for name, command in COMMANDS.items()
        for p in command.params
        if isinstance(p.type, click.Path) and p.name is not None
    ]


def _argv_with(name: str, param_name: str, path: str) -> list[str]:
    """``name`` with ``path`` for the parameter, what else it requires from FILL, and HELD."""
    command, held = COMMANDS[name], HELD.get(name, {})
    options: list[str] = [*held.get("first", [])]
    positional: list[str] = []
    for p in command.params:
        if p.name == param_name:
            value = path
        elif p.required and p.name in FILL:
            value = FILL[p.name]
        else:
            continue
        if isinstance(p, click.Argument):
            positional.append(value)
        else:
            options += [p.opts[0], value]
    last = held.get("last", [])
    flag = next(p for p in command.params if p.name == param_name)
    if last and last[0] in getattr(flag, "opts", ()):
        last = []  # the held value would override the one under test
    return [*name.split(), *options, *positional, *last]


@pytest.mark.parametrize(("name", "param_name"), _file_params(), ids=lambda v: str(v))
def test_every_path_flag_refuses_what_is_no_regular_file_by_name_and_never_waits(
    offline: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, param_name: str
) -> None:
    monkeypatch.chdir(tmp_path)
    _project(tmp_path)
    param = next(p for p in COMMANDS[name].params if p.name == param_name)
    assert isinstance(param.type, click.Path)
    kinds = ["fifo", "proc"] if name in SLOW else list(hostile.ODD_KINDS)
    for kind in kinds:
        odd = hostile.make_odd(kind, tmp_path / f"odd-{kind}")
        result = _invoke(name, _argv_with(name, param_name, str(odd)), tmp_path)
        reads_it = not param.type.dir_okay and (name, param_name) != ("libtorch acquire", "config_file")
        if reads_it:  # a file it reads (or writes): refused by name, not waited on nor ignored
            said = " ".join(result.output.split())  # click wraps its usage lines
            assert result.exit_code != 0, f"{kind}: {said[-1000:]}"
            assert "not a regular file" in said or "is a directory" in said, f"{kind}: {said[-1000:]}"


# What commands read unasked (./fdl.yml, ./fdl.cluster.yml, ./fdl.x.yml) and how they say so:
# True: refused by name (exit 1); False: status and start fall back to their defaults.
IMPLICIT: list[tuple[str, list[str], str, bool]] = [
    ("join", ["join"], "fdl.yml", True),
    ("probe", ["probe", "--no-dial"], "fdl.yml", True),
    ("publish", ["publish"], "fdl.yml", True),
    ("publish", ["publish"], "fdl.cluster.yml", True),
    ("libtorch list", ["libtorch", "list"], "fdl.yml", True),
    ("libtorch which", ["libtorch", "which"], "fdl.yml", True),
    ("@", ["@", "x", "train"], "fdl.x.yml", True),
    ("@", ["@", "x", "train"], "fdl.yml", True),
    ("status", ["status", "--addr", hostile.CLOSED[0]], "fdl.cluster.yml", False),
    ("start", ["start", "--addr", hostile.CLOSED[0]], "fdl.cluster.yml", False),
]


@pytest.mark.parametrize(("name", "argv", "where", "named"), IMPLICIT, ids=lambda v: str(v))
def test_a_project_file_that_is_no_regular_file_is_refused_not_ignored_nor_waited_on(
    offline: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    argv: list[str],
    where: str,
    named: bool,
) -> None:
    monkeypatch.chdir(tmp_path)
    _project(tmp_path)
    (tmp_path / where).unlink()
    for kind in ["fifo", "proc"] if name in SLOW else list(hostile.ODD_KINDS):
        hostile.make_odd(kind, tmp_path / where)
        result = _invoke(name, argv, tmp_path)
        if named:
            assert result.exit_code == 1, result.output[-1000:]
            assert f"{where}: error: {hostile.refusal(kind)}" in result.output
        remove = shutil.rmtree if kind == "directory" else os.unlink
        remove(tmp_path / where)


def _fdl() -> str:
    """The console script of the interpreter running the tests (pyproject's `fdl`)."""
    found = Path(sys.executable).with_name("fdl")
    if not found.exists():
        pytest.skip("no fdl console script beside this interpreter")
    return str(found)


# Every command that reads stdin: --token - (one line) and --spec-stdin (a launcher's spec).
STDIN: dict[tuple[str, str], list[str]] = {
    ("join", "token_opt"): ["join", "--token", "-"],
    ("start", "token_opt"): ["start", "--addr", hostile.CLOSED[0], "--token", "-"],
    ("join", "spec_stdin"): ["join", "--spec-stdin"],
    ("probe", "spec_stdin"): ["probe", "--no-dial", "--spec-stdin"],
}


def _bounded(limit: int) -> Callable[[], None]:
    def apply() -> None:  # an unbounded read dies of MemoryError here, not by eating the box
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return apply


def test_every_stdin_reader_reads_one_bounded_line_of_an_endless_stdin(tmp_path: Path) -> None:
    readers = {
        (n, p.name) for n, c in COMMANDS.items() for p in c.params if p.name in ("token_opt", "spec_stdin")
    }
    assert readers == set(STDIN), "give the new stdin reader its argv in STDIN"
    _project(tmp_path)
    for (name, param), argv in STDIN.items():
        flag = "--token -" if param == "token_opt" else "--spec-stdin"
        with Path("/dev/zero").open("rb") as zero:
            proc = subprocess.run(
                [_fdl(), *argv], stdin=zero, capture_output=True, text=True, timeout=DEADLINE,
                cwd=tmp_path, env={**os.environ, "HOME": str(tmp_path), "FDL_TOKEN": ""},
                preexec_fn=_bounded(4 << 30), check=False,
            )  # fmt: skip
        assert proc.returncode == 2, f"{name}: exit {proc.returncode}: {proc.stderr[-1000:]}"
        assert f"{flag} read a line longer than" in proc.stderr and "internal error" not in proc.stderr


# Every command run once with its output on a full disk: (argv, exit code, whether it writes
# to stdout). A command that would succeed exits 1; a run (launch, @, join) keeps its own code.
FULL: dict[str, tuple[list[str], int, bool]] = {
    "config check": (["config", "check", "c.yml"], 1, True),
    "config show": (["config", "show", "c.yml"], 1, True),
    "config schema": (["config", "schema"], 1, True),
    "config example": (["config", "example", "local"], 1, True),
    "launch": (["launch", "--no-fanout", "--json", "--port", "0", "--", "true"], 1, True),  # the run failed
    "@": (["@x", "train"], 1, False),  # the run failed: nobody walks in
    "join": (["join"], 1, False),  # transient: nobody on the closed port
    "status": (["status", "--addr", hostile.CLOSED[0], "--json"], 1, False),
    "start": (["start", "--addr", hostile.CLOSED[0]], 1, False),
    "probe": (["probe", "--no-dial", "--json"], 1, True),
    "publish": (
        ["publish", "file:///nonexistent-src", "--to", "pub", "--json"],
        1,
        True,
    ),  # nothing published
    "deploy": (["deploy", "missing.yml", "--json"], 2, False),
    "nccl pin": (["nccl", "pin", "2.21.5", "--venv", "venv-missing", "--json"], 1, True),
    "tls generate": (
        ["tls", "generate", "--cert", "new.pem", "--key", "new-key.pem", "--name", "127.0.0.1"],
        1,
        True,
    ),
    "tls fingerprint": (["tls", "fingerprint", "cert.pem"], 1, True),
    "plan": (["plan", "--role", "trainer", "--nodes", "2", "--gpus-per-node", "2", "--json"], 1, True),
    "placement node": (["placement", "node", "--dry-run"], 1, True),
    "placement resources": (["placement", "resources"], 1, True),
    "libtorch list": (["libtorch", "list", "--json"], 1, True),
    "libtorch which": (["libtorch", "which", "--json"], 1, True),
    "libtorch acquire": (["libtorch", "acquire", "cu1"], 2, False),
    "help": (["help"], 1, True),
}
CANNOT = "fdl: cannot write to standard output: No space left on device"


def _on_full(argv: list[str], stream: str, scratch: Path) -> subprocess.CompletedProcess[str]:
    with Path("/dev/full").open("w") as full:
        sinks: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, stream: full}
        return subprocess.run(
            [_fdl(), *argv], text=True, timeout=DEADLINE, cwd=scratch, check=False,
            env={**os.environ, "HOME": str(scratch), "FDL_TOKEN": "", "FDL_DEBUG": ""}, **sinks,
        )  # fmt: skip


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this box")
def test_every_command_on_a_full_disk_says_so_once_and_never_exits_70(tmp_path: Path) -> None:
    assert set(FULL) == set(COMMANDS), "give the new command its run on a full disk in FULL"
    runs = [(name, stream) for name in FULL for stream in ("stdout", "stderr")]
    for i in range(len(runs)):  # a directory each: `tls generate` writes its pair
        (tmp_path / str(i)).mkdir()
        _project(tmp_path / str(i), free_port())

    def run(i: int) -> subprocess.CompletedProcess[str]:
        name, stream = runs[i]
        return _on_full(FULL[name][0], stream, tmp_path / str(i))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # subprocesses: the waits overlap
        done = list(pool.map(run, range(len(runs))))
    for (name, stream), proc in zip(runs, done, strict=True):
        argv, code, writes = FULL[name]
        said = proc.stderr if stream == "stdout" else proc.stdout
        assert proc.returncode != 70 and "internal error" not in said, (
            f"{argv} > /dev/{stream}: {said[-1000:]}"
        )
        assert "Traceback" not in said and "Exception ignored" not in said, f"{argv}: {said[-1000:]}"
        if stream == "stdout":
            assert proc.returncode == code, f"{argv} > /dev/full exited {proc.returncode}: {said[-1000:]}"
            assert said.count(CANNOT) == (1 if writes else 0), f"{argv} > /dev/full: {said[-1000:]}"
        else:  # what it says on stderr is lost; a success whose stderr failed is no success either
            assert proc.returncode in EXITS[name] | {1}, f"{argv} 2> /dev/full exited {proc.returncode}"

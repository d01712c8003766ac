"""What fdl reads is bounded and what it writes may fail: a FIFO, a device or a kernel file
is refused by name (never waited on), stdin is read one bounded line at a time, and a
stream that stops taking writes (a full disk) is one line on stderr and exit 1, never 70."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from flodl_agent.cli import common
from flodl_agent.cli.main import cli
from flodl_agent.config import ConfigError, load_config
from flodl_agent.config.source import MAX_BYTES, NotRegular, read_bounded
from flodl_agent.fleet.launcher import LaunchError, check_tls_files
from tests.support import hostile

DATA = Path(__file__).parents[2] / "data"
SEED = DATA / "seed-000.fdl.cluster.yml"  # valid, with a warning (on stderr)
FULL = Path("/dev/full")
needs_full = pytest.mark.skipif(not FULL.exists(), reason="no /dev/full on this box")
needs_fdl = pytest.mark.skipif(shutil.which("fdl") is None, reason="the fdl console script is not on PATH")


KINDS = hostile.ODD_KINDS


@contextlib.contextmanager
def odd_file(kind: str, where: Path) -> Iterator[Path]:
    yield hostile.make_odd(kind, where / f"odd-{kind}")


@pytest.mark.parametrize("kind", KINDS)
def test_a_config_file_that_is_no_regular_file_is_refused_by_name_not_waited_on(
    tmp_path: Path, kind: str
) -> None:
    if kind == "proc" and not Path("/proc/self/status").exists():
        pytest.skip("no /proc")
    with odd_file(kind, tmp_path) as path, hostile.deadline(10):
        with pytest.raises(NotRegular, match=KINDS[kind]):
            read_bounded(path, MAX_BYTES)
        with pytest.raises(ConfigError) as refused:
            load_config(path)
    said = refused.value.render()
    assert f"{path}: error: {hostile.refusal(kind)}" in said and "fix: name the YAML file" in said


def test_a_regular_file_is_read_up_to_one_byte_past_the_cap(tmp_path: Path) -> None:
    path = tmp_path / "big.yml"
    path.write_bytes(b"x" * 100)
    assert read_bounded(path, 10) == b"x" * 11
    assert read_bounded(path, 1000) == b"x" * 100
    (tmp_path / "empty.yml").write_bytes(b"")
    assert read_bounded(tmp_path / "empty.yml", 10) == b""


@pytest.mark.parametrize("kind", ["fifo", "directory", "zero"])
def test_a_project_file_that_is_no_regular_file_is_refused_not_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with odd_file(kind, tmp_path) as odd:
        odd.rename(tmp_path / "fdl.yml")
        assert common.project_file() == Path("fdl.yml")
        with hostile.deadline(20):
            result = CliRunner().invoke(cli, ["join", "127.0.0.1:1", "--devices", "cpu:1"])
    assert result.exit_code == 1, result.output  # join: an invalid ./fdl.yml
    assert f"fdl.yml: error: {hostile.refusal(kind)}" in result.output


def test_status_never_waits_on_a_certificate_that_is_a_fifo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    os.mkfifo(tmp_path / "cert.pem")
    (tmp_path / "key.pem").write_text("")
    controller = {
        "host": "127.0.0.1",
        "port": 1,
        "join": {"discovery": True, "min_rank_start": 1},
        "tls": {"cert": f"{tmp_path}/cert.pem", "key": f"{tmp_path}/key.pem"},
    }
    (tmp_path / "fdl.cluster.yml").write_text(json.dumps({"cluster": {"controller": controller}}))
    cluster = load_config(tmp_path / "fdl.cluster.yml").config.cluster  # valid: status reads its pin
    assert cluster is not None
    with hostile.deadline(20):
        result = CliRunner().invoke(cli, ["status"], env={"HOME": str(tmp_path), "FDL_TLS_FINGERPRINT": None})
    assert result.exit_code == 1 and "internal error" not in result.output  # nobody answers on port 1
    with pytest.raises(
        LaunchError, match=r"cluster.controller.tls.cert: .*cert.pem is not a regular file \(a FIFO\)"
    ):
        check_tls_files(cluster)  # the launch refuses it before the port's TLS load waits on it


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["tls", "fingerprint", "{odd}"], "'CERT'"),
        (["placement", "resources", "--smi", "{odd}"], "'--smi'"),
        (["tls", "generate", "--cert", "{odd}", "--key", "k.pem", "--force"], "'--cert'"),
        (["join", "127.0.0.1:1", "--ssh", "127.0.0.1:1", "--identity", "{odd}"], "'--identity'"),
    ],
)
@pytest.mark.parametrize("kind", ["fifo", "zero", "socket"])
def test_a_file_flag_that_names_no_regular_file_is_a_usage_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], hint: str, kind: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with odd_file(kind, tmp_path) as odd, hostile.deadline(20):
        result = CliRunner().invoke(cli, [a.replace("{odd}", str(odd)) for a in argv])
    assert result.exit_code == 2, result.output
    assert hint in result.output and f"is not a regular file ({KINDS[kind]})" in result.output


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["join", "127.0.0.1:1", "--token", "-"], "--token - read a line longer than 256"),
        (["start", "--addr", "127.0.0.1:1", "--token", "-"], "--token - read a line longer than 256"),
        (["join", "--spec-stdin"], "fdl join: --spec-stdin read a line longer than"),
        (["probe", "--spec-stdin", "--no-dial"], "fdl probe: --spec-stdin read a line longer than"),
    ],
)
def test_an_endless_stdin_is_read_one_bounded_line_then_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], said: str
) -> None:
    monkeypatch.chdir(tmp_path)
    stdin = hostile.Endless(cap=32 << 20)  # a spec's bound is 8 MiB of hex
    result = CliRunner().invoke(cli, argv, input=io.BufferedReader(stdin))
    assert result.exit_code == 2, result.output[-1000:]
    assert said in result.output


@pytest.mark.parametrize("command", ["check", "show"])
def test_a_config_file_of_dash_is_stdin_read_to_its_end_or_its_bound(command: str) -> None:
    lab = CliRunner().invoke(cli, ["config", "example", "lab"]).output
    piped = CliRunner().invoke(cli, ["config", command, "-"], input=lab)
    assert piped.exit_code == 0, piped.output
    said = "ok: <stdin>: cluster with 2 workers" if command == "check" else "controller 10.89.0.10"
    assert said in piped.output
    broken = CliRunner().invoke(cli, ["config", command, "-"], input="cluster: [\n")
    assert broken.exit_code == 1 and "<stdin>:2: error: not valid YAML" in broken.output
    stdin = hostile.Endless(cap=MAX_BYTES + (2 << 20))  # read past the bound and the test fails
    endless = CliRunner().invoke(cli, ["config", command, "-"], input=io.BufferedReader(stdin))
    assert endless.exit_code == 1 and "<stdin>: error: file is larger than 4096 KiB" in endless.output
    both = CliRunner().invoke(cli, ["config", command, "-", "--base", "-"], input=lab)
    assert both.exit_code == 1 and "FILE and --base both name stdin (-)" in both.output


class Full(io.StringIO):
    """A stream on a full disk: every write and flush fails with ENOSPC."""

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def fileno(self) -> int:
        raise io.UnsupportedOperation("no descriptor")


def test_a_stream_that_fails_is_said_once_on_stderr_and_a_success_becomes_1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    said = io.StringIO()
    monkeypatch.setattr(sys, "stdout", common.PipeSafe(Full(), "stdout"))
    monkeypatch.setattr(sys, "stderr", common.PipeSafe(said, "stderr"))
    sys.stdout.write("a line")
    sys.stdout.flush()
    sys.stdout.write("another")  # dropped, not said again
    assert said.getvalue().count("fdl: cannot write to standard output: No space left on device") == 1
    assert common.finish(SystemExit(0)) == 1 and common.finish(SystemExit(None)) == 1
    assert common.finish(SystemExit(2)) == 2  # a usage error stays one
    assert common.finish(common.RunExit(0)) == 0  # a run's code is the run's


def test_a_reader_that_leaves_is_no_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    class Left(Full):
        def write(self, text: str) -> int:
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    said = io.StringIO()
    monkeypatch.setattr(sys, "stdout", common.PipeSafe(Left(), "stdout"))
    monkeypatch.setattr(sys, "stderr", common.PipeSafe(said, "stderr"))
    sys.stdout.write("x")
    assert common.stdout_gone() and said.getvalue() == "" and common.finish(SystemExit(0)) == 0


@needs_fdl
@needs_full
@pytest.mark.parametrize(
    ("argv", "streams"),
    [
        (["--version"], {"stdout": "full"}),
        (["config", "schema"], {"stdout": "full"}),
        (["config", "check", str(SEED)], {"stdout": "full"}),
        (["config", "check", str(SEED)], {"stderr": "full"}),  # its warning meets the full disk
    ],
)
def test_a_full_disk_under_a_stream_is_exit_1_with_one_line_never_70(
    argv: list[str], streams: dict[str, str]
) -> None:
    with FULL.open("w") as full:
        sinks: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        sinks |= dict.fromkeys(streams, full)
        proc = subprocess.run(["fdl", *argv], text=True, timeout=60, check=False, **sinks)
    assert proc.returncode == 1, proc.stderr
    if "stdout" in streams:
        assert (
            proc.stderr.strip()
            .splitlines()[-1]
            .startswith("fdl: cannot write to standard output: No space left on device")
        )
        assert "internal error" not in proc.stderr and "Exception ignored" not in proc.stderr

"""Ctrl-C, SIGTERM or SIGHUP (a dropped ssh session) on `fdl launch` is the operator's stop,
said as such: the controller logs it, every walk-in is told why and says so, the verdict is
kept, and the launch exits 128 + the signal. A full disk under stdout stops nothing."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support import free_port

pytestmark = pytest.mark.skipif(shutil.which("fdl") is None, reason="the fdl console script is not on PATH")
ENV = {**os.environ, "NO_COLOR": "1"}


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)  # polling what the operator would look at


def state(port: int) -> dict[str, Any]:
    """The controller's /state.json, or {} while nothing answers (polled in-process: cheap)."""
    with contextlib.suppress(OSError, ValueError):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/state.json")
        body: dict[str, Any] = json.loads(conn.getresponse().read())
        conn.close()
        return body
    return {}


def home(tmp_path: Path) -> dict[str, str]:
    """The commands' environment, with the kept verdict under ``tmp_path``."""
    return {**ENV, "HOME": str(tmp_path)}


def open_window(tmp_path: Path, port: int, target: int, **streams: Any) -> subprocess.Popen[str]:
    """`fdl launch --json` on ``port`` of loopback, its rank a sleeper that says it started."""
    window = {"discovery": True, "min_rank_start": 1, "target_ranks": target, "join_timeout": 120}
    cluster = {"cluster": {"controller": {"host": "127.0.0.1", "port": port, "join": window}}}
    (tmp_path / "fdl.cluster.yml").write_text(json.dumps(cluster))
    started = tmp_path / "started"
    rank = [sys.executable, "-c", f"import time; open(r'{started}', 'w').close(); time.sleep(600)"]
    return subprocess.Popen(
        ["fdl", "launch", "--json", "--", *streams.pop("rank", rank)], cwd=tmp_path, env=home(tmp_path),
        text=True, **{"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **streams},
    )  # fmt: skip


def walk_in(tmp_path: Path, port: int, **streams: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["fdl", "join", f"127.0.0.1:{port}", "--host", "box-a", "--devices", "cpu:1"],
        cwd=tmp_path, env=home(tmp_path), text=True,
        **{"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **streams},
    )  # fmt: skip


def stopped(
    tmp_path: Path,
    port: int,
    sig: signal.Signals,
    *,
    target: int,
    until: Callable[[], bool],
    times: int = 1,
    late: bool = False,
) -> tuple[str, str, int]:
    """Launch on ``port`` of loopback, walk one box in, send ``sig`` (``times`` over) to the
    launch once ``until`` holds, and once more after the walk-in has ended when ``late``;
    the launch's log, the walk-in's log, and the walk-in's exit code."""
    launch = open_window(tmp_path, port, target)
    walker = None
    try:
        wait_for(lambda: bool(state(port)))  # the window is open
        walker = walk_in(tmp_path, port)
        wait_for(until)
        for _ in range(times):
            launch.send_signal(sig)
        walked = walker.wait(timeout=60)
        if late:
            launch.send_signal(sig)  # the launch has stopped the hosts: closing, or gone
        code = launch.wait(timeout=60)
        assert code == 128 + sig, launch.stderr.read() if launch.stderr else ""
        assert launch.stdout is not None and launch.stderr is not None and walker.stderr is not None
        report = json.loads(launch.stdout.read())
        assert (
            not report["ok"]
            and report["reason"] == f"the operator stopped the launch ({sig.name} on the controller)"
        )
        return launch.stderr.read(), walker.stderr.read(), walked
    finally:
        for proc in (launch, walker):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def kept(tmp_path: Path, port: int) -> dict[str, Any]:
    """What `fdl status` shows once nobody answers on ``port``: the verdict the launch kept."""
    shown = subprocess.run(
        ["fdl", "status", "--addr", f"127.0.0.1:{port}", "--json"],
        cwd=tmp_path, env=home(tmp_path), capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert shown.returncode == 1, shown.stderr  # nobody answers; the kept verdict is shown
    verdict: dict[str, Any] = json.loads(shown.stdout)
    assert verdict["live"] is False
    return verdict


def test_ctrl_c_mid_run_is_the_operators_stop_and_every_host_is_told(tmp_path: Path) -> None:
    started = tmp_path / "started"
    log, walk_in, code = stopped(tmp_path, free_port(), signal.SIGINT, target=1, until=started.exists)
    assert "SIGINT: the operator stopped the launch; telling every host" in log
    assert "launch stopped by the operator (SIGINT): exit 130" in log
    assert "closed its link" not in log.split("SIGINT:")[1]  # no host is blamed for it
    assert (
        "the controller aborted the run: the operator stopped the launch (SIGINT on the controller)"
        in walk_in
    )
    assert "went away" not in walk_in and code == 1  # transient: --persist re-dials into the next launch


def test_sigterm_while_the_window_is_open_is_the_operators_stop_too(tmp_path: Path) -> None:
    # Two ranks wanted, one box in: the window stays open with the walk-in waiting.
    port = free_port()

    def waiting() -> bool:
        return state(port).get("joined_ranks") == 1

    log, walk_in, code = stopped(tmp_path, port, signal.SIGTERM, target=2, until=waiting)
    assert "launch stopped by the operator (SIGTERM): exit 143" in log
    assert (
        "the controller aborted the run: the operator stopped the launch (SIGTERM on the controller)"
        in walk_in
    )
    assert code == 1


@pytest.mark.parametrize("late", [False, True], ids=["together", "shell-hangup-after-the-stop"])
def test_sighup_a_dropped_ssh_session_is_the_operators_stop_and_the_verdict_is_kept(
    tmp_path: Path, late: bool
) -> None:
    # A dropped session's hangup comes twice (the kernel's, then the shell's), the second
    # at once or once the stop is done: one stop, and exit 129 either way, never a kill.
    started, port = tmp_path / "started", free_port()
    log, walk_in, code = stopped(
        tmp_path, port, signal.SIGHUP, target=1, until=started.exists, times=2 - late, late=late
    )
    assert "SIGHUP: the operator stopped the launch; telling every host" in log
    assert "launch stopped by the operator (SIGHUP): exit 129" in log
    assert (
        "the controller aborted the run: the operator stopped the launch (SIGHUP on the controller)"
        in walk_in
    )
    assert code == 1
    verdict = kept(tmp_path, port)
    assert not verdict["ok"]
    assert verdict["reason"] == "the operator stopped the launch (SIGHUP on the controller)"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this box")
def test_a_full_disk_under_stdout_ends_neither_the_walk_in_nor_the_run(tmp_path: Path) -> None:
    port = free_port()
    rank = [sys.executable, "-c", "for i in range(200): print('step', i, flush=True)"]
    with Path("/dev/full").open("w") as full:
        launch = open_window(tmp_path, port, 1, stdout=full, rank=rank)
        walker = None
        try:
            wait_for(lambda: bool(state(port)))
            walker = walk_in(tmp_path, port, stdout=full)
            # The rank's lines meet the full disk on the walk-in's stdout; the report on the launch's.
            assert walker.wait(timeout=60) == 0, walker.stderr.read() if walker.stderr else ""
            assert launch.wait(timeout=60) == 0, launch.stderr.read() if launch.stderr else ""
        finally:
            for proc in (launch, walker):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait()
    assert launch.stderr is not None and walker.stderr is not None
    said = "fdl: cannot write to standard output: No space left on device"
    walked, launched = walker.stderr.read(), launch.stderr.read()
    assert walked.count(said) == 1 and launched.count(said) == 1, (walked[-2000:], launched[-2000:])
    assert "internal error" not in walked + launched
    assert kept(tmp_path, port)["ok"]

"""A rank's end is its process's exit, and nothing it started outlives it: the reaper run
for real on this box, with ranks that leave a background child holding stdout, a ``setsid``
daemon and a double fork behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from flodl_agent.agent import contained, reaper
from flodl_agent.controller.controller import Controller
from flodl_agent.errors import CLEAN
from flodl_agent.retry import AgentFailure
from tests.support.control_plane import agent, run, settings, until, walk_in

# Three ways to leave something running: each writes its pid where the test reads it.
LEAKY = """
sleep 300 & echo $! > {d}/child
setsid sleep 301 & echo $! > {d}/daemon
( ( sleep 302 & echo $! > {d}/orphan ) & )
# The rank ends once all three sleep and the orphan's parent is gone (it is the reaper's).
for f in child daemon orphan; do
  until [ -s {d}/$f ] && [ "$(cat /proc/$(cat {d}/$f)/comm)" = sleep ]; do sleep 0.01; done
done
until [ "$(cut -d' ' -f4 /proc/$(cat {d}/orphan)/stat)" = "$PPID" ]; do sleep 0.01; done
echo "rank says bye"
exit {code}
"""
# A daemon that shrugs off SIGTERM: the reaper's SIGKILL ends it.
STUBBORN = """
setsid bash -c 'trap "" TERM; echo $$ > {d}/daemon; while :; do sleep 0.1; done' &
echo $$ > {d}/rank
while [ ! -s {d}/daemon ]; do sleep 0.05; done
echo ready > {d}/ready
sleep 300
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def pids(directory: Path, *names: str) -> list[int]:
    return [int((directory / name).read_text()) for name in names]


def wait_file(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text().strip():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)  # polling a file the rank writes


def reaped(command: list[str], tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """The reaper started as the agent starts it (its own session), its report in a file."""
    report = tmp_path / "report"
    fd = os.open(report, os.O_WRONLY | os.O_CREAT)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", reaper.__file__, str(fd), "--", *command],
            pass_fds=(fd,), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    finally:
        os.close(fd)
    return proc, report


def records(report: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in report.read_text().splitlines()]


@pytest.mark.parametrize("code", [0, 3])
def test_what_a_rank_leaves_behind_ends_with_it_and_its_code_is_the_rank_s(tmp_path: Path, code: int) -> None:
    proc, report = reaped(["bash", "-c", LEAKY.format(d=tmp_path, code=code)], tmp_path)
    # The background child holds the pipe: without the reaper, this read would wait 300 s.
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == code and b"rank says bye" in out
    left = pids(tmp_path, "child", "daemon", "orphan")
    assert not any(alive(pid) for pid in left)
    started, ended = records(report)
    assert isinstance(started["started"], int)
    assert ended == {"left": {str(pid): "sleep" for pid in sorted(left)}}


def test_a_rank_that_leaves_nothing_reports_nothing(tmp_path: Path) -> None:
    proc, report = reaped([sys.executable, "-c", "print('hi')"], tmp_path)
    assert proc.communicate(timeout=30)[0] == b"hi\n" and proc.returncode == 0
    assert records(report)[1] == {"left": {}}


def test_a_rank_ended_by_a_signal_ends_its_reaper_by_the_same_one(tmp_path: Path) -> None:
    proc, _ = reaped(["bash", "-c", "kill -SEGV $$"], tmp_path)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGSEGV


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_stop_reaches_a_daemon_out_of_the_rank_s_group_and_one_that_ignores_it_is_killed(
    tmp_path: Path, sig: signal.Signals
) -> None:
    proc, report = reaped(["bash", "-c", STUBBORN.format(d=tmp_path)], tmp_path)
    wait_file(tmp_path / "ready")
    rank, daemon = pids(tmp_path, "rank", "daemon")
    proc.send_signal(sig)  # to the reaper alone: the agent's killpg reaches the rank too
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM  # the rank's own end: the SIGTERM passed on
    assert not alive(rank) and not alive(daemon)
    assert str(daemon) in records(report)[-1]["left"]  # type: ignore[operator]


def test_a_command_the_kernel_refuses_is_said_as_its_error(tmp_path: Path) -> None:
    proc, report = reaped([str(tmp_path / "no-such-entry")], tmp_path)
    proc.communicate(timeout=30)
    assert proc.returncode == 127
    (said,) = records(report)
    assert said == {"start": {"errno": 2, "strerror": "No such file or directory",
                              "filename": str(tmp_path / "no-such-entry")}}  # fmt: skip


def test_the_agent_side_raises_the_kernel_s_error_as_if_it_had_started_the_rank(tmp_path: Path) -> None:
    entry = tmp_path / "not-executable"
    entry.write_text("#!/bin/sh\n")

    async def go(command: list[str]) -> None:
        await contained.start(command, dict(os.environ), None)

    with pytest.raises(FileNotFoundError):
        asyncio.run(go([str(tmp_path / "missing")]))
    with pytest.raises(PermissionError):
        asyncio.run(go([str(entry)]))


def test_the_agent_reads_a_rank_s_output_until_it_ends_and_learns_what_it_left(tmp_path: Path) -> None:
    async def go() -> tuple[list[str], int, dict[int, str]]:
        leaky = ["bash", "-c", LEAKY.format(d=tmp_path, code=5)]
        held = await contained.start(leaky, dict(os.environ), tmp_path)
        lines = [line async for line in contained.lines_until_exit(held.proc, held)]
        return lines, await held.proc.wait(), held.left

    lines, code, left = asyncio.run(asyncio.wait_for(go(), 30))
    assert lines == ["rank says bye"] and code == 5
    assert sorted(left) == sorted(pids(tmp_path, "child", "daemon", "orphan"))
    note = contained.left_note(0, left)
    assert note is not None and note.startswith("rank 0 left 3 processes running (")


def test_output_a_stray_holds_past_the_reaper_is_cut_off_after_the_drain(tmp_path: Path) -> None:
    # The reaper killed outright (its stop never ran): the rank and its child hold the pipe.
    script = (
        f"echo $$ > {tmp_path}/rank; sleep 300 & echo $! > {tmp_path}/child; echo up; kill -KILL $PPID; wait"
    )

    async def go() -> tuple[list[str], int | None]:
        held = await contained.start(["bash", "-c", script], dict(os.environ), None)
        lines = [line async for line in contained.lines_until_exit(held.proc, held)]
        return lines, await held.proc.wait()

    try:  # without the cut-off this waits out the strays' 300 s: the 30 s bound fails it
        lines, code = asyncio.run(asyncio.wait_for(go(), 30))
    finally:
        for name in ("rank", "child"):
            if (tmp_path / name).exists():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int((tmp_path / name).read_text()), signal.SIGKILL)
    assert lines == ["up"] and code == -signal.SIGKILL


# --- through the control plane: a controller and walk-ins on loopback ------------------


def test_the_run_ends_when_the_rank_does_and_its_host_log_names_what_it_left(tmp_path: Path) -> None:
    async def scenario() -> None:
        ctl = Controller(settings(["bash", "-c", LEAKY.format(d=tmp_path, code=0)], quorum=1, target=1))
        await ctl.start()
        logs: list[str] = []
        assert await walk_in(agent(ctl, "a", 1), logs) == CLEAN
        await ctl.finished.wait()
        assert ctl.exit_code == 0
        left = pids(tmp_path, "child", "daemon", "orphan")
        assert not any(alive(pid) for pid in left)
        (note,) = [line for line in logs if " left " in line]
        shown = ", ".join(f"{pid} sleep" for pid in sorted(left))
        assert note == f"rank 0 left 3 processes running ({shown}): stopped them"
        await ctl.close()

    run(scenario)


def test_an_abort_and_an_agent_that_stops_leave_nothing_of_their_ranks(tmp_path: Path) -> None:
    # Host "gone"'s agent stops mid-run (cancelled: its clean-up runs); the controller aborts
    # "told". Both ranks keep a daemon out of their group that shrugs off SIGTERM.
    (tmp_path / "gone").mkdir()
    (tmp_path / "told").mkdir()
    rank = ["bash", "-c", STUBBORN.format(d="$HOST_DIR")]

    async def scenario() -> None:
        ctl = Controller(settings(rank, quorum=2, target=2))
        await ctl.start()
        boxes = {}
        for name in ("gone", "told"):
            opts = agent(ctl, name, 1)
            opts = replace(opts, env={"HOST_DIR": str(tmp_path / name)})
            boxes[name] = asyncio.ensure_future(walk_in(opts))
        await until(lambda: all((tmp_path / n / "ready").exists() for n in boxes), timeout=30)
        boxes["gone"].cancel()
        with pytest.raises(asyncio.CancelledError):
            await boxes["gone"]
        result = await boxes["told"]
        assert isinstance(result, AgentFailure) and "aborted the run" in result.message
        for name in boxes:
            assert not any(alive(pid) for pid in pids(tmp_path / name, "rank", "daemon")), name
        await ctl.close()

    run(scenario)


@pytest.mark.skipif(shutil.which("fdl") is None, reason="the fdl console script is not on PATH")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_fdl_join_stopped_by_a_signal_leaves_nothing_of_its_ranks(
    tmp_path: Path, sig: signal.Signals
) -> None:
    async def scenario() -> None:
        ctl = Controller(settings(["bash", "-c", STUBBORN.format(d=tmp_path)], quorum=1, target=1))
        await ctl.start()
        join = await asyncio.create_subprocess_exec(
            "fdl", "join", f"127.0.0.1:{ctl.port}", "--host", "box-a", "--devices", "cpu:1",
            env={**os.environ, "NO_COLOR": "1", "HOME": str(tmp_path)},
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        await until(lambda: (tmp_path / "ready").exists(), timeout=30)
        join.send_signal(sig)
        _, said = await join.communicate()
        assert join.returncode == 1 and b"stopped by a signal; ranks ended" in said
        assert not any(alive(pid) for pid in pids(tmp_path, "rank", "daemon"))
        await ctl.close()

    run(scenario)

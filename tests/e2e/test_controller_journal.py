"""The launch's journal through the real command line: written when the world forms (its
user's alone, no token), closed when the launch ends, and after a `kill -9` of the
controller mid-run the one thing that tells `fdl status` and the next launch what happened
(issue 37: the journal a restarted controller will resume from)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

from tests.e2e.test_launch_join import fdl, loopback_cluster, pytestmark, state, wait_for
from tests.support import free_port

__all__ = ["pytestmark"]

# A rank that trains until the test lets it finish (a file appears).
WAITS = "import os, time\nwhile not os.path.exists(os.environ['GO']): time.sleep(0.05)"


def _journal(home: Path, port: int) -> Path:
    return home / ".flodl" / "controller" / f"journal-{port}.json"


def _launch(cwd: Path, env: dict[str, str], command: list[str], *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["fdl", "launch", *flags, "--", *command], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _join(cwd: Path, env: dict[str, str], port: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["fdl", "join", f"127.0.0.1:{port}", "--devices", "cpu:1", "--host", "solo"],
        cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_a_formed_world_is_journaled_and_a_finished_launch_closes_its_journal(tmp_path: Path) -> None:
    port, home = free_port(), tmp_path / "home"
    loopback_cluster(tmp_path, port, min_rank_start=1, join_timeout=1, max_join_timeout=30, token="ab" * 16)
    env = {**os.environ, "HOME": str(home), "NO_COLOR": "1", "GO": str(tmp_path / "go")}
    launch = _launch(tmp_path, env, [sys.executable, "-c", WAITS])
    wait_for(lambda: state(tmp_path, env).get("phase") == "waiting")  # a join dials once, without --persist
    join = _join(tmp_path, {**env, "FDL_TOKEN": "ab" * 16}, port)
    try:
        wait_for(lambda: state(tmp_path, env).get("phase") == "training", timeout=60)
        path = _journal(home, port)
        wait_for(path.exists)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds the run's salt
        journal = json.loads(path.read_text())
        assert journal["phase"] == "training" and journal["port"] == port and journal["plane"] == "cpu"
        assert journal["world"] == [{"host": "solo", "first": 0, "stop": 1}]
        assert "ab" * 16 not in path.read_text()  # never the token
        (tmp_path / "go").write_text("")
        assert join.wait(timeout=60) == 0, join.stderr.read() if join.stderr else ""
        assert launch.wait(timeout=60) == 0
    finally:
        for proc in (join, launch):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    closed = json.loads(path.read_text())
    assert closed["phase"] == "done" and closed["exits"] == {"0": 0}
    assert closed["launch"] == journal["launch"]
    assert closed["reason"] == "run complete: every host link closed"


def test_a_controller_killed_mid_run_is_told_by_its_journal(tmp_path: Path) -> None:
    port, home = free_port(), tmp_path / "home"
    # No grace: the walk-in stops its rank when the link breaks (the resume: test_controller_restart).
    loopback_cluster(
        tmp_path, port, min_rank_start=1, join_timeout=1, max_join_timeout=30, controller_grace=0
    )
    env = {**os.environ, "HOME": str(home), "NO_COLOR": "1", "GO": str(tmp_path / "go")}
    launch = _launch(tmp_path, env, [sys.executable, "-c", WAITS])
    wait_for(lambda: state(tmp_path, env).get("phase") == "waiting")
    join = _join(tmp_path, env, port)
    try:
        wait_for(lambda: state(tmp_path, env).get("phase") == "training", timeout=60)
        wait_for(_journal(home, port).exists)
        launch.send_signal(signal.SIGKILL)  # no verdict kept, no journal closed
        launch.wait(timeout=10)
        assert join.wait(timeout=60) == 1  # its link broke: it stopped its rank (no grace)
    finally:
        for proc in (join, launch):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    launched = json.loads(_journal(home, port).read_text())["launch"]

    gone = fdl("status", cwd=tmp_path, env=env)
    assert gone.returncode == 1 and "no controller answers" in gone.stderr
    assert f"the last launch on port {port} (launch {launched})" in gone.stdout
    assert "its controller stopped while the world trained: it kept no verdict" in gone.stdout
    told = json.loads(fdl("status", "--json", cwd=tmp_path, env=env).stdout)
    assert told["phase"] == "failed" and told["live"] is False and told["launch"] == launched
    assert [h["host"] for h in told["hosts"]] == ["solo"] and told["world_size"] == 1

    # A launch of other settings neither resumes that world nor drops it: refused, with the way out.
    other = fdl("launch", "--", sys.executable, "-c", "pass", cwd=tmp_path, env=env)
    assert other.returncode != 0 and "ran other settings than this launch's" in other.stderr, other.stderr
    assert "--fresh" in other.stderr
    # With --fresh it says so once, and closes that journal: it is no longer told.
    again = _launch(tmp_path, env, [sys.executable, "-c", "pass"], "--fresh")
    try:
        assert again.stderr is not None
        lines = []
        while "join window open" not in (line := again.stderr.readline()) and line:  # after its time stamp
            lines.append(line)
        assert any(f"launch {launched}'s journal discarded (--fresh)" in ln for ln in lines), lines
        assert any(f"launch {launched} did not finish: its controller stopped" in ln for ln in lines), lines
        again.send_signal(signal.SIGINT)
        again.wait(timeout=30)
    finally:
        if again.poll() is None:
            again.kill()
        again.wait()
    assert json.loads(_journal(home, port).read_text())["phase"] == "failed"
    after = fdl("status", cwd=tmp_path, env=env)
    assert "its controller stopped while the world trained" not in after.stdout

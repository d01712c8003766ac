"""End to end through the real command line: fdl launch, two walk-ins, fdl status,
fdl start, training and done — every exit code checked."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import free_port

pytestmark = pytest.mark.skipif(shutil.which("fdl") is None, reason="the fdl console script is not on PATH")


def fdl(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["fdl", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def loopback_cluster(cwd: Path, port: int, **join: object) -> None:
    """A discovery cluster on loopback: whoever walks in is the world."""
    (cwd / "fdl.cluster.yml").write_text(
        json.dumps(
            {
                "cluster": {
                    "controller": {"host": "127.0.0.1", "port": port, "join": {"discovery": True, **join}}
                }
            }
        )
    )


def state(cwd: Path, env: dict[str, str] | None = None) -> dict[str, object]:
    proc = fdl("status", "--json", cwd=cwd, env=env)
    return json.loads(proc.stdout) if proc.returncode == 0 else {}


def wait_for(predicate, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)  # polling the controller's status, the operator's own view


def test_manual_launch_two_walk_ins_start_train_done(tmp_path: Path) -> None:
    port = free_port()
    loopback_cluster(tmp_path, port, min_rank_start=2, start="manual", join_timeout=60, max_join_timeout=120)
    out = tmp_path / "out"
    out.mkdir()
    rank_cmd = [
        sys.executable,
        "-c",
        f"import os; open(os.path.join(r'{out}', os.environ['RANK']), 'w').write(os.environ['WORLD_SIZE'])",
    ]
    env = {**os.environ, "NO_COLOR": "1"}
    launch = subprocess.Popen(
        ["fdl", "launch", "--json", "--", *rank_cmd],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: state(tmp_path).get("phase") == "waiting")
        refused = fdl("start", cwd=tmp_path)
        assert refused.returncode == 1 and "quorum not met: 0 of 2" in refused.stderr

        walkers = [
            subprocess.Popen(
                ["fdl", "join", f"127.0.0.1:{port}", "--host", name, "--devices", "cpu:1"],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for name in ("box-a", "box-b")
        ]
        wait_for(lambda: state(tmp_path).get("joined_ranks") == 2)
        staged = state(tmp_path)
        assert staged["phase"] == "staging"
        shown = fdl("status", cwd=tmp_path)
        assert shown.returncode == 0 and "staging" in shown.stdout and "box-a" in shown.stdout

        started = fdl("start", cwd=tmp_path)
        assert started.returncode == 0 and "armed" in started.stdout

        codes = [w.wait(timeout=60) for w in walkers]
        assert codes == [0, 0], [w.stderr.read() for w in walkers if w.stderr]
        assert launch.wait(timeout=30) == 0
        assert sorted(p.name for p in out.iterdir()) == ["0", "1"]
        assert {p.read_text() for p in out.iterdir()} == {"2"}
        assert launch.stderr is not None
        log = launch.stderr.read()
        assert "operator start accepted" in log and "run complete" in log
        assert launch.stdout is not None
        report = json.loads(launch.stdout.read())
        assert report["ok"] and report["phase"] == "done" and report["world_size"] == 2
        assert [(h["host"], h["ranks"], h["exits"]) for h in report["hosts"]] == [
            ("box-a", [0, 1], {"0": 0}),
            ("box-b", [1, 2], {"1": 0}),
        ] or [(h["host"], h["ranks"], h["exits"]) for h in report["hosts"]] == [
            ("box-b", [0, 1], {"0": 0}),
            ("box-a", [1, 2], {"1": 0}),
        ]
    finally:
        if launch.poll() is None:
            launch.kill()
        launch.wait()

    gone = fdl("status", cwd=tmp_path)
    assert gone.returncode == 1 and "no controller answers" in gone.stderr


def test_after_a_run_fdl_status_says_how_it_ended_live_then_from_the_kept_verdict(tmp_path: Path) -> None:
    port = free_port()
    loopback_cluster(tmp_path, port, min_rank_start=1, join_timeout=1, max_join_timeout=30)
    env = {**os.environ, "HOME": str(tmp_path / "home"), "NO_COLOR": "1"}  # the user running both
    failing = [sys.executable, "-c", "import sys; sys.exit(3)"]
    launch = subprocess.Popen(
        ["fdl", "launch", "--", *failing], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, text=True
    )
    try:
        wait_for(lambda: state(tmp_path, env).get("phase") == "waiting")
        watch = subprocess.Popen(
            ["fdl", "status", "--watch"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True
        )
        join = ("join", f"127.0.0.1:{port}", "--devices", "cpu:1", "--host", "solo")
        joined = fdl(*join, cwd=tmp_path, env=env, timeout=90)  # rank 0's host starts torch's store
        assert joined.returncode == 1, joined.stderr  # its rank failed
        # The live final phase: someone was watching, so the controller served the verdict a
        # few seconds more, and the watch's last refresh shows it (exit 0: a controller answered).
        watched, _ = watch.communicate(timeout=30)
        assert watch.returncode == 0
        assert "failed" in watched and "failure: rank 0 on solo exited with code 3" in watched
        assert launch.wait(timeout=30) == 1
    finally:
        if launch.poll() is None:
            launch.kill()
        launch.wait()

    # After the exit: nobody answers (exit 1), and the verdict the launch kept says how it ended.
    gone = fdl("status", cwd=tmp_path, env=env)
    assert gone.returncode == 1 and "no controller answers" in gone.stderr
    assert f"failed  the last launch on port {port} (launch " in gone.stdout
    assert "failure: rank 0 on solo exited with code 3" in gone.stdout and "rank 0: exit 3" in gone.stdout
    kept = fdl("status", "--json", cwd=tmp_path, env=env)
    assert kept.returncode == 1
    verdict = json.loads(kept.stdout)
    assert verdict["live"] is False and verdict["phase"] == "failed" and not verdict["ok"]
    assert verdict["port"] == port and [h["host"] for h in verdict["hosts"]] == ["solo"]
    # Another user's status (another home) holds no verdict of this launch: only "nobody answers".
    other = fdl("status", cwd=tmp_path, env={**env, "HOME": str(tmp_path / "other")})
    assert other.returncode == 1 and other.stdout == "" and "no controller answers" in other.stderr


@pytest.mark.skipif(shutil.which("script") is None, reason="needs util-linux script for a terminal")
def test_launch_on_a_terminal_shows_a_live_roster_and_fails_at_the_cap(tmp_path: Path) -> None:
    port = free_port()
    loopback_cluster(tmp_path, port, min_rank_start=1, join_timeout=1, max_join_timeout=2)
    proc = subprocess.run(
        ["script", "-qec", "fdl launch -- true", "/dev/null"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 1
    assert "waiting: 0 ranks (quorum 1) from nobody yet" in proc.stdout
    assert "quorum not met: 0 of 1 ranks joined before the hard cap" in proc.stdout


def test_at_cluster_runs_a_named_command_of_fdl_yml(tmp_path: Path) -> None:
    port = free_port()
    out = tmp_path / "ran"
    (tmp_path / "fdl.yml").write_text(
        "commands:\n"
        f"  train: [{json.dumps(sys.executable)}, -c,\n"
        "          \"import sys; open(sys.argv[1], 'w').write(sys.argv[2])\"]\n"
    )
    loopback_cluster(tmp_path, port, min_rank_start=1, join_timeout=1, max_join_timeout=30)
    launch = subprocess.Popen(
        ["fdl", "@cluster", "train", str(out), "epoch-3"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: state(tmp_path).get("phase") == "waiting")
        joined = fdl("join", f"127.0.0.1:{port}", "--devices", "cpu:1", "--host", "solo", cwd=tmp_path)
        assert joined.returncode == 0, joined.stderr
        assert launch.wait(timeout=30) == 0
    finally:
        if launch.poll() is None:
            launch.kill()
    assert out.read_text() == "epoch-3"
    unknown = fdl("@cluster", "trian", cwd=tmp_path)
    assert unknown.returncode == 2 and "did you mean `train`?" in unknown.stderr
    missing = fdl("@nowhere", "train", cwd=tmp_path)
    assert missing.returncode == 2 and "no fdl.nowhere.yml here" in missing.stderr


@pytest.mark.skipif(shutil.which("script") is None, reason="needs util-linux script for a terminal")
def test_a_waiting_agent_on_a_terminal_shows_a_spinner(tmp_path: Path) -> None:
    port = free_port()
    loopback_cluster(tmp_path, port, min_rank_start=1, join_timeout=1, max_join_timeout=30)
    launch = subprocess.Popen(
        ["fdl", "launch", "--", "true"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_for(lambda: state(tmp_path).get("phase") == "waiting")
        proc = subprocess.run(
            ["script", "-qec", f"fdl join 127.0.0.1:{port} --devices cpu:1 --host spun", "/dev/null"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout
        assert "admitted as spun; waiting for the world to form" in proc.stdout
        assert launch.wait(timeout=30) == 0
    finally:
        if launch.poll() is None:
            launch.kill()


def test_sigterm_on_an_agent_ends_its_ranks(tmp_path: Path) -> None:
    port = free_port()
    loopback_cluster(tmp_path, port, min_rank_start=1, join_timeout=1, max_join_timeout=30)
    pidfile = tmp_path / "rank.pid"
    rank = [
        sys.executable,
        "-c",
        f"import os, time; open(r'{pidfile}', 'w').write(str(os.getpid())); time.sleep(120)",
    ]
    launch = subprocess.Popen(
        ["fdl", "launch", "--json", "--", *rank],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        wait_for(lambda: state(tmp_path).get("phase") == "waiting")
        agent = subprocess.Popen(
            ["fdl", "join", f"127.0.0.1:{port}", "--devices", "cpu:1"],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(lambda: pidfile.exists() and pidfile.read_text() != "")
        rank_pid = int(pidfile.read_text())
        agent.terminate()
        assert agent.wait(timeout=30) == 1
        wait_for(lambda: not Path(f"/proc/{rank_pid}").exists() or "zombie" in _proc_state(rank_pid))
        assert launch.wait(timeout=30) == 1  # the host vanished mid-run: the run failed
        assert launch.stdout is not None
        report = json.loads(launch.stdout.read())
        assert not report["ok"] and report["phase"] == "failed"
        assert "closed its link" in report["reason"] or "exited with code" in report["reason"]
        assert len(report["hosts"]) == 1 and report["world_size"] == 1
    finally:
        for proc in (launch,):
            if proc.poll() is None:
                proc.kill()


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"

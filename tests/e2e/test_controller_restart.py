"""A controller killed mid-run (SIGKILL) and started again re-adopts its world (issue 37):
real `fdl launch` and `fdl join` processes on loopback, the world's ranks training on
through the gap. The run completes with exit 0, every rank kept its PID and its step
counter (never restarted), and the ranks end with equal weights; on both planes: a
torchrun-style gloo script (its collectives never touch the controller) and the CPU
plane (its rounds pause while the controller is away)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_launch_join import loopback_cluster, pytestmark, state, wait_for
from tests.support import free_port

__all__ = ["pytestmark"]

pytest.importorskip("torch")

# Each step: one collective, then its line (pid, step, weights); all stop together once GO exists.
GLOO = """
import json, os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
out, go = sys.argv[1], os.environ["GO"]
w, step = torch.zeros(4), 0
with open(os.path.join(out, f"{rank}.jsonl"), "a") as log:
    while True:
        w += rank + 1
        dist.all_reduce(w)
        w /= size
        log.write(json.dumps({"pid": os.getpid(), "step": step, "w": w.tolist()}) + "\\n")
        log.flush()
        step += 1
        stop = torch.tensor([1.0 if os.path.exists(go) else 0.0])
        dist.all_reduce(stop)
        if stop.item() > 0:
            break
        time.sleep(0.05)  # a step's pace, so the gap spans steps
dist.destroy_process_group()
"""

# The CPU plane: each rank steps on its own and averages every step through the controller.
CPU = """
import json, os, sys, time
import torch
from flodl_agent.train import Averager
rank = int(os.environ["RANK"])
out, go = sys.argv[1], os.environ["GO"]
avg, w, step = Averager(), torch.zeros(4), 0
with open(os.path.join(out, f"{rank}.jsonl"), "a") as log:
    while True:
        w += rank + 1
        avg.average([w], 1.0)
        log.write(json.dumps({"pid": os.getpid(), "step": step, "w": w.tolist()}) + "\\n")
        log.flush()
        step += 1
        last = open(go).read().strip() if os.path.exists(go) else ""
        if last and avg.round > int(last):  # every rank stops after the same round
            break
        time.sleep(0.05)
"""


def _lines(out: Path, rank: int) -> list[dict[str, object]]:
    path = out / f"{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _steps(out: Path, rank: int) -> int:
    return len(_lines(out, rank))


def _launch(cwd: Path, env: dict[str, str], script: str, out: Path, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["fdl", "launch", "--no-fanout", *flags, "--", sys.executable, "-c", script, str(out)],
        cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _join(cwd: Path, env: dict[str, str], port: int, host: str) -> subprocess.Popen[str]:
    """A walk-in; its log and its ranks' lines in ``cwd/join-HOST.log`` (a failure shows them)."""
    with (cwd / f"join-{host}.log").open("w") as log:
        return subprocess.Popen(
            ["fdl", "join", f"127.0.0.1:{port}", "--devices", "cpu:1", "--host", host],
            cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip


def _logs(cwd: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(cwd.glob("join-*.log")))


def _said(proc: subprocess.Popen[str], words: str) -> list[str]:
    """The launch's log up to the line that holds ``words`` (all of it, if it ended first)."""
    assert proc.stderr is not None
    lines = []
    while line := proc.stderr.readline():
        lines.append(line)
        if words in line:
            break
    return lines


@pytest.mark.parametrize(
    ("plane", "stop"),
    [
        # Alone, after the parallel pass: in it, two gloo worlds at once have hung (here) and
        # aborted (test_store_after_formation) on the 2-core CI box; alone they pass.
        pytest.param("gloo", "kill", marks=pytest.mark.serial),
        ("cpu", "kill"),
        ("cpu", "handoff"),  # a unit's restart (SIGTERM)
    ],
)
def test_a_stopped_controller_restarted_re_adopts_its_world(tmp_path: Path, plane: str, stop: str) -> None:
    port, home, out = free_port(), tmp_path / "home", tmp_path / "out"
    out.mkdir()
    loopback_cluster(
        tmp_path, port, min_rank_start=2, target_ranks=2, join_timeout=30, max_join_timeout=60,
        controller_grace=60, token="cd" * 16,
    )  # fmt: skip
    env = {
        **os.environ,
        "HOME": str(home),
        "NO_COLOR": "1",
        "GO": str(tmp_path / "go"),
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",  # the ranks' mesh on loopback, whatever the box's hostname resolves to
    }
    script = GLOO if plane == "gloo" else CPU
    first = _launch(tmp_path, env, script, out, *(["--handoff"] if stop == "handoff" else []))
    procs = [first]
    try:
        wait_for(lambda: state(tmp_path, env).get("phase") == "waiting")  # a join dials once
        walkers = {"FDL_TOKEN": "cd" * 16}
        joins = [_join(tmp_path, {**env, **walkers}, port, host) for host in ("a", "b")]
        procs += joins
        wait_for(lambda: state(tmp_path, env).get("phase") == "training", timeout=60)
        journal = home / ".flodl" / "controller" / f"journal-{port}.json"
        wait_for(journal.exists)
        wait_for(lambda: min(_steps(out, 0), _steps(out, 1)) >= 3, timeout=120)  # gloo's init under load
        if stop == "kill":
            first.send_signal(signal.SIGKILL)  # no verdict, no goodbye: the links just end
            first.wait(timeout=10)
        else:
            first.send_signal(signal.SIGTERM)
            assert first.wait(timeout=30) == 0
            assert "handing the world over to the next controller" in "".join(_said(first, "handing"))
        killed_at = min(_steps(out, 0), _steps(out, 1))
        if plane == "gloo":  # its collectives never touch the controller: it trains through the gap
            wait_for(lambda: min(_steps(out, 0), _steps(out, 1)) >= killed_at + 3, timeout=60)
        assert all(j.poll() is None for j in joins)  # the agents hold their ranks through the gap
        again = _launch(tmp_path, env, script, out)
        procs.append(again)
        said = _said(again, "controller resumed:")
        assert "controller resumed: 2 of 2 hosts back" in said[-1], said
        assert state(tmp_path, env).get("phase") == "training"
        resumed_at = min(_steps(out, 0), _steps(out, 1))
        wait_for(lambda: min(_steps(out, 0), _steps(out, 1)) >= resumed_at + 3, timeout=60)  # trains on
        (tmp_path / "go").write_text(str(max(_steps(out, 0), _steps(out, 1)) + 3))
        for join in joins:
            assert join.wait(timeout=60) == 0
        assert again.wait(timeout=60) == 0, again.stderr.read() if again.stderr else ""
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_logs(tmp_path)}") from None  # the agents' side of it
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    ranks = [_lines(out, r) for r in (0, 1)]
    for lines in ranks:
        assert len({line["pid"] for line in lines}) == 1  # never restarted
        assert [line["step"] for line in lines] == list(range(len(lines)))  # its counter never reset
    assert ranks[0][-1]["w"] == ranks[1][-1]["w"]  # the world ends as one
    assert json.loads(journal.read_text())["phase"] == "done"

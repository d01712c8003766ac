"""Growth by re-formation, end to end on loopback (issue 38): a torchrun-style gloo script
training on two boxes takes a third box in. The controller holds the walk-in, the two
boxes' agents stop their ranks, the world forms again with three ranks in the same launch,
and the script resumes from its checkpoint (as torchrun scripts do) with
TORCHELASTIC_RESTART_COUNT 1 and the same TORCHELASTIC_RUN_ID."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path

import pytest

from flodl_agent.controller.controller import Controller
from flodl_agent.controller.elastic import Elastic
from tests.support.control_plane import agent, run, settings, until, walk_in

pytest.importorskip("torch")

# Real gloo worlds: alone after the parallel pass (on 2 cores, a loaded gloo init stalls).
pytestmark = pytest.mark.serial

STEPS = 12
HOLD = 5  # the two-rank world waits at this step for the walk-in: it never gets past it
# Each step adds the world's size to w (an all_reduce of ones); rank 0 checkpoints after every
# step (written whole, then renamed). A restarted rank resumes after its checkpoint's step.
SCRIPT = """
import json, os, sys, time
from pathlib import Path
import torch, torch.distributed as dist

out, steps, hold = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
checkpoint = out / "checkpoint.json"
dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
state = json.loads(checkpoint.read_text()) if checkpoint.exists() else {"step": -1, "w": 0.0}
resumed = state["step"] + 1
w = state["w"]
for step in range(resumed, steps):
    while size == 2 and step == hold:
        time.sleep(0.01)  # a step that waits for the walk-in: the re-formation stops it here
    ones = torch.ones(1)
    dist.all_reduce(ones)
    w += ones.item()
    if rank == 0:
        (out / "checkpoint.tmp").write_text(json.dumps({"step": step, "w": w}))
        (out / "checkpoint.tmp").replace(checkpoint)
    dist.barrier()
said = {
    "pid": os.getpid(), "w": w, "world": size, "resumed": resumed,
    "restart": os.environ["TORCHELASTIC_RESTART_COUNT"], "run_id": os.environ["TORCHELASTIC_RUN_ID"],
}
(out / f"rank-{rank}.json").write_text(json.dumps(said))
dist.destroy_process_group()
"""


def test_a_gloo_script_grows_from_two_to_three_ranks_by_re_formation(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    notes: list[str] = []
    command = [sys.executable, "-c", SCRIPT, str(out), str(STEPS), str(HOLD)]
    checkpoint = out / "checkpoint.json"

    def at_hold() -> bool:
        return checkpoint.exists() and json.loads(checkpoint.read_text())["step"] == HOLD - 1

    async def scenario() -> None:
        knobs = settings(command, elastic=Elastic(3, reform_interval=0), env={"GLOO_SOCKET_IFNAME": "lo"})
        ctl = Controller(knobs, log=notes.append)
        await ctl.start()
        formed = [asyncio.ensure_future(walk_in(agent(ctl, host))) for host in ("box-a", "box-b")]
        await until(at_hold, timeout=120)  # the world rendezvoused and trains
        said: list[str] = []
        newcomer = asyncio.ensure_future(walk_in(agent(ctl, "box-c"), said))
        assert [await task for task in (*formed, newcomer)] == [0, 0, 0], notes
        await ctl.finished.wait()
        assert ctl.exit_code == 0, ctl.reason
        assert any(
            line.startswith("world re-formed (restart 1) with this host: 3 ranks;") for line in said
        ), said
        state = ctl.view.state()
        assert state["joined_ranks"] == 3
        await ctl.close()

    run(scenario)
    results = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")}
    assert sorted(results) == [0, 1, 2]
    # Steps 0..4 in a world of two, then 5..11 in three, resumed from the checkpoint.
    expected = 2.0 * HOLD + 3.0 * (STEPS - HOLD)
    assert {r["w"] for r in results.values()} == {expected}
    assert {r["world"] for r in results.values()} == {3}
    assert {r["resumed"] for r in results.values()} == {HOLD}
    assert {r["restart"] for r in results.values()} == {"1"}
    assert len({r["run_id"] for r in results.values()}) == 1
    assert len({r["pid"] for r in results.values()}) == 3 and os.getpid() not in {
        r["pid"] for r in results.values()
    }
    reform = [line for line in notes if "re-forming the world to take in box-c" in line]
    assert len(reform) == 1 and "(restart 1)" in reform[0] and "2 host(s) asked" in reform[0], notes
    grew = [line for line in notes if "world re-formed (restart 1)" in line]
    assert len(grew) == 1 and "3 ranks on 3 hosts, box-c walked in" in grew[0], notes
    stopped = [line for line in notes if "stopped for the re-formation" in line]
    assert len(stopped) == 2, notes


def test_a_walk_in_waits_for_the_reform_interval_and_leaves_without_restarting_the_world(
    tmp_path: Path,
) -> None:
    """Within the interval a walk-in is held and the world is not touched; a held walk-in
    that hangs up never joined, and the run completes as a world of two."""
    out = tmp_path / "out"
    out.mkdir()
    notes: list[str] = []
    go = tmp_path / "go"
    command = [sys.executable, "-c", WAITING, str(out), str(go)]

    async def scenario() -> None:
        knobs = settings(command, elastic=Elastic(3, reform_interval=3600), env={"GLOO_SOCKET_IFNAME": "lo"})
        ctl = Controller(knobs, log=notes.append)
        await ctl.start()
        formed = [asyncio.ensure_future(walk_in(agent(ctl, host))) for host in ("box-a", "box-b")]
        await until(lambda: (out / "ready").exists(), timeout=120)
        newcomer = asyncio.ensure_future(walk_in(agent(ctl, "box-c")))
        await until(lambda: any("walked in:" in line and "box-c" in line for line in notes), timeout=30)
        held = next(line for line in notes if "walked in:" in line)
        wait = re.search(r"restarts with it in (\d+)s \(elastic reform_interval\)", held)
        assert wait is not None and 3500 < int(wait[1]) <= 3600, held  # the interval's wait
        reformation = ctl.reformation
        assert reformation is not None and list(reformation.held) == ["box-c"]
        newcomer.cancel()  # the box gives up waiting
        await asyncio.gather(newcomer, return_exceptions=True)
        await until(lambda: not reformation.held, timeout=30)
        go.touch()
        assert [await task for task in formed] == [0, 0], notes
        await ctl.finished.wait()
        assert ctl.exit_code == 0, ctl.reason
        await ctl.close()

    run(scenario)
    assert not any("re-forming" in line for line in notes), notes
    assert any("closed its link while it waited for the re-formation" in line for line in notes), notes
    assert sorted(p.name for p in out.glob("rank-*")) == ["rank-0", "rank-1"]


# Two ranks rendezvous, say they are ready, and wait for GO (the poll stands in for training).
WAITING = """
import os, sys, time
from pathlib import Path
import torch.distributed as dist
out, go = Path(sys.argv[1]), Path(sys.argv[2])
dist.init_process_group("gloo")
dist.barrier()
(out / "ready").touch()
while not go.exists():
    time.sleep(0.01)
(out / f"rank-{dist.get_rank()}").touch()
dist.barrier()
dist.destroy_process_group()
"""

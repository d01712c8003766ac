"""An eviction keeps its promise (issue 35): within --max-failure, a host lost before its ranks
joined a torch.distributed world ends the run at once with the host named, and the survivors
are aborted, instead of waiting on its rendezvous keys until torch's store timeout (300 s)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from flodl_agent.agent.agent import AgentFailure
from flodl_agent.controller.controller import Controller
from tests.support.control_plane import agent, run, settings, walk_in

torch = pytest.importorskip("torch")

# A torchrun-style script: env:// rendezvous through the controller's relayed store, one collective.
# The rank named by argv[2] dies before it ever reaches the store.
GLOO = """
import os, sys
from pathlib import Path
out, rank = Path(sys.argv[1]), os.environ["RANK"]
if rank == sys.argv[2]:
    sys.exit(3)
(out / f"pid-{rank}").write_text(str(os.getpid()))
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
(out / f"done-{rank}").write_text(f"{t.item():g}")
dist.destroy_process_group()
"""


def gloo_world(
    tmp_path: Path, boxes: list[str], dies: str, missing: str = ""
) -> tuple[Controller, list[object]]:
    """``boxes`` walk in with one CPU rank each (rank order); rank ``dies`` exits 3 before init,
    and box ``missing``'s --bin names no file (its rank cannot start: 127)."""
    out = tmp_path / "out"
    out.mkdir()
    holder: list[Controller] = []
    results: list[object] = []

    async def scenario() -> None:
        command = [sys.executable, "-c", GLOO, str(out), dies]
        size = len(boxes)
        knobs = {"env": {"GLOO_SOCKET_IFNAME": "lo"}, "max_failure": "1"}
        ctl = Controller(settings(command, quorum=size, target=size, roster=boxes, **knobs))
        holder.append(ctl)
        await ctl.start()
        walks = []
        for box in boxes:
            opts = agent(ctl, box)
            if box == missing:
                opts = replace(opts, bin=str(tmp_path / "no-such-train"))
            walks.append(walk_in(opts))
        results.extend(await asyncio.gather(*walks))
        await ctl.finished.wait()
        await ctl.close()

    run(scenario)
    for pid in (tmp_path / "out").glob("pid-*"):
        with pytest.raises(ProcessLookupError):  # the survivor was stopped, not left waiting
            os.kill(int(pid.read_text()), 0)
    assert not list(out.glob("done-*"))
    return holder[0], results


def test_a_host_whose_rank_cannot_start_ends_a_gloo_world_at_once(tmp_path: Path) -> None:
    started = time.monotonic()
    ctl, results = gloo_world(tmp_path, ["w1", "w2"], dies="none", missing="w2")
    assert time.monotonic() - started < 45  # seconds, not torch's 300 s store timeout
    assert ctl.exit_code == 1 and ctl.window.phase == "failed"
    assert ctl.reason.startswith("rank 1 on w2 could not start: ")
    assert "host w2's rank 1 never started" in ctl.reason and "not a process group" in ctl.reason
    survivor, lost = results
    assert isinstance(survivor, AgentFailure) and "the controller aborted the run" in survivor.message
    assert "w2" in survivor.message  # the survivor's box says which host ended it
    assert isinstance(lost, AgentFailure)
    assert ctl.view.state()["failure"] == ctl.reason


def test_a_rank_that_dies_before_init_ends_a_gloo_world_at_once(tmp_path: Path) -> None:
    """Rank 2 runs and exits 3 before reaching the store: evicted only until a far rank shows the
    world rendezvouses (rank 1's store connection crosses the controller), then the run ends."""
    started = time.monotonic()
    ctl, results = gloo_world(tmp_path, ["w1", "w2", "w3"], dies="2")
    assert time.monotonic() - started < 45
    assert ctl.exit_code == 1 and ctl.window.phase == "failed"
    # Either the far rank's store connection came first (a process group lost a rank) or the
    # exit did (evicted, until that connection showed the world rendezvouses): the same end.
    assert "host w3's rank 2" in ctl.reason and "cannot go on without them" in ctl.reason
    assert ctl.reason.endswith("not a process group")
    assert all(isinstance(r, AgentFailure) for r in results[:2])

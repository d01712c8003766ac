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
from dataclasses import replace
from pathlib import Path

import pytest

from flodl_agent.agent.options import AgentOptions
from flodl_agent.controller.controller import Controller
from flodl_agent.controller.elastic import Elastic
from flodl_agent.controller.settings import Settings
from tests.support.control_plane import agent, run, settings, until, walk_in

pytest.importorskip("torch")

# Real gloo worlds: alone after the parallel pass (on 2 cores, a loaded gloo init stalls).
pytestmark = pytest.mark.serial

STEPS = 12
HOLD = 5  # the two-rank world waits at this step for the walk-in: it never gets past it


def trainer(pause: str, said: str = "{}") -> str:
    """A torchrun-style gloo script: each step adds the world's size to w (an all_reduce of
    ones), rank 0 checkpoints after every step (written whole, then renamed), and a restarted
    rank resumes after its checkpoint's step. ``pause``: what a step does first (argv[4] is its
    knob); ``said``: what each rank reports at its end beside w, its world and its restart."""
    return f"""
import json, os, sys, time
from pathlib import Path
import torch, torch.distributed as dist

out, steps, hold, knob = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
checkpoint = out / "checkpoint.json"
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
state = json.loads(checkpoint.read_text()) if checkpoint.exists() else {{"step": -1, "w": 0.0}}
resumed, w = state["step"] + 1, state["w"]
for step in range(resumed, steps):
{pause}
    ones = torch.ones(1)
    dist.all_reduce(ones)
    w += ones.item()
    if rank == 0:
        (out / "checkpoint.tmp").write_text(json.dumps({{"step": step, "w": w}}))
        (out / "checkpoint.tmp").replace(checkpoint)
    dist.barrier()
said = {{"w": w, "world": size, "resumed": resumed, "restart": restart}} | {said}
(out / f"rank-{{rank}}.json").write_text(json.dumps(said))
dist.destroy_process_group()
"""


SCRIPT = trainer(
    """
    while size == 2 and step == hold:
        time.sleep(0.01)  # a step that waits for the walk-in: the re-formation stops it here""",
    '{"pid": os.getpid(), "run_id": os.environ["TORCHELASTIC_RUN_ID"]}',
)


def test_a_gloo_script_grows_from_two_to_three_ranks_by_re_formation(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    notes: list[str] = []
    command = [sys.executable, "-c", SCRIPT, str(out), str(STEPS), str(HOLD), "0"]
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
    assert {r["restart"] for r in results.values()} == {1}
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


# Replacement: at HOLD in the first world, the doomed rank says it is ready and waits to be
# killed while the others sit in a barrier with it (the lost peer fails their collective: their
# exits may reach the controller before the lost host's link end does). The re-formed world
# (a walk-in in rank 2's place) resumes from the checkpoint and trains to the end.
REPLACED = trainer(
    """
    if restart == 0 and step == hold:
        if rank == knob:
            (out / "doomed").touch()
            while True:
                time.sleep(0.01)  # killed with its host
        dist.barrier()  # fails (or hangs until the re-formation stops it) once the doomed rank is gone""",
    '{"host": os.environ["FLODL_TEST_HOST"]}',
)


def test_a_lost_host_in_a_gloo_world_is_replaced_by_the_next_walk_in_and_the_world_resumes(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    notes: list[str] = []
    command = [sys.executable, "-c", REPLACED, str(out), str(STEPS), str(HOLD), "2"]

    async def scenario() -> None:
        ctl = Controller(three(command, Elastic(3, reform_interval=0)), log=notes.append)
        await ctl.start()
        boxes = {host: asyncio.ensure_future(walk_in(box(ctl, host))) for host in ("box-a", "box-b", "box-c")}
        await until(lambda: (out / "doomed").exists(), timeout=120)
        boxes["box-c"].cancel()  # the host dies with its rank
        await asyncio.gather(boxes["box-c"], return_exceptions=True)
        await until(lambda: any("the world waits for a walk-in" in line for line in notes), timeout=60)
        said: list[str] = []
        newcomer = asyncio.ensure_future(walk_in(box(ctl, "box-d"), said))
        assert [await boxes["box-a"], await boxes["box-b"], await newcomer] == [0, 0, 0], notes
        await ctl.finished.wait()
        assert ctl.exit_code == 0, ctl.reason
        assert any(line.startswith("world re-formed (restart 1) with this host: 3 ranks;") for line in said)
        await ctl.close()

    run(scenario)
    results = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")}
    assert {r: results[r]["host"] for r in results} == {0: "box-a", 1: "box-b", 2: "box-d"}
    assert {r["w"] for r in results.values()} == {3.0 * STEPS}  # three ranks before the loss and after
    assert {(r["world"], r["resumed"], r["restart"]) for r in results.values()} == {(3, HOLD, 1)}
    (reform,) = [line for line in notes if "so it re-forms (restart 1)" in line]
    assert "lost ranks go to the next walk-in" in reform, notes
    (grew,) = [line for line in notes if "world re-formed (restart 1)" in line]
    assert "3 ranks on 3 hosts, box-d walked in in place of lost host box-c" in grew, notes
    assert not any("run failed" in line for line in notes), notes


def three(command: list[str], elastic: Elastic) -> Settings:
    """A three-box gloo world that may lose one rank."""
    return settings(
        command, target=3, quorum=3, max_failure="1", elastic=elastic, env={"GLOO_SOCKET_IFNAME": "lo"}
    )


def box(ctl: Controller, host: str) -> AgentOptions:
    """A box whose ranks know its name (the script reports where each rank ran)."""
    return replace(agent(ctl, host), env={"FLODL_TEST_HOST": host})


# Rank 1 fails on its own at HOLD while the restart count is below FAILS; its peer waits in a
# barrier. The restarted ranks resume from the checkpoint.
FAILING = trainer(
    """
    if step == hold and restart < knob:
        if rank == 1:
            sys.exit(3)
        dist.barrier()""",
)


@pytest.mark.parametrize("fails", [1, 2])
def test_a_rank_that_fails_restarts_the_world_on_the_same_hosts_once_within_the_interval(
    tmp_path: Path, fails: int
) -> None:
    """A failed rank whose host keeps its link runs again in the restarted world (nobody is
    lost); a second failure before the world trained reform_interval ends the run."""
    out = tmp_path / "out"
    out.mkdir()
    notes: list[str] = []
    logs: dict[str, list[str]] = {"box-a": [], "box-b": []}
    command = [sys.executable, "-c", FAILING, str(out), str(STEPS), str(HOLD), str(fails)]

    async def scenario() -> None:
        knobs = settings(
            command,
            max_failure="1",
            elastic=Elastic(2, reform_interval=3600),
            env={"GLOO_SOCKET_IFNAME": "lo"},
        )
        ctl = Controller(knobs, log=notes.append)
        await ctl.start()
        codes = await asyncio.gather(*(walk_in(agent(ctl, host), logs[host]) for host in logs))
        await ctl.finished.wait()
        if fails == 1:
            assert codes == [0, 0] and ctl.exit_code == 0, (ctl.reason, notes)
        else:
            assert ctl.exit_code == 1 and all(code != 0 for code in codes), notes
            assert "time(s) in a row, each within 3600s (elastic reform_interval)" in ctl.reason
            assert "max_failure 1 allows no more: the run ends" in ctl.reason
        await ctl.close()

    run(scenario)
    waited = [line for line in logs["box-b"] if "waiting for the controller's word" in line]
    assert len(waited) == fails, logs["box-b"]  # its rank failed: it kept its link for the word
    (restarted,) = [line for line in notes if "so it re-forms (restart 1)" in line]
    assert restarted.startswith("rank 1 on box-b exited with code 3"), notes
    (grew,) = [line for line in notes if "world re-formed (restart 1)" in line]
    assert "2 ranks on 2 hosts, nobody walked in;" in grew, notes
    if fails == 1:
        results = [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]
        assert [(r["w"], r["resumed"], r["restart"]) for r in results] == [(2.0 * STEPS, HOLD, 1)] * 2


@pytest.mark.parametrize(
    ("doomed", "why"),
    [
        (
            2,
            "no walk-in took host box-c's rank 2 within 2s (elastic replace_timeout), and a process "
            "group forms only whole",
        ),
        (0, "box-a served the world's rendezvous store (rank 0): a process group re-forms around it"),
    ],
)
def test_a_process_group_that_cannot_be_made_whole_again_ends_the_run_saying_why(
    tmp_path: Path, doomed: int, why: str
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    notes: list[str] = []
    command = [sys.executable, "-c", REPLACED, str(out), str(STEPS), str(HOLD), str(doomed)]
    hosts = ("box-a", "box-b", "box-c")

    async def scenario() -> None:
        ctl = Controller(three(command, Elastic(3, reform_interval=0, replace_timeout=2)), log=notes.append)
        await ctl.start()
        boxes = {host: asyncio.ensure_future(walk_in(box(ctl, host))) for host in hosts}
        await until(lambda: (out / "doomed").exists(), timeout=120)
        lost = hosts[doomed]
        boxes[lost].cancel()  # the host dies with its rank, and nobody walks in
        await ctl.finished.wait()
        assert ctl.exit_code == 1 and why in ctl.reason, (ctl.reason, notes)
        others = await asyncio.gather(*(task for host, task in boxes.items() if host != lost))
        assert all(code != 0 for code in others)  # the Abort reached them
        await ctl.close()

    run(scenario)
    assert not list(out.glob("rank-*.json"))  # nobody trained to the end

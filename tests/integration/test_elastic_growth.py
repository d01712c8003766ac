"""Elastic growth on the CPU plane, end to end on loopback: a third box walks into a
two-rank world that is training, takes the next round's average, averages from the round
after, and ends with the same weights as the others."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from flodl_agent.agent.agent import AgentFailure
from flodl_agent.controller.controller import Controller
from flodl_agent.controller.elastic import Elastic
from flodl_agent.controller.journaling import Journaler
from tests.support import free_port
from tests.support.control_plane import agent, run, settings, until, walk_in

pytest.importorskip("torch")

ROUNDS = 12
# The Trainer on the CPU plane, one batch a round. The formed ranks hold still at their
# fourth step until the test has the walk-in waiting (the GO file: the poll stands in for
# a step); the walk-in never holds.
SCRIPT = """
import json, os, sys, time
from pathlib import Path
import torch
from flodl_agent.train import ElCheConfig, Trainer

out, go = Path(sys.argv[1]), Path(sys.argv[2])
steps = 0
def loss(y_hat, y):
    global steps
    steps += 1
    while steps == 4 and not go.exists():
        time.sleep(0.01)
    return torch.nn.functional.mse_loss(y_hat, y)

torch.manual_seed(1)
x = torch.randn(48, 4)
data = list(zip(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])))
trainer = Trainer(
    lambda: torch.nn.Linear(4, 1), data, lambda p: torch.optim.SGD(p, lr=0.05), loss,
    ElCheConfig.cpu_sync(), batch_size=4,
)
model = trainer.fit(rounds=int(sys.argv[3]))
weights = [p.detach().reshape(-1).tolist() for p in model.parameters()]
rounds = [r.round for r in trainer.reports]
said = {"weights": weights, "rounds": rounds, "world": trainer.world}
(out / os.environ["RANK"]).write_text(json.dumps(said))
"""


def test_a_walk_in_joins_a_training_cpu_plane_world_and_ends_with_the_same_weights(tmp_path: Path) -> None:
    out, go = tmp_path / "out", tmp_path / "go"
    out.mkdir()
    notes: list[str] = []

    async def scenario() -> None:
        command = [sys.executable, "-c", SCRIPT, str(out), str(go), str(ROUNDS)]
        ctl = Controller(settings(command, elastic=Elastic(3)), log=notes.append)
        await ctl.start()
        formed = [asyncio.ensure_future(walk_in(agent(ctl, host))) for host in ("box-a", "box-b")]
        await until(lambda: ctl.hub is not None and ctl.hub.rounds_done == 3, timeout=60)
        said: list[str] = []
        newcomer = asyncio.ensure_future(walk_in(agent(ctl, "box-c"), said))
        hub = ctl.hub
        assert hub is not None
        await until(lambda: "box-c" in hub.waiting, timeout=60)  # its ranks are ready
        assert ctl.window.joined_ranks == 3 and ctl.links["box-c"].ranks == range(2, 3)
        state = ctl.view.state()
        (roster_c,) = [h for h in state["hosts"] if h["host"] == "box-c"]
        assert roster_c["ranks"] == [2, 3] and isinstance(roster_c["midrun_step"], int)
        assert state["joined_ranks"] == 3 and state["phase"] == "training"
        go.touch()
        assert [await task for task in (*formed, newcomer)] == [0, 0, 0], notes
        assert any(line.startswith("joined the training world mid-run: 3 ranks;") for line in said), said
        await ctl.finished.wait()
        assert ctl.exit_code == 0, ctl.reason
        assert hub.rounds_done == ROUNDS
        assert ctl.view.state()["averaging"]["rounds"] == ROUNDS
        await ctl.close()

    run(scenario)
    results = {int(p.name): json.loads(p.read_text()) for p in out.iterdir()}
    assert sorted(results) == [0, 1, 2]
    # The walk-in took round 3's average and trained every round after it, as the others did.
    assert results[2]["rounds"] == list(range(4, ROUNDS))
    assert results[0]["rounds"] == list(range(ROUNDS))
    assert results[0]["weights"] == results[1]["weights"] == results[2]["weights"]
    assert {r["world"] for r in results.values()} == {3}  # the formed ranks' world followed the growth
    grew = [line for line in notes if "joined mid-run" in line]
    assert len(grew) == 1 and "box-c" in grew[0] and "rank 2 " in grew[0]


# Rank 1 of the formed world dies at its fourth step; rank 0 trains on alone and holds still
# at its seventh until the test has the replacement waiting (GO), which never dies.
REPLACED = """
import json, os, sys, time
from pathlib import Path
import torch
from flodl_agent.train import ElCheConfig, Trainer

out, go = Path(sys.argv[1]), Path(sys.argv[2])
rank, newcomer = int(os.environ["RANK"]), os.environ.get("FLODL_MIDRUN") == "1"
steps = 0
def loss(y_hat, y):
    global steps
    steps += 1
    if rank == 1 and steps == 4 and not newcomer:
        os._exit(3)  # this box dies mid-run
    while rank == 0 and steps == 7 and not go.exists():
        time.sleep(0.01)
    return torch.nn.functional.mse_loss(y_hat, y)

data = [(torch.tensor([float(i)]), torch.tensor([2.0 * i + 1])) for i in range(-8, 8)]
trainer = Trainer(lambda: torch.nn.Linear(1, 1), data, lambda p: torch.optim.SGD(p, lr=0.01), loss,
                  ElCheConfig.cpu_sync(), batch_size=4)
model = trainer.fit(rounds=int(sys.argv[3]))
said = {"weights": [p.detach().reshape(-1).tolist() for p in model.parameters()],
        "rounds": [r.round for r in trainer.reports], "totals": [r.weight for r in trainer.reports]}
(out / (("new-" if newcomer else "") + os.environ["RANK"])).write_text(json.dumps(said))
"""


def test_a_lost_hosts_ranks_go_to_the_next_walk_in_and_the_budget_heals(tmp_path: Path) -> None:
    out, go = tmp_path / "out", tmp_path / "go"
    out.mkdir()
    notes: list[str] = []

    async def scenario() -> None:
        command = [sys.executable, "-c", REPLACED, str(out), str(go), str(ROUNDS)]
        ctl = Controller(settings(command, elastic=Elastic(2), max_failure="1"), log=notes.append)
        await ctl.start()
        formed = [asyncio.ensure_future(walk_in(agent(ctl, host))) for host in ("box-a", "box-b")]
        await until(lambda: ctl.supervisor is not None and ctl.supervisor.free() == (range(1, 2),), 60)
        supervisor, hub = ctl.supervisor, ctl.hub
        assert supervisor is not None and hub is not None and supervisor.failed == {1}
        newcomer = asyncio.ensure_future(walk_in(agent(ctl, "box-d")))
        await until(lambda: "box-d" in hub.waiting, timeout=60)
        assert ctl.links["box-d"].ranks == range(1, 2) and not supervisor.failed  # the budget healed
        assert ctl.window.joined_ranks == 2  # nothing more numbered: the ceiling holds
        state = ctl.view.state()  # who holds ranks now: box-b is gone, box-d holds its rank
        assert (state["joined_ranks"], state["joined_hosts"], state["lost_ranks"]) == (2, 2, [])
        assert state["elastic"] == {"max_ranks": 2}
        go.touch()
        assert [await task for task in (*formed, newcomer)][0::2] == [0, 0], notes  # box-b failed
        await ctl.finished.wait()
        assert ctl.exit_code == 0, ctl.reason
        await ctl.close()

    run(scenario)
    kept, new = json.loads((out / "0").read_text()), json.loads((out / "new-1").read_text())
    assert kept["weights"] == new["weights"]
    assert kept["totals"][:3] == [2.0] * 3 and kept["totals"][-1] == 2.0  # two ranks, then one, then two
    assert 1.0 in kept["totals"] and new["rounds"][-1] == ROUNDS - 1
    (grew,) = [line for line in notes if "joined mid-run" in line]
    assert "box-d" in grew and "in place of lost host box-b" in grew and "2 of 2 ranks" in grew


# Averages every step until GO; a walk-in (FLODL_MIDRUN) first takes the world's average.
JOINS = [
    sys.executable,
    "-c",
    "import os, torch\nfrom flodl_agent.train import Averager\navg, w = Averager(), torch.zeros(2)\n"
    "if os.environ.get('FLODL_MIDRUN') == '1': avg.average([w], 0.0, join=True)\n"
    "while not os.path.exists(os.environ['GO']): avg.average([w], 1.0)",
]


def test_a_resumed_elastic_launch_grows_again_once_its_readoption_is_over(tmp_path: Path) -> None:
    go = tmp_path / "go"

    async def body() -> None:
        knobs = {"launch": "0a1b2c3d", "controller_grace": 30.0, "env": {"GO": str(go)}}
        base = settings(JOINS, elastic=Elastic(2), max_failure="1", **knobs)
        first = Controller(replace(base, port=free_port()), log=print)
        await first.start()
        boxes = {h: asyncio.ensure_future(walk_in(agent(first, h))) for h in ("a", "b")}
        await until(lambda: first.hub is not None and first.hub.rounds_done > 2, 30)
        journal = Journaler(first, Path("unused"), print).snapshot()
        assert journal is not None
        for link in list(first.links.values()):
            link.writer.transport.abort()  # kill -9
        await first.close()
        boxes["b"].cancel()  # b went down with its controller

        again = Controller(replace(first.settings, controller_grace=1.0), log=print, resume=journal)
        await again.start()
        readoption = again.readoption
        assert readoption is not None
        early: list[str] = []
        assert isinstance(await walk_in(agent(again, "c"), early), AgentFailure)  # not during the grace
        assert again.refused["window_closed"] == 1
        await until(lambda: readoption.said, 10)  # b's grace ran out: lost, its rank free
        supervisor, hub = again.supervisor, again.hub
        assert supervisor is not None and hub is not None and supervisor.free() == (range(1, 2),)
        boxes["c"] = asyncio.ensure_future(walk_in(agent(again, "c")))
        await until(lambda: "c" in hub.training or "c" in hub.waiting, 30)
        assert again.links["c"].ranks == range(1, 2) and not supervisor.failed
        traffic = again.traffic
        assert traffic is not None
        await until(lambda: traffic.rounds.totals.get("c", 0.0) > 0, 30)  # c averages with a
        go.write_text("")
        assert await boxes["a"] == 0 and await boxes["c"] == 0
        await asyncio.wait_for(again.finished.wait(), 20)
        assert again.exit_code == 0, again.reason
        timeline = [e.text for e in again.view.timeline.events()]
        assert any("c (127.0.0.1) joined mid-run" in t and "in place of lost host b" in t for t in timeline)
        await again.close()

    run(body)

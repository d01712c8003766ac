"""The CPU plane end to end: ranks on two walk-in hosts average their parameters
through the controller (raw float32 frames, folded per host, divided once)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from flodl_agent.controller.controller import Controller
from tests.support.control_plane import agent, run, settings, walk_in, walk_ins

pytest.importorskip("torch")

SCRIPT = """
import json, os, sys
import torch
from flodl_agent.train import Averager

rank = int(os.environ["RANK"])
avg = Averager(bf16_wire=sys.argv[2] == "bf16")
params = [torch.full((3,), float(rank + 1)), torch.full((2, 2), 10.0 * (rank + 1))]
total = avg.average(params, float(rank + 1))  # weights 1, 2, 3: work-weighted
second = [torch.full((3,), float(rank)), torch.zeros(2, 2)]
total2 = avg.average(second, 0.0 if rank == 0 else 1.0)  # rank 0 took no step: excluded
out = [params[0].tolist(), params[1].tolist(), total, second[0].tolist(), total2]
open(os.path.join(sys.argv[1], str(rank)), "w").write(json.dumps(out))
"""

STREAMED = """
import json, os, sys
import torch
from flodl_agent.train import Averager

rank = int(os.environ["RANK"])
avg = Averager(bf16_wire=sys.argv[2] == "bf16")
base = (torch.arange(int(sys.argv[3])) % 97).float()  # several pieces of the hub's plan
params = [base * (rank + 1), base[:5] * 0 + 10.0 * (rank + 1)]
totals = [avg.average(params, float(rank + 1))]  # weights 1, 2, 3
block = params[1].tolist()
second = [base * rank, base[:5] * 0]
totals.append(avg.average(second, 0.0 if rank == 0 else 1.0))  # box-a folds rank 1 alone
third = [base * rank, base[:5] * 0]
totals.append(avg.average(third, 0.0 if rank < 2 else 1.0))  # box-a brings nothing: one empty piece
want = ((params[0], 14 / 6), (second[0], 1.5), (third[0], 2.0))
ok = [bool(torch.allclose(t, base * k, rtol=1e-2)) for t, k in want]
open(os.path.join(sys.argv[1], str(rank)), "w").write(json.dumps([totals, block, ok]))
"""

ADOPTED = """
import json, os, sys
import torch
from flodl_agent.protocol import wire
from flodl_agent.train.averaging import ENV_DIR, Averager

rank = int(os.environ["RANK"])
avg = Averager()
params = [torch.full((3,), float(rank + 1)), torch.full((2, 2), 10.0 * (rank + 1))]
extra = torch.full((1,), float(rank + 1))  # not adopted: copied in and out
avg.adopt(params)
where = [t.data_ptr() for t in params]
if rank == 1:  # an older rank: its segment holds weight * params, and its push says nothing more
    segment = avg._mine.view(4 * 8)
    segment[:] = 2.0 * torch.cat([*(t.reshape(-1) for t in params), extra]).numpy()
    body = {"round": 0, "rank": 1, "weight": 2.0, "size": 32, "bf16": False}
    avg._sock.sendall(avg._codec.encode(wire.Kind.AVERAGE, body))
    reply = avg._receive()
    total = float(reply["weight"])
    averaged = avg._average.view(32).tolist()
    params = [torch.tensor(averaged[:3]), torch.tensor(averaged[3:7]).view(2, 2)]
    extra = torch.tensor(averaged[7:])
else:
    total = avg.average([*params, extra], float(rank + 1))  # weights 1, 2, 3: work-weighted
stayed = [t.data_ptr() for t in params] == where
shared = os.path.exists(os.path.join(os.environ[ENV_DIR], "average"))
out = [params[0].tolist(), params[1].tolist(), extra.tolist(), total, stayed, shared]
open(os.path.join(sys.argv[1], str(rank)), "w").write(json.dumps(out))
"""

MISMATCH = """
import os, torch
from flodl_agent.train import Averager

rank = int(os.environ["RANK"])
Averager().average([torch.zeros(4 if rank == 1 else 3)], 1.0)
"""


@pytest.mark.parametrize("wire", ["f32", "bf16"])
def test_weighted_averaging_across_hosts_through_the_controller(tmp_path: Path, wire: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    bytes_in: list[int] = []

    async def scenario() -> None:
        ctl = Controller(settings([sys.executable, "-c", SCRIPT, str(out), wire], quorum=3, target=3))
        await ctl.start()
        logs: list[str] = []
        codes = await walk_ins(ctl, ("box-a", 2), ("box-b", 1), log=logs)
        assert codes == [0, 0], logs
        await ctl.finished.wait()
        assert ctl.exit_code == 0
        assert ctl.hub is not None and ctl.hub.rounds_done == 2
        assert ctl.view.state()["averaging"]["rounds"] == 2
        bytes_in.append(ctl.hub.bytes_in)
        await ctl.close()

    run(scenario)
    results = {int(p.name): json.loads(p.read_text()) for p in out.iterdir()}
    assert sorted(results) == [0, 1, 2]
    # two hosts, two rounds, 7 parameters each: float32, or half of it as bfloat16
    assert bytes_in == [2 * 2 * 7 * (2 if wire == "bf16" else 4)]
    mean = (1 * 1 + 2 * 2 + 3 * 3) / 6
    approx = {"rel": 1e-2} if wire == "bf16" else {}
    for first, block, total, second, total2 in results.values():
        assert first == pytest.approx([mean] * 3, **approx)
        assert [v for row in block for v in row] == pytest.approx([10 * mean] * 4, **approx)
        assert total == 6.0
        assert second == pytest.approx([1.5] * 3, **approx) and total2 == 2.0  # (1 + 2) / 2, rank 0 excluded


@pytest.mark.parametrize("wire", ["f32", "bf16"])
def test_a_model_of_several_pieces_streams_through_the_hub(tmp_path: Path, wire: str) -> None:
    from flodl_agent.train.hub import CHUNK

    out = tmp_path / "out"
    out.mkdir()
    numel = 2 * CHUNK + 12345  # three pieces, the last one short
    script = [sys.executable, "-c", STREAMED, str(out), wire, str(numel)]

    async def scenario() -> None:
        ctl = Controller(settings(script, quorum=3, target=3))
        await ctl.start()
        logs: list[str] = []
        assert await walk_ins(ctl, ("box-a", 2), ("box-b", 1), log=logs) == [0, 0], logs
        await ctl.finished.wait()
        assert ctl.exit_code == 0 and ctl.hub is not None and ctl.hub.rounds_done == 3
        await ctl.close()

    run(scenario)
    results = {int(p.name): json.loads(p.read_text()) for p in out.iterdir()}
    assert sorted(results) == [0, 1, 2]
    for totals, block, ok in results.values():
        assert totals == [6.0, 2.0, 1.0]
        assert block == pytest.approx([10 * 14 / 6] * 5, rel=1e-2)
        assert ok == [True, True, True]  # every piece of every round: the weighted average


def test_a_parameter_count_mismatch_fails_the_run_naming_the_ranks(tmp_path: Path) -> None:
    async def scenario() -> None:
        ctl = Controller(settings([sys.executable, "-c", MISMATCH], quorum=2, target=2))
        await ctl.start()
        logs: list[str] = []
        await walk_in(agent(ctl, "box-a", 2), logs)
        await ctl.finished.wait()
        assert ctl.exit_code == 1
        assert "parameter count mismatch: rank 0 averages 3 parameters, rank 1 4" in ctl.reason
        assert "box-a" in ctl.reason
        await ctl.close()

    run(scenario)


def test_adopted_tensors_average_in_place_beside_an_older_ranks_push(tmp_path: Path) -> None:
    """Tensors adopted into a rank's segment are neither copied in nor out: on a host of one
    rank the average lands in them (no shared average is made there); a host of two folds
    them with an older rank's push (its segment already weighed), weighing only the new one's."""
    out = tmp_path / "out"
    out.mkdir()

    async def scenario() -> None:
        ctl = Controller(settings([sys.executable, "-c", ADOPTED, str(out)], quorum=3, target=3))
        await ctl.start()
        logs: list[str] = []
        assert await walk_ins(ctl, ("box-a", 2), ("box-b", 1), log=logs) == [0, 0], logs
        await ctl.finished.wait()
        assert ctl.exit_code == 0, ctl.reason
        await ctl.close()

    run(scenario)
    results = {int(p.name): json.loads(p.read_text()) for p in out.iterdir()}
    mean = (1 * 1 + 2 * 2 + 3 * 3) / 6
    for rank, (first, block, extra, total, stayed, _) in sorted(results.items()):
        assert first == pytest.approx([mean] * 3) and extra == pytest.approx([mean]), rank
        assert [v for row in block for v in row] == pytest.approx([10 * mean] * 4), rank
        assert total == 6.0
        if rank != 1:
            assert stayed, f"rank {rank}: its adopted tensors moved"
    assert not results[2][5], "box-b has one rank: its average lands in that rank's segment"
    assert results[0][5], "box-a has two ranks: they read one shared average"

"""The Trainer across walk-ins: every ElChe mode fits y = 2x + 1 over two hosts.

The CPU modes average through the controller; the NCCL modes run their
collectives over gloo here (CPU boxes), with the same cadence logic."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from flodl_agent.controller.controller import Controller
from tests.support.control_plane import agent, run, settings, until, walk_in, walk_ins

pytest.importorskip("torch")

SCRIPT = """
import json, os, sys, time
import torch
from flodl_agent.train import ElCheConfig, Trainer

class Line(torch.utils.data.Dataset):
    def __init__(self):
        self.x = torch.linspace(-1, 1, 512).unsqueeze(1)
        self.y = 2 * self.x + 1
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return self.x[i], self.y[i]

class Slow(torch.nn.Linear):
    def __init__(self, *args):
        super().__init__(*args)
        self.register_buffer("mark", torch.zeros(1))  # a running statistic: each rank's own value

    def forward(self, x):
        self.mark.fill_(float(os.environ["RANK"]) + 1)
        if os.environ["RANK"] == "0":
            time.sleep(0.01)  # a slower device
        return super().forward(x)

config = getattr(ElCheConfig, sys.argv[2])(anchor=2, max_anchor=32, overhead_target=10.0)
sgd = lambda p: torch.optim.SGD(p, lr=0.2)
trainer = Trainer(lambda: Slow(1, 1), Line(), sgd, torch.nn.functional.mse_loss, config, batch_size=16)
budget = int(sys.argv[4]) if len(sys.argv) > 4 else None  # the world's batches
model = trainer.fit(rounds=int(sys.argv[3]), batches=budget)
out = {"w": model.weight.item(), "b": model.bias.item(), "mark": model.mark.item(),
       "batches": [r.batches for r in trainer.reports],
       "weight": [r.weight for r in trainer.reports]}
open(os.path.join(sys.argv[1], os.environ["RANK"]), "w").write(json.dumps(out))
"""


def fit(tmp_path: Path, mode: str, budget: int | None = None) -> dict[int, dict[str, object]]:
    out = tmp_path / mode
    out.mkdir()

    async def scenario() -> None:
        rounds = "80" if mode.endswith("sync") else "25"  # one batch a round vs a cadence's many
        command = [sys.executable, "-c", SCRIPT, str(out), mode, rounds]
        if budget is not None:
            command[-1:] = ["100000", str(budget)]
        ctl = Controller(settings(command, quorum=2, target=2, env={"GLOO_SOCKET_IFNAME": "lo"}))
        await ctl.start()
        logs: list[str] = []
        codes = await walk_ins(ctl, ("box-a", 1), ("box-b", 1), log=logs)
        assert codes == [0, 0], logs
        await ctl.finished.wait()
        await ctl.close()

    run(scenario)
    return {int(p.name): json.loads(p.read_text()) for p in out.iterdir()}


@pytest.mark.parametrize("mode", ["cpu_sync", "cpu_cadence", "nccl_cadence"])
def test_every_rank_ends_with_the_same_fitted_model(tmp_path: Path, mode: str) -> None:
    ranks = fit(tmp_path, mode)
    assert sorted(ranks) == [0, 1]
    assert ranks[0]["w"] == pytest.approx(ranks[1]["w"]) and ranks[0]["b"] == pytest.approx(ranks[1]["b"])
    assert ranks[0]["w"] == pytest.approx(2.0, abs=0.05) and ranks[0]["b"] == pytest.approx(1.0, abs=0.05)
    if mode.endswith("cadence"):
        # the slow rank anchors; the fast one takes more batches per round once measured
        slow, fast = ranks[0]["batches"], ranks[1]["batches"]
        assert isinstance(slow, list) and isinstance(fast, list)
        assert sum(fast[1:]) > 2 * sum(slow[1:])
        assert all(w == s + f for w, s, f in zip(ranks[0]["weight"], slow, fast, strict=True))
    # parameters are weighted by batches, float buffers averaged equally: (1 + 2) / 2
    assert ranks[0]["mark"] == pytest.approx(1.5) and ranks[1]["mark"] == pytest.approx(1.5)


def test_cpu_async_blends_toward_the_average_and_stops_on_the_batch_budget(tmp_path: Path) -> None:
    ranks = fit(tmp_path, "cpu_async", budget=500)
    for r in ranks.values():
        assert r["w"] == pytest.approx(2.0, abs=0.1) and r["b"] == pytest.approx(1.0, abs=0.1)
    # Both ranks stop after the same round: the first whose world total reaches the budget.
    weights = ranks[0]["weight"]
    assert isinstance(weights, list) and weights == ranks[1]["weight"]
    assert sum(weights[:-1]) < 500 <= sum(weights)


MISMATCHED = """
import os, torch
from flodl_agent.train import ElCheConfig, Trainer

width = 3 if os.environ["RANK"] == "1" else 2  # rank 1 runs different model code
Trainer(lambda: torch.nn.Linear(width, 1), [(torch.zeros(width), torch.zeros(1))] * 4,
        lambda p: torch.optim.SGD(p, lr=0.1), torch.nn.functional.mse_loss, ElCheConfig.cpu_sync())
"""


def test_a_model_mismatch_at_formation_names_the_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async def scenario() -> None:
        ctl = Controller(settings([sys.executable, "-c", MISMATCHED], quorum=2, target=2))
        await ctl.start()
        await walk_ins(ctl, ("box-a", 1), ("box-b", 1))
        await ctl.finished.wait()
        # the run's verdict says why, in the rank's own words: both ranks and the fix
        assert ctl.exit_code == 1
        assert "exited with code 2: model mismatch at formation: rank 0 builds" in ctl.reason
        assert "; rank 1 builds" in ctl.reason and "a stale source tree, a wrong bin" in ctl.reason
        await ctl.close()

    run(scenario)
    printed = capsys.readouterr().out
    assert "model mismatch at formation: rank 0 builds" in printed and "; rank 1 builds" in printed
    assert "Traceback" not in printed  # one line, not a stack


def test_a_box_whose_data_root_differs_is_refused_at_admission(tmp_path: Path) -> None:
    from dataclasses import replace

    same, other = tmp_path / "a", tmp_path / "b"
    for root, content in ((same, "0,1\n"), (other, "1,0\n")):
        root.mkdir()
        (root / "labels.csv").write_text(content)

    async def scenario() -> None:
        ctl = Controller(settings(quorum=2, target=2))
        await ctl.start()
        first = asyncio.ensure_future(walk_in(replace(agent(ctl, "box-a", 1), data_path=str(same))))
        await until(lambda: ctl.admitted == 1)  # box-a's data is the cohort's reference
        refused = await walk_in(replace(agent(ctl, "box-b", 1), data_path=str(other)))
        assert "dataset mismatch" in str(refused)
        assert ctl.refused.get("dataset_mismatch") == 1
        first.cancel()
        await ctl.close()

    run(scenario)


def test_the_demo_rank_trains_through_the_trainer_on_the_cpu_plane(tmp_path: Path) -> None:
    """What the lab's fault suite runs: `demo_rank --trainer`, two walk-ins, to the end."""
    command = [
        sys.executable,
        "-m",
        "flodl_agent.demo_rank",
        "--trainer",
        "5",
        "--checkpoint",
        str(tmp_path / "c"),
    ]

    async def scenario() -> None:
        ctl = Controller(settings(command, plane="cpu"))
        await ctl.start()
        assert await walk_ins(ctl, ("box-a", 1), ("box-b", 1)) == [0, 0]
        await ctl.finished.wait()
        assert ctl.exit_code == 0
        await ctl.close()

    run(scenario)

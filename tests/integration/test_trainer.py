"""The Trainer across walk-ins: every ElChe mode fits y = 2x + 1 over two hosts.

The CPU modes average through the controller; the NCCL modes run their
collectives over gloo here (CPU boxes), with the same cadence logic."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from flodl_agent.controller import Controller

from .test_control_plane import agent, run, settings, walk_in

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
    def forward(self, x):
        if os.environ["RANK"] == "0":
            time.sleep(0.01)  # a slower device
        return super().forward(x)

config = getattr(ElCheConfig, sys.argv[2])(anchor=2, max_anchor=32, overhead_target=10.0)
sgd = lambda p: torch.optim.SGD(p, lr=0.2)
trainer = Trainer(lambda: Slow(1, 1), Line(), sgd, torch.nn.functional.mse_loss, config, batch_size=16)
model = trainer.fit(rounds=int(sys.argv[3]))
out = {"w": model.weight.item(), "b": model.bias.item(), "batches": [r.batches for r in trainer.reports],
       "weight": [r.weight for r in trainer.reports]}
open(os.path.join(sys.argv[1], os.environ["RANK"]), "w").write(json.dumps(out))
"""


def fit(tmp_path: Path, mode: str) -> dict[int, dict[str, object]]:
    out = tmp_path / mode
    out.mkdir()

    async def scenario() -> None:
        rounds = "80" if mode.endswith("sync") else "25"  # one batch a round vs a cadence's many
        command = [sys.executable, "-c", SCRIPT, str(out), mode, rounds]
        ctl = Controller(settings(command, quorum=2, target=2, env={"GLOO_SOCKET_IFNAME": "lo"}))
        await ctl.start()
        logs: list[str] = []
        codes = await asyncio.gather(
            walk_in(agent(ctl, "box-a", 1), logs), walk_in(agent(ctl, "box-b", 1), logs)
        )
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


def test_cpu_async_blends_toward_the_average(tmp_path: Path) -> None:
    ranks = fit(tmp_path, "cpu_async")
    for r in ranks.values():
        assert r["w"] == pytest.approx(2.0, abs=0.1) and r["b"] == pytest.approx(1.0, abs=0.1)

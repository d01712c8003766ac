"""GPU paths (marker `gpu`: skipped cleanly on boxes without CUDA; `bench/gpu_trainer.py` runs them
with timings). A walk-in offering a real GPU passes the GPU gate, and the Trainer's NCCL plane
trains on it, keeping its shard resident within the device's budget."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from flodl_agent.config import DeviceOffer
from flodl_agent.controller.controller import Controller
from tests.support import NO_GPU
from tests.support.control_plane import agent, run, settings, walk_in

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason=f"{NO_GPU} needs a CUDA device"),
]

SCRIPT = """
import json, os, sys
import torch
from flodl_agent.train import ElCheConfig, Trainer

x = torch.linspace(-1, 1, 1024).unsqueeze(1)
data = list(zip(x, 2 * x + 1))
trainer = Trainer(lambda: torch.nn.Linear(1, 1), data, lambda p: torch.optim.SGD(p, lr=0.2),
                  torch.nn.functional.mse_loss, ElCheConfig.nccl_cadence(anchor=4), batch_size=64)
model = trainer.fit(rounds=30)
out = {"device": str(next(model.parameters()).device), "w": model.weight.item(), "b": model.bias.item(),
       "backend": torch.distributed.get_backend()}
open(sys.argv[1], "w").write(json.dumps(out))
"""


def test_a_gpu_walk_in_trains_on_its_device_over_nccl(tmp_path: Path) -> None:
    out = tmp_path / "out.json"

    async def scenario() -> None:
        ctl = Controller(settings([sys.executable, "-c", SCRIPT, str(out)], quorum=1, target=1, plane="nccl"))
        await ctl.start()
        opts = agent(ctl, "gpu-box", 1)
        opts.devices = DeviceOffer("gpus", gpus=(0,))
        assert await walk_in(opts) == 0
        await ctl.finished.wait()
        assert ctl.exit_code == 0
        await ctl.close()

    run(scenario)
    result = json.loads(out.read_text())
    assert result["device"] == "cuda:0" and result["backend"] == "nccl"
    assert result["w"] == pytest.approx(2.0, abs=0.05) and result["b"] == pytest.approx(1.0, abs=0.05)


MEMORY = """
import json, os, sys
import torch
from flodl_agent.train import ElCheConfig, Trainer

x = torch.linspace(-1, 1, 1024).unsqueeze(1)
sgd = lambda p: torch.optim.SGD(p, lr=0.2)
trainer = Trainer(lambda: torch.nn.Linear(1, 1), list(zip(x, 2 * x + 1)), sgd,
                  torch.nn.functional.mse_loss, ElCheConfig.nccl_sync(), batch_size=64)
first = next(trainer._batches)
trainer.fit(rounds=1)
props = torch.cuda.get_device_properties(0)
out = {"share": trainer.gpu_ram_share, "budget": trainer.memory.bytes, "why": trainer.memory.why,
       "resident": trainer.resident, "batch_device": str(first[0].device),
       "integrated": bool(props.is_integrated), "total": props.total_memory}
open(sys.argv[1], "w").write(json.dumps(out))
"""


def test_a_gpu_ranks_shard_goes_resident_within_its_device_budget(tmp_path: Path) -> None:
    out = tmp_path / "out.json"

    async def scenario() -> None:
        command = [sys.executable, "-c", MEMORY, str(out)]
        # The cluster's gpu_ram_share rides the envelope: an APU takes it, a discrete GPU ignores it.
        facts = {"gpu_ram_share": 0.5}
        ctl = Controller(settings(command, quorum=1, target=1, plane="nccl", walk_in_facts=facts))
        await ctl.start()
        opts = agent(ctl, "gpu-box", 1)
        opts.devices = DeviceOffer("gpus", gpus=(0,))
        assert await walk_in(opts) == 0
        await ctl.close()

    run(scenario)
    seen = json.loads(out.read_text())
    assert seen["share"] == 0.5 and seen["resident"] is True and seen["batch_device"].startswith("cuda")
    if seen["integrated"]:
        assert seen["budget"] == int(0.5 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    else:
        assert seen["budget"] == seen["total"] and "ignored" in seen["why"]

"""The Trainer's device budget on a real GPU (marker `gpu`: skipped cleanly without CUDA): a
discrete GPU's budget is its own memory whatever gpu_ram_share says, a small shard goes resident
there and trains from it; an integrated GPU takes its share of the host's RAM instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import free_port

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCRIPT = """
import json, os, sys
import torch
from flodl_agent.train import ElCheConfig, Trainer

x = torch.linspace(-1, 1, 1024).unsqueeze(1)
sgd = lambda p: torch.optim.SGD(p, lr=0.2)
trainer = Trainer(lambda: torch.nn.Linear(1, 1), list(zip(x, 2 * x + 1)), sgd,
                  torch.nn.functional.mse_loss, ElCheConfig.nccl_sync(), batch_size=64)
first = next(trainer._batches)
model = trainer.fit(rounds=200)
props = torch.cuda.get_device_properties(0)
out = {"share": trainer.gpu_ram_share, "budget": trainer.memory.bytes, "why": trainer.memory.why,
       "resident": trainer.resident, "batch_device": str(first[0].device),
       "integrated": bool(props.is_integrated), "total": props.total_memory,
       "w": model.weight.item(), "b": model.bias.item()}
open(sys.argv[1], "w").write(json.dumps(out))
"""


def test_a_small_shard_goes_resident_on_the_gpu_within_its_budget(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    env = {
        **os.environ,
        "FLODL_DEVICE": "cuda:0",
        "FLODL_GPU_RAM_SHARE": "0.5",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(out)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(out.read_text())
    assert seen["share"] == 0.5 and seen["resident"] is True and seen["batch_device"].startswith("cuda")
    if seen["integrated"]:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        assert seen["budget"] == int(0.5 * ram)
    else:
        assert seen["budget"] == seen["total"] and "ignored" in seen["why"]
    assert abs(seen["w"] - 2) < 0.05 and abs(seen["b"] - 1) < 0.05

"""The GPU paths, when a GPU is there: the `gpu`-marked tests, then the Trainer's
NCCL plane on the GPU against the same Trainer on the CPU (the baseline), in
batches per second of a small MLP.

Without a CUDA device it says so and exits 0. `--quick` trains fewer rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def throughput(device: str, batches: int, mode: str = "nccl_cadence") -> float:
    """Batches per second of ``mode`` (nccl_sync or nccl_cadence: NCCL on a GPU, gloo on the
    CPU) on a world of one rank on ``device`` (cuda or cpu), over ``batches`` batches."""
    import torch

    from flodl_agent.train import ElCheConfig, Trainer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FLODL_DEVICE=f"{device}:0"
    )
    x = torch.randn(8192, 256)
    data = list(zip(x, x.sum(dim=1, keepdim=True), strict=True))

    def mlp() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1))

    trainer = Trainer(
        mlp,
        data,
        lambda p: torch.optim.SGD(p, lr=1e-3),
        torch.nn.functional.mse_loss,
        ElCheConfig.nccl_sync() if mode == "nccl_sync" else ElCheConfig.nccl_cadence(anchor=16),
        batch_size=256,
    )
    start = time.perf_counter()
    trainer.fit(batches=batches)
    seconds = time.perf_counter() - start  # fit tore its process group down
    return sum(r.batches for r in trainer.reports) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device on this box"}))
        return
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/integration/test_gpu.py"],
        cwd=ROOT,
        check=False,
    )
    batches = 160 if args.quick else 640
    gpu = throughput("cuda", batches)
    cpu = throughput("cpu", batches)
    print(
        json.dumps(
            {
                "gpu_tests": "passed" if tests.returncode == 0 else f"failed ({tests.returncode})",
                "device": torch.cuda.get_device_name(0),
                "gpu_batches_per_s": round(gpu, 1),
                "baseline_cpu_batches_per_s": round(cpu, 1),
                "ratio": round(gpu / cpu, 2),
            }
        )
    )


if __name__ == "__main__":
    main()

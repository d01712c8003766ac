"""The demo's rank (`python -m flodl_agent.demo_rank`): a small data-parallel
training run, written the way a torchrun script is.

`init_process_group("gloo")` with env:// (the walk-in's environment says
where the rendezvous store is), a DistributedDataParallel model, and each rank
fitting its own shard of y = 2x + 1. Gradients are averaged every step, so every
rank ends with the same weights, which it prints.

`--trainer ROUNDS` runs the same fit through the Trainer on the CPU plane
instead (averaging through the controller), `--pace SECONDS` per batch, with a
checkpoint at `--checkpoint PATH` when the run ends with ShutdownWithSave: the
lab's fault suite kills, cuts off and reboots boxes under it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.linspace(-1, 1, 256)[rank::world].unsqueeze(1)
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(rank))
    y = 2 * x + 1 + 0.01 * noise
    model = DistributedDataParallel(torch.nn.Linear(1, 1))  # rank 0's initial weights, broadcast
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = torch.zeros(())
    for _step in range(60):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    w, b = model.module.weight.item(), model.module.bias.item()
    device = os.environ.get("FLODL_DEVICE", "?")
    print(f"rank {rank}/{world} on {device}: loss {loss.item():.5f}, w={w:.4f} b={b:.4f}", flush=True)
    # Every rank is past its last collective before any tears gloo down. The DDP
    # model keeps the group's threads alive past destroy_process_group(): torch's
    # teardown race stays possible (docs/data-plane.md, a rank killed by SIGABRT).
    dist.barrier()
    dist.destroy_process_group()


def trainer(rounds: int, pace: float, checkpoint: str) -> int:
    import torch

    from .train.trainer import ElCheConfig, ShutdownWithSave, Trainer

    class Paced(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(pace)  # a step's compute, stretched so a fault lands mid-run
            return super().forward(x)

    x = torch.linspace(-1, 1, 256).unsqueeze(1)
    data = list(zip(x, 2 * x + 1, strict=True))
    run = Trainer(
        lambda: Paced(1, 1),
        data,
        lambda p: torch.optim.SGD(p, lr=0.1),
        torch.nn.functional.mse_loss,
        ElCheConfig.cpu_sync(),
        batch_size=8,
        checkpoint=checkpoint,
    )
    try:
        model = run.fit(rounds=rounds)
    except ShutdownWithSave as exc:
        print(f"rank {run.rank}: {exc}", flush=True)
        return 1
    print(f"rank {run.rank}: done, w={model.weight.item():.4f} b={model.bias.item():.4f}", flush=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m flodl_agent.demo_rank")
    parser.add_argument("--trainer", type=int, metavar="ROUNDS", help="fit through the Trainer (CPU plane)")
    parser.add_argument("--pace", type=float, default=0.0, help="seconds per batch")
    parser.add_argument("--checkpoint", default="checkpoint.pt", help="where ShutdownWithSave saves")
    options = parser.parse_args()
    if options.trainer is None:
        main()
    else:
        sys.exit(trainer(options.trainer, options.pace, options.checkpoint))

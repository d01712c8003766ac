"""The demo's rank (`python -m flodl_agent.demo_rank`): a small data-parallel
training run, written the way a torchrun script is.

`init_process_group("gloo")` with env:// (the walk-in's environment says
where the rendezvous store is), a DistributedDataParallel model, and each rank
fitting its own shard of y = 2x + 1. Gradients are averaged every step, so every
rank ends with the same weights, which it prints.
"""

from __future__ import annotations

import os


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
    # Every rank is past its last collective before any tears gloo down: a rank
    # that destroys its group while a peer still sends can abort (torch 2.13, CPU).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

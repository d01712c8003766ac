"""The demo's rank (`python -m flodl_agent.demo_rank`): a few steps of real torch
training on this rank's own data.

It reads the rank environment every walk-in gets (RANK, WORLD_SIZE, ...).
Averaging across ranks arrives with the data plane; until then each rank fits
its own shard of y = 2x + 1 and reports its loss.
"""

from __future__ import annotations

import os


def main() -> None:
    import torch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(rank)
    x = torch.linspace(-1, 1, 256)[rank::world].unsqueeze(1)
    y = 2 * x + 1 + 0.01 * torch.randn_like(x)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = torch.zeros(())
    for _step in range(60):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    w, b = model.weight.item(), model.bias.item()
    device = os.environ.get("FLODL_DEVICE", "?")
    print(f"rank {rank}/{world} on {device}: loss {loss.item():.5f}, w={w:.3f} b={b:.3f}", flush=True)


if __name__ == "__main__":
    main()

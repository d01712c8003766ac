"""A fast and a slow device on the CPU plane: what cadence buys over lockstep.

Two walk-in hosts, one rank each, train the same small regression through the
controller; rank 0's device runs at a third of rank 1's speed (each forward
pass sleeps three times as long: a device's speed, not CPU contention on this box).
Each mode trains until the world has taken the same number of batches
(`Trainer.fit(batches=N)`); the figures are samples per second (the world's
samples over the slower rank's wall time) and the final loss of each rank's
model on the whole dataset (averaged over the ranks: under cpu_async they
differ a little).

The last line is one JSON object; `ratio` is cpu_cadence's samples/s over
cpu_sync's, `ratio_async` cpu_async's (goal: at least 1.5 times, with a final loss
within 5 % of cpu_sync's).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.walkins import run_world

BATCH = 32

RANK = """
import json, os, sys, time
import torch
from flodl_agent.train import ElCheConfig, Trainer

mode, budget, fast, out = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
rank = int(os.environ["RANK"])
delay = fast * (3 if rank == 0 else 1)  # rank 0's device: a third of rank 1's speed

g = torch.Generator().manual_seed(0)
x = torch.randn(4096, 16, generator=g)
y = torch.tanh(x @ torch.randn(16, 1, generator=g)) + 0.05 * torch.randn(4096, 1, generator=g)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

    def forward(self, inputs):
        time.sleep(delay)
        return self.body(inputs)


config = getattr(ElCheConfig, mode)()
sgd = lambda p: torch.optim.SGD(p, lr=0.05)
trainer = Trainer(Net, list(zip(x, y)), sgd, torch.nn.functional.mse_loss, config, batch_size=BATCH)
start = time.perf_counter()
model = trainer.fit(batches=budget)
seconds = time.perf_counter() - start
with torch.no_grad():
    loss = torch.nn.functional.mse_loss(model.body(x), y).item()
batches = sum(r.weight for r in trainer.reports)
result = {"seconds": seconds, "batches": batches, "loss": loss, "rounds": len(trainer.reports)}
open(os.path.join(out, str(rank)), "w").write(json.dumps(result))
""".replace("BATCH", str(BATCH))


def measure(mode: str, budget: int, fast: float) -> dict[str, float]:
    out = Path(tempfile.mkdtemp())
    run_world([sys.executable, "-c", RANK, mode, str(budget), str(fast), str(out)], [("h0", 1), ("h1", 1)])
    ranks = [json.loads(p.read_text()) for p in out.iterdir()]
    seconds = max(r["seconds"] for r in ranks)
    return {
        "samples_per_s": round(ranks[0]["batches"] * BATCH / seconds, 1),
        "loss": round(sum(r["loss"] for r in ranks) / len(ranks), 5),
        "rounds": ranks[0]["rounds"],
        "seconds": round(seconds, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smaller batch budget")
    args = parser.parse_args()
    budget = 800 if args.quick else 3000
    fast = 0.01  # seconds per forward pass on the fast device
    modes = {mode: measure(mode, budget, fast) for mode in ("cpu_sync", "cpu_cadence", "cpu_async")}
    for mode, figures in modes.items():
        print(json.dumps({"mode": mode, **figures}), flush=True)
    sync = modes["cpu_sync"]
    print(
        json.dumps(
            {
                "batches": budget,
                "modes": modes,
                "baseline": "cpu_sync (every rank one batch a round)",
                "ratio": round(modes["cpu_cadence"]["samples_per_s"] / sync["samples_per_s"], 3),
                "ratio_async": round(modes["cpu_async"]["samples_per_s"] / sync["samples_per_s"], 3),
                "loss_vs_sync": round(modes["cpu_cadence"]["loss"] / sync["loss"], 3),
                "loss_vs_sync_async": round(modes["cpu_async"]["loss"] / sync["loss"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()

"""The ranks the GPU check walks in, and the worlds it runs them in.

Every world is the operator's commands on loopback (``bench.walkins.launch_join``: `fdl
launch` and one `fdl join --devices OFFER` per host); every rank writes what it saw to
``OUT/RANK.json``, which the functions here read back. Offers are what `fdl join --devices`
takes: ``0`` (GPU 0) or ``cpu:1``, so the same world runs as two CPU walk-ins on a box with
no GPU (what the tests do) and as a GPU and a CPU walk-in where CUDA is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.walkins import WorldFailed, launch_join

# A torchrun-style script, unchanged by fdl: env://, LOCAL_RANK picks the device, NCCL.
NCCL_RANK = """
import json, os, sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

out = sys.argv[1]
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dist.init_process_group("nccl")
rank = dist.get_rank()
ones = torch.ones(4, device="cuda")
dist.all_reduce(ones)
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).cuda()
model = DistributedDataParallel(net, device_ids=[local])
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(256, 32, device="cuda")
y = x.sum(dim=1, keepdim=True)
losses = []
for _ in range(8):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")
names += ("FLODL_DEVICE",)
result = {
    "env": {k: os.environ.get(k) for k in names},
    "backend": dist.get_backend(),
    "device": str(next(model.parameters()).device),
    "device_name": torch.cuda.get_device_name(),
    "visible": torch.cuda.device_count(),
    "all_reduce": ones.tolist(),
    "losses": [round(v, 5) for v in losses],
}
open(os.path.join(out, f"{rank}.json"), "w").write(json.dumps(result))
dist.destroy_process_group()
"""

# One model trained together through the controller (the CPU plane), whatever each rank's device.
TRAINER_RANK = """
import hashlib, json, os, sys, time
import torch
from flodl_agent.train import ElCheConfig, Trainer

mode, batches, width, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
BATCH = 128
g = torch.Generator().manual_seed(0)
x = torch.randn(4096, 64, generator=g)
y = torch.tanh(x @ torch.randn(64, 1, generator=g))


def net():
    layers = [torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


device = "cuda" if os.environ.get("FLODL_DEVICE", "").startswith("cuda") else "cpu"
warm = net().to(device)  # kernels loaded before the first round is timed (its speed sets the shares)
for _ in range(3):
    warm(x[:BATCH].to(device)).sum().backward()
config = ElCheConfig.cpu_sync() if mode == "cpu_sync" else ElCheConfig.cpu_cadence(anchor=4, max_anchor=4096)
sgd = lambda p: torch.optim.SGD(p, lr=0.05)
trainer = Trainer(net, list(zip(x, y)), sgd, torch.nn.functional.mse_loss, config, batch_size=BATCH)
start = time.perf_counter()
model = trainer.fit(batches=batches)
seconds = time.perf_counter() - start
state = b"".join(t.detach().cpu().contiguous().numpy().tobytes() for t in model.state_dict().values())
with torch.no_grad():
    loss = torch.nn.functional.mse_loss(model(x.to(trainer.device)), y.to(trainer.device)).item()
mine = sum(r.batches for r in trainer.reports)
result = {
    "rank": trainer.rank, "device": str(trainer.device), "digest": hashlib.sha256(state).hexdigest(),
    "batches": mine, "samples": mine * BATCH, "rounds": len(trainer.reports), "seconds": seconds,
    "loss": loss,
}
open(os.path.join(out, f"{trainer.rank}.json"), "w").write(json.dumps(result))
"""

# Averaging rounds with the parameters on the rank's device, then the same tensors on the host.
AVERAGING_RANK = """
import json, os, statistics, sys, time
import torch
from flodl_agent.train import Averager

mb, rounds, out = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
device = "cuda" if os.environ.get("FLODL_DEVICE", "").startswith("cuda") else "cpu"
averager = Averager()
count = int(mb * 2**20 / 4 / 4)


def sync():
    if device == "cuda":
        torch.cuda.synchronize()


def timed(where):
    tensors = [torch.full((count,), float(rank), device=where) for _ in range(4)]
    averager.average(tensors, 1.0)  # the first round maps the segments
    times = []
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        averager.average(tensors, 1.0)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), tensors[0][-1].item()


on_device, value = timed(device)
on_host, _ = timed("cpu")
averager.close()
result = {"rank": rank, "device": device, "mb": mb, "rounds": rounds, "on_device_s": on_device,
          "on_host_s": on_host, "value": value, "expected": sum(range(world)) / world}
open(os.path.join(out, f"{rank}.json"), "w").write(json.dumps(result))
"""


def ranks_of(offer: str) -> int:
    """How many ranks an offer walks in: ``cpu:N`` N, ``0,1`` one per GPU."""
    return int(offer.removeprefix("cpu:")) if offer.startswith("cpu:") else len(offer.split(","))


def world(
    work: Path, script: str, args: list[str], offers: list[str], plane: str, timeout: float
) -> list[dict[str, Any]]:
    """Run ``script ARGS OUT`` on every rank of a loopback world of ``offers``, from ``work``
    (its logs stay there); the ranks' files, by rank."""
    out = work / "out"
    out.mkdir(parents=True)
    (work / "rank.py").write_text(script)
    command = [sys.executable, str(work / "rank.py"), *args, str(out)]
    ranks = sum(ranks_of(offer) for offer in offers)
    launch_join(work, command, offers, ranks=ranks, plane=plane, timeout=timeout)
    found = sorted(out.glob("*.json"), key=lambda p: int(p.stem))
    if len(found) != ranks:
        raise WorldFailed(f"{len(found)} of {ranks} ranks wrote their results (in {out})")
    return [json.loads(p.read_text()) for p in found]


def nccl_walk_in(work: Path, timeout: float) -> dict[str, Any]:
    """One walk-in offering GPU 0 to an NCCL window; its rank's account."""
    return world(work, NCCL_RANK, [], ["0"], "nccl", timeout)[0]


def trained(
    work: Path, mode: str, batches: int, width: int, offers: list[str], timeout: float
) -> list[dict[str, Any]]:
    """``mode`` (cpu_sync or cpu_cadence) until the world has taken ``batches`` batches."""
    return world(work, TRAINER_RANK, [mode, str(batches), str(width)], offers, "cpu", timeout)


def averaged(work: Path, mb: float, rounds: int, offers: list[str], timeout: float) -> list[dict[str, Any]]:
    """Each rank's median averaging round, parameters on its device and then on the host."""
    return world(work, AVERAGING_RANK, [str(mb), str(rounds)], offers, "cpu", timeout)

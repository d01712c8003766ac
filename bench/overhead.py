"""What walking in costs a training run: `fdl launch` + `fdl join` against plain torchrun.

One torchrun-style script (gloo, env://, DistributedDataParallel over a small
MLP, 2 ranks on this machine) runs unchanged both ways: under
`torchrun --standalone --nproc-per-node 2`, and as the ranks of one walk-in
(`fdl join --devices cpu:2`) into a window opened by `fdl launch` on loopback.
Each rank times its steps after a warm-up; the figure is rank 0's steps per
second, the best of the repeats (the two launchers alternate). The wall time
from starting the launcher to its exit is printed beside it (start-up and
teardown: the window, the rendezvous through the controller, the exit reports).

The last line is one JSON object; `ratio` is steps/s through fdl over steps/s
under torchrun (goal: at least 0.97).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.walkins import free_port

RANK = """
import json, os, sys, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

steps, out = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(rank)
model = DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                        torch.nn.ReLU(), torch.nn.Linear(256, 1))
)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 64), torch.randn(64, 1)


def step():
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


for _ in range(20):
    step()
dist.barrier()
start = time.perf_counter()
for _ in range(steps):
    step()
dist.barrier()
rate = steps / (time.perf_counter() - start)
if rank == 0:
    open(os.path.join(out, "rate"), "w").write(json.dumps(rate))
dist.barrier()
dist.destroy_process_group()
"""


def torchrun(steps: int, work: Path) -> tuple[float, float]:
    out = Path(tempfile.mkdtemp(dir=work))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    started = time.perf_counter()
    subprocess.run(
        [*command, str(work / "rank.py"), str(steps), str(out)],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return json.loads((out / "rate").read_text()), time.perf_counter() - started


def wait_for_window(work: Path, fdl_cmd: str, launch: subprocess.Popen[bytes]) -> None:
    """Until `fdl status` (the operator's own view) shows the window waiting for walk-ins."""
    while launch.poll() is None:
        status = subprocess.run([fdl_cmd, "status", "--json"], cwd=work, capture_output=True, check=False)
        if status.returncode == 0 and json.loads(status.stdout).get("phase") == "waiting":
            return
    sys.exit(f"fdl launch exited with {launch.returncode} before its window opened")


def fdl(steps: int, work: Path) -> tuple[float, float]:
    out = Path(tempfile.mkdtemp(dir=work))
    port = free_port()
    cluster = {
        "cluster": {
            "controller": {
                "host": "127.0.0.1",
                "port": port,
                "join": {"discovery": True, "min_rank_start": 2, "target_ranks": 2, "join_timeout": 60},
            }
        }
    }
    (work / "fdl.cluster.yml").write_text(json.dumps(cluster))
    bin_dir = Path(sys.executable).parent
    fdl_cmd = str(bin_dir / "fdl") if (bin_dir / "fdl").exists() else shutil.which("fdl") or "fdl"
    started = time.perf_counter()
    launch = subprocess.Popen(
        [fdl_cmd, "launch", "--no-fanout", "--", sys.executable, str(work / "rank.py"), str(steps), str(out)],
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_window(work, fdl_cmd, launch)
    join = subprocess.Popen(
        [fdl_cmd, "join", f"127.0.0.1:{port}", "--host", "bench", "--devices", "cpu:2"],
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    codes = launch.wait(), join.wait()
    elapsed = time.perf_counter() - started
    if codes != (0, 0):
        sys.exit(f"fdl run failed: launch {codes[0]}, join {codes[1]}")
    return json.loads((out / "rate").read_text()), elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer steps, one repeat")
    args = parser.parse_args()
    steps, repeats = (200, 1) if args.quick else (1000, 3)
    work = Path(tempfile.mkdtemp(prefix="flodl-overhead-"))
    (work / "rank.py").write_text(RANK)
    os.environ.pop("OMP_NUM_THREADS", None)  # both launchers set it to 1 for 2 ranks on one box
    runs: dict[str, list[tuple[float, float]]] = {"torchrun": [], "fdl": []}
    try:
        for _ in range(repeats):
            runs["torchrun"].append(torchrun(steps, work))
            runs["fdl"].append(fdl(steps, work))
            print(json.dumps({name: [round(r, 1) for r, _ in got] for name, got in runs.items()}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    best = {name: max(got) for name, got in runs.items()}
    print(
        json.dumps(
            {
                "steps": steps,
                "repeats": repeats,
                "fdl_steps_per_s": round(best["fdl"][0], 1),
                "fdl_wall_s": round(min(w for _, w in runs["fdl"]), 2),
                "torchrun_steps_per_s": round(best["torchrun"][0], 1),
                "torchrun_wall_s": round(min(w for _, w in runs["torchrun"]), 2),
                "baseline": "the same script under torchrun --standalone --nproc-per-node 2",
                "ratio": round(best["fdl"][0] / best["torchrun"][0], 3),
            }
        )
    )


if __name__ == "__main__":
    main()

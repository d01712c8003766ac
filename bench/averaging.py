"""The CPU plane's averaging bandwidth against gloo's all_reduce, same tensors, same run.

For 2 and 4 ranks (one host each: an agent process per host, every push
crossing its control link) and models of 1, 64 and 512 MB of float32:
seconds per averaging round through the controller (float32 and bf16_wire),
and per `all_reduce` with gloo on loopback; effective bandwidth = model bytes
/ seconds per round. The machine's memory-copy bandwidth is printed beside
them. `--quick`: 2 ranks, 1 and 64 MB.

The last line is one JSON object; `ratio` is the hub over gloo at 64 MB, 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.walkins import free_port, run_world

ROUNDS = 5

HUB_RANK = """
import json, os, sys, time
import torch
from flodl_agent.averaging import Averager

numel, rounds, bf16, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
tensor = torch.ones(numel)
avg = Averager(bf16_wire=bf16)
avg.average([tensor], 1.0)  # warm: connections, first allocation
start = time.perf_counter()
for _ in range(rounds):
    avg.average([tensor], 1.0)
seconds = (time.perf_counter() - start) / rounds
open(os.path.join(out, os.environ["RANK"]), "w").write(json.dumps(seconds))
"""

GLOO_RANK = """
import json, os, sys, time
import torch
import torch.distributed as dist

numel, rounds, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
tensor = torch.ones(numel)
dist.all_reduce(tensor)
start = time.perf_counter()
for _ in range(rounds):
    dist.all_reduce(tensor)
    tensor /= dist.get_world_size()
seconds = (time.perf_counter() - start) / rounds
open(os.path.join(out, os.environ["RANK"]), "w").write(json.dumps(seconds))
dist.barrier()
dist.destroy_process_group()
"""


def hub(ranks: int, numel: int, bf16: bool) -> float:
    """Seconds per round through the controller (the slowest rank's); each host's agent
    runs in a process of its own, as on a real fleet."""
    out = tempfile.mkdtemp()
    command = [sys.executable, "-c", HUB_RANK, str(numel), str(ROUNDS), "1" if bf16 else "0", out]
    run_world(command, [(f"h{i}", 1) for i in range(ranks)])
    return max(json.loads(p.read_text()) for p in Path(out).iterdir())


def gloo(ranks: int, numel: int) -> float:
    out = tempfile.mkdtemp()
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", GLOO_RANK, str(numel), str(ROUNDS), out],
            env={
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": str(ranks),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": "lo",
                "OMP_NUM_THREADS": "1",
            },
        )
        for r in range(ranks)
    ]
    if any(p.wait() != 0 for p in procs):
        sys.exit("gloo run failed")
    return max(json.loads(p.read_text()) for p in Path(out).iterdir())


def memcpy_gbps(nbytes: int = 256 * 1024 * 1024) -> float:
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    start = time.perf_counter()
    for _ in range(3):
        np.copyto(dst, src)
    return nbytes * 3 / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sizes_mb = [1, 64] if args.quick else [1, 64, 512]
    world_sizes = [2] if args.quick else [2, 4]
    rows = []
    for ranks in world_sizes:
        for mb in sizes_mb:
            numel = mb * 1024 * 1024 // 4
            nbytes = numel * 4
            row = {"ranks": ranks, "model_mb": mb}
            for name, seconds in (
                ("hub", hub(ranks, numel, False)),
                ("hub_bf16", hub(ranks, numel, True)),
                ("gloo", gloo(ranks, numel)),
            ):
                row[f"{name}_s"] = round(seconds, 4)
                row[f"{name}_gbps"] = round(nbytes / seconds / 1e9, 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    goal = next(r for r in rows if r["ranks"] == 2 and r["model_mb"] == 64)
    print(
        json.dumps(
            {
                "rows": rows,
                "memcpy_gbps": round(memcpy_gbps(), 2),
                "baseline": "gloo all_reduce, loopback, same tensors",
                "ratio": round(goal["hub_gbps"] / goal["gloo_gbps"], 3),
                "ratio_bf16": round(goal["hub_bf16_gbps"] / goal["gloo_gbps"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()

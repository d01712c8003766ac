"""Do runs that trained end cleanly? A torchrun-style script's teardown, fdl against torchrun.

A typical torchrun script (gloo, env://, a DistributedDataParallel step loop
and an ``all_reduce``, its result printed) ends the ways users write it:
``destroy`` (``destroy_process_group()``), ``barrier`` (a barrier, then
``destroy_process_group()``) and ``exit`` (neither: the group dies with the
process). Each repeat runs every variant under ``torchrun --standalone
--nproc-per-node 2`` and through ``fdl launch`` + ``fdl join`` on loopback, in
two layouts: ``fdl`` (two walk-ins of one rank each: the second host's rank
reaches the store on rank 0's host through the relay and the controller) and
``fdl-1`` (one walk-in with both ranks: the store is local). The launchers
alternate, one run at a time.

A run is ``ok`` when every rank and the launcher exit 0; ``teardown`` when
every rank wrote its result and then a rank or the launcher failed (the
crash this measures: gloo's ``terminate called without an active
exception``, SIGABRT); ``failed`` when a rank did not get as far as its
result; ``stopped`` when the launcher was signalled from outside (SIGINT or
SIGTERM), which says nothing of the run. ``--keep DIR`` keeps the output of
each run that was not ``ok`` there.

The last line is one JSON object: per launcher, runs and counts by outcome,
and ``ratio`` (fdl's teardown failures over torchrun's, both layouts summed
against twice torchrun's runs; goal: no more than torchrun's).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.overhead import wait_for_window
from bench.walkins import free_port

RANK = """
import os, sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

variant, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(32, 16), torch.randn(32, 1)
for _ in range(20):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
print(f"rank {rank}: sum {total.item():g}, w0 {model.module.weight[0, 0].item():.4f}", flush=True)
open(os.path.join(out, f"result-{rank}"), "w").write(str(total.item()))
if variant == "barrier":
    dist.barrier()
if variant in ("barrier", "destroy"):
    dist.destroy_process_group()
"""

VARIANTS = ("destroy", "barrier", "exit")
LAUNCHERS = ("torchrun", "fdl", "fdl-1")
STOPPED = {130, 143, -2, -15}  # a launcher's exit after SIGINT or SIGTERM (fdl's 128 + n, Python's -n)


def outcome(out: Path, codes: list[int]) -> str:
    if all(c == 0 for c in codes):
        return "ok"
    if codes and codes[0] in STOPPED:
        return "stopped"  # the launcher was signalled from outside: no outcome of the run's own
    return "teardown" if len(list(out.glob("result-*"))) == 2 else "failed"


def torchrun(variant: str, work: Path, out: Path) -> tuple[list[int], str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*command, str(work / "rank.py"), variant, str(out)], capture_output=True, text=True, check=False
    )
    # torchrun's summary names each failed rank's exit code and pid ("exitcode  : -6 (pid: 42)"),
    # the first one twice (its "Root Cause").
    found = re.findall(r"exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)", done.stderr)
    ranks = {pid: int(code) for code, pid in found}
    return [done.returncode, *ranks.values()], done.stdout + done.stderr


def fdl(variant: str, work: Path, out: Path, hosts: list[tuple[str, int]]) -> tuple[list[int], str]:
    port = free_port()
    join = {"discovery": True, "min_rank_start": 2, "target_ranks": 2, "join_timeout": 60}
    cluster = {"cluster": {"controller": {"host": "127.0.0.1", "port": port, "join": join}}}
    (work / "fdl.cluster.yml").write_text(json.dumps(cluster))
    bin_dir = Path(sys.executable).parent
    fdl_cmd = str(bin_dir / "fdl") if (bin_dir / "fdl").exists() else shutil.which("fdl") or "fdl"
    logs = [out / "launch.log", *(out / f"join-{name}.log" for name, _ in hosts)]
    rank = [sys.executable, str(work / "rank.py"), variant, str(out)]
    with logs[0].open("w") as log:
        launch = subprocess.Popen(
            [fdl_cmd, "launch", "--no-fanout", "--json", "--", *rank],
            cwd=work,
            stdout=subprocess.PIPE,
            stderr=log,
        )
    wait_for_window(work, fdl_cmd, launch)
    joins = []
    for (name, cpus), path in zip(hosts, logs[1:], strict=True):
        with path.open("w") as log:
            joins.append(
                subprocess.Popen(
                    [fdl_cmd, "join", f"127.0.0.1:{port}", "--host", name, "--devices", f"cpu:{cpus}"],
                    cwd=work,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    report = launch.communicate()[0].decode(errors="replace")
    codes = [launch.returncode, *(j.wait() for j in joins)]
    try:
        ranks = [c for host in json.loads(report)["hosts"] for c in host["exits"].values()]
    except (ValueError, KeyError, TypeError):
        ranks = []
    text = "\n".join(f"== {p.name}\n{p.read_text()}" for p in logs) + f"\n== report\n{report}"
    return codes + ranks, text


def run(launcher: str, variant: str, work: Path) -> tuple[str, list[int], str, float]:
    out = Path(tempfile.mkdtemp(dir=work))
    started = time.perf_counter()
    if launcher == "torchrun":
        codes, text = torchrun(variant, work, out)
    else:
        codes, text = fdl(variant, work, out, [("a", 1), ("b", 1)] if launcher == "fdl" else [("a", 2)])
    elapsed = time.perf_counter() - started
    result = outcome(out, codes)
    shutil.rmtree(out, ignore_errors=True)
    return result, codes, text, elapsed


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--runs", type=int, default=50, help="runs per launcher (default 50)")
    parser.add_argument("--quick", action="store_true", help="3 runs per launcher")
    parser.add_argument("--variant", choices=VARIANTS, action="append", help="only these endings")
    parser.add_argument("--launcher", choices=LAUNCHERS, action="append", help="only these launchers")
    parser.add_argument("--keep", type=Path, help="keep each failed run's output in this directory")
    args = parser.parse_args()
    runs = 3 if args.quick else args.runs
    variants = args.variant or list(VARIANTS)
    launchers = args.launcher or list(LAUNCHERS)
    work = Path(tempfile.mkdtemp(prefix="flodl-teardown-"))
    (work / "rank.py").write_text(RANK)
    os.environ.pop("OMP_NUM_THREADS", None)  # both launchers set it to 1 for 2 ranks on one box
    counts: dict[str, Counter[str]] = {name: Counter() for name in launchers}
    by_variant: dict[str, Counter[str]] = {f"{n}/{v}": Counter() for n in launchers for v in variants}
    try:
        for i in range(runs):
            variant = variants[i % len(variants)]
            for launcher in launchers:
                result, codes, text, elapsed = run(launcher, variant, work)
                counts[launcher][result] += 1
                by_variant[f"{launcher}/{variant}"][result] += 1
                print(f"{i + 1:3d} {launcher:8s} {variant:8s} {result:8s} {codes} {elapsed:.1f}s", flush=True)
                if result != "ok" and args.keep is not None:
                    args.keep.mkdir(parents=True, exist_ok=True)
                    (args.keep / f"{i + 1:03d}-{launcher}-{variant}-{result}.log").write_text(text)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    torchrun_failed = counts.get("torchrun", Counter())["teardown"]
    fdl_failed = sum(counts[n]["teardown"] for n in ("fdl", "fdl-1") if n in counts)
    fdl_runs = runs * sum(n in counts for n in ("fdl", "fdl-1"))
    summary = {
        "bench": "teardown",
        "runs": runs,
        "load": [round(x, 1) for x in os.getloadavg()],  # at the end: 1, 5, 15 minutes
        "variants": variants,
        "launchers": {name: {"runs": runs, **got} for name, got in counts.items()},
        "by_variant": {name: dict(got) for name, got in by_variant.items()},
        "baseline": "the same script under torchrun --standalone --nproc-per-node 2",
        "ratio": round((fdl_failed / fdl_runs) / (torchrun_failed / runs), 3)
        if torchrun_failed and fdl_runs
        else None,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

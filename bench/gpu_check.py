"""The GPU paths proved on a real GPU, in one command: ``python -m bench.gpu_check --out DIR``.

Each check is a function with its own time budget (their sum stays under 8 minutes); it
records pass, fail or skip with the reason and its figures. The report is
``DIR/report.json`` and a readable ``DIR/summary.txt``; each check's logs are under
``DIR/work/NAME/``. Without a CUDA device every check is skipped ("no CUDA device") and the
command exits 0; a check that raises is a recorded failure, and the exit code is 1 when any
check failed. ``--only NAME`` (repeatable) reruns some of them.

The checks: the ``gpu``-marked tests; ``fdl probe`` on the box (its facts, and no finding
that is not ok); the ``gpu_facts`` Ansible module run directly (one arch spelling with the
probe); a loopback ``fdl launch --plane nccl`` + ``fdl join --devices 0`` walk-in running a
torchrun-style NCCL script; the Trainer in nccl_sync and nccl_cadence on the GPU against
the same Trainer on the CPU; a mixed world (a GPU walk-in and a ``cpu:1`` walk-in) in
cpu_sync and cpu_cadence; the CPU plane's averaging round with the GPU rank's parameters
on the device against the same tensors on the host.

On the GPU machine (Python 3.12 with its own CUDA torch, no network), from the checkout,
with ``.whl`` carried (``python -m bench.gpu_wheels`` fills it here), the one call::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && \\
        python3 -m bench.gpu_check --out $OUT
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import gpu_ranks, gpu_report
from bench.gpu_report import NO_CUDA, CheckFailed, Result
from bench.walkins import WorldFailed, fdl_command, stop, tail
from tests.support import syntax  # the gpu tests this check runs live there too

ROOT = Path(__file__).resolve().parents[1]
MODULE = ROOT / "collections/ansible_collections/flodl/cluster/plugins/modules/gpu_facts.py"
TOTAL = 470.0  # seconds: the whole run, under 8 minutes


@dataclass(frozen=True)
class Check:
    name: str
    budget: float  # seconds
    run: Callable[[Path, float], dict[str, Any]]  # (work dir, budget) -> figures; raises CheckFailed


def bounded(argv: list[str], budget: float, work: Path, log: str) -> subprocess.CompletedProcess[str]:
    """``argv`` from ``work``, killed (with what it started) after ``budget`` seconds;
    its stdout returned, its stderr kept in ``work/LOG`` (the log names it in a failure)."""
    with (work / log).open("w") as err:
        proc = subprocess.Popen(
            argv, cwd=work, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True
        )
        try:
            out, _ = proc.communicate(timeout=budget)
        except subprocess.TimeoutExpired:
            stop(proc)
            raise CheckFailed(f"not done within {budget:.0f} s" + see(work, log)) from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


def see(work: Path, log: str) -> str:
    """A failure's pointer to its log, with the log's last lines."""
    return f" (see {log})\n{tail(work / log, 8)}"


def gpu_test_files(root: Path = ROOT) -> list[str]:
    """Test modules holding a ``pytest.mark.gpu`` (read from their syntax: a mark quoted in
    a string, as test_ci_skips writes one, is none)."""

    def marked(path: Path) -> bool:
        for node in ast.walk(syntax.parse(path)):
            if isinstance(node, ast.Attribute) and node.attr == "gpu":
                mark = node.value
                if isinstance(mark, ast.Attribute) and mark.attr == "mark":
                    return True
        return False

    return sorted(str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py") if marked(p))


def check_gpu_tests(work: Path, budget: float) -> dict[str, Any]:
    files = gpu_test_files()
    xml = work / "junit.xml"
    argv = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    bounded([*argv, *(str(ROOT / f) for f in files)], budget, work, "pytest.log")
    if not xml.exists():
        raise CheckFailed("pytest wrote no JUnit report" + see(work, "pytest.log"), {"files": files})
    outcome = gpu_report.junit_outcome(xml.read_text()) | {"files": files}
    if outcome["failed"] or not outcome["passed"]:
        raise CheckFailed(
            f"{outcome['failed']} failed, {outcome['passed']} passed, {outcome['skipped']} skipped", outcome
        )
    return outcome


def probe_payload(work: Path, budget: float) -> dict[str, Any]:
    """``fdl probe --json --no-dial`` from an empty directory (no ./fdl.yml to judge)."""
    done = bounded([*fdl_command(), "probe", "--json", "--no-dial"], budget, work, "probe.log")
    try:
        return dict(json.loads(done.stdout))
    except ValueError:
        why = f"fdl probe exited {done.returncode} with no JSON"
        raise CheckFailed(why + see(work, "probe.log")) from None


def driver_version() -> str:
    if shutil.which("nvidia-smi") is None:
        return ""
    argv = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=20)
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else ""


def check_probe(work: Path, budget: float) -> dict[str, Any]:
    figures, problems = gpu_report.probe_verdict(probe_payload(work, budget), driver_version())
    if problems:
        raise CheckFailed("; ".join(problems), figures)
    return figures


def check_gpu_facts(work: Path, budget: float) -> dict[str, Any]:
    args = work / "args.json"
    args.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": {}}))
    done = bounded([sys.executable, str(MODULE), str(args)], budget / 2, work, "gpu_facts.log")
    try:
        module = gpu_report.module_archs(done.stdout)
    except (ValueError, KeyError) as exc:
        raise CheckFailed(f"gpu_facts printed no facts ({exc!r})" + see(work, "gpu_facts.log")) from None
    probe = list(probe_payload(work, budget / 2).get("facts", {}).get("archs", {}).get("nvidia", []))
    figures = {"module": module, "probe": probe}
    why = gpu_report.arch_disagreement(probe, module)
    if why is None and not module:
        why = "neither lists a GPU"
    if why:
        raise CheckFailed(why, figures)
    return figures


def check_nccl_walk_in(work: Path, budget: float) -> dict[str, Any]:
    rank = gpu_ranks.nccl_walk_in(work, budget)
    if problems := gpu_report.walk_in_problems(rank):
        raise CheckFailed("; ".join(problems), rank)
    return {k: rank[k] for k in ("device_name", "backend", "device", "losses")}


# The Trainer on a world of one, each mode on the GPU then the CPU (bench.gpu_trainer's run).
TRAINER = """
import json, sys
from bench.gpu_trainer import throughput
plan = {"nccl_sync": 200, "nccl_cadence": 640}
rates = {m: {d: throughput(d, n, m) for d in ("cuda", "cpu")} for m, n in plan.items()}
print(json.dumps(rates))
"""


def check_trainer(work: Path, budget: float) -> dict[str, Any]:
    done = bounded([sys.executable, "-c", TRAINER], budget, work, "trainer.log")
    if done.returncode != 0:
        raise CheckFailed(f"the Trainer run exited {done.returncode}" + see(work, "trainer.log"))
    rates = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        mode: {
            "gpu_batches_per_s": round(r["cuda"], 1),
            "cpu_batches_per_s": round(r["cpu"], 1),
            "ratio": round(r["cuda"] / r["cpu"], 2),
        }
        for mode, r in rates.items()
    }


MIXED = ["0", "cpu:1"]  # a GPU walk-in and a CPU walk-in
MIXED_PLAN = {"cpu_sync": 80, "cpu_cadence": 2000}  # the world's batches per mode
WIDTH = 2048  # hidden width: work enough per batch that the GPU is clearly the faster device


def check_mixed_world(work: Path, budget: float) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    problems: list[str] = []
    for mode, batches in MIXED_PLAN.items():
        ranks = gpu_ranks.trained(work / mode, mode, batches, WIDTH, MIXED, budget / len(MIXED_PLAN))
        figures[mode], found = gpu_report.world_verdict(ranks, cadence=mode == "cpu_cadence")
        problems += [f"{mode}: {p}" for p in found]
    if problems:
        raise CheckFailed("; ".join(problems), figures)
    return figures


def check_averaging(work: Path, budget: float) -> dict[str, Any]:
    ranks = gpu_ranks.averaged(work, 64.0, 5, MIXED, budget)
    wrong = [r for r in ranks if abs(r["value"] - r["expected"]) > 1e-6]
    figures = {
        f"rank {r['rank']} ({r['device']})": {
            "on_device_ms": round(1000 * r["on_device_s"], 1),
            "on_host_ms": round(1000 * r["on_host_s"], 1),
        }
        for r in ranks
    }
    if wrong:
        raise CheckFailed(f"averaged values {[r['value'] for r in wrong]}, expected {wrong[0]['expected']}")
    return {"mb": 64.0, **figures}


CHECKS = [
    Check("gpu_tests", 90, check_gpu_tests),
    Check("probe", 25, check_probe),
    Check("gpu_facts", 30, check_gpu_facts),
    Check("nccl_walk_in", 60, check_nccl_walk_in),
    Check("trainer_nccl", 90, check_trainer),
    Check("mixed_world", 100, check_mixed_world),
    Check("averaging", 60, check_averaging),
]


def run_check(check: Check, out: Path) -> Result:
    work = out / "work" / check.name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.monotonic()
    try:
        result = Result(check.name, "pass", figures=check.run(work, check.budget))
    except CheckFailed as exc:
        result = Result(check.name, "fail", str(exc), figures=exc.figures)
    except WorldFailed as exc:
        result = Result(check.name, "fail", str(exc))
    except (Exception, SystemExit) as exc:  # a check that raises is a failure, never a traceback out
        result = Result(check.name, "fail", f"{type(exc).__name__}: {exc}")
    result.seconds, result.budget_s = round(time.monotonic() - started, 1), check.budget
    return result


def run_all(checks: list[Check], out: Path, cuda: bool, total: float = TOTAL) -> list[Result]:
    deadline = time.monotonic() + total
    results = []
    for check in checks:
        if not cuda:
            results.append(Result(check.name, "skip", NO_CUDA, budget_s=check.budget))
        elif time.monotonic() + check.budget > deadline:
            results.append(Result(check.name, "skip", "the run's time is spent", budget_s=check.budget))
        else:
            results.append(run_check(check, out))
            print(gpu_report.summary_line(results[-1]), flush=True)
    return results


def machine() -> dict[str, Any]:
    """This box, and its CUDA device ("" for none) with why there is none."""
    facts: dict[str, Any] = {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "device": "",
    }
    try:
        import torch
    except Exception as exc:  # an ImportError, or a broken install's OSError
        return facts | {"torch": "", "why": f"torch does not import: {exc}"}
    facts["torch"] = f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'})"
    if not torch.cuda.is_available():
        return facts | {"why": "torch.cuda.is_available() is False"}
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return facts | {"device": ", ".join(names), "gpus": len(names), "driver": driver_version()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="checks: " + ", ".join(c.name for c in CHECKS)
    )
    parser.add_argument("--out", type=Path, required=True, help="where report.json and summary.txt go")
    names = [c.name for c in CHECKS]
    parser.add_argument("--only", action="append", choices=names, help="run just this check (repeatable)")
    args = parser.parse_args(argv)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    # The ranks, pytest and fdl run from this checkout whatever the caller's PYTHONPATH says.
    path = os.environ.get("PYTHONPATH", "")
    if str(ROOT) not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (path, str(ROOT)) if p)
    box = machine()
    checks = [c for c in CHECKS if not args.only or c.name in args.only]
    results = run_all(checks, args.out.resolve(), cuda=bool(box["device"]))
    command = "python -m bench.gpu_check " + " ".join(argv if argv is not None else sys.argv[1:])
    doc = gpu_report.report(results, box, command, started)
    gpu_report.write(args.out, doc)
    print(gpu_report.summary(doc), end="")
    return gpu_report.exit_code(doc)


if __name__ == "__main__":
    sys.exit(main())

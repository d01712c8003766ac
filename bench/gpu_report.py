"""The GPU check's pure parts: each check's result, the report (``report.json`` and a readable
``summary.txt``), and the verdicts that read what the checks ran: ``fdl probe --json``, the
``gpu_facts`` module's output, pytest's JUnit XML, the walk-in's and the worlds' rank files.

A verdict returns its figures and its problems (empty: the check passed); the checks in
``bench.gpu_check`` raise :class:`CheckFailed` with them.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

Status = Literal["pass", "fail", "skip"]
NO_CUDA = "no CUDA device"
ARCH = re.compile(r"sm_\d+[a-z]?|gfx[0-9a-f]+")


class CheckFailed(Exception):
    """A check's own verdict: what was wrong, with the figures it had gathered."""

    def __init__(self, reason: str, figures: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.figures = figures or {}


@dataclass
class Result:
    name: str
    status: Status
    reason: str = ""
    seconds: float = 0.0
    budget_s: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)


def report(results: list[Result], machine: dict[str, Any], command: str, started: str) -> dict[str, Any]:
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "skip")}
    return {
        "started": started,
        "command": command,
        "machine": machine,
        "cuda": bool(machine.get("device")),
        "seconds": round(sum(r.seconds for r in results), 1),
        "counts": counts,
        "ok": counts["fail"] == 0,
        "checks": [asdict(r) for r in results],
    }


def exit_code(doc: dict[str, Any]) -> int:
    """1 when any check failed (a skip is no failure: no GPU is no fault of the code)."""
    return 0 if doc["ok"] else 1


def summary(doc: dict[str, Any]) -> str:
    machine = doc["machine"]
    lines = [
        f"GPU check, {doc['started']}: {doc['counts']['pass']} passed, {doc['counts']['fail']} failed, "
        f"{doc['counts']['skip']} skipped in {doc['seconds']} s",
        f"machine: {machine.get('device') or NO_CUDA + ' (' + machine.get('why', '?') + ')'}; "
        f"{machine.get('torch', '?')}; driver {machine.get('driver') or 'none'}; "
        f"python {machine.get('python', '?')}; {machine.get('cpus', '?')} CPUs; "
        f"host {machine.get('host', '?')}",
        f"command: {doc['command']}",
        "",
    ]
    for c in doc["checks"]:
        lines.append(summary_line(Result(**c)))
        for key, value in c["figures"].items():
            text = value if isinstance(value, str) else json.dumps(value)
            lines.append(f"      {key}: {text}")
    return "\n".join(lines) + "\n"


def summary_line(r: Result) -> str:
    """One check: status, name, its time against its budget, and why (a failure's reason
    may run over several lines: the processes' log tails, indented)."""
    head = f"{r.status:<4}  {r.name:<13} {r.seconds:6.1f} s of {r.budget_s:3.0f}"
    return head + ("  " + r.reason.replace("\n", "\n      ") if r.reason else "")


def write(out: Path, doc: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "summary.txt").write_text(summary(doc))


# --- verdicts --------------------------------------------------------------------


def probe_verdict(payload: dict[str, Any], driver: str = "") -> tuple[dict[str, Any], list[str]]:
    """``fdl probe --json`` on a GPU box: its facts, and every finding that is not ``ok``
    (on a sound GPU box with no join block to judge, any warning is a false one)."""
    facts, torch = payload.get("facts", {}), payload.get("facts", {}).get("torch", {})
    figures = {
        "driver": driver,
        "gpus": facts.get("gpus", {}).get("nvidia", []),
        "archs": facts.get("archs", {}).get("nvidia", []),
        "torch": torch.get("version", ""),
        "cuda": torch.get("cuda", ""),
        "nccl": torch.get("nccl", ""),
        "usable_gpus": torch.get("usable_gpus", 0),
        "build_archs": torch.get("archs", []),
        "findings": [f"{f['level']} {f['check']}: {f['message']}" for f in payload.get("findings", [])],
    }
    problems = [line for line in figures["findings"] if not line.startswith("ok ")]
    if not figures["gpus"]:
        problems.append("the probe lists no NVIDIA GPU")
    if not figures["cuda"] or not figures["nccl"]:
        problems.append(f"torch's CUDA ({figures['cuda'] or 'none'}) or NCCL ({figures['nccl'] or 'none'})")
    covered = [f for f in payload.get("findings", []) if f["check"] == "variant" and f["level"] == "ok"]
    if not covered:
        problems.append("no kernel-coverage finding for the GPUs (variant ok)")
    return figures, problems


def module_archs(stdout: str) -> list[str]:
    """The archs in the ``gpu_facts`` module's output (one JSON object), in index order."""
    doc = json.loads(stdout)
    if doc.get("failed"):
        raise CheckFailed(f"gpu_facts failed: {doc.get('msg', doc)}")
    gpus = doc["ansible_facts"]["flodl_gpus"]
    return [str(g.get("arch", "")) for g in sorted(gpus, key=lambda g: int(g["index"]))]


def arch_disagreement(probe: list[str], module: list[str]) -> str | None:
    """Why the probe's and the module's archs are not one spelling of the same cards, or None."""
    if probe != module:
        return f"the probe says {probe}, the gpu_facts module {module}"
    odd = [a for a in probe if not ARCH.fullmatch(a)]
    if odd:
        return f"{odd} is not torch's spelling of an arch (sm_90, gfx90a)"
    return None


def junit_outcome(xml_text: str) -> dict[str, Any]:
    """pytest's JUnit XML: counts, and each non-passing test with its message."""
    root = ET.fromstring(xml_text)
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    notes: list[str] = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            counts["passed"] += 1
            continue
        kind = "skipped" if outcome.tag == "skipped" else "failed"
        counts[kind] += 1
        notes.append(f"{kind} {name}: {(outcome.get('message') or '').strip()[:300]}")
    return {**counts, "notes": notes}


WALK_IN_ENV = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "0"}


def walk_in_problems(rank: dict[str, Any]) -> list[str]:
    """The torchrun-style NCCL script's own account, from a walk-in offering GPU 0."""
    problems = [
        f"{key}={rank['env'].get(key)!r}, expected {value!r}"
        for key, value in WALK_IN_ENV.items()
        if rank["env"].get(key) != value
    ]
    problems += [f"{key} is not set" for key in ("MASTER_ADDR", "MASTER_PORT") if not rank["env"].get(key)]
    if rank["env"].get("FLODL_DEVICE") != "cuda:0":
        problems.append(f"FLODL_DEVICE={rank['env'].get('FLODL_DEVICE')!r}, expected 'cuda:0'")
    if rank["backend"] != "nccl":
        problems.append(f"backend {rank['backend']}, expected nccl")
    if rank["visible"] != 1 or rank["device"] != "cuda:0":
        problems.append(f"the rank sees {rank['visible']} device(s) and trains on {rank['device']}")
    if rank["all_reduce"] != [1.0] * len(rank["all_reduce"]):
        problems.append(f"all_reduce over a world of one gave {rank['all_reduce']}")
    if not rank["losses"] or rank["losses"][-1] >= rank["losses"][0]:
        problems.append(f"the DDP steps did not lower the loss: {rank['losses']}")
    return problems


def world_verdict(ranks: list[dict[str, Any]], cadence: bool) -> tuple[dict[str, Any], list[str]]:
    """A mixed world's rank files (a Trainer each): the same final weights on every rank, and
    in cadence the GPU rank (if any) taking the larger share of the batches."""
    ranks = sorted(ranks, key=lambda r: r["rank"])
    total = sum(r["batches"] for r in ranks) or 1
    figures = {
        "ranks": {str(r["rank"]): r["device"] for r in ranks},
        "share": {str(r["rank"]): round(r["batches"] / total, 3) for r in ranks},
        "rounds": ranks[0]["rounds"] if ranks else 0,
        "seconds": round(max((r["seconds"] for r in ranks), default=0.0), 2),
        "samples_per_s": round(sum(r["samples"] for r in ranks) / max(r["seconds"] for r in ranks), 1)
        if ranks
        else 0.0,
        "loss": round(ranks[0]["loss"], 5) if ranks else None,
    }
    problems = []
    if len({r["digest"] for r in ranks}) != 1:
        problems.append(f"the ranks end with different weights: {[r['digest'][:12] for r in ranks]}")
    gpu = [r for r in ranks if r["device"].startswith("cuda")]
    if cadence and gpu and len(ranks) > 1:
        mine = gpu[0]["batches"] / total
        if mine <= max(r["batches"] / total for r in ranks if r is not gpu[0]):
            problems.append(f"the GPU rank took {mine:.0%} of the batches, not the larger share")
    return figures, problems

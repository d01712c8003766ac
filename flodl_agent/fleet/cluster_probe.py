"""`fdl @NAME probe`: every box of a cluster probed at once, and what only the set shows.

Each worker runs ``fdl probe --json --no-dial --spec-stdin`` over its ``ssh:``
block, with its cluster entry (devices, data_path, nccl_socket_ifname, env)
on the session's stdin; the controller box probes itself as the cluster's
controller. :func:`across` is the pure part: the findings no single box can
make (NCCL version skew, torch or vendor skew, a data root that diverges
between boxes, a box that could not be probed).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, dataclass
from typing import Any

from ..agent.spec import encode, for_worker
from ..config.models import Cluster, Worker
from ..probing.findings import Finding
from ..probing.probe import as_json_payload, check, gather
from .fanout import ask, run_fdl, worker_ssh

PROBE_TIMEOUT = 120.0  # seconds one box gets (importing torch on a cold disk is slow)
CONTROLLER = "(controller)"


@dataclass(frozen=True)
class Report:
    """One box's probe: its ``fdl probe --json`` payload, or why there is none."""

    host: str
    payload: dict[str, Any] | None = None
    error: str = ""

    @property
    def facts(self) -> dict[str, Any]:
        facts: dict[str, Any] = (self.payload or {}).get("facts", {})
        return facts

    @property
    def findings(self) -> list[Finding]:
        return [Finding(**f) for f in (self.payload or {}).get("findings", [])]


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _by_value(values: dict[str, str]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for host, value in values.items():
        groups.setdefault(value, []).append(host)
    return groups


def _listing(groups: dict[str, list[str]]) -> str:
    return "; ".join(f"{value} on {', '.join(hosts)}" for value, hosts in groups.items())


def across(reports: list[Report]) -> list[Finding]:
    """What the set of boxes shows that no box alone does."""
    found = [
        Finding(
            "reach",
            "fail",
            f"{r.host}: not probed ({r.error})",
            "check the worker's ssh: block, or run fdl probe on the box itself",
        )
        for r in reports
        if r.payload is None
    ]
    workers = [r for r in reports if r.payload is not None and r.host != CONTROLLER]
    nccl = {r.host: r.facts["torch"]["nccl"] for r in workers if r.facts.get("torch", {}).get("nccl")}
    skew = _by_value({h: _major_minor(v) for h, v in nccl.items()})
    if len(skew) > 1:
        # Pin the others to what most boxes load: the fewest boxes change.
        most = max(skew.items(), key=lambda kv: len(kv[1]))
        target = next(nccl[h] for h in most[1])
        others = sorted(h for v, hosts in skew.items() if v != most[0] for h in hosts)
        found.append(
            Finding(
                "nccl",
                "fail",
                f"NCCL version skew: {_listing(_by_value(nccl))} (major.minor must match)",
                f"on {', '.join(others)}: fdl nccl pin {target}, and add its env entry to the worker's env:",
            )
        )
    elif nccl:
        found.append(Finding("nccl", "ok", f"every GPU box loads NCCL {next(iter(skew))}"))
    torch = {r.host: r.facts["torch"]["version"] for r in workers if r.facts.get("torch", {}).get("version")}
    if len(set(torch.values())) > 1:
        found.append(
            Finding(
                "torch",
                "warn",
                f"torch versions differ: {_listing(_by_value(torch))}",
                "align the variants (flodl_worker_torch_version), or expect numerics to differ a little",
            )
        )
    vendors = {r.host: ",".join(sorted(r.facts.get("gpus", {}))) for r in workers if r.facts.get("gpus")}
    if len(set(vendors.values())) > 1:
        found.append(
            Finding(
                "vendors",
                "warn",
                f"GPU vendors differ: {_listing(_by_value(vendors))}",
                "an NCCL/RCCL plane cannot span vendors: run these boxes together on the cpu plane",
            )
        )
    found += _data(workers)
    return found


def _data(workers: list[Report]) -> list[Finding]:
    """The data root as each box signs it, compared the way admission compares the hellos'
    dataset signatures: declared roots must agree; convention roots only earn a warning."""
    seen = {r.host: r.facts["data"] for r in workers if r.facts.get("data", {}).get("path")}
    declared = {h: d for h, d in seen.items() if d.get("declared", True)}
    convention = {h: d for h, d in seen.items() if not d.get("declared", True) and d.get("exists")}
    return _compare(declared, True) + _compare(convention, False)


def _state(d: dict[str, Any]) -> str:
    if d.get("signature"):
        return f"signature {d['signature'][:12]} ({d.get('entries', 0)} entries)"
    return str(d.get("error") or d.get("signature_error") or ("unsigned" if d.get("readable") else "missing"))


def _compare(roots: dict[str, dict[str, Any]], declared: bool) -> list[Finding]:
    if len(roots) < 2:
        return []
    state = {host: _state(d) for host, d in roots.items()}
    paths = {host: d["path"] for host, d in roots.items()}
    where = _listing(_by_value(paths)) if len(set(paths.values())) > 1 else next(iter(paths.values()))
    signed = {h: d["signature"] for h, d in roots.items() if d.get("signature")}
    if declared and 0 < len(signed) < len(roots):
        return [
            Finding(
                "data",
                "fail",
                f"the data root diverges across boxes: {_listing(_by_value(state))}",
                "mount the same data root on every box (flodl_worker_data_mount, or join.data_source)",
            )
        ]
    if len(set(signed.values())) > 1 and declared:
        return [
            Finding(
                "data",
                "fail",
                f"the data root ({where}) differs across boxes: {_listing(_by_value(state))}; admission "
                "will refuse the odd box (dataset mismatch)",
                "sync the data root (names, sizes and contents are signed), or mount the shared one "
                "read-only with join.data_source",
            )
        ]
    if len(set(signed.values())) > 1:
        return [
            Finding(
                "data",
                "warn",
                f"no data_path declared, and the convention root ({where}) differs across boxes: "
                f"{_listing(_by_value(state))}",
                "admission compares declared roots only: sync it, and declare data_path so the window "
                "holds every box to one signature",
            )
        ]
    if len(signed) == len(roots):
        what = "data root" if declared else "convention root (no data_path declared)"
        return [
            Finding(
                "data", "ok", f"the {what} is the same on {len(roots)} boxes: {next(iter(state.values()))}"
            )
        ]
    return []


async def _probe_worker(worker: Worker, path: str | None, timeout: float) -> Report:
    argv = [*worker_ssh(worker), run_fdl(path, "probe --json --no-dial --spec-stdin", worker.arch)]
    try:
        code, out, errout = await ask(argv, encode(for_worker(worker)), timeout)
    except OSError as exc:
        return Report(worker.host, error=f"cannot run ssh: {exc.strerror}")
    except TimeoutError:
        return Report(worker.host, error=f"no answer within {timeout:.0f}s")
    try:
        payload = json.loads(out)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than json follows
        payload = None
    if not isinstance(payload, dict):  # ssh refused, no fdl there, or something else answered
        said = (errout or out).decode(errors="replace").strip().splitlines()
        return Report(worker.host, error=f"exit {code}: {said[-1] if said else 'no output'}")
    return Report(worker.host, payload=payload)


async def probe_cluster(cluster: Cluster, timeout: float = PROBE_TIMEOUT) -> list[Report]:
    """Every worker over ssh and the controller here, at once."""
    here = asyncio.to_thread(lambda: _controller_payload(cluster))
    reports = await asyncio.gather(
        here, *(_probe_worker(w, w.path or cluster.controller.path, timeout) for w in cluster.workers)
    )
    return list(reports)


def _controller_payload(cluster: Cluster) -> Report:
    facts = gather(None, cluster, dial=False)
    return Report(CONTROLLER, as_json_payload(facts, check(facts, None, cluster)))


def as_json(reports: list[Report], findings: list[Finding]) -> dict[str, Any]:
    failed = any(f.level == "fail" for f in findings) or any(
        not r.payload or not r.payload.get("ok") for r in reports
    )
    return {
        "ok": not failed,
        "hosts": {r.host: r.payload if r.payload is not None else {"error": r.error} for r in reports},
        "cluster": [asdict(f) for f in findings],
    }

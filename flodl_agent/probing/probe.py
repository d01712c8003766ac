"""`fdl probe`: is this box ready to walk in (or to run a controller)?

Facts are gathered once by :func:`gather` (the only IO: torch, the GPU
tools, /sys/class/net, the data root, the cache, the controller port);
:func:`check` turns them into findings, each ``ok``, ``warn`` or ``fail``
with the fix. Seed 003's list: a missing torch variant or one with no kernel
for this box's GPUs, NCCL availability, ``nccl_socket_ifname``, legacy schema
keys, the data path, and the port.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..address import join_address, split_address
from ..config.models import Cluster, Join
from ..hardware.gpus import AmdAccess, Card, Torch, amd_access, discover, read_torch
from ..hardware.offer import amd_gaps, kernel_gap
from ..net import socket_ifnames
from ..observe.status import Unreachable, request
from ..protocol.tunnel import Tunnel
from ..retry import AgentFailure
from .data_root import CONVENTION, data_facts, data_findings
from .findings import Finding as Finding  # re-exported: callers still name it probe.Finding

LOW_DISK = 2 * 1024**3  # bytes free below which the cache is called nearly full


@dataclass
class Facts:
    torch: Torch
    gpus: dict[str, list[str]] = field(
        default_factory=dict
    )  # vendor -> names, from nvidia-smi / rocm-smi / KFD
    archs: dict[str, list[str]] = field(default_factory=dict)  # vendor -> each GPU's arch, in the same order
    interfaces: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)  # data_root.data_facts: the root and its signature
    cache: dict[str, Any] = field(default_factory=dict)  # path, writable, free, fstype
    controller: dict[str, Any] = field(default_factory=dict)  # addr, phase or error
    port: dict[str, Any] = field(default_factory=dict)  # controller side: port, free, answered
    tools: dict[str, bool] = field(default_factory=dict)  # walk-in tooling on PATH (and /dev/fuse)
    amd: AmdAccess = field(default_factory=AmdAccess)  # /dev/kfd, render nodes, groups, ROCm runtime


# --- the pure part --------------------------------------------------------------


def check(facts: Facts, join: Join | None = None, cluster: Cluster | None = None) -> list[Finding]:
    controller_only = join is None and cluster is not None
    found = [*_torch(facts, controller_only), *_gpus(facts, join), *data_findings(facts.data)]
    if facts.torch.usable_gpus == 0:  # the agent's gate words the same causes the same way
        gaps = amd_gaps(facts.amd, bool(facts.torch.hip))
        found += [Finding("amd", "fail", f"no usable GPU: {g.message}", g.fix) for g in gaps]
    if join is not None:
        found += _ifname(join.nccl_socket_ifname or "", facts.interfaces, "join.nccl_socket_ifname")
        found += _tooling(join, facts)
        found += _cache(facts)
        found += _controller(facts)
    if cluster is not None:
        found += _cluster(cluster, facts)
    return found


_GLIBC = re.compile(r"GLIBC(?:XX)?_([\d.]+)'? not found")


# The Debian package behind each tool a walk-in's transports drive.
TOOL_PACKAGES = {"rsync": "rsync", "git": "git", "ssh": "openssh-client", "sshfs": "sshfs", "fuse": "fuse3"}


def needed_tools(join: Join) -> dict[str, str]:
    """Tool -> why, for the transports this join block names."""
    need: dict[str, str] = {}
    if join.ssh is not None:
        need["ssh"] = "join.ssh dials through a tunnel"
    if join.source is not None:
        scheme = join.source.from_.partition("://")[0]
        need["rsync"] = f"join.source fetches with rsync ({scheme}://)"
        if scheme.startswith("git+"):
            need["git"] = f"join.source is a {scheme} spec"
        if scheme in ("rsync", "git+ssh"):
            need["ssh"] = f"join.source goes over ssh ({scheme}://)"
    if join.data_source is not None:
        need["sshfs"] = "join.data_source mounts over sshfs"
        need["fuse"] = "an sshfs mount needs /dev/fuse"
    return need


def _tooling(join: Join, facts: Facts) -> list[Finding]:
    need = needed_tools(join)
    missing = [tool for tool in need if not facts.tools.get(tool, False)]
    found = [
        Finding(
            "tools",
            "fail",
            f"{tool} is missing: {need[tool]}",
            f"apt-get install {TOOL_PACKAGES[tool]}"
            + (" (and give containers /dev/fuse)" if tool == "fuse" else ""),
        )
        for tool in missing
    ]
    if need and not missing:
        found.append(Finding("tools", "ok", f"walk-in tooling present: {', '.join(sorted(need))}"))
    return found


def _torch(facts: Facts, controller_only: bool = False) -> list[Finding]:
    t = facts.torch
    if not t.version and controller_only:
        return [Finding("torch", "ok", "no torch here: a controller needs none (ranks run on the workers)")]
    needs = _GLIBC.search(t.error)
    if not t.version and needs is not None:
        return [
            Finding(
                "torch",
                "fail",
                f"torch does not load in this box's C library: it needs GLIBC {needs.group(1)}, this box "
                f"has {t.libc or 'another libc'}",
                "install a torch built for an older glibc (an earlier release's manylinux wheel), "
                "or run the workers on a newer OS image",
            )
        ]
    if not t.version:
        return [
            Finding(
                "torch",
                "fail",
                f"torch does not import here ({t.error})",
                "run fdl from the worker's torch venv (<path>/libtorch/<variant>), or install one: "
                "flodl_worker_libtorch: auto",
            )
        ]
    build = f"CUDA {t.cuda}" if t.cuda else f"ROCm {t.hip}" if t.hip else "CPU"
    found = [Finding("torch", "ok", f"torch {t.version} ({build} build), gloo {'yes' if t.gloo else 'no'}")]
    if t.cuda or t.hip:
        if t.nccl:
            found.append(Finding("nccl", "ok", f"{'RCCL' if t.hip else 'NCCL'} {t.nccl}"))
        else:
            found.append(Finding("nccl", "warn", "this torch build has no NCCL: GPU runs need the cpu plane"))
    return found


def _gpus(facts: Facts, join: Join | None) -> list[Finding]:
    t, nvidia, amd = facts.torch, facts.gpus.get("nvidia", []), facts.gpus.get("amd", [])
    found: list[Finding] = []
    if nvidia or amd:
        names = ", ".join(nvidia + amd)
        found.append(Finding("gpus", "ok", f"{len(nvidia) + len(amd)} GPU(s): {names}"))
    if t.version:
        variant_fix = (
            "set libtorch: auto (flodl_worker_libtorch: auto) so the variant follows this box's devices"
        )
        if nvidia and not t.cuda:
            found.append(
                Finding(
                    "variant",
                    "fail",
                    f"torch {t.version} has no CUDA kernels, but this box has {len(nvidia)} NVIDIA GPU(s)",
                    variant_fix + ", or offer CPU ranks with --devices cpu:N",
                )
            )
        elif amd and not t.hip:
            found.append(
                Finding(
                    "variant",
                    "fail",
                    f"torch {t.version} has no ROCm kernels, but this box has {len(amd)} AMD GPU(s)",
                    variant_fix + ", or offer CPU ranks with --devices cpu:N",
                )
            )
        elif (nvidia or amd) and t.usable_gpus == 0:
            found.append(
                Finding(
                    "variant",
                    "fail",
                    "torch sees no usable GPU although the driver lists some",
                    "check the driver version against the torch build, and device permissions "
                    "(the service user may need the video/render groups)",
                )
            )
        elif (t.cuda or t.hip) and not (nvidia or amd):
            found.append(Finding("variant", "warn", "a GPU torch on a box with no GPU: CPU ranks only"))
        else:
            found += _coverage(facts, join)
    offer = join.devices if join is not None else None
    if offer is not None and offer.kind == "gpus":
        have = t.usable_gpus
        missing = [i for i in offer.gpus if i >= have]
        if missing:
            found.append(
                Finding(
                    "devices",
                    "fail",
                    f"join.devices names GPU {missing[0]}, but {have} are usable here",
                    f"offer devices 0..{have - 1}" if have else "offer CPU ranks (devices: cpu:N)",
                )
            )
    return found


def _coverage(facts: Facts, join: Join | None) -> list[Finding]:
    """The build's kernels against each offered card's arch."""
    t = facts.torch
    vendor = "amd" if t.hip else "nvidia"
    names, archs = facts.gpus.get(vendor, []), facts.archs.get(vendor, [])
    offer = join.devices if join is not None else None
    wanted = list(offer.gpus) if offer is not None and offer.kind == "gpus" else range(len(archs))
    devices = [Card(i, names[i] if i < len(names) else "?", archs[i]) for i in wanted if i < len(archs)]
    build = f"torch {t.version} ({f'CUDA {t.cuda}' if t.cuda else f'ROCm {t.hip}'})"
    gap = kernel_gap(build, t.archs, devices)
    if gap is not None:
        return [Finding("variant", "fail", gap.message, gap.fix)]
    if devices and t.archs:
        return [
            Finding(
                "variant", "ok", f"{build} has kernels for {', '.join(sorted({c.arch for c in devices}))}"
            )
        ]
    return []


def _ifname(value: str, interfaces: list[str], where: str) -> list[Finding]:
    if not value:
        return [
            Finding(
                "ifname",
                "warn",
                f"{where} is not set: NCCL and gloo pick an interface themselves",
                "on a multi-homed box name the training network's interface (e.g. eth0)",
            )
        ]
    env = socket_ifnames(value, interfaces)
    if "GLOO_SOCKET_IFNAME" not in env and not value.startswith("^"):
        return [
            Finding(
                "ifname",
                "fail",
                f"{where}: {value} matches no interface here ({', '.join(interfaces) or 'none'})",
                f"set {where} to one of this box's interfaces",
            )
        ]
    gloo = env.get("GLOO_SOCKET_IFNAME", "(gloo picks)")
    return [Finding("ifname", "ok", f"NCCL_SOCKET_IFNAME={value}, GLOO_SOCKET_IFNAME={gloo}")]


def _cache(facts: Facts) -> list[Finding]:
    return dir_findings(facts.cache) if facts.cache else []


def dir_findings(c: dict[str, Any]) -> list[Finding]:
    """A node-local directory (``dir_facts``): writable, or a failure; on tmpfs or nearly full, a warning."""
    if not c.get("writable"):
        return [
            Finding(
                "cache",
                "fail",
                f"the node-local directory {c['path']} is not writable ({c.get('error', '')})",
                "give the service user its home (or set HOME) so ~/.flodl can be written",
            )
        ]
    found = [Finding("cache", "ok", f"{c['path']} writable, {c['free'] / 1024**3:.1f} GiB free")]
    if c.get("fstype") == "tmpfs":
        found.append(
            Finding("cache", "warn", f"{c['path']} is on tmpfs: what it holds is lost at every reboot")
        )
    if c.get("free", LOW_DISK) < LOW_DISK:
        found.append(Finding("cache", "warn", f"{c['path']} is nearly full ({c['free'] / 1024**3:.1f} GiB)"))
    return found


def _controller(facts: Facts) -> list[Finding]:
    c = facts.controller
    if not c:
        return []
    if "phase" in c:
        return [Finding("controller", "ok", f"controller at {c['addr']} answers: window {c['phase']}")]
    error = str(c.get("error", ""))
    return [
        Finding(
            "controller",
            "warn",
            error if error.startswith("no controller answers") else f"{c['addr']}: {error}",
            "normal between runs; join units keep dialling. Otherwise check the address and the door",
        )
    ]


def _cluster(cluster: Cluster, facts: Facts) -> list[Finding]:
    found: list[Finding] = []
    for i, worker in enumerate(cluster.workers):
        if len(cluster.workers) > 1 and not worker.nccl_socket_ifname:
            found.append(
                Finding(
                    "ifname",
                    "warn",
                    f"cluster.workers[{i}] ({worker.host}) has no nccl_socket_ifname on a multi-host cluster",
                    "name each worker's training interface, or NCCL may pick a management or docker bridge",
                )
            )
    p = facts.port
    if p:
        if p.get("answered"):
            answer = f"a controller already answers on port {p['port']} ({p['phase']})"
            found.append(Finding("port", "ok", answer))
        elif not p.get("free"):
            found.append(
                Finding(
                    "port",
                    "fail",
                    f"port {p['port']} is taken by something that is not a flodl controller",
                    "stop it, or pick another cluster.controller.port",
                )
            )
        else:
            found.append(Finding("port", "ok", f"port {p['port']} is free for the controller"))
    return found


# --- the IO shell ---------------------------------------------------------------


def gather(
    join: Join | None, cluster: Cluster | None, dial: bool = True, convention: Path = CONVENTION
) -> Facts:
    """``convention``: the data root checked when no data_path is declared."""
    gpus, archs = discover()
    facts = Facts(torch=read_torch(), gpus=gpus, archs=archs, interfaces=_interfaces(), amd=amd_access())
    if join is not None:
        facts.tools = {
            tool: (Path("/dev/fuse").exists() if tool == "fuse" else shutil.which(tool) is not None)
            for tool in needed_tools(join)
        }
        facts.cache = dir_facts(Path.home() / ".flodl" / "data")
        if dial and join.ssh is not None:
            facts.controller = asyncio.run(_dial_through(join))
        elif dial and join.controller:
            facts.controller = _dial(join.controller, join.tls_fingerprint)
    if join is not None or cluster is None:  # a walk-in's box (a controller reads no data)
        facts.data = data_facts(join.data_path if join is not None else None, convention)
    if cluster is not None:
        facts.port = _port_facts(cluster.controller.host, cluster.controller.port)
    return facts


def _interfaces() -> list[str]:
    try:
        return sorted(p.name for p in Path("/sys/class/net").iterdir())
    except OSError:
        return []


def dir_facts(path: Path) -> dict[str, Any]:
    facts: dict[str, Any] = {"path": str(path)}
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        facts.update(writable=False, error=exc.strerror)
        return facts
    facts.update(writable=True, free=shutil.disk_usage(path).free, fstype=_fstype(path))
    return facts


def _fstype(path: Path) -> str:
    """The filesystem type of the mount holding ``path`` (longest mount point prefix)."""
    best, kind = "", ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 2 and str(path.resolve()).startswith(parts[1]) and len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
    return kind


def _dial(addr: str, pin: str | None = None) -> dict[str, Any]:
    try:
        reply = request(addr, "GET", "/state.json", timeout=3, pin=pin)
    except Unreachable as exc:
        return {"addr": addr, "error": str(exc)}
    return {"addr": addr, "phase": reply.body.get("phase", "?")}


async def _dial_through(join: Join) -> dict[str, Any]:
    """The controller through the join's own ssh forward: the road a walk-in takes."""
    assert join.ssh is not None
    host, port = split_address(join.controller or "127.0.0.1:1337")
    road = f"{join_address(host, port)} via ssh {join.ssh.target}"
    try:
        async with Tunnel(join.ssh, host, port) as tunnel:
            facts = await asyncio.to_thread(_dial, f"127.0.0.1:{tunnel.local_port}", join.tls_fingerprint)
    except AgentFailure as exc:
        return {"addr": road, "error": exc.render()}
    return facts | {"addr": road}


def _port_facts(host: str, port: int) -> dict[str, Any]:
    addr = f"{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{port}"
    with contextlib.suppress(Unreachable):
        reply = request(addr, "GET", "/state.json", timeout=2)
        return {"port": port, "free": False, "answered": True, "phase": reply.body.get("phase", "?")}
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return {"port": port, "free": False, "answered": False}
    return {"port": port, "free": True, "answered": False}


def as_json_payload(facts: Facts, findings: list[Finding]) -> dict[str, Any]:
    return {
        "ok": not any(f.level == "fail" for f in findings),
        "findings": [asdict(f) for f in findings],
        "facts": asdict(facts),
    }

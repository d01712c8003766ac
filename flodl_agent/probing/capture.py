"""`fdl probe --capture`: this box's GPU stack in one directory (or .tar.gz) for a bug report.

What a "no usable GPU" on a fresh AMD box (and its CUDA kin) needs in one place: the
probe's report, the kernel and its amdgpu/kfd modules, the device nodes with their modes
and groups against this user's groups, the KFD topology, the vendor tools' answers, the
torch build and whether its runtime starts, the GPU environment, the kernel's lines about
the driver. Every source is optional and bounded (:mod:`flodl_agent.hardware.capture_files`): what
is missing, fails or hangs is written down in index.json and README.txt, never fatal.
Where the facts are read is a parameter (:class:`Roots`), so a test gives its own.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import re
import shutil
import socket
import stat
import sys
import tarfile
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import __version__
from ..hardware.capture_files import (
    MAX_BYTES,
    TIMEOUT,
    Capture,
    Entry,
    gpu_env,
    readme,
    redact_words,
    tool_env,
)
from ..hardware.gpus import NVIDIA_SMI, ROCM_SMI
from ..hardware.variants import FACTS

# The vendor tools, each optional: (file, what it is, the command).
TOOLS = (
    ("tools/rocminfo.txt", "rocminfo: the HSA runtime's agents (fails without /dev/kfd)", ["rocminfo"]),
    ("tools/rocm-smi.txt", "rocm-smi: the cards as the SMI lists them", ["rocm-smi"]),
    ("tools/rocm-smi-fdl.txt", "rocm-smi as fdl probe reads it", ROCM_SMI),
    ("tools/amd-smi.txt", "amd-smi static: the newer SMI's card facts", ["amd-smi", "static"]),
    ("tools/hipconfig.txt", "hipconfig --full: the HIP installation", ["hipconfig", "--full"]),
    ("tools/nvidia-smi.txt", "nvidia-smi: the driver, its CUDA, the cards", ["nvidia-smi"]),
    ("tools/nvidia-smi-fdl.txt", "nvidia-smi as fdl probe reads it", NVIDIA_SMI),
    ("tools/modinfo-amdgpu.txt", "modinfo amdgpu: the module's file, version", ["modinfo", "amdgpu"]),
)  # fmt: skip
TORCH_TIMEOUT = 120.0  # an interpreter importing torch (the probe, the build, the runtime)
MAX_NODES = 64  # KFD topology nodes copied

# torch's runtime, started: what "no usable GPU" is about (it may hang or crash: bounded, apart).
RUNTIME = """
import torch
print("torch", torch.__version__, "hip", getattr(torch.version, "hip", None), "cuda", torch.version.cuda)
print("is_available", torch.cuda.is_available())
count = torch.cuda.device_count()
print("device_count", count)
for i in range(count):
    p = torch.cuda.get_device_properties(i)
    print(i, torch.cuda.get_device_name(i), getattr(p, "gcnArchName", ""), f"{p.total_memory >> 20} MiB")
"""


@dataclass(frozen=True)
class Roots:
    """Where the box's facts are read."""

    kfd: Path = Path("/sys/class/kfd/kfd/topology")
    dev: Path = Path("/dev")
    os_release: Path = Path("/etc/os-release")
    proc: Path = Path("/proc")
    modules: Path = Path("/sys/module")
    rocm: Path = Path("/opt/rocm")


# --- the sections ----------------------------------------------------------------------


def _system(c: Capture, roots: Roots) -> None:
    u = os.uname()
    c.text(
        "system.txt",
        "the kernel (uname) and its command line",
        "os.uname(), /proc/version, /proc/cmdline",
        f"uname: {u.sysname} {u.nodename} {u.release} {u.version} {u.machine}\n"
        f"version: {_read(roots.proc / 'version')}\n"
        f"cmdline: {redact_words(_read(roots.proc / 'cmdline'))}\n",
    )
    c.copy("os-release.txt", "the distribution", roots.os_release)


def _modules(c: Capture, roots: Roots) -> None:
    loaded = [
        line
        for line in _read(roots.proc / "modules").splitlines()
        if re.match(r"(amdgpu|amdkfd|amdxcp|nvidia\w*|drm|drm_\w+|gpu_sched)\s", line)
    ]
    lines = ["loaded (/proc/modules):", *(f"  {line}" for line in loaded or ["none of amdgpu, kfd, nvidia"])]
    for module in ("amdgpu", "nvidia"):
        base = roots.modules / module
        if not base.is_dir():
            continue
        lines.append(f"{module}: version {_read(base / 'version') or '(in-tree: none)'}")
        with contextlib.suppress(OSError):
            for param in sorted((base / "parameters").iterdir())[:200]:
                lines.append(f"  {param.name}={_read(param)}")
    c.text(
        "modules.txt",
        "the kernel's GPU modules and amdgpu's parameters",
        "/proc/modules, /sys/module",
        "\n".join(lines) + "\n",
    )


def _devices(c: Capture, roots: Roots) -> None:
    dri = _listing(roots.dev / "dri") or [roots.dev / "dri"]  # absent: no DRM device at all
    nodes = [roots.dev / "kfd", *dri, *sorted(roots.dev.glob("nvidia*"))]
    lines = [_node_line(node) for node in nodes]
    c.text(
        "devices.txt",
        "the GPU device nodes: mode, owner, group, and whether this user opens them",
        f"{roots.dev}/kfd, {roots.dev}/dri/*, {roots.dev}/nvidia*",
        "\n".join(lines) + "\n",
    )


def _node_line(node: Path) -> str:
    try:
        st = node.stat()
    except OSError as exc:
        return f"{node}: {'absent' if isinstance(exc, FileNotFoundError) else exc.strerror}"
    kind = (
        f"char {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}" if stat.S_ISCHR(st.st_mode) else "not a device"
    )
    opens = "read-write" if os.access(node, os.R_OK | os.W_OK) else "DENIED to this user"
    owner = f"{_user_name(st.st_uid)}:{_group_name(st.st_gid)}"
    return f"{node}: {stat.filemode(st.st_mode)} {owner} {kind}; {opens}"


def _user(c: Capture) -> None:
    uid = os.getuid()
    name = _user_name(uid)
    process = sorted({_group_name(g) for g in os.getgroups()} | {_group_name(os.getgid())})
    listed: list[str] = []
    with contextlib.suppress(KeyError, OSError):
        primary = pwd.getpwuid(uid).pw_gid
        listed = sorted({g.gr_name for g in grp.getgrall() if name in g.gr_mem} | {_group_name(primary)})
    lines = [f"user: {name} (uid {uid})", f"this process's groups: {', '.join(process)}"]
    lines.append(f"the group database's: {', '.join(listed) or '?'}")
    if set(listed) - set(process):
        lines.append(
            f"  not yet in this login: {', '.join(sorted(set(listed) - set(process)))} (log in again)"
        )
    for wanted in ("render", "video"):
        lines.append(f"in {wanted}: {'yes' if wanted in process else 'no'}")
    c.text(
        "user.txt",
        "this user and its groups (render/video open /dev/kfd and /dev/dri)",
        "os.getgroups(), the group database",
        "\n".join(lines) + "\n",
    )


def _kfd(c: Capture, roots: Roots) -> None:
    if not roots.kfd.is_dir():
        c.put(
            Entry(
                "kfd/",
                "the KFD topology",
                str(roots.kfd),
                "absent",
                note="no KFD: the amdgpu driver is not loaded, or no AMD GPU",
            ),
            b"",
        )
        return
    for name in ("generation_id", "system_properties"):
        c.copy(f"kfd/{name}", f"the KFD topology's {name}", roots.kfd / name)
    nodes = sorted((n for n in _listing(roots.kfd / "nodes") if n.name.isdigit()), key=lambda n: int(n.name))
    for node in nodes[:MAX_NODES]:
        for name in ("name", "gpu_id", "properties"):
            c.copy(f"kfd/nodes/{node.name}/{name}", f"KFD node {node.name}'s {name}", node / name)


def _tools(c: Capture, roots: Roots) -> None:
    c.copy("rocm-version.txt", "the installed ROCm's version", roots.rocm / ".info" / "version")
    runtime = sorted(
        p.name
        for pattern in ("libamdhip64.so*", "libhsa-runtime64.so*")
        for p in (roots.rocm / "lib").glob(pattern)
    )
    c.text(
        "rocm-runtime.txt",
        "the ROCm runtime libraries installed",
        f"{roots.rocm}/lib",
        "\n".join(runtime) + "\n"
        if runtime
        else f"no libamdhip64 / libhsa-runtime64 under {roots.rocm}/lib\n",
    )
    for name, what, argv in TOOLS:
        c.run(name, what, argv)
    c.run(
        "dmesg.txt",
        "the kernel's lines about amdgpu, kfd and nvidia",
        ["dmesg"],
        keep=r"amdgpu|kfd|KFD|nvidia|NVRM",
    )


def _torch(c: Capture, probe_args: Sequence[str]) -> None:
    """The probe and torch, each in an interpreter of this venv (a broken ROCm torch may hang
    or crash on import: bounded, apart from this process); JSON on stdout, stderr beside it."""
    python = sys.executable
    args = ["probe", "--json", "--no-dial", *probe_args]
    probe = [python, "-c", "from flodl_agent.cli.main import main; main()", *args]
    what = "fdl probe --json --no-dial: the findings and the facts"
    c.run("probe.json", what, probe, TORCH_TIMEOUT, apart=True, shown=" ".join(["fdl", *args]))
    what = "this venv's torch build: version, CUDA/HIP, arch flags, NCCL"
    build = [python, "-c", FACTS]
    c.run("torch.json", what, build, TORCH_TIMEOUT, apart=True, shown=f"{python} (its torch build)")
    what = "torch's GPU runtime started: the devices it sees, or its error"
    runtime = [python, "-c", RUNTIME]
    c.run("torch-runtime.txt", what, runtime, TORCH_TIMEOUT, shown=f"{python} (torch.cuda)")


# --- the whole ------------------------------------------------------------------------


def capture(
    dest: Path,
    roots: Roots = Roots(),
    env: Mapping[str, str] | None = None,
    timeout: float = TIMEOUT,
    max_bytes: int = MAX_BYTES,
    probe_args: Sequence[str] = (),
) -> tuple[Path, dict[str, Any]]:
    """Write the capture at ``dest``: a new (or empty) directory, or a file ending .tar.gz or
    .tgz; returns it and the index."""
    env = dict(os.environ if env is None else env)
    tarball = dest.name.endswith((".tar.gz", ".tgz"))
    where = Path(tempfile.mkdtemp(prefix=".capture.", dir=dest.parent)) if tarball else dest
    where.mkdir(parents=True, exist_ok=True)
    tools = tool_env(env)
    # rocminfo lives in ROCm's bin, modinfo and dmesg in sbin: found when PATH lacks them
    tools["PATH"] = os.pathsep.join(
        [env.get("PATH", os.defpath), str(roots.rocm / "bin"), "/usr/sbin", "/sbin"]
    )
    c = Capture(where, tools, timeout, max_bytes)
    started = time.time()
    try:
        c.text(
            "env.txt",
            "the GPU stack's environment variables (credential-like ones redacted)",
            "the environment",
            gpu_env(env),
        )
        _system(c, roots)
        _user(c)
        _devices(c, roots)
        _modules(c, roots)
        _kfd(c, roots)
        _tools(c, roots)
        _torch(c, probe_args)
        index: dict[str, Any] = {
            "format": 1,
            "host": socket.gethostname(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "seconds": round(time.time() - started, 1),
            "fdl": __version__,
            "python": sys.executable,
            "timeout_s": timeout,
            "max_bytes": max_bytes,
            "files": [asdict(e) for e in c.entries],
        }
        (where / "index.json").write_text(json.dumps(index, indent=2) + "\n")
        (where / "README.txt").write_text(readme(index, c.entries))
        if tarball:
            stem = dest.name.removesuffix(".tar.gz").removesuffix(".tgz")
            with tarfile.open(dest, "w:gz") as archive:
                archive.add(where, arcname=stem)
    finally:
        if tarball:
            shutil.rmtree(where, ignore_errors=True)
    return dest, index


# --- small readers ---------------------------------------------------------------------


def _read(path: Path) -> str:
    with contextlib.suppress(OSError, UnicodeDecodeError):
        return path.read_text()[:4096].replace("\0", " ").strip()
    return ""


def _listing(path: Path) -> list[Path]:
    with contextlib.suppress(OSError):
        return sorted(path.iterdir())
    return []


def _user_name(uid: int) -> str:
    with contextlib.suppress(KeyError):
        return pwd.getpwuid(uid).pw_name
    return str(uid)


def _group_name(gid: int) -> str:
    with contextlib.suppress(KeyError):
        return grp.getgrgid(gid).gr_name
    return str(gid)

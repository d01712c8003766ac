"""GPU discovery, once for the agent and ``fdl probe``: what this box's GPUs are.

Two sources: the vendor tools and sysfs (``nvidia-smi``, ``rocm-smi``, the KFD
topology: no GPU runtime is loaded) and torch (what the build ships kernels for,
which cards it can use). The parsers are pure; the readers below them are thin.

One spelling of an architecture everywhere: torch's ``get_arch_list`` one, ``sm_80``
for NVIDIA and the bare target name, ``gfx90a``, for AMD. The collection's
``gpu_facts`` module keeps its own copy of the tool parsers (it runs where this
package is not installed); tests/unit/test_collection.py holds the two to the same answers.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

KFD_NODES = Path("/sys/class/kfd/kfd/topology/nodes")  # AMD GPUs, readable with no ROCm runtime
NVIDIA_SMI = [
    "nvidia-smi",
    "--query-gpu=index,name,memory.total,compute_cap",
    "--format=csv,noheader,nounits",
]
ROCM_SMI = ["rocm-smi", "--showproductname", "--showmeminfo", "vram", "--json"]


@dataclass(frozen=True)
class Gpu:
    """One GPU as its vendor tool lists it."""

    index: int
    vendor: str  # nvidia | amd
    name: str
    arch: str  # sm_80, gfx90a; "" when the tool does not say
    memory_mib: int | None = None


@dataclass(frozen=True)
class Card:
    """One GPU torch can use (or one the probe's tools list), by its index."""

    index: int
    name: str
    arch: str


@dataclass
class AmdAccess:
    """What decides whether this user reaches the box's AMD GPUs, read with no ROCm runtime
    loaded: the KFD topology's GPUs, /dev/kfd and the DRM render nodes (``ok``, ``missing``
    or why they do not open), the groups involved, and what ROCm userspace is installed."""

    gpus: list[str] = field(default_factory=list)  # the KFD topology's gfx targets; [] for no AMD GPU
    kfd: str = ""  # /dev/kfd: "ok", "missing" or the open's error ("Permission denied")
    render: dict[str, str] = field(default_factory=dict)  # renderD128 -> "ok" | why not
    owners: dict[str, str] = field(default_factory=dict)  # device path -> the group owning it
    user: str = ""
    groups: list[str] = field(default_factory=list)  # this process's groups (what access checks)
    listed: list[str] = field(default_factory=list)  # groups the group database lists the user in
    runtime: list[str] = field(default_factory=list)  # ROCm userspace found: libamdhip64, rocminfo
    container: str = ""  # "podman" or "docker" when this runs in a container


@dataclass
class Torch:
    """What the torch build in this environment is (``fdl probe --json`` reports it as is)."""

    version: str = ""
    error: str = ""  # why it does not import
    cuda: str = ""  # the CUDA it was built for ("" for CPU and ROCm builds)
    hip: str = ""
    usable_gpus: int = 0
    nccl: str = ""
    gloo: bool = False
    archs: list[str] = field(default_factory=list)  # the build's kernels (sm_90, compute_90, gfx942)
    libc: str = ""  # this box's C library, as confstr says ("glibc 2.36")


# --- the pure part --------------------------------------------------------------


def cuda_arch(major: int, minor: int) -> str:
    """A compute capability (8, 6) as torch spells its arch: sm_86."""
    return f"sm_{major}{minor}"


def compute_cap_arch(text: str) -> str:
    """nvidia-smi's compute_cap ("8.0") as an arch (sm_80); "" for anything else ("[N/A]")."""
    m = re.fullmatch(r"(\d+)\.(\d+)", text.strip())
    return cuda_arch(int(m.group(1)), int(m.group(2))) if m else ""


def amd_arch(text: str) -> str:
    """A gfx target without its feature flags: gfx90a:sramecc+:xnack- is gfx90a."""
    return text.strip().split(":")[0]


def gfx_name(target_version: int) -> str:
    """KFD's gfx_target_version (90402) as the target's name (gfx942); 90010 is gfx90a."""
    major, minor, stepping = target_version // 10000, target_version // 100 % 100, target_version % 100
    return f"gfx{major}{minor:x}{stepping:x}"


def parse_nvidia(text: str) -> list[Gpu]:
    """``NVIDIA_SMI``'s CSV: index, name, memory.total (MiB), compute_cap."""
    gpus = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4 or not parts[0].isdigit():
            continue  # "No devices were found", a warning line
        memory = parts[-2]
        gpus.append(
            Gpu(
                index=int(parts[0]),
                vendor="nvidia",
                name=", ".join(parts[1:-2]),  # a name may hold a comma; the other columns never do
                arch=compute_cap_arch(parts[-1]),
                memory_mib=int(float(memory)) if re.fullmatch(r"[0-9.]+", memory) else None,
            )
        )
    return gpus


def parse_rocm(text: str) -> list[Gpu]:
    """``ROCM_SMI``'s JSON: one ``cardN`` object per GPU (its key spellings vary by release)."""
    try:
        data = json.loads(text)
    except ValueError:
        return []
    if not isinstance(data, dict):
        return []
    gpus = []
    for card, info in data.items():
        m = re.fullmatch(r"card(\d+)", card)
        if not m or not isinstance(info, dict):
            continue
        name = info.get("Card Series") or info.get("Card series") or info.get("Card model") or ""
        memory = str(info.get("VRAM Total Memory (B)"))
        gpus.append(
            Gpu(
                index=int(m.group(1)),
                vendor="amd",
                name=str(name),
                arch=amd_arch(str(info.get("GFX Version") or "")),
                memory_mib=int(memory) // (1024 * 1024) if memory.isdigit() else None,
            )
        )
    return sorted(gpus, key=lambda g: g.index)


def parse_kfd(nodes: Mapping[str, str]) -> list[str]:
    """The gfx target of each GPU node of the KFD topology (node name -> its properties file),
    in node order; CPU nodes have version 0."""
    found: list[tuple[int, str]] = []
    for node, properties in nodes.items():
        if not node.isdigit():
            continue
        props = dict(parts for line in properties.splitlines() if len(parts := line.split()) == 2)
        version = int(props.get("gfx_target_version", "0") or 0)
        if version:
            found.append((int(node), gfx_name(version)))
    return [arch for _, arch in sorted(found)]


def by_vendor(gpus: list[Gpu], kfd: list[str]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(vendor -> names, vendor -> archs), in the same order. AMD archs come from the KFD
    topology (there with no ROCm installed); rocm-smi's names are used when they line up."""
    names: dict[str, list[str]] = {}
    archs: dict[str, list[str]] = {}
    nvidia = [g for g in gpus if g.vendor == "nvidia"]
    if nvidia:
        names["nvidia"] = [g.name for g in nvidia]
        archs["nvidia"] = [g.arch or "?" for g in nvidia]
    amd = [g.name for g in gpus if g.vendor == "amd"]
    if kfd or amd:
        names["amd"] = amd if len(amd) == len(kfd) or not kfd else [f"AMD {a}" for a in kfd]
        archs["amd"] = list(kfd)
    return names, archs


# --- the IO shell ---------------------------------------------------------------


TOOL_OUTPUT_MAX = 1 << 20  # a vendor tool's listing of a box's GPUs is kilobytes


def tool_output(argv: list[str], timeout: float = 20.0) -> str:
    """A vendor tool's stdout; "" when it is absent or fails (a box without that vendor)."""
    # Here, as torch below: the offer's pure gate imports this module's types.
    from .capture_files import bounded_run

    if shutil.which(argv[0]) is None:
        return ""
    # In a session of its own: cut, a hung tool goes with every child it started, so none of
    # them holds the pipe open past the timeout (subprocess.run would wait on it).
    ran = bounded_run(argv, os.environ, timeout, TOOL_OUTPUT_MAX, apart=True)
    return ran.out.decode(errors="replace") if ran.code == 0 and not ran.cut else ""


def kfd_archs(root: Path = KFD_NODES) -> list[str]:
    nodes: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for node in root.iterdir():
            if node.name.isdigit():
                nodes[node.name] = (node / "properties").read_text()
    return parse_kfd(nodes)


# Where a ROCm userspace runtime lives (relative to the root): AMD's packages, then the distributions'.
ROCM_LIBS = ("opt/rocm*/lib", "usr/lib/x86_64-linux-gnu", "usr/lib64", "usr/lib", "usr/local/lib")


def _opens(path: Path) -> str:
    """Whether this process can open ``path`` read-write, as the ROCm runtime does: "ok",
    "missing", or the error."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    return "ok"


def _group(gid: int) -> str:
    import grp

    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def rocm_runtime(root: Path = Path("/"), path: str | None = None) -> list[str]:
    """The ROCm userspace on this box: libamdhip64 where the packages put it, and rocminfo."""
    found = [str(lib) for pattern in ROCM_LIBS for lib in sorted(root.glob(f"{pattern}/libamdhip64.so*"))]
    tool = shutil.which("rocminfo", path=path) or next(
        iter(sorted(root.glob("opt/rocm*/bin/rocminfo"))), None
    )
    return found[:1] + ([str(tool)] if tool else [])


def amd_access(root: Path = Path("/"), path: str | None = None) -> AmdAccess:
    """:class:`AmdAccess` under ``root`` (the KFD topology, /dev, the libraries, the container
    markers); ``path`` is the PATH searched for rocminfo (None: this process's)."""
    import grp
    import pwd

    access = AmdAccess(gpus=kfd_archs(root / KFD_NODES.relative_to("/")))
    if not access.gpus:
        return access  # no AMD GPU: nothing to reach
    with contextlib.suppress(KeyError):
        access.user = pwd.getpwuid(os.getuid()).pw_name
    access.groups = sorted({_group(g) for g in {os.getgid(), *os.getgroups()}})
    with contextlib.suppress(OSError):
        access.listed = sorted(g.gr_name for g in grp.getgrall() if access.user in g.gr_mem)
    dev = root / "dev"
    access.kfd = _opens(dev / "kfd")
    access.render = {node.name: _opens(node) for node in sorted((dev / "dri").glob("renderD*"))}
    for node in [dev / "kfd", *sorted((dev / "dri").glob("renderD*"))]:
        with contextlib.suppress(OSError):
            access.owners[f"/dev/{node.relative_to(dev)}"] = _group(node.stat().st_gid)
    access.runtime = rocm_runtime(root, path)
    if (root / "run/.containerenv").exists():
        access.container = "podman"
    elif (root / ".dockerenv").exists():
        access.container = "docker"
    return access


def discover(kfd: Path = KFD_NODES) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(vendor -> names, vendor -> archs) from the vendor tools and sysfs."""
    gpus = parse_nvidia(tool_output(NVIDIA_SMI)) + parse_rocm(tool_output(ROCM_SMI))
    return by_vendor(gpus, kfd_archs(kfd))


def read_torch() -> Torch:
    """The torch build, read without touching a device."""
    try:
        import torch
        import torch.distributed as dist
    except Exception as exc:  # an ImportError, or a broken install's OSError
        return Torch(error=f"{type(exc).__name__}: {exc}", libc=_libc())
    t = Torch(
        version=str(torch.__version__),
        cuda=torch.version.cuda or "",
        hip=getattr(torch.version, "hip", None) or "",
        gloo=bool(dist.is_available() and dist.is_gloo_available()),
        libc=_libc(),
    )
    with contextlib.suppress(Exception):  # read from the build: no device is touched
        t.archs = str(torch._C._cuda_getArchFlags() or "").split()
    with contextlib.suppress(Exception):
        t.usable_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if t.cuda or t.hip:
        with contextlib.suppress(Exception):
            version = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
            t.nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return t


def read_cards(count: int) -> list[Card]:
    """The first ``count`` cards torch can use, with their names and archs."""
    if count == 0:
        return []
    import torch

    hip = bool(getattr(torch.version, "hip", None))
    cards = []
    for i in range(count):
        if hip:
            arch = amd_arch(str(torch.cuda.get_device_properties(i).gcnArchName))
        else:
            arch = cuda_arch(*torch.cuda.get_device_capability(i))
        cards.append(Card(i, torch.cuda.get_device_name(i), arch))
    return cards


def _libc() -> str:
    with contextlib.suppress(ValueError, OSError):
        return os.confstr("CS_GNU_LIBC_VERSION") or ""
    return ""

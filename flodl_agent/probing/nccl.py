"""`fdl nccl pin`: one NCCL across a fleet whose torch builds load different ones.

The Python world's counterpart of building NCCL from source: PyPI carries
NCCL itself as ``nvidia-nccl-cu<major>`` wheels, and pip's torch loads
``libnccl.so.2`` from that package's directory. Pinning installs the wanted
version into the variant's venv (``--no-deps``: torch's own pin would
otherwise pull it back) and prints the ``join.env`` entry that puts the
library first for torch builds that do not look there by themselves. The
admission check then sees one NCCL major.minor in every hello.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import Failure

VERSION = re.compile(r"^\d+\.\d+\.\d+(\.\d+)?$")
PROBE = """
import json, pathlib
out = {"cuda": "", "torch": ""}
try:
    import torch
    out["torch"], out["cuda"] = torch.__version__, torch.version.cuda or ""
except Exception:
    pass
try:
    import importlib.metadata as md, nvidia.nccl
    lib = pathlib.Path(list(nvidia.nccl.__path__)[0]) / "lib" / "libnccl.so.2"
    out["lib"] = str(lib) if lib.exists() else ""
    out["installed"] = {d.metadata["Name"]: d.version for d in md.distributions()
                        if (d.metadata["Name"] or "").lower().startswith("nvidia-nccl")}
except Exception:
    out["lib"], out["installed"] = "", {}
print(json.dumps(out))
"""


class NcclError(Failure):
    pass


@dataclass(frozen=True)
class Pin:
    package: str
    version: str
    lib: str  # libnccl.so.2 as installed
    env: dict[str, str]  # what join.env should carry


def package_for(cuda: str) -> str:
    """``12.6`` -> ``nvidia-nccl-cu12`` (the wheels are per CUDA major)."""
    major = cuda.split(".")[0]
    if not major.isdigit():
        raise NcclError(f"`{cuda}` is not a CUDA version", "pass --cuda 12 (or the major of this box's CUDA)")
    return f"nvidia-nccl-cu{major}"


def probe(python: Path) -> dict[str, object]:
    """What the venv's interpreter says about its torch and its NCCL wheel."""
    try:
        proc = subprocess.run(
            [str(python), "-c", PROBE], capture_output=True, text=True, timeout=120, check=False
        )
    except FileNotFoundError:
        raise NcclError(f"{python} does not exist", "point --venv at the variant's virtualenv") from None
    if proc.returncode != 0:
        raise NcclError(
            f"{python} cannot run: {proc.stderr.strip()[-300:]}", "point --venv at a working virtualenv"
        )
    result: dict[str, object] = json.loads(proc.stdout)
    return result


def pin(version: str, venv: Path, cuda: str | None = None, find_links: Path | None = None) -> Pin:
    """Install ``nvidia-nccl-cu<major>==version`` into ``venv``; what to wire into join.env."""
    if not VERSION.match(version):
        raise NcclError(f"`{version}` is not an NCCL version", "write it as major.minor.patch, e.g. 2.21.5")
    python = venv / "bin" / "python"
    facts = probe(python)
    if cuda is None:
        cuda = str(facts.get("cuda") or "")
        if not cuda:
            raise NcclError(
                f"the torch in {venv} is a CPU build (or missing): NCCL does not apply to it",
                "pin on the CUDA variant's venv (libtorch: auto on a GPU box), or pass --cuda",
            )
    package = package_for(cuda)
    argv = [str(python), "-m", "pip", "install", "--quiet", "--no-deps", f"{package}=={version}"]
    if find_links is not None:
        argv[5:5] = ["--no-index", "--find-links", str(find_links)]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        last = " / ".join(proc.stderr.strip().splitlines()[-2:])
        raise NcclError(
            f"installing {package}=={version} failed: {last}",
            "check the version exists for this CUDA major (pip index versions " + package + ")",
        )
    after = probe(python)
    installed = after.get("installed")
    lib = str(after.get("lib") or "")
    if not isinstance(installed, dict) or installed.get(package) != version or not lib:
        raise NcclError(
            f"{package} {version} did not land in {venv} (found {installed or 'nothing'})",
            "install it by hand to see pip's reason",
        )
    return Pin(package, version, lib, {"LD_LIBRARY_PATH": str(Path(lib).parent)})

"""Torch variants without a download: variant venvs, a stand-in nvidia-smi, and wheelhouses.

A variant venv is a real venv of this interpreter that sees this checkout's site-packages
(its CPU torch, its flodl-fleet) through a .pth line: the roles' venvs without the download.
A wheelhouse holds real wheels, written here: a stand-in torch that says it is the build
a test names (a CUDA or ROCm torch cannot run on a box without the card) and flodl-fleet at
the running version, so pip, venv and the acquisition's checks run for real and offline.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path

FDL = Path(sys.executable).parent / "fdl"


def run_fdl(
    cwd: Path, env: dict[str, str], *args: str, stdin: str = "", timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """This venv's `fdl ARGS` in ``cwd`` with exactly ``env``."""
    return subprocess.run(
        [str(FDL), *args], input=stdin, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def variant_venv(root: Path, name: str, with_torch: bool = True) -> Path:
    """A venv at <root>/<name>; with torch: this checkout's site-packages, and a bin/fdl that
    says which interpreter it runs in."""
    where = root / name
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=60)
    if with_torch:
        site = next(where.glob("lib/python3*/site-packages"))
        (site / "_checkout.pth").write_text(
            f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n"
        )
        fdl = where / "bin" / "fdl"
        fdl.write_text(
            f"#!{where}/bin/python\n"
            "import sys\n"
            "sys.stderr.write(f'fdl running in {sys.prefix}\\n')\n"
            "from flodl_agent.cli.main import main\n"
            "sys.exit(main())\n"
        )
        fdl.chmod(0o755)
    return where


NVIDIA_SMI = """#!/bin/sh
case "$1" in
  --query-gpu=*) echo "0, NVIDIA H200, 143771, 9.0" ;;
  *) echo "| NVIDIA-SMI 570.86.15   Driver Version: 570.86.15   CUDA Version: 12.8 |" ;;
esac
"""


def stand_in_nvidia_smi(where: Path) -> Path:
    """A directory holding an nvidia-smi that answers as an H200 with driver CUDA 12.8."""
    tools = where / "tools"
    tools.mkdir()
    (tools / "nvidia-smi").write_text(NVIDIA_SMI)
    (tools / "nvidia-smi").chmod(0o755)
    return tools


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def wheel(where: Path, name: str, version: str, files: dict[str, str], entry_points: str = "") -> Path:
    """A pure-Python wheel of ``files`` (path in site-packages -> text) in ``where``."""
    dist = f"{name.replace('-', '_')}-{version}"
    info = f"{dist}.dist-info"
    members = dict(files)
    members[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    members[f"{info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    if entry_points:
        members[f"{info}/entry_points.txt"] = entry_points
    record = [f"{path},{_record_hash(text.encode())},{len(text.encode())}" for path, text in members.items()]
    members[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    where.mkdir(parents=True, exist_ok=True)
    target = where / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(target, "w") as archive:
        for path, text in members.items():
            archive.writestr(path, text)
    return target


def stand_in_torch(
    where: Path, version: str, cuda: str = "", hip: str = "", archs: str = "", nccl: str = ""
) -> Path:
    """A torch wheel whose build facts are the ones given (what a variant's interpreter reads)."""
    nccl_version = tuple(int(p) for p in nccl.split(".")) if nccl else None
    init = (
        f"__version__ = {version!r}\n"
        f"class version:\n    cuda = {cuda or None!r}\n    hip = {hip or None!r}\n"
        f"class _C:\n    @staticmethod\n    def _cuda_getArchFlags():\n        return {archs!r}\n"
        "class cuda:\n    class nccl:\n        @staticmethod\n        def version():\n"
        f"            if {nccl_version!r} is None:\n                raise RuntimeError('no NCCL')\n"
        f"            return {nccl_version!r}\n"
    )
    return wheel(where, "torch", version, {"torch/__init__.py": init})


def fleet_wheel(where: Path) -> Path:
    """flodl-fleet at the running version, with its fdl console script (what a variant needs
    to run the agent; the acquisition installs it from the wheelhouse when it is there)."""
    return wheel(
        where,
        "flodl-fleet",
        metadata.version("flodl-fleet"),
        {"flodl_agent_stand_in/__init__.py": ""},
        "[console_scripts]\nfdl = flodl_agent.cli.main:main\n",
    )


def fdl_env(root: Path, home: Path, tools: Path | None = None) -> dict[str, str]:
    """The environment of an `fdl` run on a box whose libtorch root is ``root``: this
    checkout's code (PYTHONPATH passed on), pip with no config of this machine's."""
    path = f"{tools}:{FDL.parent}:/usr/bin:/bin" if tools else f"{FDL.parent}:/usr/bin:/bin"
    env = {
        "FLODL_LIBTORCH_ROOT": str(root),
        "PATH": path,
        "HOME": str(home),
        "PIP_CONFIG_FILE": os.devnull,  # this machine's pip.conf adds a wheelhouse
        "PIP_RETRIES": "0",
    }
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env

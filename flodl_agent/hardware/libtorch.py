"""``join.libtorch`` at join: read the venvs and the cards, acquire a variant, re-exec into it.

The IO shell around :mod:`flodl_agent.hardware.variants`: each venv's torch is read by
running its own interpreter, the cards by the vendor tools and sysfs (never
torch: a CPU build sees no GPU), and a missing variant is acquired with venv and
pip into a hidden directory beside its place, renamed into place only once its
torch imports, so a killed acquire never leaves a half venv that looks installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import NoReturn
from urllib.parse import unquote, urlsplit

from ..retry import Permanent
from .gpus import NVIDIA_SMI, Gpu, Torch, kfd_archs, parse_nvidia, tool_output
from .variants import (
    CHOSEN_ENV,
    FACTS,
    FLEET,
    BoxGpus,
    Choice,
    Venv,
    choose,
    fleet_argv,
    is_index,
    libtorch_root,
    parse_driver_cuda,
    parse_facts,
    pip_failure,
    source_for,
    torch_argv,
)

ROCM_VERSION = Path("/opt/rocm/.info/version")
FACTS_TIMEOUT = 120.0  # a cold torch import on a slow disk
VENV_TIMEOUT = 300.0
PIP_TIMEOUT = 3600.0  # a CUDA torch is gigabytes


def root() -> Path:
    return libtorch_root(Path(sys.prefix), os.environ, Path.home())


def read_venv(path: Path, name: str | None = None) -> Venv:
    """One venv's torch, read by its own interpreter; a failure is reported in the facts."""
    python = path / "bin" / "python"
    try:
        proc = subprocess.run(
            [str(python), "-c", FACTS], capture_output=True, text=True, timeout=FACTS_TIMEOUT, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        torch = Torch(error=f"{python} does not run ({type(exc).__name__}: {exc})")
    else:
        if proc.returncode == 0:
            torch = parse_facts(proc.stdout)
        else:
            torch = Torch(error=f"{python} exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return Venv(name or path.name, path, torch, (path / "bin" / "fdl").exists())


def installed(where: Path, only: str | None = None) -> list[Venv]:
    """Each ``<where>/<variant>/bin/python`` with its torch (hidden directories are acquisitions
    under way); ``only``: that variant's alone (each read starts an interpreter that imports torch)."""
    with contextlib.suppress(OSError):
        return [
            read_venv(d)
            for d in sorted(where.iterdir())
            if not d.name.startswith(".")
            and (only is None or d.name == only)
            and (d / "bin" / "python").exists()
        ]
    return []


def box_gpus(kfd: Path | None = None) -> BoxGpus:
    """The cards as nvidia-smi and the KFD topology list them, the driver's CUDA, the ROCm."""
    gpus = parse_nvidia(tool_output(NVIDIA_SMI))
    amd = kfd_archs() if kfd is None else kfd_archs(kfd)
    gpus += [Gpu(index=i, vendor="amd", name=f"AMD {arch}", arch=arch) for i, arch in enumerate(amd)]
    driver = parse_driver_cuda(tool_output(["nvidia-smi"])) if any(g.vendor == "nvidia" for g in gpus) else ""
    rocm = ""
    if amd:
        with contextlib.suppress(OSError):
            rocm = ROCM_VERSION.read_text()
    return BoxGpus(gpus, driver, rocm)


def running_fleet() -> tuple[str, str]:
    """The running flodl-fleet's version, and its project directory when it is a development
    (editable) install ("" otherwise; "?" when that directory cannot be found)."""
    try:
        dist = metadata.distribution(FLEET)
    except metadata.PackageNotFoundError:
        return "", "?"
    project = ""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
        if direct.get("dir_info", {}).get("editable"):
            url = urlsplit(str(direct.get("url", "")))
            where = Path(unquote(url.path))
            project = str(where) if url.scheme == "file" and (where / "pyproject.toml").is_file() else "?"
    return dist.version, project


def _run(argv: list[str], timeout: float) -> tuple[int, str]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:.0f} s"
    except OSError as exc:
        return 127, str(exc)
    return proc.returncode, proc.stdout + proc.stderr


def relocate(venv: Path, old: Path, new: Path) -> None:
    """Point the scripts pip wrote (``#!<old>/bin/python``) at the venv's final place."""
    before, after = str(old).encode(), str(new).encode()
    for item in [*(venv / "bin").iterdir(), venv / "pyvenv.cfg"]:
        if item.is_file() and not item.is_symlink():
            data = item.read_bytes()
            if before in data:
                item.write_bytes(data.replace(before, after))


def acquire(variant: str, where: Path, source: str, log: Callable[[str], None]) -> Path:
    """Install ``variant`` as ``<where>/<variant>``: a venv with torch from ``source`` and
    flodl-fleet at the running version, renamed into place only when its torch imports."""
    final = where / variant
    if final.exists():
        raise Permanent(
            f"libtorch {variant}: {final} is there but is not a working venv",
            f"remove {final} so join acquires {variant} again",
        )
    version, project = running_fleet()
    wheels = f"{FLEET.replace('-', '_')}-{version}*"
    has_fleet = bool(version) and not is_index(source) and any(Path(source).glob(wheels))
    if not has_fleet and (not version or project == "?"):
        raise Permanent(
            f"libtorch {variant}: this fdl is not an installed release (a development tree), so the "
            "new venv cannot get the same flodl-fleet",
            f"acquisition needs a wheelhouse with flodl-fleet: put its wheel beside torch's and set "
            f"join.torch_sources.{variant} to that directory, or install {variant} under {where}",
        )
    _sweep(where, variant)
    try:
        where.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{variant}.", suffix=".partial", dir=where))
    except OSError as exc:
        raise Permanent(
            f"libtorch {variant}: cannot create a venv under {where} ({exc.strerror or exc})",
            f"give the service user write access to {where}, or set FLODL_LIBTORCH_ROOT",
        ) from None
    try:
        code, output = _run([sys.executable, "-m", "venv", str(tmp)], VENV_TIMEOUT)
        if code != 0:
            raise Permanent(
                f"libtorch {variant}: `python -m venv` failed ({output.strip()[-300:]})",
                "install the venv module (apt-get install python3-venv)",
            )
        with contextlib.suppress(OSError):  # the running venv's pip settings (its index, a proxy)
            shutil.copy(Path(sys.prefix) / "pip.conf", tmp / "pip.conf")
        python = tmp / "bin" / "python"
        log(f"libtorch {variant}: pip install torch from {source}")
        code, output = _run(torch_argv(python, source), PIP_TIMEOUT)
        if code != 0:
            raise pip_failure("torch", variant, source, output)
        what = f"{FLEET}=={version}" if has_fleet or not project else project
        log(f"libtorch {variant}: pip install {what}")
        code, output = _run(fleet_argv(python, version, source, has_fleet, project), PIP_TIMEOUT)
        if code != 0:
            raise pip_failure(what, variant, source if has_fleet else "pip's index", output)
        facts = read_venv(tmp, variant)
        if facts.problem:
            raise Permanent(
                f"libtorch {variant}: the torch installed from {source} does not run: {facts.problem}",
                f"check what {source} serves for {variant}",
            )
        if facts.variant != variant:
            raise Permanent(
                f"libtorch {variant}: {source} served torch {facts.torch.version}, a {facts.variant} build",
                f"point join.torch_sources.{variant} at an index or wheelhouse with {variant} wheels",
            )
        relocate(tmp, tmp, final)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; a failure's leftovers otherwise
    log(f"libtorch {variant}: installed at {final}")
    return final


def _sweep(where: Path, variant: str) -> None:
    """Remove what a killed acquisition of ``variant`` left (older than any live one can be)."""
    with contextlib.suppress(OSError):
        for stale in where.glob(f".{variant}.*.partial"):
            if time.time() - stale.stat().st_mtime > PIP_TIMEOUT + VENV_TIMEOUT:
                shutil.rmtree(stale, ignore_errors=True)


@dataclass(frozen=True)
class Survey:
    """What a choice is made over: the root, the venvs read under it, the running venv, the cards."""

    root: Path
    venvs: list[Venv]
    running: Venv
    box: BoxGpus

    def choose(self, wanted: str, sources: Mapping[str, str]) -> Choice:
        return choose(wanted, self.venvs, self.box, self.running, sources, self.root)


def survey(wanted: str = "auto", cpu_offer: bool = False) -> Survey:
    """Read what ``wanted`` is chosen over: every venv under the root for ``auto`` (and the
    cards, unless the box offers CPU ranks only), a named variant's own venv alone."""
    where = root()
    venvs = installed(where, None if wanted == "auto" else wanted)  # a named variant needs its own venv only
    prefix = Path(sys.prefix)
    running = next((v for v in venvs if _same(v.path, prefix)), None)
    if running is None:
        # A named variant found installed never looks at the running venv: spare a torch import.
        running = read_venv(prefix) if wanted == "auto" or not venvs else Venv(prefix.name, prefix, Torch())
    running = Venv(running.name, running.path, running.torch, fdl=True)
    box = box_gpus() if wanted == "auto" and not cpu_offer else BoxGpus()
    return Survey(where, venvs, running, box)


def settle(
    wanted: str, sources: Mapping[str, str], log: Callable[[str], None], cpu_offer: bool = False
) -> tuple[str, Path] | None:
    """The variant and venv this join must run in (acquired first when missing), or None to stay.
    ``cpu_offer``: the box offers CPU ranks only, so ``auto`` looks at no card."""
    if os.environ.get(CHOSEN_ENV):
        return None  # the agent this process was exec'd from chose already
    found = survey(wanted, cpu_offer)
    for venv in found.venvs:
        if venv.problem:
            log(f"libtorch: skipping {venv.path}: {venv.problem}")
    choice = found.choose(wanted, sources)
    log(f"libtorch {wanted}: {choice.reason}")
    path = choice.venv or acquire(choice.variant, found.root, source_for(choice.variant, sources), log)
    return None if _same(path, Path(sys.prefix)) else (choice.variant, path)


def _same(a: Path, b: Path) -> bool:
    with contextlib.suppress(OSError):
        return a.resolve() == b.resolve()
    return a == b


def reexec(venv: Path, argv: list[str], variant: str) -> NoReturn:
    """Become ``<venv>/bin/fdl`` with the same arguments; the mark stops it choosing again."""
    fdl = venv / "bin" / "fdl"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(fdl, [str(fdl), *argv[1:]], {**os.environ, CHOSEN_ENV: variant})
    except OSError as exc:
        raise Permanent(
            f"libtorch {variant}: cannot run {fdl} ({exc.strerror or exc})",
            f"install flodl-fleet into {venv}, or remove {venv} so join acquires it again",
        ) from None

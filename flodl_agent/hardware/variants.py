"""``join.libtorch``: which torch variant's venv runs this box's agent and ranks (pure).

The variants live side by side, one venv each, under a libtorch root
(``<home>/libtorch/<variant>`` as the worker role lays them out). Given what is
installed, the box's cards (read without torch: a CPU torch sees no GPU) and
the running venv, :func:`choose` names the venv to run, or the variant to
acquire and why. The IO around it (reading the venvs, nvidia-smi, pip, exec) is
:mod:`flodl_agent.hardware.libtorch`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..protocol.messages import vendor_of
from ..retry import AgentFailure, Permanent, Transient
from .gpus import Gpu, Torch
from .offer import covers

CHOSEN_ENV = "FLODL_LIBTORCH_CHOSEN"  # set on the re-exec'd agent: it never chooses again
ROOT_ENV = "FLODL_LIBTORCH_ROOT"
DEFAULT_INDEX = "https://download.pytorch.org/whl"
# The CUDA variants tried by `auto` when join.torch_sources names none (download.pytorch.org's).
KNOWN_CUDA = ("cu118", "cu121", "cu124", "cu126", "cu128", "cu129", "cu130")
FLEET = "flodl-fleet"

# Run by each venv's interpreter: its torch build, read without touching a device.
FACTS = """
import json, os
out = {"version": "", "cuda": "", "hip": "", "archs": [], "nccl": "", "error": ""}
try:
    import torch
    out["version"] = str(torch.__version__)
    out["cuda"] = torch.version.cuda or ""
    out["hip"] = getattr(torch.version, "hip", None) or ""
    try:
        out["archs"] = str(torch._C._cuda_getArchFlags() or "").split()
    except Exception:
        pass
    if out["cuda"] or out["hip"]:
        try:  # the library's version, read without a device
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:
            pass
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Venv:
    """One variant's venv: its directory's name, where it is, its torch, and whether it has fdl."""

    name: str
    path: Path
    torch: Torch
    fdl: bool = True

    @property
    def variant(self) -> str:
        return build_variant(self.torch) if self.torch.version else self.name

    @property
    def problem(self) -> str:
        """Why it cannot run the agent; "" when it can."""
        if not self.torch.version:
            return f"torch does not import ({self.torch.error or 'no torch'})"
        return "" if self.fdl else "flodl-fleet is not installed in it (no bin/fdl)"


@dataclass(frozen=True)
class BoxGpus:
    """This box's cards as the vendor tools list them, the driver's CUDA and the installed ROCm."""

    gpus: list[Gpu] = field(default_factory=list)
    driver_cuda: str = ""  # nvidia-smi's header: "CUDA Version: 12.6"
    rocm: str = ""  # /opt/rocm/.info/version: "6.4.1-120"


@dataclass(frozen=True)
class Choice:
    """The variant to run and why; ``venv`` None: it is not installed and must be acquired."""

    variant: str
    venv: Path | None
    reason: str

    @property
    def acquire(self) -> bool:
        return self.venv is None


# --- facts ---------------------------------------------------------------------------


def build_variant(torch: Torch) -> str:
    """The variant a torch build is: cpu, cu126, rocm6.4."""
    if torch.hip:
        major, minor = [*torch.hip.split("."), "0"][:2]
        return f"rocm{major}.{minor}"
    if torch.cuda:
        return f"cu{torch.cuda.replace('.', '')[:3]}"
    return "cpu"


def vendor(variant: str) -> str:
    return "nvidia" if variant.startswith("cu") else "amd" if variant.startswith("rocm") else "cpu"


def version_key(variant: str) -> tuple[int, ...]:
    """cu126 -> (12, 6), rocm6.4 -> (6, 4), cpu -> (): newest sorts last."""
    if m := re.fullmatch(r"cu(\d+)(\d)", variant):
        return int(m.group(1)), int(m.group(2))
    if m := re.fullmatch(r"rocm(\d+(?:\.\d+)*)", variant):
        return tuple(int(p) for p in m.group(1).split("."))
    return ()


def parse_facts(text: str) -> Torch:
    """:data:`FACTS`' JSON as a :class:`Torch` (an unreadable answer is an error, not a crash)."""
    try:
        data = json.loads(text.strip().splitlines()[-1])
        return Torch(
            version=str(data["version"]),
            cuda=str(data["cuda"]),
            hip=str(data["hip"]),
            archs=[str(a) for a in data["archs"]],
            nccl=str(data.get("nccl", "")),
            error=str(data["error"]),
        )
    except (ValueError, KeyError, IndexError, TypeError):
        return Torch(error=f"its interpreter printed no torch facts ({text.strip()[-200:]!r})")


def parse_driver_cuda(text: str) -> str:
    """The CUDA version in nvidia-smi's header ("CUDA Version: 12.6"); "" when absent."""
    m = re.search(r"CUDA Version\s*:\s*(\d+\.\d+)", text)
    return m.group(1) if m else ""


def rocm_variant(text: str) -> str:
    """/opt/rocm/.info/version ("6.4.1-120") as a variant (rocm6.4); "" when unreadable."""
    m = re.match(r"\s*(\d+)\.(\d+)", text)
    return f"rocm{m.group(1)}.{m.group(2)}" if m else ""


# The roles' home (flodl_worker_home, flodl_controller_home), which holds libtorch/<variant>: where a
# host with an ``arch`` but no ``path`` finds its variant's venv.
ROLE_HOME = "/opt/flodl"


def variant_venv(path: str | None, arch: str) -> str:
    """``<path>/libtorch/<arch>``: a cluster entry's variant venv (the role's home without a path)."""
    return f"{path or ROLE_HOME}/libtorch/{arch}"


def libtorch_root(prefix: Path, env: Mapping[str, str], home: Path) -> Path:
    """$FLODL_LIBTORCH_ROOT; else the directory holding the running venv when it is named
    ``libtorch`` (the role's <home>/libtorch/<variant>); else ~/.flodl/libtorch."""
    if env.get(ROOT_ENV):
        return Path(env[ROOT_ENV])
    if prefix.parent.name == "libtorch":
        return prefix.parent
    return home / ".flodl" / "libtorch"


# --- sources -------------------------------------------------------------------------


def default_source(variant: str) -> str:
    """Where a variant comes from when join.torch_sources does not name it (the role mirrors this)."""
    return f"{DEFAULT_INDEX}/{variant}"


def source_for(variant: str, sources: Mapping[str, str]) -> str:
    return sources.get(variant) or default_source(variant)


def is_index(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def index_args(source: str) -> list[str]:
    """pip's arguments for a source: an index URL (a plain-http one trusted by host), or a
    wheelhouse directory with no index."""
    if not is_index(source):
        return ["--no-index", "--find-links", source]
    args = ["--index-url", source]
    host = urlsplit(source).hostname
    if source.startswith("http://") and host:
        args += ["--trusted-host", host]
    return args


def pip_install(python: Path, *args: str) -> list[str]:
    return [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--no-input", *args]


def torch_argv(python: Path, source: str) -> list[str]:
    return pip_install(python, *index_args(source), "torch")


def fleet_argv(python: Path, version: str, source: str, has_fleet: bool, project: str) -> list[str]:
    """flodl-fleet at the running version: from the wheelhouse when it holds it, else the
    running project's directory (a development install), else from pip's configured index."""
    if has_fleet and not is_index(source):
        return pip_install(python, *index_args(source), f"{FLEET}=={version}")
    if project:
        return pip_install(python, project)
    return pip_install(python, f"{FLEET}=={version}")


# pip's words for "nothing installable there" (a re-try brings no other answer).
_MISSING = (
    "No matching distribution found",
    "Could not find a version that satisfies",
    "ResolutionImpossible",
)


# pip's words for an index it did not reach: its retries, after which it too says "no
# matching distribution" (it found none, having read nothing).
_UNREACHED = (
    "Retrying (Retry(",
    "NewConnectionError",
    "Failed to establish a new connection",
    "Max retries exceeded",
    "Temporary failure in name resolution",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ProxyError",
)


def pip_failure(what: str, variant: str, source: str, output: str) -> AgentFailure:
    """A failed pip install: nothing to install there is permanent, anything else (the network,
    a mirror down) transient."""
    lines = output.strip().splitlines()
    unreached = [line for line in lines if any(m in line for m in _UNREACHED)]
    tail = (unreached[-1] if unreached else " ".join(lines[-3:]))[-400:]
    if any(m in output for m in _MISSING) and not unreached:
        return Permanent(
            f"libtorch {variant}: {what} is not available from {source} ({tail})",
            f"check that {source} serves {variant} for this Python, or point join.torch_sources.{variant} "
            "at an index or wheelhouse that does (libtorch: names another variant)",
        )
    return Transient(
        f"libtorch {variant}: pip could not install {what} from {source} ({tail})",
        "check that this box reaches it (proxy, DNS); the join retries when its service restarts, "
        f"or set join.torch_sources.{variant} to a reachable mirror or a local wheelhouse",
    )


# --- the choice ----------------------------------------------------------------------


def _cards(gpus: Sequence[Gpu]) -> str:
    return ", ".join(f"GPU {g.index} ({g.arch or '?'})" for g in gpus)


def _covers_all(flags: list[str], cards: Sequence[Gpu]) -> bool:
    """No flags: the build does not say (as offer.kernel_gap, nothing to compare)."""
    return not flags or all(covers(flags, g.arch) for g in cards)


def _vendor_cards(box: BoxGpus) -> tuple[str, list[Gpu]]:
    """The vendor whose cards ``auto`` serves (NVIDIA on a box with both) and those cards."""
    kind = "nvidia" if any(g.vendor == "nvidia" for g in box.gpus) else "amd"
    return kind, [g for g in box.gpus if g.vendor == kind]


def _fix(root: Path) -> str:
    return f"set libtorch: cu126 (or rocm6.4, --libtorch) explicitly, or install a covering variant in {root}"


def explicit(wanted: str, installed: Sequence[Venv], running: Venv, root: Path) -> Choice:
    """A named variant: its venv when installed (a broken one is refused), the running venv
    when it is that variant, else the variant to acquire."""
    for v in installed:
        if v.name == wanted:
            if v.problem:
                raise Permanent(
                    f"libtorch {wanted}: the venv at {v.path} cannot run the agent: {v.problem}",
                    f"remove {v.path} so join acquires it again, or reinstall it",
                )
            return Choice(wanted, v.path, f"{wanted} as asked, installed at {v.path}")
    if not running.problem and running.variant == wanted:
        return Choice(wanted, running.path, f"{wanted} as asked: the running venv is {wanted}")
    return Choice(wanted, None, f"{wanted} as asked, not installed under {root}")


def cpu_box(usable: Sequence[Venv], running: Venv) -> Choice:
    """``auto`` with no card: ``cpu``, else the running venv (any torch runs CPU ranks), else
    any working one; with none, acquire ``cpu``."""
    # of equals, the first installed wins
    v = min(usable, key=lambda v: (v.variant != "cpu", v.path != running.path), default=None)
    if v is None:
        return Choice("cpu", None, "a CPU box with no working torch venv")
    why = "a CPU box" if v.variant == "cpu" else f"a CPU box; {v.variant} runs CPU ranks"
    return Choice(v.variant, v.path, why)


def covering(usable: Sequence[Venv], kind: str, cards: Sequence[Gpu], running: Venv) -> Choice | None:
    """The newest installed ``kind`` variant whose kernels cover every card (the running venv
    among equals); None when none does."""
    fits = [v for v in usable if vendor(v.variant) == kind and _covers_all(v.torch.archs, cards)]
    if not fits:
        return None
    best = max(fits, key=lambda v: (version_key(v.variant), v.path == running.path))
    return Choice(best.variant, best.path, f"{best.variant} covers {_cards(cards)}")


def _uncovered(cards: Sequence[Gpu]) -> str:
    return f"no installed variant covers {_cards(cards)}"


def cuda_to_acquire(cards: Sequence[Gpu], driver_cuda: str, sources: Mapping[str, str], root: Path) -> Choice:
    """The newest CUDA variant the driver runs, among join.torch_sources' (else the known ones)."""
    what = _uncovered(cards)
    if not driver_cuda:
        raise Permanent(f"libtorch auto: {what}, and the driver's CUDA version is unknown", _fix(root))
    keys = [k for k in sources if vendor(k) == "nvidia"] or list(KNOWN_CUDA)
    driver = version_key("cu" + driver_cuda.replace(".", ""))
    fits = [k for k in keys if version_key(k) <= driver]
    if not fits:
        raise Permanent(
            f"libtorch auto: {what}, and the driver's CUDA {driver_cuda} is older than every "
            f"known variant ({', '.join(sorted(keys, key=version_key))})",
            "upgrade the NVIDIA driver, or " + _fix(root),
        )
    pick = max(fits, key=version_key)
    return Choice(pick, None, f"{what}; the driver runs CUDA {driver_cuda}: acquiring {pick}")


def rocm_to_acquire(cards: Sequence[Gpu], rocm: str, sources: Mapping[str, str], root: Path) -> Choice:
    """The installed ROCm's variant, else the newest in join.torch_sources."""
    what = _uncovered(cards)
    pick = rocm_variant(rocm) or max((k for k in sources if vendor(k) == "amd"), key=version_key, default="")
    if not pick:
        raise Permanent(
            f"libtorch auto: {what}, and no ROCm version is known (no /opt/rocm/.info/version, "
            "no rocm key in join.torch_sources)",
            _fix(root),
        )
    return Choice(pick, None, f"{what}; ROCm {pick[4:]} on this box: acquiring {pick}")


def choose(
    wanted: str,
    installed: Sequence[Venv],
    box: BoxGpus,
    running: Venv,
    sources: Mapping[str, str] | None = None,
    root: Path = Path("~/.flodl/libtorch"),
) -> Choice:
    """The venv to run for ``wanted`` (auto, cpu, cuNNN, rocmX.Y), or the variant to acquire.

    Explicit: that venv when installed, else acquire it. ``auto``: on a CPU box ``cpu``
    (else the running venv: any torch runs CPU ranks); with cards, the newest installed
    variant of their vendor whose kernels cover every card; else the variant to acquire:
    the newest CUDA one the driver runs, or the installed ROCm's.
    """
    if wanted != "auto":
        return explicit(wanted, installed, running, root)
    # the running venv counts once, whether or not it lives under the root
    candidates = [v for v in installed if v.path != running.path] + [running]
    usable = [v for v in candidates if not v.problem]
    if not box.gpus:
        return cpu_box(usable, running)
    kind, cards = _vendor_cards(box)
    if found := covering(usable, kind, cards, running):
        return found
    if kind == "nvidia":
        return cuda_to_acquire(cards, box.driver_cuda, sources or {}, root)
    return rocm_to_acquire(cards, box.rocm, sources or {}, root)


# --- the listing (`fdl libtorch list`) -----------------------------------------------


def coverage(venv: Venv, box: BoxGpus) -> tuple[bool | None, str]:
    """Whether a venv serves this box's cards as ``auto`` judges it, and in words; None on a
    box with no card (any working torch runs CPU ranks)."""
    if venv.problem:
        return False, venv.problem
    if not box.gpus:
        return None, "CPU ranks (no GPU on this box)"
    kind, cards = _vendor_cards(box)
    if vendor(venv.variant) != kind:
        return False, f"a {venv.variant} build: no kernels for {_cards(cards)}"
    gap = [g for g in cards if not _covers_all(venv.torch.archs, [g])]
    if gap:
        return False, f"no kernel for {_cards(gap)}"
    return True, f"covers {_cards(cards)}"


def listing(
    venvs: Sequence[Venv], running: Venv, box: BoxGpus, root: Path, auto: Choice | AgentFailure
) -> dict[str, Any]:
    """What `fdl libtorch list --json` prints: the root, this box's cards, each venv under the
    root (and the running one when it lives elsewhere) and what ``auto`` would pick."""
    rows = list(venvs) + ([] if any(v.path == running.path for v in venvs) else [running])
    variants = []
    for v in rows:
        covers_box, words = coverage(v, box)
        named = v.name if v.path.parent == root else ""
        variants.append(
            {
                "name": v.name,
                "path": str(v.path),
                "variant": v.variant,
                "torch": v.torch.version,
                "cuda": v.torch.cuda,
                "hip": v.torch.hip,
                "archs": list(v.torch.archs),
                "nccl": v.torch.nccl,
                "fdl": v.fdl,
                "problem": v.problem,
                "running": v.path == running.path,
                "covers": covers_box,
                "coverage": words,
                # join finds a venv by its directory's name: say when the build inside is another
                "note": f"named {named}, holds a {v.variant} build"
                if named and not v.problem and v.variant != named
                else "",
            }
        )
    if isinstance(auto, AgentFailure):
        pick: dict[str, Any] = {"error": auto.message, "fix": auto.fix}
    else:
        pick = choice_json(auto)
    return {
        "root": str(root),
        "box": {
            "gpus": [
                {"index": g.index, "vendor": g.vendor, "name": g.name, "arch": g.arch} for g in box.gpus
            ],
            "driver_cuda": box.driver_cuda,
            "rocm": box.rocm.strip(),
        },
        "variants": variants,
        "auto": pick,
    }


def choice_json(choice: Choice) -> dict[str, Any]:
    return {
        "variant": choice.variant,
        "venv": str(choice.venv) if choice.venv else None,
        "acquire": choice.acquire,
        "reason": choice.reason,
    }


def variant_env(variant: str) -> dict[str, str]:
    """What a build line learns of the torch variant it builds for: ``FDL_TORCH_VARIANT``, the
    variant itself (cpu, cu128, rocm6.4), and ``FDL_GPU_FEATURE``, seed 000's name for the
    GPU feature to build (its vendor, cuda or rocm; empty for cpu: ``--features
    "$FDL_GPU_FEATURE"`` then builds the default)."""
    vendor = vendor_of(variant)
    return {"FDL_TORCH_VARIANT": variant, "FDL_GPU_FEATURE": "" if vendor == "cpu" else vendor}

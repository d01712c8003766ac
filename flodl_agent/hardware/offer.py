"""The GPU gate, over facts: what this box offers a run, or why it offers nothing.

Pure: torch and its cards are read by :mod:`flodl_agent.hardware.gpus`; here they are
judged. Nothing usable is a :class:`~flodl_agent.retry.Permanent` failure (a
re-dial brings no GPU), and so is a card the build ships no kernel for.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..config.devices import DeviceOffer
from ..retry import Permanent
from .gpus import AmdAccess, Card, Torch


@dataclass(frozen=True)
class Offer:
    devices: list[str]
    labels: list[str]
    variant: str
    nccl: str = ""


@dataclass(frozen=True)
class Gap:
    """Offered cards the build cannot run a kernel on: the cause and the fix."""

    message: str
    fix: str


_ARCH = re.compile(r"(sm|compute)_(\d+)(\d)([a-z]?)")


def covers(flags: list[str], arch: str) -> bool:
    """Does a torch build with these arch flags run kernels on a device of ``arch``?

    ``sm_XY`` cubins run on the same major at an equal or later minor (``sm_80``
    on an 8.6 card); a suffixed one (``sm_90a``) only on its own arch; ``compute_XY``
    PTX is compiled at load for any later device. AMD code objects match exactly.
    """
    if arch.startswith("gfx"):
        return any(flag.split(":")[0] == arch for flag in flags)
    device = _ARCH.fullmatch(arch)
    if device is None:
        return True  # an arch we cannot read is not called uncovered
    want = (int(device.group(2)), int(device.group(3)))
    for flag in flags:
        m = _ARCH.fullmatch(flag)
        if m is None:
            continue
        have = (int(m.group(2)), int(m.group(3)))
        if m.group(1) == "compute" and have <= want:
            return True
        if m.group(1) == "sm" and (have == want if m.group(4) else have[0] == want[0] and have[1] <= want[1]):
            return True
    return False


def kernel_gap(build: str, flags: list[str], devices: Sequence[Card]) -> Gap | None:
    """The gap when the build covers only part of the offered devices."""
    if not flags:
        return None  # the build does not say: nothing to compare
    missing = [card for card in devices if not covers(flags, card.arch)]
    if not missing:
        return None
    cards = ", ".join(f"GPU {c.index} ({c.name}, {c.arch})" for c in missing)
    return Gap(
        f"{build} ships no kernel for part of what this box offers: {cards}; it covers {' '.join(flags)}",
        "libtorch: auto picks a covering variant when one exists; --devices (join.devices) scopes the "
        "offer to covered cards",
    )


ROCM_INSTALL = (
    "install the ROCm runtime (amdgpu-install --usecase=rocm, or apt-get install rocm-hip-runtime "
    "from repo.radeon.com), or run a torch ROCm build, which bundles it (libtorch: auto)"
)
CONTAINER_DEVICES = "--device /dev/kfd --device /dev/dri --group-add video --group-add render"


def amd_gaps(access: AmdAccess, torch_hip: bool = False) -> list[Gap]:
    """Why this box's AMD GPUs are out of this user's reach, each with its fix: the two
    first-contact causes on a fresh box, no ROCm userspace runtime, and /dev/kfd or the
    render node not openable (membership, then a re-login; in a container, the devices)."""
    if not access.gpus:
        return []
    cards = f"{len(access.gpus)} AMD GPU(s) ({', '.join(access.gpus)})"
    gaps = []
    if not access.runtime and not torch_hip:
        gaps.append(
            Gap(
                f"this box has {cards} but no ROCm userspace runtime (no libamdhip64, no rocminfo, "
                "and torch is not a ROCm build)",
                ROCM_INSTALL,
            )
        )
    nodes = {"/dev/kfd": access.kfd} | {f"/dev/dri/{n}": why for n, why in access.render.items()}
    if not access.render:
        nodes["/dev/dri/renderD*"] = "missing"
    blocked = {node: why for node, why in nodes.items() if why != "ok"}
    if not blocked:
        return gaps
    user = access.user or "this user"
    what = ", ".join(f"{node} ({why})" for node, why in blocked.items())
    message = f"the GPU devices are not openable by {user} (groups {', '.join(access.groups)}): {what}"
    if access.container:
        fix = (
            f"this runs in a {access.container} container: pass the devices and groups ({CONTAINER_DEVICES})"
        )
    elif all(why == "missing" for why in blocked.values()):
        fix = "the device nodes are missing: check that the amdgpu driver is loaded (dmesg | grep -i amdgpu)"
    else:
        fix = (
            f"sudo usermod -aG render,video {access.user or '$USER'}, then log in again "
            "(a service user: restart its unit, e.g. flodl-join.service)"
        )
        stale = sorted({access.owners.get(n, "") for n in blocked} & set(access.listed) - set(access.groups))
        if stale:
            message += f"; {user} is in {', '.join(stale)}, but this session started before that"
    gaps.append(Gap(message, fix))
    return gaps


def variant(torch: Torch) -> str:
    """The torch variant this build is (cu126, rocm6.4), as the hello names it."""
    if torch.hip:
        major, minor = torch.hip.split(".")[:2]
        return f"rocm{major}.{minor}"
    return f"cu{torch.cuda.replace('.', '')}"


def resolve_offer(
    offer: DeviceOffer, torch: Torch | None = None, cards: Sequence[Card] = (), amd: AmdAccess | None = None
) -> Offer:
    """What this box actually offers: CPU ranks as asked, or the offered GPUs among ``cards``
    (the ``torch.usable_gpus`` cards torch can use). ``torch`` None: torch is not installed;
    ``amd`` says why AMD GPUs torch cannot see are out of reach."""
    if offer.kind == "cpu":
        return Offer([f"cpu:{i}" for i in range(offer.cpus)], ["cpu"] * offer.cpus, "cpu")
    if torch is None or not torch.version:
        raise Permanent(
            "no usable GPU: torch is not installed on this box",
            "install a torch variant, or offer CPU ranks with --devices cpu:N",
        )
    count = torch.usable_gpus
    gaps = amd_gaps(amd, bool(torch.hip)) if count == 0 and amd is not None else []
    if gaps:
        raise Permanent(
            "no usable GPU: " + "; and ".join(g.message for g in gaps), "; ".join(g.fix for g in gaps)
        )
    if count == 0:
        raise Permanent(
            "no usable GPU on this box",
            "check the driver and device permissions (fdl probe), or offer CPU ranks with --devices cpu:N",
        )
    indices = list(range(count)) if offer.kind == "all" else list(offer.gpus)
    missing = [i for i in indices if i >= count]
    if missing:
        raise Permanent(
            f"GPU {missing[0]} is not on this box ({count} visible)",
            f"offer devices 0..{count - 1} with --devices",
        )
    build = variant(torch)
    chosen = [cards[i] for i in indices]
    gap = kernel_gap(f"torch {torch.version} ({build})", torch.archs, chosen)
    if gap is not None:  # the first GPU op would die: "no kernel image is available"
        raise Permanent(gap.message, gap.fix)
    return Offer([f"cuda:{i}" for i in indices], [card.name for card in chosen], build, torch.nccl)

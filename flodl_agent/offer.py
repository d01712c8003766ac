"""The GPU gate, over facts: what this box offers a run, or why it offers nothing.

Pure: torch and its cards are read by :mod:`flodl_agent.gpus`; here they are
judged. Nothing usable is a :class:`~flodl_agent.retry.Permanent` failure (a
re-dial brings no GPU), and so is a card the build ships no kernel for.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from .config.devices import DeviceOffer
from .gpus import Card, Torch
from .retry import Permanent


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


def variant(torch: Torch) -> str:
    """The torch variant this build is (cu126, rocm6.4), as the hello names it."""
    if torch.hip:
        major, minor = torch.hip.split(".")[:2]
        return f"rocm{major}.{minor}"
    return f"cu{torch.cuda.replace('.', '')}"


def resolve_offer(offer: DeviceOffer, torch: Torch | None = None, cards: Sequence[Card] = ()) -> Offer:
    """What this box actually offers: CPU ranks as asked, or the offered GPUs among ``cards``
    (the ``torch.usable_gpus`` cards torch can use). ``torch`` None: torch is not installed."""
    if offer.kind == "cpu":
        return Offer([f"cpu:{i}" for i in range(offer.cpus)], ["cpu"] * offer.cpus, "cpu")
    if torch is None or not torch.version:
        raise Permanent(
            "no usable GPU: torch is not installed on this box",
            "install a torch variant, or offer CPU ranks with --devices cpu:N",
        )
    count = torch.usable_gpus
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

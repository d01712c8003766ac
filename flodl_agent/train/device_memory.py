"""The memory a rank's device gives its data, and whether the data goes resident there (pure).

A discrete GPU has the memory torch reports. An integrated GPU (an APU) has
none of its own: its aperture claims a share of the host's physical RAM, and
torch's figure for it is often the small carve-out the firmware reserves.
``gpu_ram_share`` says how much: the Trainer's own argument when code gives
one, else ``FLODL_GPU_RAM_SHARE`` in the rank's environment (the agent puts
the box's join.gpu_ram_share there, else what the cluster file says of the
host: its worker entry over the cluster's default). Discrete GPUs and CPU
ranks ignore it.

The Trainer keeps a rank's shard of the dataset resident on the device when
it fits in half the budget (the rest is the model's, its optimizer's and the
activations'), and streams it batch by batch otherwise: the large GPU goes
resident while the small one streams.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

SHARE_ENV = "FLODL_GPU_RAM_SHARE"
RESIDENT_FRACTION = 0.5  # of the budget a resident dataset may take


@dataclass(frozen=True)
class Device:
    """What the Trainer reads of its device (torch and the host's RAM are its IO)."""

    kind: str  # "cuda" (CUDA and ROCm alike) or "cpu"
    total_memory: int = 0  # bytes, as torch reports them
    integrated: bool = False  # an APU: torch's is_integrated
    host_ram: int = 0  # the host's physical RAM in bytes


@dataclass(frozen=True)
class Budget:
    """The bytes a rank's device may hold (``None`` for a CPU rank), and why that many."""

    bytes: int | None
    why: str

    def fits(self, data_bytes: int) -> bool:
        """Does a dataset of ``data_bytes`` go resident on the device?"""
        return self.bytes is not None and data_bytes <= self.bytes * RESIDENT_FRACTION


def resolve_share(explicit: float | None, env: Mapping[str, str]) -> float | None:
    """The Trainer's knob: code's value wins; else the rank environment's; else unset."""
    if explicit is not None:
        if not (explicit > 0 and math.isfinite(explicit)):
            raise ValueError(f"gpu_ram_share must be a positive fraction of RAM, e.g. 0.5 (got {explicit})")
        return float(explicit)
    text = env.get(SHARE_ENV, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(
            f"{SHARE_ENV}={text!r} is not a positive fraction of RAM: set gpu_ram_share in the cluster "
            "file or the join block (e.g. 0.5), or pass gpu_ram_share= to the Trainer"
        )
    return value


def _gib(n: int) -> str:
    return f"{n / 1024**3:.1f} GiB"


def device_budget(device: Device, share: float | None) -> Budget:
    """What the device may hold: an APU's share of the host's RAM, a discrete GPU's own memory."""
    if device.kind != "cuda":
        return Budget(None, "a CPU rank: its data stays where the dataset keeps it")
    if device.integrated and share is not None and device.host_ram:
        held = int(share * device.host_ram)
        return Budget(held, f"integrated GPU: gpu_ram_share {share:g} of {_gib(device.host_ram)} RAM")
    if device.integrated:
        return Budget(
            device.total_memory,
            f"integrated GPU: torch's {_gib(device.total_memory)} (often only the firmware's carve-out; "
            "gpu_ram_share gives the aperture)",
        )
    ignored = f" (gpu_ram_share {share:g} ignored: the GPU is discrete)" if share is not None else ""
    return Budget(device.total_memory, f"discrete GPU: {_gib(device.total_memory)}{ignored}")

"""This node's topology resources, read from the box: the IO shell of
``segments.topology_resources`` (which parses ``nvidia-smi -q`` text, purely)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from .segments import topology_resources

SMI_TIMEOUT = 60.0  # seconds; nvidia-smi -q can be slow on a box with many GPUs
SMI_MAX = 16 * 1024 * 1024  # bytes: a large box's report is a few hundred KiB


def smi_query(smi: Path | None = None) -> str:
    """``nvidia-smi -q`` output: from ``smi`` when given, else by running it; empty when
    there is no nvidia-smi or it fails (a node without NVIDIA GPUs). A file over SMI_MAX
    (``/dev/urandom``, say) raises ``ValueError``; bytes that are not UTF-8 read as U+FFFD."""
    if smi is not None:
        with smi.open("rb") as handle:
            raw = handle.read(SMI_MAX + 1)
        if len(raw) > SMI_MAX:
            raise ValueError(f"{smi} is larger than {SMI_MAX // 2**20} MiB: not `nvidia-smi -q` output")
        return raw.decode(errors="replace")
    if not shutil.which("nvidia-smi"):
        return ""
    proc = subprocess.run(
        ["nvidia-smi", "-q"], capture_output=True, text=True, timeout=SMI_TIMEOUT, check=False
    )
    return proc.stdout if proc.returncode == 0 else ""


def node_resources(smi: Path | None, env: Mapping[str, str]) -> dict[str, float]:
    """The resources `ray start --resources` gets on this node."""
    return topology_resources(smi_query(smi), env)

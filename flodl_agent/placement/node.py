"""This node's topology resources, read from the box: the IO shell of
``segments.topology_resources`` (which parses ``nvidia-smi -q`` text, purely)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from .segments import topology_resources

SMI_TIMEOUT = 60.0  # seconds; nvidia-smi -q can be slow on a box with many GPUs


def smi_query(smi: Path | None = None) -> str:
    """``nvidia-smi -q`` output: from ``smi`` when given, else by running it; empty when
    there is no nvidia-smi or it fails (a node without NVIDIA GPUs)."""
    if smi is not None:
        return smi.read_text()
    if not shutil.which("nvidia-smi"):
        return ""
    proc = subprocess.run(
        ["nvidia-smi", "-q"], capture_output=True, text=True, timeout=SMI_TIMEOUT, check=False
    )
    return proc.stdout if proc.returncode == 0 else ""


def node_resources(smi: Path | None, env: Mapping[str, str]) -> dict[str, float]:
    """The resources `ray start --resources` gets on this node."""
    return topology_resources(smi_query(smi), env)

"""The compose kit: podman, podman-compose and the lab's node image on this machine (installed
and built by the lab script), a project whose service runs that image, and its containers."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
import time
from pathlib import Path

from tests.support.lab import LAB

IMAGE = "localhost/flodl-lab-node:latest"  # Debian 12 with python3; `tests/lab/lab image` builds it


def missing() -> str | None:
    """Install podman, podman-compose and the image when they are not here (root: the lab
    script does it, cached); a reason to skip when that cannot be done."""
    ready = (
        shutil.which("podman")
        and shutil.which("podman-compose")
        and subprocess.run(["podman", "image", "exists", IMAGE], capture_output=True).returncode == 0
    )
    if ready:
        return None
    if os.geteuid() != 0:
        return "podman, podman-compose and the lab image are missing (run tests/lab/lab image as root)"
    built = subprocess.run([str(LAB), "image"], capture_output=True, text=True, timeout=900)
    if built.returncode != 0:
        return f"tests/lab/lab image failed: {built.stderr.strip()[-500:]}"
    return None


def project(where: Path, service: str, rank_script: str) -> Path:
    """A compose project: ``service`` runs the lab image; ``rank.py`` is the ranks' entry point."""
    where.mkdir(parents=True)
    (where / "compose.yaml").write_text(f"services:\n  {service}:\n    image: {IMAGE}\n")
    (where / "rank.py").write_text(textwrap.dedent(rank_script))
    return where


def containers(label: str, *status: str) -> list[str]:
    """Names of the containers with ``label`` (KEY=VALUE), of any status unless ``status`` says."""
    argv = ["podman", "ps", "-a", "--filter", f"label={label}", "--format", "{{.Names}}"]
    argv += [f"--filter=status={s}" for s in status]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return out.split()


def remove(label: str, project_name: str) -> None:
    """What a test left: its containers, and the network podman-compose makes per project."""
    names = containers(label)
    if names:
        subprocess.run(["podman", "rm", "-f", *names], capture_output=True)
    nets = subprocess.run(
        ["podman", "network", "ls", "-q", "--filter", f"label=io.podman.compose.project={project_name}"],
        capture_output=True,
        text=True,
    ).stdout.split()
    if nets:
        subprocess.run(["podman", "network", "rm", "-f", *nets], capture_output=True)


def argv_holding(secret: str) -> list[str]:
    """Command lines of this machine's processes that contain ``secret``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        if secret in text:
            found.append(text)
    return found


def wait_for(paths: list[Path], timeout: float = 60.0) -> None:
    """Until every path exists (files a rank writes in its container)."""
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise AssertionError(f"not written in time: {[str(p) for p in paths if not p.exists()]}")
        time.sleep(0.05)

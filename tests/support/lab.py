"""The lab's test kit: its names, and commands run on its boxes or against its inventory.
Shared by the fleet suite and the fault suite (tests/lab/conftest.py holds the lab fixture)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).parents[2]
LAB = ROOT / "tests" / "lab" / "lab"
NAME = "flodl-labtest"
CONTROLLER, WORKERS = f"{NAME}-controller", [f"{NAME}-worker-1", f"{NAME}-worker-2"]
# A worker's ssh to the door, as its service user holds it: its key, its pin, never a prompt.
DOOR = [
    "ssh",
    "-i",
    "/opt/flodl/.ssh/join_ed25519",
    "-p",
    "2222",
    "-o",
    "BatchMode=yes",
    "-o",
    "UserKnownHostsFile=/opt/flodl/.ssh/known_hosts",
    "-o",
    "StrictHostKeyChecking=yes",
]


def lab_env(inventory: Path) -> dict[str, str]:
    return {
        **os.environ,
        "LAB_NAME": NAME,
        "LAB_SUBNET": "10.89.3.0/24",
        "LAB_INVENTORY": str(inventory),
        "ANSIBLE_FORCE_COLOR": "0",
        "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}",
    }


_BARE: list[subprocess.CompletedProcess[str]] = []


def check_bare(env: dict[str, str]) -> None:
    """`site.yml --check` on the boxes as `lab up` left them: the lab fixture runs it first,
    since every suite converges the fleet."""
    _BARE.append(play(env, "site.yml", "--check"))


def bare_check() -> subprocess.CompletedProcess[str]:
    assert _BARE, "the lab fixture runs site.yml --check on the bare boxes"
    return _BARE[0]


def play(env: dict[str, str], playbook: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return in_lab(env, "ansible-playbook", playbook, *extra)


def in_lab(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    """A command from the repo root against the lab's inventory."""
    return subprocess.run(
        list(argv),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
    )


def booted(host: str, timeout: float = 120.0) -> str:
    """The host's systemd state once boot is over. Right after a restart its bus may not
    exist yet ("Failed to connect to bus"): ask again until it answers."""
    deadline = time.monotonic() + timeout
    while True:
        state = on(host, "systemctl", "is-system-running", "--wait")
        if state.stdout.strip() or time.monotonic() > deadline:
            return state.stdout.strip()
        time.sleep(0.5)  # polling for a bus that has no event to wait on from outside


def on(host: str, *argv: str, user: str | None = None) -> subprocess.CompletedProcess[str]:
    command = ["podman", "exec", *(["--user", user] if user else []), host, *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def journals(since: str = "-10min") -> str:
    """What the workers' join units said lately: the agents' side of a failed run."""
    return "\n".join(
        f"--- {w}\n"
        + on(w, "journalctl", "-u", "flodl-join.service", "--since", since, "--no-pager", "-o", "cat").stdout[
            -3000:
        ]
        for w in WORKERS
    )

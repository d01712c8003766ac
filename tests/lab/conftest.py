"""The lab fixture, shared by the fleet suite and the fault suite: one lab per session."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
LAB = ROOT / "tests" / "lab" / "lab"
NAME = "flodl-labtest"


def _env(inventory: Path) -> dict[str, str]:
    return {
        **os.environ,
        "LAB_NAME": NAME,
        "LAB_SUBNET": "10.89.3.0/24",
        "LAB_INVENTORY": str(inventory),
        "ANSIBLE_FORCE_COLOR": "0",
        "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}",
    }


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    if os.geteuid() != 0:
        pytest.skip("the lab needs root (podman with systemd containers)")
    if shutil.which("ansible-playbook", path=str(ROOT / ".venv" / "bin")) is None:
        pytest.skip("ansible is not installed in .venv (pip install '.[ansible]')")
    inventory = tmp_path_factory.mktemp("inventory")
    env = _env(inventory)
    subprocess.run([str(LAB), "down"], env=env, check=False, capture_output=True)  # a stale one
    up = subprocess.run([str(LAB), "up"], env=env, capture_output=True, text=True, timeout=1200, check=False)
    assert up.returncode == 0, up.stderr[-3000:]
    env["ANSIBLE_INVENTORY"] = str(inventory / "hosts.yml")
    try:
        yield env
    finally:
        subprocess.run([str(LAB), "down"], env=env, check=False, capture_output=True, timeout=300)

"""The lab fixture, shared by the fleet suite and the fault suite: one lab per session."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from tests.support.lab import LAB, ROOT, check_bare, lab_env, play


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    if os.geteuid() != 0:
        pytest.skip("the lab needs root (podman with systemd containers)")
    if shutil.which("ansible-playbook", path=str(ROOT / ".venv" / "bin")) is None:
        pytest.skip("ansible is not installed in .venv (pip install '.[ansible]')")
    inventory = tmp_path_factory.mktemp("inventory")
    env = lab_env(inventory)
    subprocess.run([str(LAB), "down"], env=env, check=False, capture_output=True)  # a stale one
    up = subprocess.run([str(LAB), "up"], env=env, capture_output=True, text=True, timeout=1200, check=False)
    assert up.returncode == 0, up.stderr[-3000:]
    env["ANSIBLE_INVENTORY"] = str(inventory / "hosts.yml")
    check_bare(env)
    try:
        yield env
    finally:
        subprocess.run([str(LAB), "down"], env=env, check=False, capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def fleet(lab: dict[str, str]) -> Iterator[dict[str, str]]:
    """The lab converged (a no-change pass when the fleet suite ran first)."""
    converged = play(lab, "site.yml")
    assert converged.returncode == 0, converged.stdout[-4000:]
    yield lab

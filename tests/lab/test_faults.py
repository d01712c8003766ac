"""Faults on the lab fleet, each with its verdict and nothing lost.

A Trainer run on the CPU plane (`demo_rank --trainer`, averaging through the
controller and the door) is hurt mid-run: a worker killed, a worker cut off its
network, the controller restarted; and a worker is rebooted between runs. Beyond
max_failure the survivor writes a ShutdownWithSave checkpoint, and it loads; a
box that comes back re-dials into the next run by itself.

Marked `lab` (root and podman): `make test-lab` runs it with the fleet suite.
"""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

import pytest

from tests.support.lab import CONTROLLER, NAME, ROOT, WORKERS, booted, journals, on, play

pytestmark = pytest.mark.lab

CHECKPOINT = "/opt/flodl/fault-checkpoint.pt"
TRAINER = [
    "python",
    "-m",
    "flodl_agent.demo_rank",
    "--trainer",
    "2000",
    "--pace",
    "0.01",
    "--checkpoint",
    CHECKPOINT,
]
PYTHON = "/opt/flodl/libtorch/cpu/bin/python"


def state() -> dict[str, Any]:
    got = on(CONTROLLER, "fdl", "status", "--json", "--addr", "127.0.0.1:1337")
    return json.loads(got.stdout) if got.returncode == 0 else {}


def until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s\n{journals('-3min')}"
        time.sleep(0.5)  # polling the controller's own status, as an operator would


def start_run(lab: dict[str, str], *extra: str) -> subprocess.Popen[str]:
    """run.yml in the background with the Trainer as the command; the window open when it returns."""
    command = json.dumps({"flodl_run_command": TRAINER, "flodl_run_timeout": 400})
    proc = subprocess.Popen(
        ["ansible-playbook", "playbooks/run.yml", "-e", command, *extra],
        cwd=ROOT,
        env=lab,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    until(lambda: (state().get("averaging") or {}).get("rounds", 0) >= 20, 240, "the run training")
    return proc


def verdict(proc: subprocess.Popen[str]) -> str:
    out, _ = proc.communicate(timeout=600)
    return out


def checkpoint_round(host: str) -> int:
    loaded = on(host, PYTHON, "-c", f"import torch; print(torch.load('{CHECKPOINT}')['round'])")
    assert loaded.returncode == 0, loaded.stderr
    return int(loaded.stdout.strip())


def ip_of(host: str) -> str:
    got = subprocess.run(
        ["podman", "inspect", "-f", f'{{{{(index .NetworkSettings.Networks "{NAME}").IPAddress}}}}', host],
        capture_output=True,
        text=True,
        check=True,
    )
    return got.stdout.strip()


def back(host: str) -> None:
    """A box that came back: booted, and its join unit dialling again by itself."""
    assert booted(host) in ("running", "degraded")
    until(
        lambda: (
            on(host, "systemctl", "is-active", "flodl-join.service").stdout.strip()
            in ("active", "activating")
        ),
        120,
        f"{host}'s join unit",
    )


def test_a_worker_killed_mid_run_ends_it_with_a_checkpoint_that_loads(fleet: dict[str, str]) -> None:
    on(WORKERS[0], "rm", "-f", CHECKPOINT)
    run = start_run(fleet)
    subprocess.run(["podman", "kill", WORKERS[1]], check=True, capture_output=True)
    try:
        out = verdict(run)
        assert run.returncode != 0, out[-3000:]
        assert "the run did not reach done" in out and "ShutdownWithSave" in out + journals("-3min"), out[
            -3000:
        ]
        assert checkpoint_round(WORKERS[0]) >= 1  # the survivor saved where the run stood
    finally:
        subprocess.run(["podman", "start", WORKERS[1]], check=True, capture_output=True)
        back(WORKERS[1])


def test_a_worker_cut_off_its_network_is_cut_off_and_the_survivor_saves(fleet: dict[str, str]) -> None:
    on(WORKERS[0], "rm", "-f", CHECKPOINT)
    address = ip_of(WORKERS[1])
    run = start_run(fleet)
    subprocess.run(["podman", "network", "disconnect", NAME, WORKERS[1]], check=True, capture_output=True)
    try:
        out = verdict(run)  # the controller's heartbeat watchdog cuts the silent host (30 s)
        assert run.returncode != 0, out[-3000:]
        assert f"host {WORKERS[1]} sent nothing for" in out, out[-3000:]
        assert checkpoint_round(WORKERS[0]) >= 1
    finally:
        subprocess.run(
            ["podman", "network", "connect", "--ip", address, NAME, WORKERS[1]],
            check=True,
            capture_output=True,
        )
    back(WORKERS[1])
    again = play(fleet, "playbooks/run.yml", "-e", "flodl_run_timeout=300")  # reconnected, it walks in again
    assert again.returncode == 0, again.stdout[-3000:] + journals()


def test_a_controller_restarted_mid_run_and_the_fleet_walks_into_the_next(fleet: dict[str, str]) -> None:
    run = start_run(fleet)
    on(CONTROLLER, "pkill", "-f", "fdl launch")  # the controller process dies with its window
    out = verdict(run)
    assert run.returncode != 0, out[-3000:]
    for worker in WORKERS:  # the agents saw the controller go and went back to dialling
        assert (
            "re-dialling in"
            in on(
                worker,
                "journalctl",
                "-u",
                "flodl-join.service",
                "--since",
                "-3min",
                "--no-pager",
                "-o",
                "cat",
            ).stdout
        )
    again = play(fleet, "playbooks/run.yml", "-e", "flodl_run_timeout=300")
    assert again.returncode == 0, again.stdout[-3000:] + journals()
    assert all(f"admitted {w}" in again.stdout for w in WORKERS)


def _said(host: str, unit: str, since: str = "-5min") -> str:
    return on(host, "journalctl", "-u", unit, "--since", since, "--no-pager", "-o", "cat").stdout


def test_a_controller_killed_mid_run_is_restarted_by_systemd_and_its_world_trains_on(
    fleet: dict[str, str],
) -> None:
    run = start_run(fleet)
    units = on(CONTROLLER, "systemctl", "list-units", "--plain", "--no-legend", "flodl-run-*.service").stdout
    unit = units.split()[0]
    before = state().get("launch")
    killed = on(CONTROLLER, "systemctl", "kill", "--signal=SIGKILL", "--kill-whom=main", unit)
    assert killed.returncode == 0, killed.stderr
    out = verdict(run)  # systemd starts the controller again (Restart=on-abnormal); it resumes
    assert run.returncode == 0, out[-3000:] + journals("-5min")
    controller = _said(CONTROLLER, unit)
    assert f"launch {before} did not finish: resuming it" in controller, controller[-3000:]
    assert "controller resumed: 2 of 2 hosts back" in controller, controller[-3000:]
    finals = []
    for worker in WORKERS:
        said = _said(worker, "flodl-join.service")
        assert "this host's ranks train on; re-dialling to resume" in said, said[-3000:]
        assert "resumed: the controller re-adopted this host after" in said, said[-3000:]
        finals += [line.split(": done, ")[1] for line in said.splitlines() if ": done, w=" in line][-1:]
    assert len(finals) == 2 and finals[0] == finals[1], finals  # the ranks end with equal weights


def test_a_rebooted_worker_remounts_its_data_and_redials_into_the_next_run(fleet: dict[str, str]) -> None:
    restarted = subprocess.run(["podman", "restart", WORKERS[0]], capture_output=True, text=True, timeout=180)
    assert restarted.returncode == 0, restarted.stderr
    back(WORKERS[0])
    until(lambda: on(WORKERS[0], "findmnt", "-n", "/flodl/data").returncode == 0, 120, "the data mount")
    run = play(fleet, "playbooks/run.yml", "-e", "flodl_run_timeout=300")
    assert run.returncode == 0, run.stdout[-3000:] + journals()
    assert f"admitted {WORKERS[0]}" in run.stdout

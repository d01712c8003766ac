"""The units as installed on booted hosts, scored by `systemd-analyze security`, and the join
unit meeting a door whose host key is not the pinned one.

The lab's other suites prove the sandboxes leave the job working: runs train through the
door, fetch the published tree, mount the data root, and re-dial after a restarted
controller and a rebooted worker, all under these units.
"""

from __future__ import annotations

import time

import pytest

from tests.support.lab import CONTROLLER, WORKERS, journals, on

pytestmark = pytest.mark.lab

CEILINGS = {  # tenths, as --threshold takes them (docs/guardrails.md has the scores)
    "flodl-run-probe.service": 25,
    "flodl-door.service": 66,
    "flodl-join.service": 40,
}
KNOWN_HOSTS = "/opt/flodl/.ssh/known_hosts"


def security(host: str, unit: str) -> tuple[int, str]:
    done = on(host, "systemd-analyze", "security", f"--threshold={CEILINGS[unit]}", "--no-pager", unit)
    return done.returncode, done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr


@pytest.mark.parametrize(
    ("host", "unit"),
    [
        (CONTROLLER, "flodl-door.service"),
        (WORKERS[0], "flodl-join.service"),
    ],
)
def test_installed_units_score_under_their_ceilings(fleet: dict[str, str], host: str, unit: str) -> None:
    status, overall = security(host, unit)
    assert status == 0, (unit, overall)
    assert on(host, "systemctl", "is-active", unit).stdout.strip() == "active", unit


def test_a_one_shot_run_is_the_sandboxed_controller(fleet: dict[str, str]) -> None:
    # The lab runs its controllers as run.yml does, as transient flodl-run-* units: the
    # controller role's prefix drop-in gives each the standing unit's sandbox.
    unit = "flodl-run-probe.service"
    on(CONTROLLER, "systemctl", "stop", unit)
    started = on(CONTROLLER, "systemd-run", "--unit", unit, "--collect", "/bin/sleep", "600")
    assert started.returncode == 0, started.stderr
    try:
        shown = on(
            CONTROLLER, "systemctl", "show", unit, "-p", "User", "-p", "ProtectSystem", "-p", "DropInPaths"
        )
        assert "User=flodl" in shown.stdout and "ProtectSystem=strict" in shown.stdout, shown.stdout
        status, overall = security(CONTROLLER, unit)
        assert status == 0, overall
    finally:
        on(CONTROLLER, "systemctl", "stop", unit)


def show(host: str, unit: str) -> dict[str, str]:
    got = on(host, "systemctl", "show", unit, "-p", "ActiveState", "-p", "ExecMainStatus", "-p", "NRestarts")
    return dict(line.split("=", 1) for line in got.stdout.splitlines() if "=" in line)


def test_an_impostor_door_stops_the_join_unit_with_the_permanent_exit(fleet: dict[str, str]) -> None:
    worker = WORKERS[1]
    pinned = on(worker, "cat", KNOWN_HOSTS).stdout
    host_field = pinned.split()[0]
    # the door's address answers with another key (a fresh one stands for the impostor's):
    # the worker's pin no longer matches what it shows
    on(worker, "systemctl", "stop", "flodl-join.service", "flodl-data.mount")
    on(worker, "sh", "-c", "rm -f /tmp/impostor* && ssh-keygen -q -t ed25519 -N '' -f /tmp/impostor")
    impostor = on(worker, "cut", "-d", " ", "-f", "1,2", "/tmp/impostor.pub").stdout.strip()
    assert impostor.startswith("ssh-ed25519 ")
    on(worker, "sh", "-c", f"echo '{host_field} {impostor}' > {KNOWN_HOSTS}")
    try:
        on(worker, "systemctl", "reset-failed", "flodl-join.service")
        on(worker, "systemctl", "start", "--no-block", "flodl-join.service")
        deadline = time.monotonic() + 120
        while show(worker, "flodl-join.service").get("ActiveState") not in {"failed", "inactive"}:
            assert time.monotonic() < deadline, journals("-3min")
            time.sleep(0.5)  # polling the unit's state, as an operator's systemctl would
        ended = show(worker, "flodl-join.service")
        # "failed", not "activating" (auto-restart): the permanent exit scheduled no re-dial
        assert ended["ActiveState"] == "failed" and ended["ExecMainStatus"] == "2", (ended, journals("-3min"))
        said = on(
            worker, "journalctl", "-u", "flodl-join.service", "--since", "-3min", "--no-pager", "-o", "cat"
        )
        assert "not the pinned one" in said.stdout and "host key" in said.stdout.lower(), said.stdout[-3000:]
        assert on(worker, "systemctl", "is-active", "flodl-data.mount").stdout.strip() != "active"
    finally:
        on(worker, "sh", "-c", f"cat > {KNOWN_HOSTS} <<'EOF'\n{pinned}EOF")
        on(worker, "systemctl", "reset-failed", "flodl-join.service")
        assert on(worker, "systemctl", "start", "flodl-join.service").returncode == 0
    assert on(worker, "systemctl", "is-active", "flodl-data.mount").stdout.strip() == "active"

"""The door as installed on the lab's booted controller, audited from outside the way an ops
team's review audits it (`ssh-audit` from the lab host against 10.89.3.10:2222), and attacked
from a worker with its real key: rsync filter rules that name files above the published tree
(the merge-file leak) read nothing back.

tests/integration/test_door_audit.py and tests/integration/test_door.py run the same audit and
the same rules against a real sshd on loopback; this suite checks what the roles installed.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import sshd as sshd_kit
from tests.support.lab import CONTROLLER, DOOR, WORKERS, on

pytestmark = pytest.mark.lab

ADDRESS, PORT = "10.89.3.10", 2222  # the lab controller's door (its ansible_host)
TREE = "/opt/flodl/run/tree"
MARKER = "door-audit-marker"  # a file of the tree, and the line that would take it out of a pull


def test_ssh_audit_against_the_door_finds_no_fail_and_only_the_post_quantum_notes(
    fleet: dict[str, str], tmp_path: Path
) -> None:
    report = sshd_kit.ssh_audit(ADDRESS, PORT)
    fails, warns = sshd_kit.findings(report)
    assert fails == [] and report["cves"] == [], fails
    assert warns == sshd_kit.EXPECTED_WARNINGS
    assert report["compression"] == ["none"]
    assert [key["algorithm"] for key in report["key"]] == ["ssh-ed25519"]
    # The built-in policy wants its lists exactly (and predates the Terrapin marker Debian's
    # 9.2 sends): the door offers a subset of each; the same policy allowing subsets passes.
    exact = sshd_kit.ssh_audit(ADDRESS, PORT, "-P", sshd_kit.HARDENED_POLICY)
    assert exact["passed"] is False and sshd_kit.only_exactness(exact["errors"]), exact["errors"]
    subset = sshd_kit.ssh_audit(ADDRESS, PORT, "-P", str(sshd_kit.hardened_subset_policy(tmp_path / "p.txt")))
    assert subset["passed"] is True, subset["errors"]


def test_the_door_listens_on_the_address_the_workers_dial_alone(fleet: dict[str, str]) -> None:
    listening = on(CONTROLLER, "ss", "-Hltn", f"sport = :{PORT}")
    assert listening.returncode == 0, listening.stderr
    assert [line.split()[3] for line in listening.stdout.splitlines()] == [f"{ADDRESS}:{PORT}"]
    effective = on(
        CONTROLLER,
        "/usr/sbin/sshd",
        "-T",
        "-f",
        "/etc/flodl-door/sshd_config",
        "-C",
        f"lport={PORT},user=flodl-join,host=w,addr=10.89.3.11",
    )
    for line in ("compression no", "persourcemaxstartups 4", "persourcenetblocksize 32:128", "maxsessions 1"):
        assert line in effective.stdout.splitlines(), line


def test_one_source_gets_four_unauthenticated_connections_at_a_time(fleet: dict[str, str]) -> None:
    held = []
    try:
        for _ in range(4):
            held.append(socket.create_connection((ADDRESS, PORT), timeout=10))
            assert held[-1].recv(64).startswith(b"SSH-2.0-")
        with socket.create_connection((ADDRESS, PORT), timeout=10) as fifth:
            assert fifth.recv(64) == b"Exceeded MaxStartups\r\n"
    finally:
        for conn in held:
            conn.close()
    # the workers, each its own source, are untouched: a pull goes through
    listed = on(WORKERS[0], "rsync", "-e", " ".join(DOOR), f"flodl-join@{ADDRESS}:/", user="flodl")
    assert listed.returncode == 0, listed.stderr


def pull(worker: str, into: str, *rules: str) -> tuple[int, str, bool]:
    """A worker's pull of the tree with ``rules``: its exit, its stderr, and whether MARKER came."""
    on(worker, "rm", "-rf", into)
    got = on(
        worker,
        "rsync",
        "-r",
        "-e",
        " ".join(DOOR),
        *(f"--filter={rule}" for rule in rules),
        f"flodl-join@{ADDRESS}:/",
        f"{into}/",
        user="flodl",
    )
    return got.returncode, got.stderr, on(worker, "test", "-f", f"{into}/{MARKER}").returncode == 0


@pytest.fixture
def planted(fleet: dict[str, str]) -> Iterator[None]:
    """The marker in the tree; in two directories above it (the served directory, /opt) a file
    whose line names it; and, in the tree, a rules file whose `merge` lines name files above it."""
    script = (
        f"echo marked > {TREE}/{MARKER} && echo {MARKER} > /opt/flodl/run/names && echo {MARKER} > /opt/names"
        f" && printf 'merge,- /opt/flodl/run/names\\nmerge /opt/flodl/.bashrc\\n' > {TREE}/rules.lab"
    )
    assert on(CONTROLLER, "sh", "-c", script).returncode == 0
    yield
    on(CONTROLLER, "rm", "-f", f"{TREE}/{MARKER}", "/opt/flodl/run/names", "/opt/names", f"{TREE}/rules.lab")


def test_filter_rules_from_a_worker_read_no_file_above_the_tree(planted: None) -> None:
    worker, into = WORKERS[0], "/tmp/door-audit"
    # The attack as found: the service user's .bashrc, whose first line that is no rule came back.
    status, stderr, marked = pull(worker, into, "dir-merge /opt/flodl/.bashrc")
    assert status == 0 and marked, stderr
    assert "Unknown filter rule" not in stderr and "case $-" not in stderr
    # Each ancestor of the tree, absolutely and climbing from it, with and without `-` (the
    # oracle: a line read as a pattern takes the marker out), and a file elsewhere.
    rules = [
        "dir-merge,- /opt/flodl/run/names",
        "dir-merge,- ../names",
        ":- /opt/names",
        "dir-merge /opt/flodl/.profile",
        "dir-merge,- /opt/flodl/.bashrc",
        "dir-merge /etc/passwd",
        f"dir-merge,- {'../' * 8}etc/passwd",
    ]
    status, stderr, marked = pull(worker, into, *rules)
    assert status == 0 and marked, stderr
    assert "Unknown filter rule" not in stderr and "root:x:0:0" not in stderr
    # `merge` lines the controller's sender parses itself (a rules file in the tree names them):
    # the files are not opened, so the pull stops without a line of them.
    status, stderr, marked = pull(worker, into, "dir-merge rules.lab")
    assert "Unknown filter rule" not in stderr and "case $-" not in stderr, stderr
    assert status != 0 or marked, stderr
    # and the honest pull of the same tree still works
    status, stderr, marked = pull(worker, into)
    assert status == 0 and marked, stderr

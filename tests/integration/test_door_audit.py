"""The door's sshd as the controller role renders it with its defaults, audited the way an ops
team's review audits it: `ssh-audit` (PyPI) against a real OpenSSH server running that
configuration, `sshd -T` for what ssh-audit cannot see, the per-source throttle exercised,
and the workers' stock OpenSSH client negotiating with it. The lab suite runs the same audit
against the door installed on a booted controller (tests/lab/test_door_audit.py).

Rendering is Ansible's own (the template module with the role's defaults and vars); only the
port, the directories and the listen address are the test's. Where the door listens by default
(the address the workers dial) is Ansible's too: the role's tasks, run against this box."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import free_port
from tests.support import sshd as sshd_kit

ROOT = Path(__file__).parents[2]
BIN = ROOT / ".venv" / "bin"
ROLE = ROOT / "roles" / "flodl_controller"
pytestmark = [
    pytest.mark.skipif(not (BIN / "ssh-audit").exists(), reason="ssh-audit is not installed in .venv"),
    pytest.mark.skipif(not (BIN / "ansible").exists(), reason="ansible is not installed in .venv"),
    pytest.mark.skipif(sshd_kit.missing() is not None, reason=str(sshd_kit.missing())),
]


def ansible_env() -> dict[str, str]:
    return {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}


def render(dest: Path, **overrides: object) -> None:
    """door_sshd_config.j2 rendered by Ansible with the role's defaults and vars, then ``overrides``."""
    extra = {"ansible_python_interpreter": str(BIN / "python"), **overrides}
    template = f"src={ROLE / 'templates' / 'door_sshd_config.j2'} dest={dest} mode=0644"
    role_vars = ["-e", f"@{ROLE / 'defaults' / 'main.yml'}", "-e", f"@{ROLE / 'vars' / 'main.yml'}"]
    adhoc = [str(BIN / "ansible"), "localhost", "-i", "localhost,", "-c", "local"]
    done = subprocess.run(
        [*adhoc, "-m", "ansible.builtin.template", "-a", template, *role_vars, "-e", json.dumps(extra)],
        cwd=ROOT,
        env=ansible_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


class Door:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.port = free_port()
        self.config = home / "sshd_config"
        self.host_key = home / "ssh_host_ed25519_key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.host_key)], check=True)
        render(
            self.config,
            flodl_controller_door_port=self.port,
            flodl_controller_door_listen_on="127.0.0.1",
            flodl_controller_door_dir=str(home),
            flodl_controller_door_host_key=str(self.host_key),
        )

    def audit(self, *options: str) -> dict[str, Any]:
        return sshd_kit.ssh_audit("127.0.0.1", self.port, *options)

    def effective(self) -> str:
        done = subprocess.run(
            [
                str(sshd_kit.SSHD),
                "-T",
                "-f",
                str(self.config),
                "-C",
                f"lport={self.port},user=flodl-join,addr=::1",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.lower()


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Door]:
    running = Door(tmp_path_factory.mktemp("door"))
    # The unit's PidFile is /run/flodl-door.pid: this one keeps its own.
    with sshd_kit.running(running.config, running.port, f"PidFile={running.home / 'sshd.pid'}"):
        yield running


def test_ssh_audit_finds_no_fail_and_warns_only_of_post_quantum_curve25519(door: Door) -> None:
    report = door.audit()
    fails, warns = sshd_kit.findings(report)
    assert fails == [] and report["cves"] == [], fails
    assert warns == sshd_kit.EXPECTED_WARNINGS
    assert report["compression"] == ["none"]
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    offered = {section: [e["algorithm"] for e in report[section]] for section in ("kex", "key", "enc", "mac")}
    assert offered == {
        "kex": [*defaults["flodl_controller_door_kex_algorithms"], sshd_kit.TERRAPIN],
        "key": ["ssh-ed25519"],
        "enc": defaults["flodl_controller_door_ciphers"],
        "mac": defaults["flodl_controller_door_macs"],
    }


def test_the_door_offers_only_what_the_hardened_openssh_9_2_policy_allows(door: Door, tmp_path: Path) -> None:
    """The built-in policy asks for its lists exactly, and Debian's 9.2 appends the Terrapin
    marker to every key-exchange list, so no sshd_config can match it: the door offers a strict
    subset of each list (and the marker). The same policy with subsets allowed, and the
    marker required as ssh-audit's own later policies require it, passes."""
    exact = door.audit("-P", sshd_kit.HARDENED_POLICY)
    assert exact["passed"] is False and sshd_kit.only_exactness(exact["errors"]), exact["errors"]
    subset = door.audit("-P", str(sshd_kit.hardened_subset_policy(tmp_path / "policy.txt")))
    assert subset["passed"] is True and subset["errors"] == [], subset


def test_sshd_takes_no_compression_and_throttles_each_source(door: Door) -> None:
    config = door.effective()
    for line in (
        f"listenaddress 127.0.0.1:{door.port}",
        "compression no",
        "logingracetime 30",
        "maxauthtries 3",
        "maxsessions 1",
        "maxstartups 10:30:100",
        "persourcemaxstartups 4",
        "persourcenetblocksize 32:128",
        # AEAD ciphers only, so no MAC is used; the list holds encrypt-then-MAC SHA-2 alone
        "macs hmac-sha2-512-etm@openssh.com,hmac-sha2-256-etm@openssh.com",
        "hostkeyalgorithms ssh-ed25519",
        "pubkeyacceptedalgorithms ssh-ed25519",
        # the guardrails that held still hold: the join account forwards to the controller port only
        "allowtcpforwarding local",
        "permitopen 127.0.0.1:1337",
        "permittty no",
        "x11forwarding no",
    ):
        assert line in config.splitlines(), line


def banner(source: str, port: int) -> tuple[socket.socket, bytes]:
    conn = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    return conn, conn.recv(64)


def test_one_source_gets_four_unauthenticated_connections_and_others_still_get_in(door: Door) -> None:
    held = []
    try:
        for _ in range(4):
            conn, greeting = banner("127.0.0.1", door.port)
            held.append(conn)
            assert greeting.startswith(b"SSH-2.0-"), greeting
        dropped, greeting = banner("127.0.0.1", door.port)
        dropped.close()
        assert greeting == b"Exceeded MaxStartups\r\n"
        other, greeting = banner("127.0.0.2", door.port)  # another address: its own budget
        other.close()
        assert greeting.startswith(b"SSH-2.0-"), greeting
    finally:
        for conn in held:
            conn.close()


def test_the_workers_stock_openssh_client_negotiates_and_legacy_algorithms_are_refused(
    door: Door, tmp_path: Path
) -> None:
    key = tmp_path / "join_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{door.port} {door.host_key.with_suffix('.pub').read_text().strip()}\n")
    worker = [
        "ssh",
        "-vv",
        "-p",
        str(door.port),
        "-i",
        str(key),
        "-o",
        "BatchMode=yes",
        "-o",
        "IdentitiesOnly=yes",
    ]
    worker += ["-o", f"UserKnownHostsFile={known}", "-o", "StrictHostKeyChecking=yes"]

    def dial(*options: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*worker, *options, "flodl-join@127.0.0.1", "true"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    # The worker's options (flodl_agent.net.ssh_argv, the data mount's): the key exchange, the
    # pinned host key and the cipher all agree; the key itself is no join key here.
    agreed = dial()
    for line in (
        "kex: algorithm: sntrup761x25519-sha512@openssh.com",
        "kex: host key algorithm: ssh-ed25519",
        "kex: server->client cipher: chacha20-poly1305@openssh.com",
    ):
        assert line in agreed.stderr, agreed.stderr[-2000:]
    assert "Permission denied (publickey)" in agreed.stderr
    for legacy, refusal in (
        ("KexAlgorithms=ecdh-sha2-nistp256,diffie-hellman-group14-sha256", "no matching key exchange method"),
        ("Ciphers=aes128-ctr,aes256-cbc", "no matching cipher"),
        ("HostKeyAlgorithms=ecdsa-sha2-nistp256,rsa-sha2-512", "no matching host key type"),
    ):
        refused = dial("-o", legacy)
        assert refused.returncode == 255 and refusal in refused.stderr, (legacy, refused.stderr[-600:])


LISTEN_TASKS = "Work out where the door listens"
CASE = """
- name: The case
  ansible.builtin.include_tasks: listen.yml
  vars:
    flodl_controller_address: "{{ item.value.address | default('localhost') }}"
    flodl_controller_door_listen: "{{ item.value.listen | default('') }}"
- name: Its address
  ansible.builtin.set_fact:
    picked: "{{ picked | default({}) | combine({item.key: flodl_controller_door_listen_on}) }}"
"""
PLAY = """
- name: Where the door listens
  hosts: localhost
  connection: local
  gather_facts: FACTS
  gather_subset: ["!all", network]
  tasks:
    - name: Each case
      ansible.builtin.include_tasks: case.yml
      loop: "{{ cases | dict2items }}"
    - name: Keep the picks, and the default route's address in the facts
      ansible.builtin.copy:
        content: "{{ picked | combine({'facts': ansible_facts.default_ipv4.address}) | to_json }}"
        dest: "{{ out }}"
        mode: "0644"
"""


def where_the_door_listens(
    tmp_path: Path, cases: dict[str, dict[str, str]], facts: bool = True
) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    """The role's own tasks that pick the door's address (tasks/door.yml), run on this box (with
    its network facts, or none) for each case's address and listen; the run, and each case's
    pick with the facts' default-route address."""
    door_tasks = yaml.safe_load((ROLE / "tasks" / "door.yml").read_text())
    (tmp_path / "listen.yml").write_text(yaml.safe_dump([t for t in door_tasks if t["name"] == LISTEN_TASKS]))
    (tmp_path / "case.yml").write_text(CASE)
    (tmp_path / "play.yml").write_text(PLAY.replace("FACTS", str(facts).lower()))
    extra = {
        "cases": cases,
        "out": str(tmp_path / "picked.json"),
        "ansible_python_interpreter": str(BIN / "python"),
    }
    done = subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "-i",
            "localhost,",
            str(tmp_path / "play.yml"),
            "-e",
            json.dumps(extra),
        ],
        cwd=ROOT,
        env=ansible_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    picked = tmp_path / "picked.json"
    return done, (dict(json.loads(picked.read_text())) if picked.exists() else {})


def test_the_door_listens_where_the_workers_dial_it_unless_told_otherwise(tmp_path: Path) -> None:
    own_name = socket.gethostname()
    name_is_loopback = all(
        info[4][0] in {"127.0.1.1", "127.0.0.1", "::1"} for info in socket.getaddrinfo(own_name, None)
    )
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("198.51.100.7", 9))  # no packet leaves: the kernel picks the default route's source
        route = probe.getsockname()[0]
    cases = {
        "route": {"address": route},  # the box's own address, as the workers dial it
        "told": {"listen": "0.0.0.0"},
        "localhost": {"address": "localhost"},
        "loopback": {"address": "127.0.0.1"},
        "elsewhere": {"address": "198.51.100.7"},  # a NAT's address, say: not this box's
        "unknown": {"address": "no-such-door.invalid"},
        "own name": {"address": own_name},
    }
    done, picked = where_the_door_listens(tmp_path, cases)
    assert done.returncode == 0, done.stdout[-3000:]
    assert picked["facts"] == route and picked["route"] == route
    assert picked["told"] == "0.0.0.0"
    assert picked["localhost"] in {"127.0.0.1", "::1"} and picked["loopback"] == "127.0.0.1"
    assert picked["elsewhere"] == route and picked["unknown"] == route
    # A name that resolves to loopback here (Debian's 127.0.1.1 for the box's own name) is not
    # what the workers reach: the door takes the default route's address instead.
    if name_is_loopback:
        assert picked["own name"] == route


def test_without_facts_or_a_usable_address_the_play_says_what_to_set(tmp_path: Path) -> None:
    done, _ = where_the_door_listens(tmp_path, {"nowhere": {"address": "no-such-door.invalid"}}, facts=False)
    assert done.returncode != 0
    assert "set flodl_controller_door_listen (0.0.0.0 listens on every interface)" in done.stdout

"""A private, real OpenSSH server on loopback for tests of tunnels and doors.

Host keys are pinned on the client side (a known_hosts file of our own) —
the tests never turn host key checking off.
"""

from __future__ import annotations

import ctypes
import json
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import yaml

from flodl_agent.config import ClusterBuilder
from flodl_agent.config.models import Ssh
from tests.support import free_port

SSHD = Path("/usr/sbin/sshd")
ROOT = Path(__file__).parents[2]
DOOR_FETCH = ROOT / "roles" / "flodl_controller" / "templates" / "door_fetch.j2"


def missing() -> str | None:
    """Why a real sshd cannot run here (None when it can)."""
    if not SSHD.exists() or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        return "OpenSSH server/client not installed (scripts/system-deps installs them)"
    return None


@dataclass
class Sshd:
    port: int
    home: Path
    client_key: Path
    known_hosts: Path
    authorized_keys: Path

    @property
    def options(self) -> list[str]:
        return [f"UserKnownHostsFile={self.known_hosts}", "StrictHostKeyChecking=yes"]

    def door(self) -> Ssh:
        """A join block's ssh: for this server as the door (root on loopback, the client key)."""
        return Ssh(
            target="127.0.0.1",
            port=self.port,
            user="root",
            identity_file=str(self.client_key),
            options=self.options,
        )

    def authorize(self, line_prefix: str = "") -> None:
        """Authorize the client key, optionally behind key options (the door recipe)."""
        key = self.client_key.with_suffix(".pub").read_text().strip()
        self.authorized_keys.write_text(f"{line_prefix} {key}\n".lstrip())

    @property
    def client(self) -> list[str]:
        """ssh with the client key and the pinned host key (an rsync ``-e``, joined)."""
        argv = ["ssh", "-p", str(self.port), "-i", str(self.client_key), "-o", "BatchMode=yes"]
        for option in self.options:
            argv += ["-o", option]
        return argv

    def ssh(self, *remote: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.client, "root@127.0.0.1", *remote],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


def door_fetch(served: Path, dest: Path, rrsync: Path | None = None) -> Path:
    """The controller role's door B program, rendered as the role renders it for the publish
    directory ``served`` (it serves ``served/tree``), executable at ``dest``; ``rrsync``: what
    it hands the pull to instead of the box's /usr/bin/rrsync."""
    env = jinja2.Environment(keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    env.filters["to_json"] = json.dumps  # Ansible's filter of that name
    text = env.from_string(DOOR_FETCH.read_text()).render(
        ansible_managed="rendered by the tests", flodl_controller_served_dir=str(served)
    )
    if rrsync is not None:
        assert RRSYNC_LINE in text, "door_fetch.j2 no longer names rrsync as the tests expect"
        text = text.replace(RRSYNC_LINE, f"RRSYNC = {json.dumps(str(rrsync))}")
    dest.write_text(text)
    dest.chmod(0o755)
    return dest


# --- ssh-audit (PyPI), as the door's audits run it -----------------------------------------
AUDIT = ROOT / ".venv" / "bin" / "ssh-audit"
HARDENED_POLICY = "Hardened OpenSSH Server v9.2 (version 3)"
PQ_NOTE = "does not provide protection against post-quantum attacks"
# The only warnings the door leaves: the post-quantum notes on the classical curve25519
# exchanges, which the hardened policy itself lists (OpenSSH before 8.5 has no sntrup761).
EXPECTED_WARNINGS = {
    ("kex", "curve25519-sha256"): [PQ_NOTE],
    ("kex", "curve25519-sha256@libssh.org"): [PQ_NOTE],
}
TERRAPIN = "kex-strict-s-v00@openssh.com"  # Debian's 9.2 appends it to every key-exchange list


def ssh_audit(host: str, port: int, *options: str) -> dict[str, Any]:
    """``ssh-audit -j`` against ``host:port`` (``options``: a policy, say): its JSON report."""
    done = subprocess.run(
        [str(AUDIT), "-j", "-p", str(port), *options, host],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.stdout.strip(), done.stderr
    return dict(json.loads(done.stdout))


def findings(report: dict[str, Any]) -> tuple[list[tuple[str, str, str]], dict[tuple[str, str], list[str]]]:
    """An audit's [fail] notes, and its [warn] notes by (section, algorithm)."""
    fails, warns = [], {}
    for section in ("kex", "key", "enc", "mac"):
        for entry in report.get(section, []):
            notes = entry.get("notes", {})
            fails += [(section, entry["algorithm"], note) for note in notes.get("fail", [])]
            if notes.get("warn"):
                warns[(section, entry["algorithm"])] = notes["warn"]
    return fails, warns


def only_exactness(errors: list[dict[str, Any]]) -> bool:
    """A policy's errors are all of one kind: the server offers fewer of a list's algorithms
    than the policy names (and the Terrapin marker, which the v9.2 policy predates)."""
    fields = {"Host keys", "Key exchanges", "Ciphers", "MACs"}
    return all(
        error["mismatched_field"] in fields
        and set(error["actual"]) <= {*error["expected_required"], *error["expected_optional"], TERRAPIN}
        for error in errors
    )


def hardened_subset_policy(dest: Path) -> Path:
    """ssh-audit's HARDENED_POLICY with its lists unchanged, a server allowed to offer a subset
    of each, compression none and the Terrapin marker required (as its later versions require
    it): a policy file for ``ssh-audit -P``. Needs ssh-audit (PyPI) importable."""
    from ssh_audit.builtin_policies import BUILTIN_POLICIES  # type: ignore[import-untyped]  # audits only

    policy = BUILTIN_POLICIES[HARDENED_POLICY]
    lists = {
        "host keys": [*policy["host_keys"], *policy["optional_host_keys"]],
        "key exchanges": [*policy["kex"], TERRAPIN],
        "ciphers": policy["ciphers"],
        "macs": policy["macs"],
    }
    dest.write_text(
        f'name = "{HARDENED_POLICY}, subsets allowed"\nversion = 1\n'
        "allow_algorithm_subset_and_reordering = true\nallow_larger_keys = false\ncompressions = none\n"
        f"host_key_sizes = {json.dumps(policy['hostkey_sizes'])}\n"
        f"dh_modulus_sizes = {json.dumps(policy['dh_modulus_sizes'])}\n"
        + "".join(f"{field} = {', '.join(names)}\n" for field, names in lists.items())
    )
    return dest


RRSYNC_LINE = 'RRSYNC = "/usr/bin/rrsync"'
LANDLOCK_CALLS = (444, 446)  # landlock_create_ruleset .. landlock_restrict_self, on every architecture


def deny_landlock() -> None:
    """Refuse Landlock's system calls with EPERM in this process and all it starts (a seccomp
    filter), as a systemd unit's SystemCallFilter= without them does: for Popen's preexec_fn."""
    ld_nr, jge, jgt, ret = 0x20, 0x35, 0x25, 0x06  # BPF: load word, jump >=, jump >, return
    program = [
        (ld_nr, 0, 0, 0),  # the system call's number
        (jge, 0, 2, LANDLOCK_CALLS[0]),
        (jgt, 1, 0, LANDLOCK_CALLS[1]),
        (ret, 0, 0, 0x00050000 | 1),  # SECCOMP_RET_ERRNO | EPERM
        (ret, 0, 0, 0x7FFF0000),  # SECCOMP_RET_ALLOW
    ]
    code = b"".join(struct.pack("=HBBI", *op) for op in program)
    filters = ctypes.create_string_buffer(code)
    fprog = struct.pack("@HP", len(program), ctypes.addressof(filters))  # struct sock_fprog
    libc = ctypes.CDLL(None, use_errno=True)
    # PR_SET_NO_NEW_PRIVS, then PR_SET_SECCOMP with SECCOMP_MODE_FILTER
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.create_string_buffer(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "could not install the seccomp filter")


@contextmanager
def serve(
    home: Path, env: Mapping[str, str] | None = None, extra: str = "", no_landlock: bool = False
) -> Iterator[Sshd]:
    """An sshd in ``home`` (created here) for the length of the block; the client key authorized.
    ``env``: set in every session (sshd's SetEnv), e.g. a PATH with fake vendor tools first;
    ``extra``: more sshd_config lines (a door's ForceCommand, say); ``no_landlock``: its sessions
    are refused Landlock, as under a unit whose system-call filter leaves it out."""
    home.mkdir()
    _keygen(home / "host_key")
    _keygen(home / "client_key")
    port = free_port()
    known = home / "known_hosts"
    known.write_text(f"[127.0.0.1]:{port} {(home / 'host_key.pub').read_text().strip()}\n")
    authorized = home / "authorized_keys"
    config = home / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {home / 'host_key'}\nPidFile {home / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {authorized}\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\nAllowTcpForwarding yes\n"
        "Subsystem sftp internal-sftp\nLogLevel ERROR\n"
        + "".join(f"SetEnv {key}={value}\n" for key, value in (env or {}).items())
        + extra
    )
    server = Sshd(port, home, home / "client_key", known, authorized)
    server.authorize()
    with running(config, port, no_landlock=no_landlock):
        yield server


@contextmanager
def running(config: Path, port: int, *options: str, no_landlock: bool = False) -> Iterator[None]:
    """``/usr/sbin/sshd -D -f config`` (``options``: its -o overrides) for the length of the block,
    up once it accepts on 127.0.0.1:``port``; ``no_landlock``: as for :func:`serve`."""
    Path("/run/sshd").mkdir(exist_ok=True)  # privilege separation directory
    log = config.with_suffix(".log")  # a file, not a pipe: nothing reads it while sshd runs
    overrides = [arg for option in options for arg in ("-o", option)]
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [str(SSHD), "-D", "-e", "-f", str(config), *overrides],
            stderr=stderr,
            preexec_fn=deny_landlock if no_landlock else None,
        )
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"sshd did not start: {log.read_text()}") from None
            time.sleep(0.05)  # sshd binds its port when ready; nothing else to wait on
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def loopback_cluster(
    tmp_path: Path, server: Sshd, port: int, tls: tuple[Path, Path] | None = None, **join: object
) -> Path:
    """A cluster file whose two workers, fan-a and fan-b, are this box reached through ``server``;
    they run the repository's own fdl, the controller on ``port`` (over TLS with ``tls``: cert, key)."""
    served = {"tls": {"cert": str(tls[0]), "key": str(tls[1])}} if tls else {}
    builder = ClusterBuilder().controller("127.0.0.1", port=port, path=str(ROOT), **served).join(**join)
    for name in ("fan-a", "fan-b"):
        builder.worker(
            name,
            ssh={
                "target": "127.0.0.1",
                "port": server.port,
                "user": "root",
                "identity_file": str(server.client_key),
                "options": server.options,
            },
            local_devices="cpu:1",
            nccl_socket_ifname="lo",
        )
    path = tmp_path / "fdl.cluster.yml"
    path.write_text(yaml.safe_dump(builder.to_data()))
    return path

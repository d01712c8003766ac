"""A private, real OpenSSH server on loopback for tests of tunnels and doors.

Host keys are pinned on the client side (a known_hosts file of our own) —
the tests never turn host key checking off.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

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


def door_fetch(served: Path, dest: Path) -> Path:
    """The controller role's door B program, rendered as the role renders it for the publish
    directory ``served`` (it serves ``served/tree``), executable at ``dest``."""
    env = jinja2.Environment(keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    env.filters["to_json"] = json.dumps  # Ansible's filter of that name
    text = env.from_string(DOOR_FETCH.read_text()).render(
        ansible_managed="rendered by the tests", flodl_controller_served_dir=str(served)
    )
    dest.write_text(text)
    dest.chmod(0o755)
    return dest


@contextmanager
def serve(home: Path, env: Mapping[str, str] | None = None, extra: str = "") -> Iterator[Sshd]:
    """An sshd in ``home`` (created here) for the length of the block; the client key authorized.
    ``env``: set in every session (sshd's SetEnv), e.g. a PATH with fake vendor tools first;
    ``extra``: more sshd_config lines (a door's ForceCommand, say)."""
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
    Path("/run/sshd").mkdir(exist_ok=True)  # privilege separation directory
    server = Sshd(port, home, home / "client_key", known, authorized)
    server.authorize()
    proc = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(config)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"sshd did not start: {proc.stderr.read() if proc.stderr else ''}"
                ) from None
            time.sleep(0.05)  # sshd binds its port when ready; nothing else to wait on
    try:
        yield server
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

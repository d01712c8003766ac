"""Connections through the door count against their account's budget, not the loopback exemption.

The door's session process runs as its join account and opens every forwarded
connection, so a tunnelled walk-in arrives from 127.0.0.1. The kernel knows the
account; the controller's gate keeps one budget per account (``tunnel_budget``).
Here a real OpenSSH server logs a second account in (``nobody``: the controller
runs as root in these tests) and a flood goes through its tunnel.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import socket
import struct
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from flodl_agent.agent.agent import AgentFailure
from flodl_agent.agent.options import AgentOptions
from flodl_agent.config import DeviceOffer
from flodl_agent.config.models import Ssh
from flodl_agent.controller.controller import Controller
from flodl_agent.controller.listener import Timeouts
from flodl_agent.controller.tunnel_budget import Owners, label
from flodl_agent.protocol import local_port
from tests.support import free_port
from tests.support import sshd as sshd_kit
from tests.support.control_plane import agent, run, settings, until, walk_in

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="logs other accounts in: needs root")

CAP = 16  # the per-peer cap of unadmitted connections, small so that a flood is quick
FLOOD = 64

# Opens connections to the port in argv[1] and holds them until its stdin closes.
FLOODER = """
import socket, sys
held = [socket.create_connection(("127.0.0.1", int(sys.argv[1]))) for _ in range(int(sys.argv[2]))]
print("held", flush=True)
sys.stdin.read()
"""

# Dials the port in argv[1] as whoever runs it, says its own port, and waits for stdin to close.
DIALLER = """
import socket, sys
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
print(sock.getsockname()[1], flush=True)
sys.stdin.read()
"""


# The dialler runs as another account, which cannot reach this checkout's interpreter.
SYSTEM_PYTHON = Path("/usr/bin/python3")


def _fds() -> int:
    return sum(1 for _ in Path("/proc/self/fd").iterdir())


@pytest.fixture
def keys() -> Iterator[Path]:
    """An authorized-keys folder the other accounts can read (pytest's tmp_path is root's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="flodl-door-keys-"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


def _door(server: sshd_kit.Sshd, user: str) -> Ssh:
    return Ssh(
        target="127.0.0.1",
        port=server.port,
        user=user,
        identity_file=str(server.client_key),
        options=server.options,
    )


def _through(server: sshd_kit.Sshd, ctl: Controller, host: str, user: str) -> AgentOptions:
    return AgentOptions(
        controller_host="127.0.0.1",
        controller_port=ctl.port,
        host=host,
        devices=DeviceOffer("cpu", cpus=1),
        ssh=_door(server, user),
    )


def _listening(port: int) -> bool:
    return bool(local_port.listener_uids(Path("/proc/net/tcp").read_text(), "127.0.0.1", port))


def test_the_kernel_names_the_account_that_opened_a_loopback_connection() -> None:
    if not SYSTEM_PYTHON.exists():
        pytest.skip(f"no {SYSTEM_PYTHON} for the other account to run")
    nobody = pwd.getpwnam("nobody").pw_uid

    async def scenario() -> None:
        server = socket.create_server(("127.0.0.1", 0))
        server.setblocking(False)
        port = server.getsockname()[1]
        loop = asyncio.get_running_loop()
        dialler = await asyncio.create_subprocess_exec(
            str(SYSTEM_PYTHON), "-I", "-c", DIALLER, str(port), user=nobody,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        theirs, _ = await loop.sock_accept(server)
        mine_out = socket.create_connection(("127.0.0.1", port))
        mine, _ = await loop.sock_accept(server)
        fast, tables = Owners(), Owners(diag=False)  # sock_diag, and /proc/net/tcp as a sandbox leaves it
        try:
            for owners in (fast, tables):
                assert owners.uid(theirs) == nobody
                assert owners.uid(mine) == os.geteuid()
            assert fast._diag is not None and not fast._diag_failed  # the fast road was taken
            # A far end reset before we asked is nobody's: not root's (its orphan's uid 0).
            mine_out.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            mine_out.close()
            assert fast.uid(mine) is None and Owners(diag=False).uid(mine) is None
            left, right = socket.socketpair()
            assert fast.uid(left) == os.geteuid()  # a unix socket names its user itself
            left.close(), right.close()
        finally:
            fast.close()
            assert dialler.stdin is not None
            dialler.stdin.close()
            await dialler.wait()
            for sock in (theirs, mine, server):
                sock.close()

    run(scenario)


def test_a_flood_through_a_door_account_is_held_to_its_budget_and_locks_out_no_one_else(
    tmp_path: Path, keys: Path
) -> None:
    if why := sshd_kit.missing():
        pytest.skip(why)
    nobody = pwd.getpwnam("nobody")
    door = label(nobody.pw_uid, "nobody")
    log: list[str] = []

    async def scenario() -> None:
        ctl = Controller(
            settings(quorum=3, target=3),
            log=log.append,
            # Long enough that the flood's silent connections stay until the flooder hangs up.
            timeouts=Timeouts(per_peer=CAP, preamble=60.0, hello=60.0),
        )
        await ctl.start()
        # The door's rules for both accounts: a forward to the controller port and nothing else.
        extra = (
            "Match User nobody,daemon\n"
            f"    AuthorizedKeysFile {keys / 'authorized_keys'}\n"
            f"    PermitOpen 127.0.0.1:{ctl.port}\n"
        )
        with sshd_kit.serve(tmp_path / "sshd", extra=extra) as server:
            (keys / "authorized_keys").write_text(server.client_key.with_suffix(".pub").read_text())
            (keys / "authorized_keys").chmod(0o644)
            # Before the flood, an operator's walk-in on the box (the controller's own user).
            local = asyncio.ensure_future(walk_in(agent(ctl, "on-the-box")))
            await until(lambda: "on-the-box" in ctl.links)
            before = _fds()
            # The stolen key's tunnel: up when ssh listens (a test dial would be one more channel).
            forward = free_port()
            tunnel = await asyncio.create_subprocess_exec(
                *server.client, "-N", "-o", "ExitOnForwardFailure=yes",
                "-L", f"127.0.0.1:{forward}:127.0.0.1:{ctl.port}", "nobody@127.0.0.1",
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            try:
                await until(lambda: _listening(forward), timeout=20)
                flooder = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", FLOODER, str(forward), str(FLOOD),
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                )  # fmt: skip
                assert flooder.stdout is not None and await flooder.stdout.readline() == b"held\n"
                # Every channel reached the controller: CAP held, the rest turned away at once.
                gate = ctl.listener.gate
                await until(lambda: gate.unsettled(door) + ctl.dropped["busy_peer"] == FLOOD, timeout=30)
                assert gate.unsettled(door) == CAP
                # What else this process opened meanwhile: the two subprocesses' pipes.
                held = _fds() - before
                assert held <= CAP + 8, f"the flood holds {held} of the controller's descriptors"

                # Through another tunnel of the same account: turned away while the flood lasts.
                refused = await walk_in(_through(server, ctl, "door-b", "nobody"))
                assert isinstance(refused, AgentFailure) and "before its challenge" in refused.message
                # Through another account's tunnel: its own budget, untouched.
                other = asyncio.ensure_future(walk_in(_through(server, ctl, "door-c", "daemon")))
                await until(lambda: "door-c" in ctl.links)

                # The flood ends: its slots are settled, and the account's next walk-in is admitted.
                assert flooder.stdin is not None
                flooder.stdin.close()
                await flooder.wait()
                await until(lambda: gate.unsettled(door) == 0)
                assert await walk_in(_through(server, ctl, "door-b", "nobody")) == 0
            finally:
                tunnel.terminate()
                await tunnel.wait()
            assert await local == 0 and await other == 0
        await ctl.finished.wait()
        assert ctl.exit_code == 0
        await ctl.close()

    run(scenario)
    turned = [line for line in log if line.startswith(f"turned {door} away")]
    # A line per account and cause a minute, however many were turned away: not one per channel.
    assert len(turned) == 1 and f"holds {CAP} unadmitted connections already" in turned[0], log
    assert any(f"admitted door-b ({door})" in line for line in log), log


# POSTs /start to the port in argv[1] with the body in argv[2]; prints the status line.
STARTER = """
import socket, sys
body = sys.argv[2].encode()
with socket.create_connection(("127.0.0.1", int(sys.argv[1]))) as sock:
    sock.sendall(b"POST /start HTTP/1.1\\r\\nHost: 127.0.0.1:" + sys.argv[1].encode()
                 + b"\\r\\nContent-Type: application/x-www-form-urlencoded\\r\\nContent-Length: "
                 + str(len(body)).encode() + b"\\r\\n\\r\\n" + body)
    print(sock.makefile("rb").readline().decode().strip(), flush=True)
"""


def test_a_start_through_another_account_needs_the_token_as_a_remote_one_does() -> None:
    # The door's tunnels arrive on loopback as the join account: before, a stolen worker
    # key could fire a manual start with no token. Only the operator on the box may.
    if not SYSTEM_PYTHON.exists():
        pytest.skip(f"no {SYSTEM_PYTHON} for the other account to run")
    nobody = pwd.getpwnam("nobody").pw_uid
    token = "5" * 32

    async def post(port: int, body: str, user: int | None) -> str:
        proc = await asyncio.create_subprocess_exec(
            str(SYSTEM_PYTHON), "-I", "-c", STARTER, str(port), body, user=user,
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await proc.communicate()
        return out.decode().strip()

    async def scenario() -> None:
        ctl = Controller(settings(start="manual", quorum=1, target=None, token=token))
        await ctl.start()
        try:
            assert (await post(ctl.port, "", nobody)).startswith("HTTP/1.1 403")
            assert (await post(ctl.port, "token=" + "6" * 32, nobody)).startswith("HTTP/1.1 403")
            # with the token it is let through to the window (no quorum yet: 409, not 403)
            assert (await post(ctl.port, f"token={token}", nobody)).startswith("HTTP/1.1 409")
            # the controller's own user on the box needs none
            assert (await post(ctl.port, "", None)).startswith("HTTP/1.1 409")
        finally:
            await ctl.close()

    run(scenario)

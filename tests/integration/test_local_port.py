"""Walk-ins on the controller's box come through its local socket, and trust it only when the
user behind it holds the TCP port they asked for."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from flodl_agent.agent import agent as agent_module
from flodl_agent.controller.controller import Controller
from flodl_agent.protocol import local_port
from flodl_agent.protocol.streams import dial
from flodl_agent.protocol.tls import generate
from flodl_agent.retry import Permanent
from tests.support.control_plane import run, settings, walk_ins


def families(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The socket family of every connection the agents dial from now on."""
    seen: list[int] = []

    async def recording(*args: Any, **kwargs: Any) -> Any:
        reader, writer = await dial(*args, **kwargs)
        seen.append(writer.get_extra_info("socket").family)
        return reader, writer

    monkeypatch.setattr(agent_module, "dial", recording)
    return seen


@pytest.mark.parametrize(("local", "family"), [(True, socket.AF_UNIX), (False, socket.AF_INET)])
def test_walk_ins_on_the_controllers_box_train_through_its_local_socket(
    monkeypatch: pytest.MonkeyPatch, local: bool, family: int
) -> None:
    seen = families(monkeypatch)

    async def scenario() -> None:
        ctl = Controller(settings(local_socket=local))
        await ctl.start()
        assert await walk_ins(ctl, ("a", 1), ("b", 1)) == [0, 0]
        await ctl.finished.wait()
        assert ctl.exit_code == 0 and ctl.admitted == 2
        await ctl.close()
        # Closed with the port: the name is free again, and a dial goes nowhere local.
        assert await local_port.connect("127.0.0.1", ctl.port) is None

    run(scenario)
    assert seen == [family, family]


def test_a_pinned_dial_runs_tls_over_the_local_socket(tmp_path: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "c.key"
    pin = generate(cert, key, ["127.0.0.1"])

    async def scenario() -> None:
        ctl = Controller(settings(tls=(str(cert), str(key))))
        await ctl.start()
        _, writer = await dial("127.0.0.1", ctl.port, pin)
        assert writer.get_extra_info("ssl_object") is not None
        assert writer.get_extra_info("socket").family == socket.AF_UNIX
        writer.close()
        with pytest.raises(Permanent, match="not the pinned"):
            await dial("127.0.0.1", ctl.port, "sha256:" + "3" * 64)
        await ctl.close()

    run(scenario)


SQUATTER = """
import os, socket, sys
os.setgid(65534)
os.setuid(65534)
s = socket.socket(socket.AF_UNIX)
s.bind("\\0flodl/127.0.0.1:" + sys.argv[1])
s.listen()
print("bound", flush=True)
conn, _ = s.accept()
print("dialled", flush=True)
conn.recv(1)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a squatter of another user needs root to become one")
def test_a_name_another_user_holds_is_not_trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Someone else binds the controller's local name first: the controller says so and the
    agents dial TCP; they never talk to the squatter."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    squatter = subprocess.Popen(
        [sys.executable, "-c", SQUATTER, str(port)], stdout=subprocess.PIPE, text=True
    )
    assert squatter.stdout is not None and squatter.stdout.readline() == "bound\n"
    seen = families(monkeypatch)
    log: list[str] = []

    async def scenario() -> None:
        ctl = Controller(replace(settings(), port=port), log=log.append)
        await ctl.start()
        assert await walk_ins(ctl, ("a", 1), ("b", 1)) == [0, 0]
        await ctl.finished.wait()
        assert ctl.exit_code == 0
        await ctl.close()

    try:
        run(scenario)
        assert seen == [socket.AF_INET, socket.AF_INET]
        assert any(f"cannot listen on the local socket @flodl/127.0.0.1:{port}" in line for line in log)
        assert squatter.stdout.readline() == "dialled\n"  # it was asked, and not believed
    finally:
        squatter.kill()
        squatter.wait()


def _row(address: str, port: int, uid: int, state: str = "0A") -> str:
    """A /proc/net/tcp(6) line: each 32-bit word of the address in this machine's byte order."""
    packed = socket.inet_pton(socket.AF_INET6 if ":" in address else socket.AF_INET, address)
    words = "".join(f"{struct.unpack('=I', packed[i : i + 4])[0]:08X}" for i in range(0, len(packed), 4))
    timers = "00000000:00000000 00:00000000 00000000"
    return f"   0: {words}:{port:04X} {'0' * len(words)}:0000 {state} {timers} {uid} 0 1"


HEAD = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode"


def test_the_port_holder_is_read_from_the_kernels_socket_table() -> None:
    table = "\n".join(
        [
            HEAD,
            _row("0.0.0.0", 29500, 7),
            _row("127.0.0.1", 29500, 1000),
            _row("127.0.0.1", 29501, 5),
            _row("127.0.0.1", 29502, 6, state="01"),  # connected, not listening
        ]
    )
    assert local_port.listener_uids(table, "127.0.0.1", 29500) == {1000}  # the exact address wins
    assert local_port.listener_uids(table, "127.0.0.2", 29500) == {7}  # else the wildcard's holder
    assert local_port.listener_uids(table, "127.0.0.1", 29502) == set()
    six = "\n".join([HEAD, _row("::1", 29500, 42), _row("::", 29501, 43)])
    assert local_port.listener_uids(six, "::1", 29500) == {42}
    assert local_port.listener_uids(six, "[::1]", 29501) == {43}
    assert local_port.listener_uids(HEAD + "\n   0: garbage\n", "127.0.0.1", 29500) == set()


def test_trust_needs_the_one_holder_and_a_user_this_namespace_can_name(tmp_path: Path) -> None:
    (tmp_path / "tcp").write_text(
        "\n".join([HEAD, _row("127.0.0.1", 29500, 1000), _row("0.0.0.0", 29501, 0)])
    )
    assert local_port.trusted(1000, "127.0.0.1", 29500, tmp_path)
    assert not local_port.trusted(1001, "127.0.0.1", 29500, tmp_path)  # somebody else's socket
    assert not local_port.trusted(0, "127.0.0.1", 29999, tmp_path)  # nobody holds that port
    assert local_port.trusted(0, "localhost", 29501, tmp_path)
    (tmp_path / "tcp").write_text("\n".join([HEAD, _row("127.0.0.1", 29500, 65534)]))
    assert not local_port.trusted(65534, "127.0.0.1", 29500, tmp_path)  # unmapped users look alike
    assert not local_port.trusted(0, "::1", 29500, tmp_path)  # no tcp6 table there


def test_only_loopback_reachable_ports_get_a_local_name() -> None:
    bound = [("0.0.0.0", 29500), ("::", 29500), ("127.0.0.1", 29500), ("10.0.0.5", 29500), ("::1", 80)]
    assert local_port.names(bound) == ["\0flodl/127.0.0.1:29500", "\0flodl/::1:29500", "\0flodl/::1:80"]
    assert local_port.name_for("10.0.0.5", 29500) is None and local_port.name_for("ctl.example", 1) is None
    assert local_port.name_for("localhost", 1) == "\0flodl/127.0.0.1:1"
    assert local_port.address_of("\0flodl/::1:29500") == "::1"


def test_a_dial_elsewhere_never_looks_for_a_local_socket() -> None:
    async def scenario() -> None:
        assert await local_port.connect("192.0.2.1", 29500) is None
        assert await local_port.connect("ctl.example", 29500) is None
        assert await local_port.connect("127.0.0.1", 1) is None  # nobody there

    asyncio.run(scenario())

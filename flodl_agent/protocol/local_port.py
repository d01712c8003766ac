"""The controller port on its own box: a unix socket beside each loopback-reachable TCP one.

A walk-in on the controller's box (``fdl join 127.0.0.1:PORT``) talks to the
controller through the kernel twice per byte however it connects; over TCP loopback
that costs about twice what a unix socket does (docs/performance.md), and the CPU
plane moves every host's model up and the average back down each round. So a
controller whose TCP port this box reaches on loopback also listens on an abstract
unix socket named after that address (``@flodl/127.0.0.1:29500``), and an agent that
dials a loopback address tries it first. Nothing else changes: the same preamble,
TLS when the port serves it, hello, admission and authenticated frames.

An abstract name is not a port: any local user may bind it first. So the agent
trusts the socket only when the process behind it (``SO_PEERCRED``) runs as the user
that holds the TCP port it asked for (``/proc/net/tcp``); anything else, and it dials
TCP as it would have. A name in another network namespace (a container, the bench's
shaped hosts, a tunnel's far end) is simply not there.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import struct
import sys
from collections.abc import Iterable
from pathlib import Path

from ..address import BIND_ALL

PREFIX = "\0flodl/"
BUFFER = 4 << 20  # bytes each way: the kernel's default (208 KiB) wakes each side 20 times a MiB
CONNECT_TIMEOUT = 1.0  # seconds before a dial gives up on the local socket and takes TCP
LISTEN = "0A"  # /proc/net/tcp's state for a listening socket
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
PROC_NET = Path("/proc/net")
LINUX = sys.platform.startswith("linux")  # abstract names, SO_PEERCRED and /proc/net: Linux's


def _canonical(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    host = "127.0.0.1" if host == "localhost" else host.split("%")[0].strip("[]")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def name_for(host: str, port: int) -> str | None:
    """The unix socket that stands for loopback ``host``:``port`` (None: not a loopback address)."""
    address = _canonical(host)
    if address is None or not address.is_loopback:
        return None
    return f"{PREFIX}{address}:{port}"


def address_of(name: str) -> str:
    """The loopback address a local socket's name stands for (what its peers count as)."""
    return name[len(PREFIX) :].rpartition(":")[0]


def names(bound: Iterable[tuple[str, int]]) -> list[str]:
    """The local names for a controller's TCP sockets, (address, port) each: a loopback address
    is reached as itself, a bind-all one on its family's loopback, anything else not at all."""
    out = []
    for host, port in bound:
        name = name_for(BIND_ALL.get(host, host), port)
        if name is not None and name not in out:
            out.append(name)
    return out


def listener_uids(table: str, host: str, port: int) -> set[int]:
    """Who holds TCP ``host``:``port`` in a ``/proc/net/tcp`` (or ``tcp6``) table: the uids of the
    sockets listening on exactly that address, or failing any, on the family's wildcard."""
    wanted = _canonical(host)
    exact: set[int] = set()
    wildcard: set[int] = set()
    needle = f":{port:04X} "  # a box with thousands of connections: most lines are not it
    for line in table.splitlines()[1:]:
        if needle not in line:
            continue
        fields = line.split()
        if len(fields) < 8 or fields[3] != LISTEN:
            continue
        address, _, hex_port = fields[1].partition(":")
        try:
            if int(hex_port, 16) != port:
                continue
            # Each 32-bit word is printed in this machine's byte order.
            raw = b"".join(struct.pack("=I", int(address[i : i + 8], 16)) for i in range(0, len(address), 8))
            listening = ipaddress.ip_address(raw)
            uid = int(fields[7])
        except ValueError:
            continue
        if listening == wanted:
            exact.add(uid)
        elif listening.is_unspecified and listening.version == getattr(wanted, "version", 0):
            wildcard.add(uid)
    return exact or wildcard


def _overflow_uid() -> int:
    """The uid a user namespace shows for a user it does not map (two of them look alike)."""
    try:
        return int(Path("/proc/sys/kernel/overflowuid").read_text())
    except (OSError, ValueError):
        return 65534


def trusted(peer_uid: int, host: str, port: int, proc_net: Path = PROC_NET) -> bool:
    """The process behind a local socket runs as the one user that holds TCP ``host``:``port``."""
    address = _canonical(host)
    table = "tcp6" if address is not None and address.version == 6 else "tcp"
    try:
        uids = listener_uids((proc_net / table).read_text(), host, port)
    except OSError:
        return False
    return uids == {peer_uid} and peer_uid != _overflow_uid()


def tune(sock: socket.socket) -> None:
    """Buffers as deep as TCP's autotuning makes them (the kernel caps them at wmem_max/rmem_max)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)


def bind(bound: Iterable[tuple[str, int]]) -> tuple[list[socket.socket], list[str]]:
    """Listening unix sockets for a controller's TCP ones: (sockets, the names someone else holds)."""
    sockets: list[socket.socket] = []
    taken: list[str] = []
    for name in names(bound) if LINUX else []:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(name)
            sock.listen(socket.SOMAXCONN)
        except OSError:
            sock.close()
            taken.append(name)  # squatted, or a namespace without unix sockets: walk-ins use TCP
            continue
        sock.setblocking(False)
        sockets.append(sock)
    return sockets, taken


async def connect(host: str, port: int) -> socket.socket | None:
    """A connected unix socket to the controller that holds loopback ``host``:``port``, or None
    (not loopback, nobody there, or somebody else there): then dial TCP."""
    name = name_for(host, port)
    if name is None or not LINUX:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        # A unix socket's full backlog answers EAGAIN, and may never say when it has room.
        async with asyncio.timeout(CONNECT_TIMEOUT):
            await asyncio.get_running_loop().sock_connect(sock, name)
        _, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    except (OSError, TimeoutError):
        sock.close()
        return None
    if not trusted(uid, host, port):
        sock.close()
        return None
    tune(sock)
    return sock

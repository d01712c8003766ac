"""Whose budget a loopback connection spends: the local account behind it.

Workers walk in through the join door: an sshd on this box whose join account may
forward to the controller port alone. The door's session process, running as that
account, opens each forwarded connection, so every tunnelled walk-in arrives from
127.0.0.1; a flat loopback exemption let one stolen key's tunnel hold thousands of
the controller's descriptors. The kernel knows which user opened the far end of a
loopback connection, so the gate keeps a budget per local account (the per-peer
cap of unadmitted connections and the bad-dial rate) and exempts only the
controller's own user: an operator's ``fdl join 127.0.0.1`` on this box, which
could stop the controller anyway.

sshd does not tell which session a forwarded connection came from, so the budget
is per account, not per tunnel. The trade-off: while a flood through one door
session holds the account's cap, the account's other walk-ins are turned away too
(and re-dial: admitted at the first dial after the flood's connections are gone;
a silent flood's are cut at the preamble deadline, each cut a bad dial, so past
the burst the account is rate-limited until its budget refills). The ranks
already admitted are not counted, the controller's descriptors stay bounded, and
other accounts are not touched. What one session can hold is the door unit's to
bound (``LimitNOFILE``: a session's descriptors are its channels and seven).

Asking the kernel: the exact lookup of ``sock_diag`` (a netlink request for one
4-tuple, tens of microseconds), else ``/proc/net/tcp`` and ``tcp6`` (a scan of
every socket of the box: tens of milliseconds at 10,000, read once per batch of
arrivals). A unix-socket arrival names its user itself (``SO_PEERCRED``).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import ipaddress
import os
import pwd
import socket
import struct
from collections.abc import Callable
from pathlib import Path

PROC_NET = Path("/proc/net")
UNKNOWN = "loopback (owner unknown)"  # its far end is gone, or in another network namespace

# linux/netlink.h, linux/sock_diag.h, linux/inet_diag.h
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port id
_REQUEST = struct.Struct("=BBBBI")  # inet_diag_req_v2: family, protocol, ext, pad, states
_PORTS = struct.Struct("!HH")  # the sockid's ports, in network order
_TAIL = struct.Struct("=III")  # the sockid's interface and cookie (none: look it up by address)
_OWNER = struct.Struct("=II")  # inet_diag_msg's uid and inode
_OWNER_AT = _HEADER.size + 4 + 48 + 12  # after family..retrans, the sockid, expires/rqueue/wqueue
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Unavailable(Exception):
    """Nothing on this box can tell who owns a loopback connection."""


def label(uid: int, name: str | None) -> str:
    """How a local account's budget is named: in the gate's books and in the log."""
    return f"loopback as {name} (uid {uid})" if name else f"loopback as uid {uid}"


def budget_key(owner: int | None, own: int, name: Callable[[int], str | None]) -> str | None:
    """The budget a loopback connection spends, by the uid that opened its far end; ``None``:
    none (the controller's own user). A connection whose owner is not known (``None``) is
    counted, under one budget for all such: else a flood could hide behind a lookup it races."""
    if owner is None:
        return UNKNOWN
    if owner == own:
        return None
    return label(owner, name(owner))


def _hex(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    """An address as /proc/net/tcp prints it: each 32-bit word in this machine's byte order."""
    packed = address.packed
    return "".join(f"{word:08X}" for word in struct.unpack(f"={len(packed) // 4}I", packed))


def _needle(peer: tuple[str, int], local: tuple[str, int], mapped: bool = False) -> str:
    """The columns of the far end's row: its address is the peer's, its remote one ours."""

    def column(host: str, port: int) -> str:
        address = ipaddress.ip_address(host)
        if mapped:
            address = ipaddress.IPv6Address(f"::ffff:{address}")
        return f"{_hex(address)}:{port:04X}"

    return f" {column(*peer)} {column(*local)} "


def table_owner(
    table: str, peer: tuple[str, int], local: tuple[str, int], mapped: bool = False
) -> int | None:
    """The uid that opened ``peer``'s end of its connection to ``local``, read off a
    ``/proc/net/tcp`` (``mapped``: a ``tcp6`` table, where an IPv4 peer may sit as
    ``::ffff:a.b.c.d``); ``None`` when no row with an owner has it. A row without an inode
    (closed, orphaned, in TIME_WAIT) prints uid 0 for nobody: it is no owner."""
    needle = _needle(peer, local, mapped)
    at = table.find(needle)  # a box with thousands of sockets: a scan in C, not a split per row
    while at >= 0:
        start = table.rfind("\n", 0, at) + 1
        end = table.find("\n", at)
        fields = table[start : end if end >= 0 else len(table)].split()
        if len(fields) >= 10 and fields[9] != "0" and fields[7].isdigit():
            return int(fields[7])
        at = table.find(needle, at + 1)
    return None


def diag_request(peer: tuple[str, int], local: tuple[str, int], sequence: int) -> bytes:
    """A ``sock_diag`` request for the one TCP socket whose address is ``peer`` and whose
    remote one is ``local``: the kernel looks it up by its 4-tuple."""
    src, dst = ipaddress.ip_address(peer[0]), ipaddress.ip_address(local[0])
    family = socket.AF_INET if src.version == 4 else socket.AF_INET6
    body = (
        _REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
        + _PORTS.pack(peer[1], local[1])
        + src.packed.ljust(16, b"\0")
        + dst.packed.ljust(16, b"\0")
        + _TAIL.pack(0, 0xFFFFFFFF, 0xFFFFFFFF)
    )
    return _HEADER.pack(_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, sequence, 0) + body


def diag_owner(reply: bytes, sequence: int) -> int | None:
    """The uid in a ``sock_diag`` reply; ``None`` when the kernel has no such socket, or one
    without an owner (inode 0: closed or orphaned; its uid 0 is nobody's). Raises ValueError
    for any other answer (the caller asks ``/proc/net/tcp`` instead)."""
    if len(reply) < _HEADER.size + 4:
        raise ValueError("a short sock_diag reply")
    _, kind, _, seq, _ = _HEADER.unpack_from(reply)
    if seq != sequence:
        raise ValueError(f"a sock_diag reply to request {seq}, not {sequence}")
    if kind == NLMSG_ERROR:
        (code,) = struct.unpack_from("=i", reply, _HEADER.size)
        if -code == errno.ENOENT:
            return None
        raise ValueError(f"sock_diag: {os.strerror(-code)}")
    if kind != SOCK_DIAG_BY_FAMILY or len(reply) < _OWNER_AT + _OWNER.size:
        raise ValueError(f"an unexpected sock_diag reply (type {kind}, {len(reply)} bytes)")
    uid, inode = _OWNER.unpack_from(reply, _OWNER_AT)
    return uid if inode else None


@functools.lru_cache(maxsize=256)  # asked once per arrival of a counted account: NSS may be slow
def account_name(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


class Owners:
    """Who opened the far end of a loopback connection (the IO shell over the functions above)."""

    def __init__(self, proc_net: Path = PROC_NET, diag: bool = True) -> None:
        self.proc_net = proc_net
        self._diag: socket.socket | None = None
        self._diag_failed = not diag
        self._sequence = 0
        self._tables: dict[str, str] = {}  # read during this batch of arrivals

    def close(self) -> None:
        if self._diag is not None:
            self._diag.close()
            self._diag = None

    def uid(self, sock: socket.socket) -> int | None:
        """The uid behind ``sock`` (an accepted loopback connection); None when the kernel knows
        none (its far end is gone); raises :class:`Unavailable` when nothing can be asked."""
        try:
            if sock.family == socket.AF_UNIX:
                return int(
                    _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))[1]
                )
            peer, local = sock.getpeername()[:2], sock.getsockname()[:2]
        except OSError:
            return None  # reset before we asked: nobody's
        if not self._diag_failed:
            try:
                return self._ask_diag(peer, local)
            except (OSError, ValueError, AttributeError):  # AttributeError: a platform without netlink
                self._diag_failed = True  # refused (a sandbox's RestrictAddressFamilies): the tables
                self.close()
        return self._ask_tables(peer, local)

    def _ask_diag(self, peer: tuple[str, int], local: tuple[str, int]) -> int | None:
        """The kernel's exact lookup of the far end by its 4-tuple."""
        if self._diag is None:
            kind = socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
            self._diag = socket.socket(socket.AF_NETLINK, kind, NETLINK_SOCK_DIAG)
            self._diag.setblocking(False)  # the kernel answers within the send: never wait
        self._sequence = self._sequence % 0xFFFFFFFF + 1
        self._diag.send(diag_request(peer, local, self._sequence))
        return diag_owner(self._diag.recv(4096), self._sequence)

    def _ask_tables(self, peer: tuple[str, int], local: tuple[str, int]) -> int | None:
        cached = bool(self._tables)
        owner = self._search(peer, local)
        if owner is None and cached:  # read before this connection was made, perhaps: once more
            self._tables.clear()
            owner = self._search(peer, local)
        return owner

    def _search(self, peer: tuple[str, int], local: tuple[str, int]) -> int | None:
        v4 = ipaddress.ip_address(peer[0]).version == 4
        # An IPv4 peer's socket is in tcp, or in tcp6 when its program dialled ::ffff:127.0.0.1.
        for name, mapped in (("tcp", False), ("tcp6", True)) if v4 else (("tcp6", False),):
            owner = table_owner(self._table(name), peer, local, mapped)
            if owner is not None:
                return owner
        return None

    def _table(self, name: str) -> str:
        """One read per table for a batch of arrivals (the acceptor's): forgotten as soon as
        the event loop moves on."""
        table = self._tables.get(name)
        if table is None:
            try:
                table = (self.proc_net / name).read_text()
            except OSError as exc:
                if name == "tcp":
                    raise Unavailable(f"cannot read {self.proc_net / name}: {exc.strerror}") from None
                table = ""  # no IPv6 on this box
            if not self._tables:
                asyncio.get_running_loop().call_soon(self._tables.clear)
            self._tables[name] = table
        return table

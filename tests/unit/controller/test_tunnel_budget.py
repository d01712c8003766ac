"""Whose budget a loopback connection spends: the kernel's tables and replies, read (pure)."""

from __future__ import annotations

import errno
import socket
import struct
import sys

import pytest

from flodl_agent.controller.admission import Gate
from flodl_agent.controller.tunnel_budget import (
    UNKNOWN,
    budget_key,
    diag_owner,
    diag_request,
    label,
    table_owner,
)

# Rows a Linux kernel printed (x86, so each address word is little-endian): a controller on
# 127.0.0.1:1337 (0539) and ::1 port 1337; peers 127.0.0.1:54742 (D5D6), ::ffff:127.0.0.1:40000
# (9C40, a dual-stack socket: in tcp6) and [::1]:41666 (A2C2). Uids edited in: 998 for the
# door's account, 0 for the controller's own rows.
TCP = "\n".join(
    [
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode",
        "   1: 0100007F:0539 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 "
        "2206738 1 0000000081369350 100 0 0 10 0",
        " 448: 0100007F:0539 0100007F:D5D6 01 00000000:00000000 00:00000000 00000000     0        0 "
        "2206740 1 00000000f77fb65d 20 0 0 10 -1",
        # an earlier connection of the same 4-tuple, in TIME_WAIT: uid 0, inode 0, nobody's
        "   5: 0100007F:D5D6 0100007F:0539 06 00000000:00000000 03:000016C5 00000000     0        0 "
        "0 3 0000000000000000",
        " 541: 0100007F:D5D6 0100007F:0539 01 00000000:00000000 00:00000000 00000000   998        0 "
        "2206739 2 000000006232636c 20 0 0 10 -1",
    ]
)
TCP6 = "\n".join(
    [
        "  sl  local_address                         remote_address                        st ...",
        "   1: 00000000000000000000000001000000:0539 00000000000000000000000001000000:A2C2 01 "
        "00000000:00000000 00:00000000 00000000     0        0 2206745 1 00000000af761ecc 20 0 0 10 -1",
        "   2: 00000000000000000000000001000000:A2C2 00000000000000000000000001000000:0539 01 "
        "00000000:00000000 00:00000000 00000000  1001        0 2206744 2 0000000010e8ce52 20 0 0 10 -1",
        "   3: 0000000000000000FFFF00000100007F:9C40 0000000000000000FFFF00000100007F:0539 01 "
        "00000000:00000000 00:00000000 00000000   998        0 2206741 2 000000008b7b657f 20 0 0 10 -1",
    ]
)
CONTROLLER = ("127.0.0.1", 1337)

little_endian = pytest.mark.skipif(sys.byteorder != "little", reason="the sample rows are x86's")


@little_endian
def test_the_far_ends_row_names_its_owner_not_the_controllers_own_row() -> None:
    # The controller's accepted socket has the same two addresses the other way round (uid 0).
    assert table_owner(TCP, ("127.0.0.1", 54742), CONTROLLER) == 998
    assert table_owner(TCP, ("127.0.0.1", 1337), ("127.0.0.1", 54742)) == 0  # that one, asked for
    assert table_owner(TCP, ("127.0.0.1", 54743), CONTROLLER) is None  # no such connection
    assert table_owner(TCP, ("127.0.0.1", 54742), ("127.0.0.1", 1338)) is None  # nor to that port


@little_endian
def test_a_row_without_an_inode_is_nobodys() -> None:
    lingering = "\n".join(line for line in TCP.splitlines() if not line.startswith(" 541:"))
    assert table_owner(lingering, ("127.0.0.1", 54742), CONTROLLER) is None  # not root's
    assert table_owner(TCP.splitlines()[3], ("127.0.0.1", 54742), CONTROLLER) is None  # a last row


@little_endian
def test_ipv6_and_dual_stack_peers_are_found_in_tcp6() -> None:
    assert table_owner(TCP6, ("::1", 41666), ("::1", 1337)) == 1001
    assert table_owner(TCP6, ("127.0.0.1", 40000), CONTROLLER, mapped=True) == 998
    assert table_owner(TCP6, ("127.0.0.1", 40000), CONTROLLER) is None  # asked as a plain v4 row
    assert table_owner(TCP, ("127.0.0.1", 40000), CONTROLLER) is None  # it is not in tcp


def test_a_sock_diag_request_names_the_far_end_by_its_4_tuple() -> None:
    request = diag_request(("127.0.0.1", 54742), CONTROLLER, 7)
    length, kind, flags, sequence, port = struct.unpack_from("=IHHII", request)
    assert (length, kind, flags, sequence, port) == (len(request), 20, 1, 7, 0)
    family, protocol, _, _, states = struct.unpack_from("=BBBBI", request, 16)
    assert (family, protocol, states) == (socket.AF_INET, socket.IPPROTO_TCP, 0xFFFFFFFF)
    assert struct.unpack_from("!HH", request, 24) == (54742, 1337)  # its port first: it is "src"
    assert request[28:44] == bytes([127, 0, 0, 1]) + bytes(12)
    assert request[44:60] == bytes([127, 0, 0, 1]) + bytes(12)
    assert struct.unpack_from("=III", request, 60) == (0, 0xFFFFFFFF, 0xFFFFFFFF)  # no cookie
    assert len(request) == 72
    six = diag_request(("::1", 41666), ("::1", 1337), 8)
    assert six[16] == socket.AF_INET6 and six[28:44] == socket.inet_pton(socket.AF_INET6, "::1")


def _reply(uid: int, inode: int, sequence: int = 7) -> bytes:
    body = (
        struct.pack("=BBBB", socket.AF_INET, 1, 0, 0) + bytes(48) + struct.pack("=IIIII", 0, 0, 0, uid, inode)
    )
    return struct.pack("=IHHII", 16 + len(body), 20, 0, sequence, 0) + body


def _error(code: int, sequence: int = 7) -> bytes:
    return struct.pack("=IHHIIi", 36, 2, 0, sequence, 0, -code) + bytes(16)


def test_a_sock_diag_reply_gives_the_owner_or_nobody_or_a_reason_to_read_the_tables() -> None:
    assert diag_owner(_reply(998, 2206739), 7) == 998
    assert diag_owner(_reply(0, 0), 7) is None  # closed or orphaned: its uid 0 is nobody's
    assert diag_owner(_error(errno.ENOENT), 7) is None  # gone (reset before we asked)
    with pytest.raises(ValueError, match="Operation not permitted"):
        diag_owner(_error(errno.EPERM), 7)
    with pytest.raises(ValueError, match="request 6, not 7"):
        diag_owner(_reply(998, 1, sequence=6), 7)  # a stale answer is no answer
    with pytest.raises(ValueError, match="short"):
        diag_owner(b"\0" * 8, 7)
    with pytest.raises(ValueError, match="unexpected"):
        diag_owner(_reply(998, 1)[:-4], 7)


def test_the_controllers_own_user_is_exempt_and_every_other_account_has_a_budget() -> None:
    names = {998: "flodl-join"}.get
    assert budget_key(1000, 1000, names) is None  # an operator's fdl join on the box
    assert budget_key(998, 1000, names) == "loopback as flodl-join (uid 998)" == label(998, "flodl-join")
    assert budget_key(0, 1000, names) == "loopback as uid 0"  # root is not the controller: counted
    assert budget_key(None, 1000, names) == UNKNOWN  # a far end nobody owns is counted too
    assert budget_key(None, 0, names) == UNKNOWN  # even under a root controller


def test_a_flood_through_one_account_spends_that_accounts_budget_alone() -> None:
    door, other = label(998, "flodl-join"), label(999, "flodl-other")
    gate = Gate(per_peer=2)
    assert gate.open(door, True, 0.0) and gate.open(door, True, 0.0)
    assert not gate.open(door, True, 0.0)  # the door account's third unadmitted connection
    assert gate.dropped == {"busy_peer": 1}
    assert gate.open(other, True, 0.0)  # another account, and the controller's own user, are not
    assert gate.open("127.0.0.1", False, 0.0) and gate.unsettled("127.0.0.1") == 0
    gate.settle(door)  # one is admitted (or gone): the next walk-in through the door gets its slot
    assert gate.open(door, True, 0.0) and gate.unsettled(door) == 2
    for _ in range(int(gate.guard.burst)):
        gate.bad(door, "tag", True, 0.0)
    assert not gate.open(door, True, 0.0) and gate.dropped["rate_limited"] == 1  # bad dials: cut off
    assert gate.open(other, True, 0.0)

"""The training host's road up across a controller gap (issue 37): nothing raises when the
connection closes under a send, and a new connection hears every rank exit again."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from flodl_agent.agent.uplink import Uplink
from flodl_agent.protocol import wire


class _Client:
    def __init__(self, closed: bool = False) -> None:
        self.closed, self.sent = closed, []  # type: ignore[var-annotated]

    def send(self, kind: wire.Kind, body: dict[str, Any]) -> list[bytes]:
        if self.closed:
            raise RuntimeError("no link to send on: the connection is closed")
        self.sent.append((kind, body))
        return [b"frame"]


class _Transport:
    def get_protocol(self) -> None:
        return None  # not taken over: write_parts writes the parts


class _Writer:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.transport = _Transport()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def writelines(self, data: list[bytes]) -> None:
        self.written.extend(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def _uplink(client: _Client) -> Uplink:
    return Uplink(cast(Any, None), cast(Any, _Writer()), cast(Any, client))


def test_a_send_on_a_connection_closed_under_it_does_not_raise_and_its_exit_is_kept() -> None:
    async def body() -> None:
        old = _Client(closed=True)
        uplink = _uplink(old)
        uplink.send(wire.Kind.RANK_EXITED, {"rank": 3, "code": 0})  # the link broke a moment ago
        uplink.send(wire.Kind.HEARTBEAT, {"ranks": {}})
        uplink.lost()
        uplink.send(wire.Kind.RANK_EXITED, {"rank": 4, "code": 1})  # during the gap
        uplink.send(wire.Kind.HEARTBEAT, {"ranks": {}})  # dropped: it describes a moment
        new, broken = _Client(), uplink.writer
        uplink.rebind(cast(Any, None), cast(Any, _Writer()), cast(Any, new), cast(Any, object()))
        assert new.sent == [
            (wire.Kind.RANK_EXITED, {"rank": 3, "code": 0}),
            (wire.Kind.RANK_EXITED, {"rank": 4, "code": 1}),
        ]
        uplink.send(wire.Kind.HEARTBEAT, {"ranks": {}})
        assert new.sent[-1][0] is wire.Kind.HEARTBEAT
        assert broken.is_closing()  # the broken connection's socket is let go at the rebind

    asyncio.run(body())


def test_a_round_streamed_while_the_road_is_down_is_dropped_not_raised() -> None:
    async def body() -> None:
        uplink = _uplink(_Client())
        uplink.link = cast(Any, object())  # never touched while down
        uplink.lost()
        uplink.stream([({"round": 1}, b"")])

    asyncio.run(body())

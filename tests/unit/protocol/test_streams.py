"""An admitted link's own protocol over a real socket pair: bytes received into place, frames in
order, writes bounded, the stream's read-ahead carried over, the link's end reported."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import numpy as np
import pytest

from flodl_agent.protocol import wire
from flodl_agent.protocol.join_protocol import NEED_DATA, Closed, Event, JoinClient, JoinServer, Message
from flodl_agent.protocol.streams import PIECE, LinkStream, take_over, write_parts

KEY = bytes(range(16))  # the run key: box-a dials with its host key
MB = 1 << 20


def handshake() -> tuple[JoinServer, JoinClient]:
    """Both sides of a join connection, admitted, without a socket."""
    server, client = JoinServer(KEY), JoinClient(wire.host_key(KEY, "box-a"))
    client.receive_data(server.start())
    assert client.next_event() is not NEED_DATA
    server.receive_data(client.hello({"host": "box-a", "devices": ["cpu:0"]}))
    assert server.next_event() is not NEED_DATA
    client.receive_data(server.accept(0, 1))
    assert client.next_event() is not NEED_DATA
    return server, client


async def streams() -> tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter], ...]:
    a, b = socket.socketpair()
    return await asyncio.open_connection(sock=a), await asyncio.open_connection(sock=b)


def blobs(count: int, size: int) -> list[bytes]:
    return [np.full(size, i + 1, np.uint8).tobytes() for i in range(count)]


def test_bulk_frames_stream_both_ways_in_order_between_small_ones() -> None:
    async def scenario() -> None:
        server, client = handshake()
        (sr, sw), (cr, cw) = await streams()
        at_server: list[tuple[str, Any, bytes]] = []
        at_client: list[tuple[str, Any, bytes]] = []

        def keep(into: list[tuple[str, Any, bytes]]) -> Any:
            def on_event(event: Event) -> None:
                if isinstance(event, Message) and event.message is not None:
                    # A bulk frame's bytes are only valid during the call: keep a copy.
                    message = event.message
                    into.append((type(message).__name__, getattr(message, "round", None), bytes(event.blob)))

            return on_event

        try:
            up = take_over(sr, sw, server, keep(at_server))
            down = take_over(cr, cw, client, keep(at_client))
            sent = blobs(3, 3 * MB + 5)
            scratch = bytearray(len(sent[0]))

            def pieces() -> Any:
                # One buffer for every frame: safe only if each is made after the last has left.
                for r, blob in enumerate(sent):
                    scratch[:] = blob
                    yield wire.Kind.AVERAGE, {"round": r}, memoryview(scratch)

            down.stream(pieces())
            # A small frame waits for the frame being written, not for the whole stream.
            write_parts(cw, client.send(wire.Kind.HEARTBEAT, {"ranks": {}}))
            for r, blob in enumerate(sent):
                write_parts(sw, server.send(wire.Kind.AVERAGED, {"round": r}, blob))
            await down.drain()
            await up.drain()
            await asyncio.wait_for(_until(lambda: len(at_server) == 4 and len(at_client) == 3), 30)
            assert at_server == [
                ("Average", 0, sent[0]),
                ("Heartbeat", None, b""),
                ("Average", 1, sent[1]),
                ("Average", 2, sent[2]),
            ]
            assert at_client == [("Averaged", r, blob) for r, blob in enumerate(sent)]
            cw.close()
            assert await up.ended() is None  # the peer's EOF: a clean end
        finally:
            sw.close()
            cw.close()

    asyncio.run(scenario())


async def _until(done: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_writes_leave_in_bounded_pieces_from_the_senders_buffer() -> None:
    async def scenario() -> None:
        server, client = handshake()
        (sr, sw), (cr, cw) = await streams()
        link = take_over(cr, cw, client, None)
        seen: list[int] = []
        real = link.transport.write

        def write(data: Any) -> None:
            seen.append(len(data))
            real(data)

        link.transport.write = write  # type: ignore[method-assign]
        got = bytearray()

        async def read() -> None:
            while len(got) < 8 * MB:
                got.extend(await sr.read(1 << 20))

        reader = asyncio.ensure_future(read())
        payload = np.arange(2 * MB, dtype=np.float32)
        write_parts(cw, client.send(wire.Kind.AVERAGE, {"round": 0}, payload.data.cast("B")))
        await link.drain()
        await reader
        assert max(seen) <= PIECE and sum(seen) == len(got)
        # The receiving codec reads the frame back whole and authentic.
        server.receive_data(bytes(got))
        (event,) = list(iter(server.next_event, NEED_DATA))
        assert isinstance(event, Message) and bytes(event.blob) == payload.tobytes()
        sw.close()
        cw.close()

    asyncio.run(scenario())


def test_what_the_stream_had_read_ahead_is_dispatched_first() -> None:
    async def scenario() -> None:
        server, client = handshake()
        (sr, sw), (_, cw) = await streams()
        frames = b"".join(client.send(wire.Kind.HEARTBEAT, {"ranks": {}}))
        frames += b"".join(client.send(wire.Kind.AVERAGE, {"round": 7}, b"\x01" * (200 * 1024)))
        cw.write(frames)
        await cw.drain()
        await _until(lambda: len(getattr(sr, "_buffer")) == len(frames))  # noqa: B009
        got: list[Event] = []
        link = take_over(sr, sw, server, got.append)
        assert [type(e.message).__name__ for e in got if isinstance(e, Message)] == ["Heartbeat", "Average"]
        cw.close()
        assert await link.ended() is None and isinstance(got[-1], Closed)
        sw.close()

    asyncio.run(scenario())


def test_a_forged_frame_ends_the_link_with_its_cause() -> None:
    async def scenario() -> None:
        server, client = handshake()
        (sr, sw), (cr, cw) = await streams()
        landed = bytearray(MB)
        server.codec.sink = lambda kind, body, n: memoryview(landed)[:n]
        got: list[Event] = []
        link: LinkStream = take_over(sr, sw, server, got.append)
        frame = bytearray(b"".join(client.send(wire.Kind.AVERAGE, {"round": 0}, b"\x02" * MB)))
        frame[-1] ^= 1  # the raw bytes' last byte: it lands in place, then fails its tag
        cw.write(bytes(frame))
        ended = await asyncio.wait_for(link.ended(), 30)
        assert isinstance(ended, wire.Dropped) and ended.cause == "tag"
        assert got == [] and landed[:4] == b"\x02" * 4  # received into place, never handed out
        assert await cr.read() == b""  # the link was closed
        cw.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("size", [10, 200 * 1024])
def test_a_small_or_staged_bulk_frame_needs_no_destination(size: int) -> None:
    server, client = handshake()
    data = b"".join(client.send(wire.Kind.AVERAGE, {"round": 1}, b"\x03" * size))
    server.receive_data(data)
    (event,) = list(iter(server.next_event, NEED_DATA))
    assert isinstance(event, Message) and bytes(event.blob) == b"\x03" * size

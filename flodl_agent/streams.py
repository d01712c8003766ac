"""The join protocol over asyncio streams: the agent's dial, the one read loop, writes."""

from __future__ import annotations

import asyncio
import socket
import ssl

from . import wire
from .address import join_address
from .join_protocol import NEED_DATA, RATE_LIMITED, Event, JoinClient, JoinServer
from .pin import PinMismatch, check_pin
from .retry import Permanent, Transient
from .tls import client_context, turned_away

DIAL_TIMEOUT = 10.0


async def dial(
    host: str, port: int, pin: str = "", timeout: float = DIAL_TIMEOUT
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to a controller port; with ``pin``, over TLS with its certificate pinned."""
    try:
        reader, writer = await asyncio.wait_for(
            # A large buffer: the link brings the CPU plane's averages, hundreds of MB a round.
            asyncio.open_connection(host, port, limit=1 << 22, ssl=client_context() if pin else None),
            timeout,
        )
    except (OSError, asyncio.IncompleteReadError) as exc:
        if turned_away(exc):
            raise Transient(f"refused: {RATE_LIMITED.reason}", RATE_LIMITED.fix) from None
        if pin and isinstance(exc, ssl.SSLError | ConnectionResetError | asyncio.IncompleteReadError):
            # Something listens, but the handshake died: a port that does not speak TLS hangs up.
            raise Transient(
                f"the TLS handshake with {host}:{port} failed ({type(exc).__name__}: {exc})",
                "join.tls_fingerprint is set: does this controller serve TLS (cluster.controller.tls)?",
            ) from None
        if isinstance(exc, socket.gaierror):
            raise Transient(
                f"the controller's name {host} does not resolve ({exc.strerror})",
                "check the address (fdl join HOST:PORT, or join.controller in fdl.yml), or dial the "
                "controller by its IP; DNS may come back, so --persist re-dials",
            ) from None
        raise Transient(
            f"cannot reach the controller at {host}:{port}: {exc}",
            "is a window open? --persist re-dials until one is",
        ) from None
    if pin:
        try:
            ssl_object = writer.get_extra_info("ssl_object")
            der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
            check_pin(der, pin, f"the controller at {join_address(host, port)}")
        except PinMismatch as exc:
            writer.close()
            raise Permanent(exc.message, exc.fix) from None
    return reader, writer


def read_size(wanted: int) -> int:
    """A frame's size is known from its header: read it in large pieces."""
    return max(65536, min(wanted, 1 << 24))


async def next_event(
    reader: asyncio.StreamReader, side: JoinClient | JoinServer, timeout: float | None = None
) -> Event:
    """The connection's next event, reading as much as it needs (``timeout`` per read)."""
    while True:
        event = side.next_event()
        if event is not NEED_DATA:
            return event
        side.receive_data(await asyncio.wait_for(reader.read(read_size(side.wanted)), timeout))


async def next_frame(
    reader: asyncio.StreamReader, codec: wire.Codec, timeout: float | None = None
) -> wire.Frame | None:
    """The next verified frame on a connection without a handshake (a rank's loopback
    connection to its agent's relay); None at EOF."""
    while (frame := codec.next_frame()) is None:
        data = await asyncio.wait_for(reader.read(read_size(codec.wanted)), timeout)
        if not data:
            return None
        codec.feed(data)
    return frame


def write_parts(writer: asyncio.StreamWriter, parts: list[wire.Blob]) -> None:
    for part in parts:
        writer.write(part)  # one write per part: a bulk frame's raw bytes are never joined into a copy

"""The join protocol over asyncio streams: the agent's dial, the one read loop, writes, and an
admitted link's own protocol (:class:`LinkStream`).

Until admission a connection is an asyncio stream (``next_event``). An admitted link carries
the CPU plane's rounds, hundreds of megabytes each way, so it takes its transport over
(``take_over``): bytes are received straight into where they belong (a bulk frame's raw bytes
into their destination, no reader buffer in between), every frame is handed to a callback
the moment it verifies, and writes leave in order, in bounded pieces, from the sender's own
buffer: the transport copies only what the kernel did not take at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..address import join_address
from ..pin import PinMismatch, check_pin
from ..retry import Permanent, Transient
from . import local_port, wire
from .join_protocol import NEED_DATA, RATE_LIMITED, Closed, Event, JoinClient, JoinServer
from .tls import client_context, turned_away

DIAL_TIMEOUT = 10.0


async def dial(
    host: str, port: int, pin: str = "", timeout: float = DIAL_TIMEOUT
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to a controller port; with ``pin``, over TLS with its certificate pinned. A
    loopback address is reached through the controller's local socket where it has one."""
    try:
        reader, writer = await asyncio.wait_for(_open(host, port, client_context() if pin else None), timeout)
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


async def _open(
    host: str, port: int, context: ssl.SSLContext | None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    # A large buffer: the link brings the CPU plane's averages, hundreds of MB a round.
    local = await local_port.connect(host, port)
    if local is not None:
        return await asyncio.open_unix_connection(
            sock=local, limit=1 << 22, ssl=context, server_hostname=host if context else None
        )
    return await asyncio.open_connection(host, port, limit=1 << 22, ssl=context)


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
        # asyncio.timeout, not wait_for: on 3.11 wait_for loses a cancellation that lands as
        # the read completes (a cancelled join would then wait on, for a world that never forms).
        async with asyncio.timeout(timeout):
            data = await reader.read(read_size(side.wanted))
        side.receive_data(data)


async def next_frame(
    reader: asyncio.StreamReader, codec: wire.Codec, timeout: float | None = None
) -> wire.Frame | None:
    """The next verified frame on a connection without a handshake (a rank's loopback
    connection to its agent's relay); None at EOF."""
    while (frame := codec.next_frame()) is None:
        async with asyncio.timeout(timeout):
            data = await reader.read(read_size(codec.wanted))
        if not data:
            return None
        codec.feed(data)
    return frame


def write_parts(writer: asyncio.StreamWriter, parts: list[wire.Blob]) -> None:
    """Write a frame's parts in order (on a taken-over link: behind whatever it has queued)."""
    link = writer.transport.get_protocol()
    if isinstance(link, LinkStream):
        link.send(parts)
        return
    for part in parts:
        writer.write(part)  # one write per part: a bulk frame's raw bytes are never joined into a copy


STAGE = 64 * 1024  # headers and small frames are received here, then fed to the codec
PIECE = 1024 * 1024  # the most handed to the transport at once (loopback: 256 KiB cost a tenth more CPU)
_stage = threading.local()  # one staging buffer per thread: it is only used within one callback


def _staging() -> memoryview:
    view: memoryview | None = getattr(_stage, "view", None)
    if view is None:
        view = _stage.view = memoryview(bytearray(STAGE))
    return view


class LinkEnded(Exception):
    """A link's callback ended it on purpose (the controller aborted the run, say): ``done``
    fails with it, and the connection stays for whatever its owner still has to say."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


Frames = Iterable[tuple[wire.Kind, dict[str, Any], wire.Blob]]


class LinkStream(asyncio.BufferedProtocol):
    """An admitted link's protocol, in place of the stream's (see ``take_over``).

    ``on_event`` gets every event as it arrives (a bulk frame's ``blob`` is valid only during
    the call); ``done`` resolves at the peer's EOF, or fails with what ended the link
    (``wire.Dropped``, ``BadMessage``, ``ConnectionError``, ``LinkEnded``). The stream's own
    protocol still hears the transport's flow control and its end, so its writer keeps working
    (``close``, ``wait_closed``) and its reader sees the EOF."""

    def __init__(
        self,
        side: JoinClient | JoinServer,
        transport: asyncio.Transport,
        inner: asyncio.BaseProtocol,
        on_event: Callable[[Event], None] | None,
    ) -> None:
        self.side = side
        self.transport = transport
        self.inner = inner
        self.on_event = on_event  # None: events are read and dropped (the run is over)
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.done.add_done_callback(lambda f: f.cancelled() or f.exception())  # awaited or not
        self._queue: deque[memoryview] = deque()  # encoded parts, in order
        self._frames: deque[Iterator[tuple[wire.Kind, dict[str, Any], wire.Blob]]] = deque()
        self._paused = False
        self._idle: list[asyncio.Future[None]] = []  # drain() waiters
        self._direct = False  # get_buffer handed out the codec's own destination

    # --- receiving -----------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        view = self.side.direct()
        self._direct = view is not None
        if view is not None:
            return view
        return _staging()[: max(4096, min(STAGE, self.side.wanted))]

    def buffer_updated(self, nbytes: int) -> None:
        if self._direct:
            self.side.filled(nbytes)
        else:
            self.side.receive_data(_staging()[:nbytes])
        self._dispatch()

    def received(self, data: bytes) -> None:
        """Bytes the stream had already read when the link was taken over."""
        self.side.receive_data(data)
        self._dispatch()

    def eof_received(self) -> bool | None:
        self.side.receive_data(b"")
        self._dispatch()
        return self.inner.eof_received() if isinstance(self.inner, asyncio.Protocol) else None

    def _dispatch(self) -> None:
        try:
            while (event := self.side.next_event()) is not NEED_DATA:
                if self.on_event is not None and not self.done.done():
                    self.on_event(event)
                if isinstance(event, Closed):
                    if not self.done.done():
                        self.done.set_result(None)
                    return
        except LinkEnded as exc:  # the callback's verdict: the rest is read and dropped
            self.end(exc, close=False)
            self._dispatch()
        except Exception as exc:  # a bad frame, or the callback's own failure: the link ends with it
            self.end(exc)

    async def ended(self) -> BaseException | None:
        """What ended the link (None: the peer's EOF); cancelling the wait leaves the link be."""
        await asyncio.wait([self.done])
        return self.done.exception()

    def end(self, exc: BaseException, close: bool = True) -> None:
        """End the link with ``exc`` (``done`` fails with it) and close the transport."""
        if not self.done.done():
            self.done.set_exception(exc)
        if close:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(exc or ConnectionResetError("the link closed"))
        self._queue.clear()
        self._frames.clear()
        self._wake()
        self.inner.connection_lost(exc)

    # --- sending -------------------------------------------------------------

    def send(self, parts: list[wire.Blob]) -> None:
        """A frame's parts, written after everything queued before them."""
        if self.transport.is_closing():
            return  # as a closed transport does: the link's end is reported elsewhere
        if not self._queue and not self._frames and sum(len(p) for p in parts) <= PIECE:
            for part in parts:
                self.transport.write(part)  # a small frame: nothing to bound
            return
        self._queue.extend(_bytes(p) for p in parts if len(p))
        self._pump()

    def stream(self, frames: Frames) -> None:
        """Frames made one at a time, each once the ones before it are with the transport
        (so a producer may reuse its buffer for the next)."""
        self._frames.append(iter(frames))
        self._pump()

    async def drain(self) -> None:
        """Until everything queued has left this process's buffers."""
        while (self._queue or self._frames or self._paused) and not self.transport.is_closing():
            waiter = asyncio.get_running_loop().create_future()
            self._idle.append(waiter)
            await waiter

    def pause_writing(self) -> None:
        self._paused = True
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self._paused = False
        self.inner.resume_writing()
        self._pump()

    def _pump(self) -> None:
        transport = self.transport
        while not self._paused and not transport.is_closing():
            if not self._queue:
                if not self._frames:
                    break
                frame = next(self._frames[0], None)
                if frame is None:
                    self._frames.popleft()
                else:
                    self._queue.extend(_bytes(p) for p in self.side.send(*frame) if len(p))
                continue
            part = self._queue[0]
            if len(part) > PIECE:
                self._queue[0], part = part[PIECE:], part[:PIECE]
            else:
                self._queue.popleft()
            # The kernel takes what it can; the transport keeps a copy of only the rest, and
            # (its high-water mark is 0) pauses us until that is gone.
            transport.write(part)
        if not (self._queue or self._frames or self._paused):
            self._wake()

    def _wake(self) -> None:
        for waiter in self._idle:
            if not waiter.done():
                waiter.set_result(None)
        self._idle.clear()


def _bytes(part: wire.Blob) -> memoryview:
    view = memoryview(part)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def take_over(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    side: JoinClient | JoinServer,
    on_event: Callable[[Event], None] | None,
) -> LinkStream:
    """Give an admitted link its own protocol: what the reader already holds is dispatched
    first (``on_event`` may run before this returns)."""
    transport = writer.transport
    assert isinstance(transport, asyncio.Transport)
    link = LinkStream(side, transport, transport.get_protocol(), on_event)
    # The stream's read-ahead: asyncio keeps it in the reader, with no public way to take it.
    held: bytearray = getattr(reader, "_buffer")  # noqa: B009
    leftover = bytes(held)
    held.clear()
    transport.set_protocol(link)
    transport.set_write_buffer_limits(high=0)
    if leftover:
        link.received(leftover)
    if reader.at_eof():
        link.eof_received()
    elif transport.is_closing():
        link.connection_lost(None)
    else:
        with contextlib.suppress(AttributeError, RuntimeError):
            transport.resume_reading()  # the stream may have paused it (a full reader)
    return link

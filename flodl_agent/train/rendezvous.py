"""Rendezvous on the controller port: torch's own TCPStore, reached through the links.

An unmodified torchrun-style script calls ``init_process_group(backend)`` with
``env://``. Ranks get ``TORCHELASTIC_USE_AGENT_STORE=True``, so every rank is a
TCPStore *client* of ``MASTER_ADDR:MASTER_PORT``, and the agent of the host
that holds rank 0 serves a real ``torch.distributed.TCPStore`` on loopback —
the arrangement torchrun's own elastic agent uses. Every other host's agent
listens on loopback and carries each connection to that store as a stream of
``STREAM`` frames over its authenticated control link; the controller routes
them between links. Forming a world therefore needs no second port and no
worker-to-worker reachability (collectives still need what their backend
needs: gloo and NCCL connect ranks pairwise).

Three pieces: :class:`StreamRouter` (the controller's pure routing table),
:class:`StreamRelay` (an agent's end of the streams) and :func:`serve_store`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CHUNK = 64 * 1024  # bytes per STREAM frame; well under the control frame cap
MAX_STREAMS = 4096  # open streams per host: a rank opens a handful


class RouteError(Exception):
    """A stream frame that cannot be routed: counted and dropped by the controller."""


@dataclass
class StreamRouter:
    """The controller's table: a member host's stream ``id`` <-> the store host's ``gid``.

    Pure bookkeeping, no IO. The store host is the one whose share holds rank 0.
    """

    store_host: str
    max_streams: int = MAX_STREAMS
    _to_store: dict[tuple[str, int], int] = field(default_factory=dict)
    _from_store: dict[int, tuple[str, int]] = field(default_factory=dict)
    _open: dict[str, int] = field(default_factory=dict)
    _next: int = 0

    @property
    def opened(self) -> int:
        """Streams routed so far (each a far rank's connection to the store)."""
        return self._next

    def from_member(self, host: str, sid: int, end: bool) -> int:
        """The store-side id for a member's stream; opens it on first sight."""
        if host == self.store_host:
            raise RouteError("the store host's own ranks reach the store directly")
        gid = self._to_store.get((host, sid))
        if gid is None:
            if end:
                raise RouteError("end of a stream that was never opened")
            if self._open.get(host, 0) >= self.max_streams:
                raise RouteError(f"{host} holds {self.max_streams} open streams")
            gid = self._next
            self._next += 1
            self._to_store[(host, sid)] = gid
            self._from_store[gid] = (host, sid)
            self._open[host] = self._open.get(host, 0) + 1
        if end:
            self._forget(gid)
        return gid

    def from_store(self, gid: int, end: bool) -> tuple[str, int]:
        """Where a frame from the store host goes back to."""
        target = self._from_store.get(gid)
        if target is None:
            raise RouteError(f"no open stream {gid}")
        if end:
            self._forget(gid)
        return target

    def drop_host(self, host: str) -> list[int]:
        """A member left: the store-side ids of its streams, which the store host must close."""
        gone = [gid for (h, _), gid in self._to_store.items() if h == host]
        for gid in gone:
            self._forget(gid)
        return gone

    def _forget(self, gid: int) -> None:
        host, sid = self._from_store.pop(gid)
        del self._to_store[(host, sid)]
        self._open[host] -= 1


Send = Callable[[int, bytes, bool], None]


class StreamRelay:
    """An agent's end of the streams.

    On a member host, :meth:`listen` opens the loopback port the local ranks use
    as ``MASTER_PORT``; each connection becomes a stream sent with ``send``. On
    the store host, :meth:`feed` opens a connection to the local store for each
    new stream id. Either way, :meth:`feed` delivers what the link brought in.

    When the link breaks (:meth:`link_lost`), every stream ends; a restarted controller numbers
    the store host's streams afresh, so an id may come back as a new stream after :meth:`link_back`.
    """

    def __init__(self, send: Send, store_port: int | None = None) -> None:
        self._send = send
        self._store_port = store_port
        self._writers: dict[int, asyncio.StreamWriter | _Pending] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._server: asyncio.Server | None = None
        self._next = 0
        self._linked = True  # a link carries the streams (from ``link_lost`` to ``link_back``: none)
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def open_streams(self) -> int:
        return len(self._writers)

    async def drained(self) -> None:
        """Until no stream is open (every far rank let go of the store)."""
        while self._writers:
            self._idle.clear()
            await self._idle.wait()

    def _forget(self, sid: int, writer: asyncio.StreamWriter | _Pending) -> bool:
        """``sid`` ends, if it is still ``writer``'s (a lost link ended it, and the next link
        may have opened a stream of the same id)."""
        if self._writers.get(sid) is not writer:
            return False
        del self._writers[sid]
        if not self._writers:
            self._idle.set()
        return True

    def link_lost(self) -> None:
        """The link broke: every stream ends (its local connection closes; what the far end says
        of it after the loss is ignored), and until ``link_back`` a rank's new connection is
        closed at once (what it sent would be lost on the way, and the rest reach a store mid-stream)."""
        self._linked = False
        writers = list(self._writers.values())
        self._writers.clear()
        self._idle.set()
        for writer in writers:
            if isinstance(writer, _Pending):
                writer.chunks.clear()  # a store connection still opening: nothing of the cut stream
            writer.close()

    def serve(self, store_port: int) -> None:
        """A fresh store serves the streams opened from now on (a re-formed world's: reusing the
        old one would hand its ranks the stopped world's keys)."""
        self._store_port = store_port

    def link_back(self) -> None:
        """A new link carries the streams: new ones route as usual."""
        self._linked = True

    async def listen(self) -> int:
        self._server = await asyncio.start_server(self._accepted, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._linked:
            writer.close()
            return
        sid = self._next
        self._next += 1
        self._writers[sid] = writer
        await self._pump(sid, reader, writer)

    async def _pump(self, sid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Local socket -> link, until the socket ends (then the far end is told)."""
        try:
            while data := await reader.read(CHUNK):
                self._send(sid, data, False)
        except (ConnectionError, OSError):
            pass
        finally:
            if self._forget(sid, writer):
                with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                    self._send(sid, b"", True)

    def feed(self, sid: int, data: bytes, end: bool) -> None:
        """Link -> local socket."""
        writer = self._writers.get(sid)
        if writer is None and not end:
            if self._store_port is None:
                self._send(sid, b"", True)  # no store on this host: refuse the stream
                return
            # Hold the id now, not when the task starts: the link may deliver the stream's
            # next frames before the task runs, and they must queue behind this one
            # (a second connection to the store would split the stream).
            pending = _Pending([data])
            self._writers[sid] = pending
            self._spawn(self._open_to_store(sid, pending))
            return
        if writer is None:
            return  # a stream this side already closed
        if data:
            writer.write(data)
        if end:
            self._forget(sid, writer)
            writer.close()

    async def _open_to_store(self, sid: int, pending: _Pending) -> None:
        assert self._store_port is not None
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self._store_port)
        except OSError:
            if self._forget(sid, pending):
                self._send(sid, b"", True)
            return
        for chunk in pending.chunks:
            writer.write(chunk)
        if pending.ended:  # the far side finished (or the link broke) while we connected
            writer.close()
            return
        self._writers[sid] = writer
        await self._pump(sid, reader, writer)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers.values()):
            writer.close()
        self._writers.clear()
        self._idle.set()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class _Pending:
    """Stands in for a store connection that is still being opened."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.ended = False

    def write(self, data: bytes) -> None:
        self.chunks.append(data)

    def close(self) -> None:
        self.ended = True


def warm_store() -> None:
    """Import what :func:`serve_store` needs ahead of time (blocking; no torch is no error:
    a script that never rendezvouses still runs)."""
    with contextlib.suppress(ImportError, RuntimeError, OSError):
        import torch.distributed  # noqa: F401


def serve_store() -> tuple[Any, int]:
    """Start torch's TCPStore server on loopback (blocking: call it in an executor).

    Returns the store (keep it referenced: the server lives as long as it) and its port.
    """
    # torch is the worker venv's; the controller needs none
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return store, int(store.port)

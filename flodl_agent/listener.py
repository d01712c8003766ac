"""The controller's one port: accept, gate, pick the channel, hand the connection on.

Every connection opens with 4 bytes that pick its channel (``wire.classify``):
the join channel goes to the controller's handshake, an HTTP method to the
status surface, anything else is a bad dial. Before that, the ``admission.Gate``
decides whether this peer is served at all (rate limit, per-peer cap). The
listener also owns the bookkeeping that lets ``close()`` end every handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import http_surface, wire
from .address import is_loopback
from .admission import Gate
from .net import keepalive
from .pin import cleartext_warning
from .tls import server_context

# Connections asyncio accepts per wake-up of the listening socket before the loop runs
# anything else (its backlog argument): small, so a storm of walk-ins cannot queue a
# status request behind thousands of connects; the kernel's own queue stays SOMAXCONN deep.
ACCEPT_BATCH = 64


class BindError(Exception):
    """The controller port cannot be opened (in use, or not an address of this host);
    ``errno`` says which (None for a certificate that does not load)."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


@dataclass(frozen=True)
class Timeouts:
    """How long the controller waits, and how much it holds, per connection."""

    preamble: float = 5.0  # the 4 bytes that pick the channel (and a TLS handshake)
    hello: float = 10.0  # the challenge's answer
    close_grace: float = 2.0  # handlers finishing on EOF at close() before they are cancelled
    handshakes: int = 2048  # unadmitted connections at once; a flood waits its turn by being dropped
    # Unadmitted connections from one address at once (loopback exempt): one flooding
    # address cannot hold every handshake slot or file descriptor. Generous for NAT.
    per_peer: int = 256
    ship_batch: int = 512  # WorldFormed frames sent between yields to other work
    http: http_surface.HttpLimits = field(default_factory=http_surface.HttpLimits)


# The join channel's handler: (reader, writer, peer, settle) where settle() says the
# connection is no longer an unadmitted one of this peer.
OnJoin = Callable[[asyncio.StreamReader, asyncio.StreamWriter, str, Callable[[], None]], Awaitable[None]]


def this_host(bind: str) -> http_surface.HostPolicy:
    """The names a browser may use for this controller: the bind name and this box's names."""
    names = {socket.gethostname(), socket.getfqdn(), bind}
    return http_surface.HostPolicy(frozenset(n.lower() for n in names if n))


class Listener:
    def __init__(
        self,
        bind: str,
        port: int,
        *,
        on_join: OnJoin,
        routes: http_surface.Routes,
        hosts: http_surface.HostPolicy | None = None,
        tls: tuple[str, str] | None = None,
        timeouts: Timeouts = Timeouts(),
        clock: Callable[[], float] = time.monotonic,
        log: Callable[[str], None] = lambda line: None,
    ) -> None:
        self.bind = bind
        self.port = port
        self.on_join = on_join
        self.routes = routes
        self.hosts = hosts if hosts is not None else this_host(bind)
        self.tls = tls
        self.timeouts = timeouts
        self.clock = clock
        self.log = log
        self.gate = Gate(timeouts.per_peer)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._warned: set[str] = set()  # peers told their connection is cleartext

    async def open(self) -> int:
        """Listen; the port actually bound (``port`` 0 picks one)."""
        tls = self.tls
        try:
            context = server_context(Path(tls[0]), Path(tls[1])) if tls else None
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            raise BindError(f"cannot load the TLS certificate {tls[0] if tls else ''}: {exc}") from None
        try:
            self._server = await asyncio.start_server(
                self._serve,
                self.bind,
                self.port,
                limit=wire.CONTROL_MAX,
                backlog=ACCEPT_BATCH,
                ssl=context,
                ssl_handshake_timeout=self.timeouts.preamble if context else None,
            )
        except OSError as exc:
            raise BindError(
                f"cannot open the join window on {self.bind}:{self.port}: {exc.strerror}", exc.errno
            ) from None
        for listening in self._server.sockets:
            # A storm of walk-ins must not overflow the accept queue: listen again, deeper
            # (on a duplicate of the descriptor: asyncio owns the socket).
            with socket.socket(fileno=os.dup(listening.fileno())) as same:
                same.listen(socket.SOMAXCONN)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        # Closing every connection lets each handler finish on EOF; only a
        # straggler is cancelled (a cancelled handler makes asyncio log noise).
        for writer in list(self._writers):
            writer.close()
        if self._tasks:
            _, late = await asyncio.wait(set(self._tasks), timeout=self.timeouts.close_grace)
            for task in late:
                task.cancel()
            if late:
                await asyncio.gather(*late, return_exceptions=True)

    def spawn(self, coro: Any) -> None:
        """Run ``coro`` as one of the tasks ``close()`` ends."""
        self._track(asyncio.ensure_future(coro))

    def _track(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def bad(self, peer: str, cause: str) -> None:
        self.gate.bad(peer, cause, not is_loopback(peer), self.clock())

    def cleartext(self, peer: str) -> None:
        """Say once per peer (and remember at most 1024) when one comes from outside the private ranges."""
        if peer in self._warned or len(self._warned) >= 1024 or not cleartext_warning(peer):
            return
        self._warned.add(peer)
        self.log(
            f"note: {peer} reaches the controller port in cleartext from outside the private ranges: "
            "frames are authenticated, not encrypted (cluster.controller.tls encrypts them)"
        )

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(writer.get_extra_info("peername", ("?", 0))[0])
        task = asyncio.current_task()
        if task is not None:
            self._track(task)  # so close() can end every handler, not just the ones we spawned
        keepalive(writer)
        self._writers.add(writer)
        # Loopback is exempt from the gate: under tunnels every walk-in arrives from
        # 127.0.0.1, and one bad tunnel must not lock the others out.
        counted = not is_loopback(peer)
        now = self.clock()
        opened = self.gate.open(peer, counted, now)
        unsettled = opened and counted
        if self.tls is None:
            self.cleartext(peer)

        def settle() -> None:  # no longer an unadmitted connection of this peer
            nonlocal unsettled
            if unsettled:
                unsettled = False
                self.gate.settle(peer)

        try:
            if opened:
                await self._channel(reader, writer, peer, settle)
            elif not self.gate.guard.allow(peer, now):
                writer.write(wire.RATE_LIMITED)  # the dialler learns why; close() below sends it
        except wire.Dropped as exc:
            self.bad(peer, exc.cause)
        except TimeoutError:
            self.bad(peer, "timeout")  # a silent dial, a hello or a request that never completed
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            settle()
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _channel(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer: str,
        settle: Callable[[], None],
    ) -> None:
        preamble = await asyncio.wait_for(reader.readexactly(4), self.timeouts.preamble)
        channel = wire.classify(preamble)
        if channel is wire.Channel.HTTP:
            await http_surface.serve(
                preamble,
                reader,
                writer,
                peer,
                self.routes,
                limits=self.timeouts.http,
                bad=lambda cause: self.bad(peer, cause),
                clock=self.clock,
                policy=self.hosts,
            )
        elif channel is wire.Channel.JOIN:
            await self.on_join(reader, writer, peer, settle)
        else:
            self.bad(peer, "channel")  # rendezvous, data and control ride the admitted join link

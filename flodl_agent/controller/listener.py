"""The controller's one port: accept, gate, (TLS), pick the channel, hand the connection on.

Every connection opens with 4 bytes that pick its channel (``preamble.classify``):
the join channel goes to the controller's handshake, an HTTP method to the
status surface, anything else is a bad dial. Before any of that — before a TLS
handshake too — the ``admission.Gate`` decides whether this peer is served at all
(rate limit, per-peer cap), on the bare accepted socket: a connection turned away
costs one send and a close. A loopback connection is counted by the local account
that opened it (``tunnel_budget``: the door's, when it came through a tunnel); only
the controller's own user is exempt. A TLS handshake then has the preamble's
deadline and counts as unadmitted for the per-peer cap while it runs. The listener
also owns the bookkeeping that lets ``close()`` end every handler, and the log of
dials it turned away or cut (one line per peer and cause a minute: ``log_limit``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..address import is_loopback
from ..net import keepalive
from ..pin import cleartext_warning
from ..protocol import local_port, preamble, wire
from ..protocol.tls import server_context
from . import http_surface
from .accept import Acceptor, bind, raise_fd_limit
from .admission import Gate
from .log_limit import LogLimit
from .tunnel_budget import Owners, Unavailable, account_name, budget_key


class BindError(Exception):
    """The controller port cannot be opened (in use, or not an address of this host);
    ``errno`` says which (None for a certificate that does not load)."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


@dataclass(frozen=True)
class Timeouts:
    """How long the controller waits, and how much it holds, per connection."""

    preamble: float = 5.0  # the 4 bytes that pick the channel (and, before them, a TLS handshake)
    hello: float = 10.0  # the challenge's answer
    close_grace: float = 2.0  # handlers finishing on EOF at close() before they are cancelled
    handshakes: int = 2048  # unadmitted connections at once; a flood waits its turn by being dropped
    # Unadmitted connections at once from one address, or from one local account on loopback
    # (the door's: every tunnelled walk-in; the controller's own user is exempt): one flooding
    # address or stolen door key cannot hold every handshake slot or file descriptor. Generous
    # for NAT, and for a fleet's walk-ins through one door (each holds a slot for its handshake).
    per_peer: int = 256
    ship_batch: int = 512  # WorldFormed frames sent between yields to other work
    http: http_surface.HttpLimits = field(default_factory=http_surface.HttpLimits)


# The join channel's handler: (reader, writer, peer, settle) where settle() says the
# connection is no longer an unadmitted one of this peer. ``peer``: the address, or for a
# loopback connection of another local account, its budget's name (``tunnel_budget.label``).
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
        note: Callable[[str, str], None] | None = None,
        local: bool = True,
    ) -> None:
        self.bind = bind
        self.local = local  # a unix socket beside each loopback-reachable TCP one (local_port)
        self.port = port
        self.on_join = on_join
        self.routes = routes
        self.hosts = hosts if hosts is not None else this_host(bind)
        self.tls = tls
        self.timeouts = timeouts
        self.clock = clock
        self.log = log
        # An event of the port (a refusal, a bad dial): the controller's log and the page's timeline.
        self.note = note if note is not None else (lambda kind, line: log(line))
        self.gate = Gate(timeouts.per_peer)
        self.quiet = LogLimit()  # one line per peer and cause a minute, however hard a flood dials
        self.owners = Owners()  # who opened a loopback connection's far end
        self.own_uid = os.geteuid()  # loopback connections of this user are exempt from the gate
        self._root = budget_key(0, self.own_uid, account_name)  # root's budget name (None: we are root)
        self._blind = False  # nothing could tell who owns loopback connections (said once)
        self._context: ssl.SSLContext | None = None
        self._acceptor: Acceptor | None = None
        self._arriving: set[asyncio.Task[Any]] = set()  # before their streams: close() cancels them
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._warned: set[str] = set()  # peers told their connection is cleartext

    async def open(self) -> int:
        """Listen; the port actually bound (``port`` 0 picks one)."""
        tls = self.tls
        try:
            self._context = server_context(Path(tls[0]), Path(tls[1])) if tls else None
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            raise BindError(f"cannot load the TLS certificate {tls[0] if tls else ''}: {exc}") from None
        raised = raise_fd_limit()
        if raised is not None:
            self.log(f"raised the open-file limit from {raised[0]} to {raised[1]}: each connection holds one")
        try:
            sockets = bind(self.bind, self.port)
        except OSError as exc:
            raise BindError(
                f"cannot open the join window on {self.bind}:{self.port}: {exc.strerror}", exc.errno
            ) from None
        self.port = sockets[0].getsockname()[1]
        peers: dict[socket.socket, str] = {}
        if self.local:
            local, taken = local_port.bind((sock.getsockname()[0], self.port) for sock in sockets)
            peers = {sock: local_port.address_of(sock.getsockname().decode()) for sock in local}
            for name in taken:
                self.log(
                    f"cannot listen on the local socket @{name[1:]} (another process holds it): "
                    "walk-ins on this box reach the port over TCP"
                )
        self._acceptor = Acceptor(
            [*sockets, *peers],
            self._arrived,
            log=lambda line: self.note("port", line),
            clock=self.clock,
            peers=peers,
        )
        self._acceptor.start()
        return self.port

    async def close(self) -> None:
        if self._acceptor is not None:
            self._acceptor.close()
        self.owners.close()
        for task in list(self._arriving):
            task.cancel()  # a handshake or a silent socket: nothing of ours to finish
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
        # A local account's budget name is no address: it is counted, as remote peers are.
        self.gate.bad(peer, cause, not is_loopback(peer), self.clock())
        self.say("drop", (peer, cause), f"dropped a dial from {peer}: {DROP_WORDS.get(cause, cause)}")

    def charge(self, peer: str) -> None:
        """A bad dial counted elsewhere (a refusal): it spends the peer's budget all the same."""
        if not is_loopback(peer):
            self.gate.guard.penalize(peer, self.clock())

    def say(self, kind: str, key: tuple[str, ...], line: str) -> None:
        """Note ``line`` unless one like it (same ``key``: peer and cause) went out in the last minute."""
        said = self.quiet.admit(key, self.clock())
        if said is not None:
            self.note(kind, line + said.suffix(self.quiet.interval))

    def cleartext(self, peer: str) -> None:
        """Say once per peer (and remember at most 1024) when one comes from outside the private ranges."""
        if peer in self._warned or len(self._warned) >= 1024 or not cleartext_warning(peer):
            return
        self._warned.add(peer)
        self.log(
            f"note: {peer} reaches the controller port in cleartext from outside the private ranges: "
            "frames are authenticated, not encrypted (cluster.controller.tls encrypts them)"
        )

    def budget(self, sock: socket.socket, peer: str) -> str | None:
        """The budget the connection spends at the gate: its address, or on loopback the local
        account that opened it; None: the controller's own user (exempt). Under tunnels every
        walk-in arrives from 127.0.0.1: an address would be one budget for every tunnel."""
        if not is_loopback(peer):
            return peer
        try:
            owner = self.owners.uid(sock)
        except Unavailable as exc:
            if not self._blind:
                self._blind = True
                self.log(f"note: loopback connections are not counted by account ({exc}): all are exempt")
            return None
        return budget_key(owner, self.own_uid, account_name)

    def _arrived(self, sock: socket.socket, peer: str) -> None:
        """A connection the acceptor took: the gate decides on the bare socket, before any TLS."""
        if sock.family == socket.AF_UNIX:
            local_port.tune(sock)
        key = self.budget(sock, peer)
        counted = key is not None
        who = key or peer  # what the gate's books, the handlers and the log call it
        now = self.clock()
        if self.gate.open(who, counted, now):
            task = asyncio.ensure_future(self._connection(sock, peer, who, counted))
            self._track(task)
            self._arriving.add(task)
            # However it ends (cancelled before it ran, too); a no-op once a transport closed it.
            task.add_done_callback(lambda _: sock.close())
            return
        if not self.gate.guard.allow(who, now):
            # The dialler learns why, for the price of one send: a TLS client reads an alert.
            _send_and_close(sock, preamble.TLS_DENIED_ALERT if self.tls else preamble.RATE_LIMITED)
            self.say("drop", (who, "rate_limited"), f"turned {who} away: rate-limited after bad dials")
            return
        sock.close()
        self.say(
            "drop",
            (who, "busy_peer"),
            f"turned {who} away: it holds {self.timeouts.per_peer} unadmitted connections already",
        )

    async def _connection(self, sock: socket.socket, peer: str, who: str, counted: bool) -> None:
        """Serve one connection from ``peer`` (its address), counted at the gate as ``who``."""
        unsettled = counted

        def settle() -> None:  # no longer an unadmitted connection of this peer
            nonlocal unsettled
            if unsettled:
                unsettled = False
                self.gate.settle(who)

        try:
            try:
                opening = self._streams(sock, who)
                # Only a TLS port waits for anything here (the first bytes, the handshake).
                streams = await (asyncio.wait_for(opening, self.timeouts.preamble) if self.tls else opening)
            finally:
                task = asyncio.current_task()
                if task is not None:
                    self._arriving.discard(task)
            if streams is not None:
                await self._serve(*streams, peer, who, settle)
        except TimeoutError:
            self.bad(who, "timeout")  # a silent dial on the TLS port, or a handshake that stalled
        except ssl.SSLError:
            self.bad(who, "tls")  # a handshake that failed: not TLS 1.2+, or not TLS at all
        except OSError:
            pass  # reset or gone
        finally:
            settle()

    async def _streams(
        self, sock: socket.socket, who: str
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """The connection as streams, over TLS on a TLS port; None when it ended before."""
        loop = asyncio.get_running_loop()
        if self._context is not None:
            first = await _peek(loop, sock)
            if not first:
                return None  # hung up before a byte
            if first[:1] != b"\x16":  # not a TLS handshake: a cleartext dial on the TLS port
                http = preamble.classify(first) is preamble.Channel.HTTP
                _send_and_close(sock, _CLEARTEXT_HTTP if http else preamble.TLS_CLEARTEXT_ALERT)
                self.bad(who, "cleartext")
                return None
        reader = asyncio.StreamReader(limit=wire.CONTROL_MAX, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        transport, _ = await loop.connect_accepted_socket(
            lambda: protocol,
            sock,
            ssl=self._context,
            # A backstop: the caller's deadline (the preamble's) covers the handshake.
            ssl_handshake_timeout=2 * self.timeouts.preamble if self._context else None,
        )
        return reader, asyncio.StreamWriter(transport, protocol, reader, loop)

    async def _serve(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer: str,
        who: str,
        settle: Callable[[], None],
    ) -> None:
        keepalive(writer)
        self._writers.add(writer)
        if self.tls is None:
            self.cleartext(peer)
        try:
            first = await asyncio.wait_for(reader.readexactly(4), self.timeouts.preamble)
            channel = preamble.classify(first)
            if channel is preamble.Channel.HTTP:
                # A start needs no token from the operator on this box (the controller's own user,
                # or root): their loopback address goes on. Another account's loopback connection
                # (the door's tunnels) goes on as its budget's name, which is not loopback.
                asker = peer if who in (peer, self._root) else who
                await http_surface.serve(
                    first,
                    reader,
                    writer,
                    asker,
                    self.routes,
                    limits=self.timeouts.http,
                    bad=lambda cause: self.bad(who, cause),
                    clock=self.clock,
                    policy=self.hosts,
                )
            elif channel is preamble.Channel.JOIN:
                await self.on_join(reader, writer, who, settle)
            else:
                self.bad(who, "channel")  # rendezvous, data and control ride the admitted join link
        except wire.Dropped as exc:
            self.bad(who, exc.cause)
        except TimeoutError:
            self.bad(who, "timeout")  # a silent dial, a hello or a request that never completed
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            settle()
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


# What the log says of a dropped dial, by its cause (the counters keep the bare cause).
DROP_WORDS = {
    "timeout": "it said nothing in time (a silent dial, or a hello or request that never completed)",
    "tls": "its TLS handshake failed",
    "cleartext": "it spoke cleartext to this TLS port (it must pin the certificate)",
    "channel": "an unknown preamble",
    "tag": "a frame that does not verify (a wrong key, or tampering)",
    "http": "a malformed HTTP request",
}

# A plain HTTP request on the TLS port (curl http://…, an unpinned client) is told what to do.
_TLS_ERROR = (
    b'{"error": "this controller speaks TLS: pin its certificate (--tls-fingerprint or '
    b'FDL_TLS_FINGERPRINT; fdl tls fingerprint CERT prints it)", "tls": true}'
)
_CLEARTEXT_HTTP = (
    b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\n"
    + b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in http_surface.security_headers())
    + b"content-length: %d\r\n\r\n%s" % (len(_TLS_ERROR), _TLS_ERROR)
)


async def _peek(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    """The connection's first bytes (up to 4: a preamble), left unread for the TLS handshake."""
    ready: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(sock.fileno(), readable)
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())
    return sock.recv(4, socket.MSG_PEEK)


def _send_and_close(sock: socket.socket, data: bytes) -> None:
    """One non-blocking send, then close. What the peer already sent is read off before the
    close, so the close is a FIN the peer reads after ``data``, not a reset that could discard it."""
    with contextlib.suppress(OSError):
        sock.send(data)
        sock.recv(65536)
    sock.close()

"""The controller port's sockets: bind, accept in batches, back off at the descriptor limit.

The listener accepts connections itself rather than through ``asyncio.start_server``,
so that nothing is spent on a connection the gate turns away (no transport, no TLS
handshake) and so that running out of file descriptors is one line per episode:
asyncio's own accept loop logs a traceback for every attempt at ``EMFILE``, hundreds
of megabytes in a flood. Out of descriptors, the acceptor stops accepting for a
moment (connections wait in the kernel's backlog), says so once, and says when it
accepts again.
"""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Callable, Mapping

# Out of a resource that connections closing give back: pause accepting, don't spin.
STARVED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# Connections accepted per wake-up before other work gets a turn: small, so a storm of walk-ins
# cannot queue a status request behind thousands of connects (the kernel's queue is SOMAXCONN).
ACCEPT_BATCH = 64
PAUSE = 1.0  # seconds between tries while out of descriptors (asyncio waits as long)
FD_CEILING = 1 << 20  # how far the soft limit is raised at most, whatever the hard one says


def raise_fd_limit() -> tuple[int, int] | None:
    """Raise this process's soft open-file limit to its hard limit: (before, after) when it moved.

    Every connection holds a descriptor, and the usual soft limit (1024) is a flood's
    first target. A sandbox that forbids the raise leaves the limit as it was, quietly."""
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = FD_CEILING if hard == resource.RLIM_INFINITY else min(hard, FD_CEILING)
    if soft != resource.RLIM_INFINITY and soft >= wanted:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (OSError, ValueError):
        return None
    return soft, wanted


def fd_limit() -> int | None:
    try:
        import resource
    except ImportError:
        return None
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def bind(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address ``host`` names (``port`` 0: one free port for all)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    seen: set[tuple[int, object]] = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address[0]) in seen:
                continue
            seen.add((family, address[0]))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if sockets[0] is not sock:  # the port the first address got, for every other
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
            # A storm of walk-ins must not overflow the accept queue.
            sock.listen(socket.SOMAXCONN)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class Acceptor:
    """Accepts on ``sockets`` and hands each connection (non-blocking) and its peer's address on
    (``peers``: what a listening socket's peers count as, where they have no address: unix ones)."""

    def __init__(
        self,
        sockets: list[socket.socket],
        on_connection: Callable[[socket.socket, str], None],
        *,
        log: Callable[[str], None],
        clock: Callable[[], float],
        pause: float = PAUSE,
        peers: Mapping[socket.socket, str] | None = None,
    ) -> None:
        self.sockets = sockets
        self.peers = dict(peers or {})
        self.on_connection = on_connection
        self.log = log
        self.clock = clock
        self.pause = pause
        self.starved_since: float | None = None  # an episode out of descriptors, while it lasts
        self.episodes = 0
        self._retry: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        for sock in self.sockets:
            loop.add_reader(sock.fileno(), self._ready, sock)

    def close(self) -> None:
        self._stop_reading()
        if self._retry is not None:
            self._retry.cancel()
        for sock in self.sockets:
            sock.close()

    def _stop_reading(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            for sock in self.sockets:
                if sock.fileno() >= 0:
                    self._loop.remove_reader(sock.fileno())

    def _ready(self, listening: socket.socket) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, address = listening.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in STARVED:
                    self._starve(exc)
                    return
                continue  # this one connection went wrong (reset before we took it): the next
            if self.starved_since is not None:
                self.log(
                    f"accepting connections again after {self.clock() - self.starved_since:.1f}s "
                    "out of file descriptors"
                )
                self.starved_since = None
            conn.setblocking(False)
            self.on_connection(conn, self.peers.get(listening) or str(address[0]))

    def _starve(self, exc: OSError) -> None:
        self._stop_reading()
        if self.starved_since is None:
            self.starved_since = self.clock()
            self.episodes += 1
            limit = fd_limit()
            self.log(
                f"out of file descriptors ({errno.errorcode.get(exc.errno or 0, exc.errno)}"
                f"{f', the limit is {limit}' if limit else ''}): not accepting connections for now, they "
                f"wait in the backlog (trying again every {self.pause:g}s); raise LimitNOFILE / ulimit -n "
                "if this is not a flood"
            )
        assert self._loop is not None
        self._retry = self._loop.call_later(self.pause, self.start)

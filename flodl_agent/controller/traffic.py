"""The formed world's traffic through the controller: rendezvous streams and CPU-plane rounds.

Everything dials in, so the controller carries what ranks on different hosts
say to each other: torch's store connections (relayed as streams between rank
0's host and the others) and the CPU plane's averaging rounds (summed by the
``hub``). This module routes both between the host links; the supervisor hears
when a round opens and closes (its stall ceiling), and who saves at a shutdown. A restarted
controller hears from each host it re-adopts which round it pushes next (``resumed``): the
rounds below the highest are abandoned, so that the hosts meet again.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ..observe.history import RoundLog
from ..protocol import wire
from ..protocol.messages import Average, Stream
from ..train.hub import Averaged, Hub, Mismatch
from ..train.rendezvous import RouteError, StreamRouter
from .supervision import FailRun, Supervisor


class Sender(Protocol):
    def send(self, kind: wire.Kind, body: dict[str, Any], blob: wire.Blob = b"") -> None: ...


class RoundFailed(Exception):
    """A round that cannot be averaged (a host's relay failed, or shapes differ): the run fails."""


class Traffic:
    def __init__(
        self,
        hosts: list[str],
        links: Mapping[str, Sender],
        supervisor: Supervisor,
        dropped: Counter[str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.links = links  # the controller's live links: a host that left is simply not there
        self.supervisor = supervisor
        self.dropped = dropped
        self.streams = StreamRouter(hosts[0])  # rank 0's host serves the store
        self.hub = Hub(set(hosts))
        self.rounds = RoundLog()  # each round's seconds and shares, for the status page
        self.clock = clock  # times rounds from their first push to their average

    @property
    def averaging(self) -> bool:
        """Ranks average through the controller (only they can be asked to save)."""
        return self.hub.active

    def route(self, host: str, stream: Stream) -> FailRun | None:
        """A rendezvous stream's bytes: member -> store host, or store host -> member; the
        supervisor's verdict when this is the first sign that the world rendezvouses."""
        router = self.streams
        verdict = None
        if host != router.store_host and not self.supervisor.rendezvous:
            # A far rank dialled the store (routable or not: its store host may be gone).
            verdict = self.supervisor.rendezvoused(averaging=self.averaging)
        try:
            if host == router.store_host:
                target, sid = router.from_store(stream.id, stream.end)
            else:
                target, sid = router.store_host, router.from_member(host, stream.id, stream.end)
        except RouteError:
            self.dropped["stream"] += 1
            return verdict
        link = self.links.get(target)
        if link is None:
            self.dropped["stream"] += 1
            return verdict
        link.send(wire.Kind.STREAM, {"id": sid, "data": stream.data, "end": stream.end})
        return verdict

    def push(self, host: str, pushed: Average, blob: wire.Blob, now: float) -> bool:
        """A host's folded round; the average goes back once the round is complete.
        True when this push opened a round (its stall ceiling starts)."""
        if pushed.error:
            raise RoundFailed(f"{host}: {pushed.error}")
        if self.supervisor.shutdown:  # a round pushed after the shutdown: answered with it at once
            if pushed.offset == 0:  # once per round, not per piece
                self.tell_shutdown(host, pushed.round)
            return False
        if pushed.join:  # a walk-in's ranks are ready: counted from the next round (hub.join)
            self.joined(host, pushed.params)
            return False
        if pushed.round < self.hub.floor:  # abandoned at a resume: answered at once, never opened
            self._send(self.hub.push(host, pushed.round, 0.0, b"", pushed.bf16, pushed.offset))
            return False
        self.rounds.opened(pushed.round, self.clock())
        try:
            pieces = self.hub.push(
                host, pushed.round, pushed.weight, blob, pushed.bf16, pushed.offset, pushed.params
            )
        except Mismatch as exc:
            raise RoundFailed(str(exc)) from None
        if pieces:
            self.deliver(pieces)
            if pieces[-1].last:
                return False
        if pushed.round in self.supervisor.stalls:
            return False
        self.supervisor.round_opened(pushed.round, now)
        return True

    def joined(self, host: str, params: int = 0) -> None:
        """A walk-in's ranks are ready: it takes the next round's average, then averages. One
        that does not fit (another model) is refused alone: its ranks fail, as any host's may."""
        try:
            self.deliver(self.hub.join(host, params))
        except Mismatch as exc:
            if (link := self.links.get(host)) is not None:
                error = f"{exc}: this walk-in builds another model than the world's"
                link.send(wire.Kind.AVERAGED, {"round": 0, "error": error})

    def resumed(self, host: str, round_no: int) -> None:
        """A restarted controller re-adopted ``host``, whose ranks push ``round_no`` next: the
        hub's floor rises to it, and the open rounds below it end, answered with weight 0 (their
        ranks keep their parameters), so that every host meets at the floor."""
        abandoned = self.hub.resume(round_no)
        for piece in abandoned:
            self.supervisor.round_closed(piece.round)
        self._send(abandoned)

    def reformed(self, hosts: list[str], supervisor: Supervisor) -> None:
        """The world re-formed (a process group grown by restart): a new supervision over its
        hosts, the stream table kept (rank 0's host serves the store still, and its stream
        numbers go on, so that a stopped rank's last frames never meet a new rank's)."""
        if hosts[0] != self.streams.store_host:
            raise ValueError(f"the re-formed world's rank 0 is on {hosts[0]}, not the store's host")
        self.supervisor = supervisor
        self.hub = Hub(set(hosts))

    def deliver(self, pieces: list[Averaged]) -> None:
        """Pieces of averages, to every host of their round (the same bytes to each: no copy)."""
        for piece in pieces:
            if piece.last:
                self.supervisor.round_closed(piece.round)
                self.rounds.closed(piece.round, self.clock(), piece.weights)
        self._send(pieces)

    def _send(self, pieces: list[Averaged]) -> None:
        for piece in pieces:
            body = {
                "round": piece.round,
                "weight": piece.weight,
                "bf16": piece.bf16,
                "offset": piece.offset,
                "params": piece.params,
                "last": piece.last,
                "taken": piece.taken,
            }
            for host in piece.hosts:
                link = self.links.get(host)
                if link is not None:
                    link.send(wire.Kind.AVERAGED, body, piece.data)

    def shutdown(self) -> None:
        """ShutdownWithSave: every round waiting is answered with it (and the saver's rank)."""
        self.rounds.dropped()
        for round_no, hosts in self.hub.shutdown():
            for host in hosts:
                self.tell_shutdown(host, round_no)

    def tell_shutdown(self, host: str, round_no: int) -> None:
        link = self.links.get(host)
        if link is not None:
            error = f"shutdown with save: {self.supervisor.shutdown}"
            link.send(
                wire.Kind.AVERAGED, {"round": round_no, "error": error, "saver": self.supervisor.saver()}
            )

    def ranks_done(self, host: str) -> None:
        """Every rank of ``host`` exited: its rounds no longer wait for it."""
        self.deliver(self.hub.leave(host))

    def left(self, host: str) -> None:
        """``host``'s link closed: its rounds and its ranks' store connections end."""
        self.deliver(self.hub.leave(host))
        if host != self.streams.store_host:
            store = self.links.get(self.streams.store_host)
            for gid in self.streams.drop_host(host):
                if store is not None:
                    store.send(wire.Kind.STREAM, {"id": gid, "end": True})

"""The controller: one port, the join window, host links and the status surface.

The IO shell around the pure cores: ``wire`` frames every byte, ``admission``
judges each hello, ``window`` decides when the world forms, and this module
only moves bytes, runs the one timer the window asks for, and supervises the
host links. Everything dials in; the controller never dials out.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import h11

from . import wire
from .admission import Cohort, DialGuard, Refusal, check
from .averaging import DATA_MAX
from .hub import Averaged, Hub, Mismatch
from .messages import (
    Accept,
    Average,
    BadMessage,
    Challenge,
    Heartbeat,
    Hello,
    Plane,
    RankExited,
    Reject,
    Stream,
)
from .messages import parse as parse_message
from .metrics import PROMETHEUS_TEXT as METRICS
from .metrics import RankBoard, exposition
from .net import is_loopback, join_address, keepalive
from .placement.fleet import PlacementError
from .placement.parallel import check_world
from .ranks import RankRange, assign_contiguous
from .rendezvous import RouteError, StreamRouter
from .status_page import HTML, status_page
from .tls import cleartext_warning, server_context
from .window import Fail, Form, Keep, Window, WindowConfig

PREAMBLE_TIMEOUT = 5.0
CLOSE_GRACE = 2.0
MAX_HANDSHAKES = 2048  # unadmitted connections at once; a flood waits its turn by being dropped
# Unadmitted connections from one address at once (loopback exempt): one flooding
# address cannot hold every handshake slot or file descriptor. Generous for NAT.
MAX_PER_PEER = 256
HELLO_TIMEOUT = 10.0
HTTP_TIMEOUT = 10.0
HTTP_MAX_BODY = 4096
SHIP_BATCH = 512


class BindError(Exception):
    """The controller port cannot be opened (in use, or not an address of this host)."""


@dataclass
class Link:
    """One admitted host: its hello, its stream and its codec (after rekey)."""

    hello: Hello
    writer: asyncio.StreamWriter
    codec: wire.Codec
    joined_at: float
    peer: str
    ranks: range | None = None  # its share of the formed world
    exited: dict[int, int] = field(default_factory=dict)
    seen: float = 0.0  # when its last frame arrived (the heartbeat watchdog reads it)
    silent: bool = False  # cut by the watchdog: its end says why

    def send(self, kind: wire.Kind, body: dict[str, Any], blob: wire.Blob = b"") -> None:
        for part in self.codec.encode_parts(kind, body, blob):
            self.writer.write(part)  # one write per part: the parameters are never joined into a copy


@dataclass
class Settings:
    window: WindowConfig
    command: list[str]
    bind: str = "127.0.0.1"
    port: int = 1337
    token: str | None = None
    open_admission: bool = False
    plane: Plane = "cpu"
    env: dict[str, str] = field(default_factory=dict)
    run: str = ""
    roster: list[str] = field(default_factory=list)  # configured workers, in rank order
    max_failure: str = "0"  # ranks that may fail mid-run: "N", or "P%" of the formed world
    shutdown_grace: float = 60.0  # seconds survivors get to save before the run is aborted
    stall_ceiling: float = 600.0  # seconds an averaging round may wait for its last host
    heartbeat_timeout: float = 30.0  # a training host silent this long is cut off (agents beat every 5 s)
    parallelism: dict[str, int] | None = None  # tensor/pipeline/data/expert the formed world must satisfy
    tls: tuple[str, str] | None = None  # (certificate, key): serve the port over TLS


def failure_budget(spec: str, world_size: int) -> int:
    """``max_failure`` as a rank count: ``"2"``, or ``"25%"`` of the world (rounded down)."""
    text = spec.strip()
    if text.endswith("%"):
        return int(world_size * float(text[:-1]) / 100)
    return int(text)


def parse_max_failure(spec: str) -> str:
    """Check a ``max_failure`` spelling; returns it normalized or raises ValueError."""
    text = spec.strip()
    try:
        value = float(text[:-1]) if text.endswith("%") else int(text)
    except ValueError:
        raise ValueError(f"max_failure is a rank count (2) or a percentage (25%), not {spec!r}") from None
    if value < 0 or (text.endswith("%") and value > 100):
        raise ValueError(f"max_failure {spec!r} is out of range")
    return text


class Controller:
    def __init__(
        self,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.monotonic,
        log: Callable[[str], None] = lambda line: None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.log = log
        self.salt = wire.new_salt()
        self.key = wire.run_key(settings.token, self.salt)
        # A configured token always forces credential-checked admission.
        self.open = settings.token is None and (settings.open_admission or is_loopback(settings.bind))
        self.join_key = wire.OPEN_KEY if self.open else self.key
        self.window = Window(settings.window, self.clock())
        self.links: dict[str, Link] = {}
        self.cohort = Cohort()
        # /state.json's roster as JSON text per host, in admission order; None = rebuild
        self._roster: dict[str, str] | None = {}
        self.guard = DialGuard()
        self.dropped: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.admitted = 0
        self.finished = asyncio.Event()
        self.exit_code = 1
        self.reason = ""
        # The world as formed and every rank's exit: the run's report outlives the links.
        self.formed: list[dict[str, Any]] = []
        self.exits: dict[str, dict[int, int]] = {}
        self.streams: StreamRouter | None = None  # rendezvous routes, once the world formed
        self.hub: Hub | None = None  # the CPU plane's averaging, once the world formed
        self.failed_ranks: set[int] = set()  # ranks lost mid-run (evicted within max_failure)
        self.board = RankBoard()  # per-rank progress from the heartbeats
        self._shutdown = ""  # ShutdownWithSave in progress: why
        self._grace: asyncio.TimerHandle | None = None
        self._stalls: dict[int, asyncio.TimerHandle] = {}  # open averaging rounds: their ceiling
        self.port = settings.port
        self._timer: asyncio.TimerHandle | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._handshakes = 0
        self._unsettled: Counter[str] = Counter()  # unadmitted connections per (non-loopback) peer
        self._warned: set[str] = set()  # peers told their connection is cleartext

    # --- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        tls = self.settings.tls
        try:
            context = server_context(Path(tls[0]), Path(tls[1])) if tls else None
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            raise BindError(f"cannot load the TLS certificate {tls[0] if tls else ''}: {exc}") from None
        try:
            self._server = await asyncio.start_server(
                self._serve,
                self.settings.bind,
                self.settings.port,
                limit=wire.CONTROL_MAX,
                backlog=socket.SOMAXCONN,  # a storm of walk-ins must not overflow the accept queue
                ssl=context,
                ssl_handshake_timeout=PREAMBLE_TIMEOUT if context else None,
            )
        except OSError as exc:
            raise BindError(
                f"cannot open the join window on {self.settings.bind}:{self.settings.port}: {exc.strerror}"
            ) from None
        self.port = self._server.sockets[0].getsockname()[1]
        self._apply(self.window.decide(self.clock()))

    async def close(self) -> None:
        for timer in (self._timer, self._grace, *self._stalls.values()):
            if timer is not None:
                timer.cancel()
        if self._server is not None:
            self._server.close()
        # Closing every connection lets each handler finish on EOF; only a
        # straggler is cancelled (a cancelled handler makes asyncio log noise).
        for writer in list(self._writers):
            writer.close()
        if self._tasks:
            _, late = await asyncio.wait(set(self._tasks), timeout=CLOSE_GRACE)
            for task in late:
                task.cancel()
            if late:
                await asyncio.gather(*late, return_exceptions=True)

    # --- the window's verdicts -----------------------------------------------

    def fail(self, reason: str) -> None:
        """Fail the run from outside (the launcher): Abort goes down every link."""
        self._apply(self.window.fail(reason, self.clock()))

    def _apply(self, decision: Keep | Form | Fail) -> None:
        if isinstance(decision, Form):
            self._form(decision)
        elif isinstance(decision, Fail):
            self._fail(decision.reason)
        elif self.window.phase == "done":
            self.log("run complete: every host link closed")
            self.exit_code = 0
            self.finished.set()
        self._arm_timer()

    def _arm_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        deadline = self.window.next_deadline()
        if deadline is None:
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(
            max(0.0, deadline - self.clock()), lambda: self._apply(self.window.decide(self.clock()))
        )

    def _form(self, decision: Form) -> None:
        # Configured workers take ranks in worker order (the cluster file's promise);
        # walk-ins follow in admission order.
        place = {host: i for i, host in enumerate(self.settings.roster)}
        members = sorted(decision.members, key=lambda m: place.get(m.host, len(place)))
        if self.settings.parallelism:
            try:
                check_world(self.settings.parallelism, [m.ranks for m in members])
            except PlacementError as exc:
                reason = f"the formed world cannot satisfy the parallelism request: {exc.message}"
                self._apply(self.window.fail(reason, self.clock()))
                return
        ranges = assign_contiguous([(m.host, m.ranks) for m in members])
        common = {
            "world_size": ranges[-1].stop if ranges else 0,
            "hosts": len(ranges),
            "controller": join_address(self.settings.bind, self.port),
            "command": self.settings.command,
            "plane": self.settings.plane,
            "env": self.settings.env,
            "run": self.settings.run,
        }
        # Training starts at the freeze: a host that gets its share early may
        # finish (or die) before the last one is sent, and training judges that.
        self.window.formed(self.clock())
        for r in ranges:
            if r.host in self.links:
                self.links[r.host].ranks = r.ranks
        if ranges:
            self.streams = StreamRouter(ranges[0].host)  # rank 0's host serves the store
            self.hub = Hub({r.host for r in ranges})
        self.formed = [
            json.loads(self._host_json(self.links[r.host], r.start)) for r in ranges if r.host in self.links
        ]
        self._roster = None  # the final ranks replace the provisional ones
        now = self.clock()
        for link in self.links.values():
            link.seen = now
        self._spawn(self._ship(ranges, common))
        self._spawn(self._watch_heartbeats())

    async def _ship(self, ranges: list[RankRange], common: dict[str, Any]) -> None:
        """Send every host its share of the world, yielding to other work between batches."""
        try:
            for group, r in enumerate(ranges):
                if self.window.phase == "failed":
                    return  # a host died meanwhile: Abort went out instead
                link = self.links.get(r.host)
                if link is None:
                    continue  # its link closed after the freeze; training already judged it
                share = {
                    "host": r.host,
                    "first_rank": r.start,
                    "count": r.count,
                    "data_path": link.hello.data_path,
                }
                link.send(wire.Kind.WORLD_FORMED, {**common, "host": share, "group": group})
                if group % SHIP_BATCH == SHIP_BATCH - 1:
                    await asyncio.sleep(0)  # let status requests through during a fleet-sized fan-out
        except Exception as exc:  # a formation that cannot ship must fail loudly, not hang
            self._apply(self.window.fail(f"the world could not be formed: {exc}", self.clock()))
            return
        self.log(f"world formed: {common['world_size']} ranks on {len(ranges)} hosts; training")

    async def _watch_heartbeats(self) -> None:
        """The backstop behind exit reports and link ends: a training host that sends
        nothing (a frozen agent, a partition without a reset) is cut off."""
        timeout = self.settings.heartbeat_timeout
        while self.window.phase == "training":
            with contextlib.suppress(TimeoutError):  # the watchdog's period; the run's end stops it at once
                await asyncio.wait_for(self.finished.wait(), timeout / 4)
            if self.window.phase != "training":
                return
            now = self.clock()
            for link in list(self.links.values()):
                if now - link.seen > timeout and not link.silent:
                    link.silent = True
                    self.log(
                        f"host {link.hello.host} sent nothing for {now - link.seen:.0f}s; cutting its link"
                    )
                    link.writer.close()

    def _fail(self, reason: str) -> None:
        self.log(f"run failed: {reason}")
        self.reason = reason
        for link in self.links.values():
            with contextlib.suppress(Exception):
                link.send(wire.Kind.ABORT, {"reason": reason})
        self.exit_code = 1
        self.finished.set()

    # --- connections ---------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(writer.get_extra_info("peername", ("?", 0))[0])
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)  # so close() can end every handler, not just the ones we spawned
            task.add_done_callback(self._tasks.discard)
        keepalive(writer)
        self._writers.add(writer)
        # Loopback is exempt: under tunnels every walk-in arrives from 127.0.0.1,
        # and one bad tunnel must not lock the others out.
        counted = not is_loopback(peer)
        if self.settings.tls is None:
            self._cleartext(peer)

        def settle() -> None:  # no longer an unadmitted connection of this peer
            nonlocal counted
            if counted:
                counted = False
                self._unsettled[peer] -= 1
                if self._unsettled[peer] <= 0:
                    del self._unsettled[peer]

        try:
            if counted and not self.guard.allow(peer, self.clock()):
                self.dropped["rate_limited"] += 1
                counted = False
                return
            if counted and self._unsettled[peer] >= MAX_PER_PEER:
                self.dropped["busy_peer"] += 1
                counted = False
                return
            if counted:
                self._unsettled[peer] += 1
            try:
                preamble = await asyncio.wait_for(reader.readexactly(4), PREAMBLE_TIMEOUT)
            except TimeoutError:
                self._bad(peer, "timeout")  # a silent connection is a bad dial: it held a slot
                return
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            channel = wire.classify(preamble)
            if channel is wire.Channel.HTTP:
                await self._http(preamble, reader, writer, peer)
            elif channel is wire.Channel.JOIN:
                await self._join(reader, writer, peer, settle)
            else:
                # rendezvous, data and control channels arrive with the data plane
                self._bad(peer, "channel")
        except wire.Dropped as exc:
            self._bad(peer, exc.cause)
        except TimeoutError:
            self._bad(peer, "timeout")  # a hello or a request that never completed
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            settle()
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _cleartext(self, peer: str) -> None:
        """Say once per peer (and remember at most 1024) when one comes from outside the private ranges."""
        if peer in self._warned or len(self._warned) >= 1024 or not cleartext_warning(peer):
            return
        self._warned.add(peer)
        self.log(
            f"note: {peer} reaches the controller port in cleartext from outside the private ranges: "
            "frames are authenticated, not encrypted (cluster.controller.tls encrypts them)"
        )

    def _bad(self, peer: str, cause: str) -> None:
        self.dropped[cause] += 1
        if not is_loopback(peer):
            self.guard.penalize(peer, self.clock())

    async def _read_frame(self, reader: asyncio.StreamReader, codec: wire.Codec) -> wire.Frame | None:
        while True:
            frame = codec.next_frame()
            if frame is not None:
                return frame
            # A frame's size is known from its header: read it in large pieces.
            data = await reader.read(max(65536, min(codec.wanted, 1 << 24)))
            if not data:
                return None
            codec.feed(data)

    async def _join(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer: str,
        settle: Callable[[], None] = lambda: None,
    ) -> None:
        if self._handshakes >= MAX_HANDSHAKES:
            self.dropped["busy"] += 1
            return
        self._handshakes += 1
        try:
            link = await self._handshake(reader, writer, peer)
        finally:
            self._handshakes -= 1
            settle()  # admitted or not, the handshake is over
        if link is not None:
            await self._link(reader, link)

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str
    ) -> Link | None:
        """Challenge, hello, admission; the admitted host's link, or None."""
        # Until admitted, a peer gets a small frame cap: it has proven nothing yet.
        codec = wire.Codec(self.join_key, max_payload=wire.PRE_ADMISSION_MAX)
        nonce = wire.new_nonce()
        writer.write(
            codec.encode(
                wire.Kind.CHALLENGE,
                Challenge(nonce=nonce, open=self.open, run=self.settings.run).model_dump(),
            )
        )
        frame = await asyncio.wait_for(self._read_frame(reader, codec), HELLO_TIMEOUT)
        if frame is None:
            return None
        if frame.kind is not wire.Kind.HELLO:
            raise wire.Dropped("kind", "expected a hello")
        try:
            hello = parse_message(frame)
        except BadMessage as exc:
            raise wire.Dropped("payload", str(exc)) from None
        assert isinstance(hello, Hello)
        if not hmac.compare_digest(hello.nonce, nonce):
            raise wire.Dropped("replay", "hello does not answer this connection's challenge")
        refusal = self._admit(hello)
        if refusal is not None:
            self.refused[refusal.code] += 1
            self.log(f"refused {hello.host or peer}: {refusal.reason}")
            writer.write(
                codec.encode(
                    wire.Kind.REJECT,
                    Reject(reason=refusal.reason, fix=refusal.fix, permanent=refusal.permanent).model_dump(),
                )
            )
            await writer.drain()
            return None
        first = self.window.joined_ranks
        count = len(hello.devices)
        decision = self.window.join(hello.host, count, self.clock())  # _admit checked the phase
        link = Link(hello, writer, codec, time.time(), peer)
        self._register(link, first)
        accept = Accept(
            ranks=(first, count),
            salt=self.salt if self.open else None,
            command=self.settings.command,
            plane=self.settings.plane,
            run=self.settings.run,
        )
        writer.write(codec.encode(wire.Kind.ACCEPT, accept.model_dump()))
        # Rekey before anything else is written: whatever follows (a WorldFormed
        # this very join may trigger) speaks this connection's key.
        codec.rekey(wire.connection_key(self.key, nonce, hello.client_nonce))
        codec.max_payload = DATA_MAX  # an admitted host's link carries the CPU plane's rounds
        self.admitted += 1
        self.log(
            f"admitted {hello.host} ({peer}): ranks [{first}..{first + count}) on {', '.join(hello.devices)}"
        )
        self._apply(decision)
        try:
            await writer.drain()
        except (ConnectionError, OSError):
            # A failed Accept write rolls the admission back (or, after the freeze, is a lost host).
            if self.links.get(hello.host) is link:
                self._unregister(link)
                self._closed(link)
            return None
        return link

    def _admit(self, hello: Hello) -> Refusal | None:
        if not self.window.can_admit():
            return Refusal(
                "window_closed",
                f"the window is closed (phase {self.window.phase})",
                "wait for the next run; --persist re-dials",
            )
        return check(self.cohort, hello, self.settings.plane)

    async def _link(self, reader: asyncio.StreamReader, link: Link) -> None:
        """The host's control link for the whole run; its EOF is the host's exit."""
        host = link.hello.host
        try:
            while True:
                frame = await self._read_frame(reader, link.codec)
                if frame is None:
                    break
                link.seen = self.clock()
                if frame.kind is wire.Kind.HEARTBEAT:
                    beat = parse_message(frame)
                    assert isinstance(beat, Heartbeat)
                    own = {
                        r: rep.model_dump() for r, rep in beat.ranks.items() if link.ranks and r in link.ranks
                    }
                    if len(own) < len(beat.ranks):
                        self.dropped["rank"] += 1  # reports for ranks that are not this host's
                    self.board.update(host, own, link.seen)
                    continue
                if frame.kind is wire.Kind.STREAM:
                    self._route(host, frame)
                    continue
                if frame.kind is wire.Kind.AVERAGE:
                    self._average(host, frame)
                    continue
                if frame.kind is wire.Kind.RANK_EXITED:
                    exited = parse_message(frame)
                    assert isinstance(exited, RankExited)
                    if link.ranks is None or exited.rank not in link.ranks:
                        self.dropped["rank"] += 1  # not one of this host's ranks: ignore, never count
                        continue
                    link.exited[exited.rank] = exited.code
                    self.exits.setdefault(host, {})[exited.rank] = exited.code
                    if len(link.exited) == len(link.hello.devices) and self.hub is not None:
                        self._averaged(self.hub.leave(host))  # its rounds no longer wait for it
                    self.log(f"rank {exited.rank} on {host} exited with code {exited.code}")
                    if exited.code != 0 and self.window.phase == "training":
                        self._rank_failed(
                            f"rank {exited.rank} on {host} exited with code {exited.code}", {exited.rank}
                        )
        except (wire.Dropped, BadMessage) as exc:
            self.dropped[getattr(exc, "cause", "payload")] += 1
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            if self.links.get(host) is link:
                self._unregister(link)
                self._closed(link)

    def _route(self, host: str, frame: wire.Frame) -> None:
        """A rendezvous stream's bytes: member -> store host, or store host -> member."""
        stream = parse_message(frame)
        assert isinstance(stream, Stream)
        router = self.streams
        try:
            if router is None:
                raise RouteError("no world formed yet")
            if host == router.store_host:
                target, sid = router.from_store(stream.id, stream.end)
            else:
                target, sid = router.store_host, router.from_member(host, stream.id, stream.end)
        except RouteError:
            self.dropped["stream"] += 1
            return
        link = self.links.get(target)
        if link is None:
            self.dropped["stream"] += 1
            return
        link.send(wire.Kind.STREAM, {"id": sid, "data": stream.data, "end": stream.end})

    def _average(self, host: str, frame: wire.Frame) -> None:
        """A host's folded round for the CPU plane; the average goes back once the round is complete."""
        pushed = parse_message(frame)
        assert isinstance(pushed, Average)
        if self.window.phase != "training" or self.hub is None:
            self.dropped["average"] += 1
            return
        if pushed.error:
            self._apply(self.window.fail(f"{host}: {pushed.error}", self.clock()))
            return
        if self._shutdown:  # a round pushed after the shutdown: answered with it at once
            self._tell_shutdown(host, pushed.round)
            return
        try:
            done = self.hub.push(host, pushed.round, pushed.weight, frame.blob, pushed.bf16)
        except Mismatch as exc:
            self._apply(self.window.fail(str(exc), self.clock()))
            return
        if done is not None:
            self._averaged([done])
        elif pushed.round not in self._stalls:  # the round's first push starts its ceiling
            self._stalls[pushed.round] = asyncio.get_running_loop().call_later(
                self.settings.stall_ceiling, self._stalled, pushed.round
            )

    def _stalled(self, round_no: int) -> None:
        """A round waited past the ceiling: a host is alive but not averaging (hung, or deadlocked)."""
        self._stalls.pop(round_no, None)
        if self.hub is None or self._shutdown or self.window.phase != "training":
            return
        missing = ", ".join(sorted(self.hub.missing(round_no))) or "nobody"
        self._shutdown_with_save(
            f"averaging round {round_no} stalled for {self.settings.stall_ceiling:g}s waiting on {missing}"
        )

    def _averaged(self, rounds: list[Averaged]) -> None:
        for done in rounds:
            stall = self._stalls.pop(done.round, None)
            if stall is not None:
                stall.cancel()
            body = {"round": done.round, "weight": done.weight, "bf16": done.bf16}
            for host in done.hosts:
                link = self.links.get(host)
                if link is not None:
                    link.send(wire.Kind.AVERAGED, body, done.data)

    def _register(self, link: Link, first: int) -> None:
        self.links[link.hello.host] = link
        self.cohort.add(link.hello)
        if self._roster is not None:  # an arrival appends; nobody's ranks move
            self._roster[link.hello.host] = self._host_json(link, first)

    def _unregister(self, link: Link) -> None:
        del self.links[link.hello.host]
        if self.hub is not None:
            self._averaged(self.hub.leave(link.hello.host))
        if self.streams is not None and link.hello.host != self.streams.store_host:
            store = self.links.get(self.streams.store_host)
            for gid in self.streams.drop_host(link.hello.host):  # its ranks' store connections end
                if store is not None:
                    store.send(wire.Kind.STREAM, {"id": gid, "end": True})
        self.cohort.remove(link.hello.host)
        self._roster = None

    def _closed(self, link: Link) -> None:
        host = link.hello.host
        phase = self.window.phase
        if phase in ("done", "failed"):
            return
        if self._shutdown:
            self.log(f"host {host} closed its link")
            if not self.links:  # every survivor has saved and gone
                self._apply(self.window.fail(self._shutdown, self.clock()))
            return
        running = len(link.hello.devices) - len(link.exited)
        if phase == "training" and running > 0:
            # A host that leaves with ranks still running has died, not finished.
            lost = set(link.ranks or ()) - set(link.exited)
            why = (
                f"host {host} went silent (no heartbeat for {self.settings.heartbeat_timeout:g}s)"
                if link.silent
                else f"host {host} closed its link"
            )
            if not self._rank_failed(f"{why} with {running} rank(s) still running", lost):
                return
        self.log(f"host {host} closed its link")
        self._apply(self.window.leave(host, self.clock()))

    # --- failures mid-run: eviction within max_failure, then ShutdownWithSave ------

    def _rank_failed(self, reason: str, ranks: set[int]) -> bool:
        """Ranks were lost; True when the run goes on without them."""
        if self._shutdown:
            return False
        self.failed_ranks |= ranks
        world = sum(len(h["devices"]) for h in self.formed)
        budget = failure_budget(self.settings.max_failure, world)
        if len(self.failed_ranks) <= budget:
            self.log(
                f"{reason}: evicted ({len(self.failed_ranks)} of max_failure {budget}); "
                "the others train on and averaging renormalizes"
            )
            return True
        self._shutdown_with_save(
            f"{reason}; {len(self.failed_ranks)} failed rank(s) exceed max_failure {budget}"
        )
        return False

    def _survivors(self) -> set[int]:
        ranks = {r for h in self.formed for r in range(h["ranks"][0], h["ranks"][1])}
        done = {r for exits in self.exits.values() for r in exits}
        return ranks - done - self.failed_ranks

    def _shutdown_with_save(self, reason: str) -> None:
        """Too many ranks lost: the survivors save a checkpoint, then the run fails.

        Only ranks averaging through the controller can be asked (their next round is
        answered with the shutdown and the saver's rank); otherwise the run fails now.
        """
        survivors = self._survivors()
        if self.hub is None or not self.hub.active or not survivors:
            self._apply(self.window.fail(reason, self.clock()))
            return
        self._shutdown = reason
        for stall in self._stalls.values():
            stall.cancel()
        self._stalls.clear()
        saver = min(survivors)
        self.log(f"ShutdownWithSave: {reason}; rank {saver} saves a checkpoint")
        for round_no, hosts in self.hub.shutdown():
            for host in hosts:
                self._tell_shutdown(host, round_no)
        self._grace = asyncio.get_running_loop().call_later(
            self.settings.shutdown_grace, lambda: self._apply(self.window.fail(reason, self.clock()))
        )

    def _tell_shutdown(self, host: str, round_no: int) -> None:
        link = self.links.get(host)
        if link is not None:
            saver = min(self._survivors(), default=-1)
            body = {"round": round_no, "error": f"shutdown with save: {self._shutdown}", "saver": saver}
            link.send(wire.Kind.AVERAGED, body)

    # --- HTTP: /state.json and /start ----------------------------------------

    @staticmethod
    def _host_json(link: Link, first: int) -> str:
        hello = link.hello
        return json.dumps(
            {
                "host": hello.host,
                "ranks": [first, first + len(hello.devices)],
                "devices": hello.devices,
                "device_labels": hello.device_labels,
                "variant": hello.variant,
                "joined_at": round(link.joined_at, 1),
            }
        )

    def _roster_json(self) -> str:
        if self._roster is None:
            # A departure shifted ranks, or the world formed: rebuild once, then arrivals append again.
            ranges = assign_contiguous([(m.host, m.ranks) for m in self.window.members])
            self._roster = {}
            for r in ranges:
                link = self.links.get(r.host)
                if link is not None:
                    first = link.ranks.start if link.ranks is not None else r.start
                    self._roster[r.host] = self._host_json(link, first)
        return "[" + ",".join(self._roster.values()) + "]"

    def _state_head(self) -> dict[str, Any]:
        now = self.clock()
        return self.window.snapshot(now, members=False) | {
            "now": round(time.time(), 1),
            "run": self.settings.run,
            "port": self.port,
            "plane": self.settings.plane,
            "admitted": self.admitted,
            "refused": dict(self.refused),
            "dropped": dict(self.dropped),
            "averaging": {"rounds": self.hub.rounds_done, "bytes": self.hub.bytes_in} if self.hub else None,
            "ranks": self.board.snapshot(now),
            "heartbeats": (
                {host: round(now - link.seen, 1) for host, link in self.links.items()}
                if self.window.phase == "training"
                else {}
            ),
        }

    def state_json(self) -> bytes:
        """/state.json: the small live head, with the cached roster spliced in."""
        head = json.dumps(self._state_head())
        return f'{head[:-1]}, "hosts": {self._roster_json()}}}'.encode()

    def state(self) -> dict[str, Any]:
        return self._state_head() | {"hosts": json.loads(self._roster_json())}

    def report(self) -> dict[str, Any]:
        """The run's verdict (`fdl launch --json`): the world as formed and how every rank exited."""
        hosts = [
            host
            | {"exits": {str(rank): code for rank, code in sorted(self.exits.get(host["host"], {}).items())}}
            for host in self.formed
        ]
        return {
            "run": self.settings.run,
            "ok": self.exit_code == 0,
            "phase": self.window.phase,
            "reason": self.reason,
            "world_size": sum(len(h["devices"]) for h in self.formed),
            "hosts": hosts,
            "admitted": self.admitted,
            "refused": dict(self.refused),
            "dropped": dict(self.dropped),
        }

    def summary(self) -> dict[str, Any]:
        """The live head plus host names: what a spinner shows, without the roster's JSON."""
        return self._state_head() | {"hosts": [{"host": host} for host in self.links]}

    async def _http(
        self, preamble: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str
    ) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=16 * 1024)
        conn.receive_data(preamble)
        request: h11.Request | None = None
        body = b""
        deadline = self.clock() + HTTP_TIMEOUT
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                self._bad(peer, "http")
                return await self._respond(writer, conn, 400, {"error": "malformed HTTP request"})
            if event is h11.NEED_DATA:
                # One deadline for the whole request: a slow client cannot hold the handler.
                data = await asyncio.wait_for(reader.read(65536), max(0.1, deadline - self.clock()))
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > HTTP_MAX_BODY:
                    return await self._respond(writer, conn, 413, {"error": "request body too large"})
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                break
        if request is None:
            return
        method = request.method.decode()
        target = request.target.decode().split("?")[0]
        if target == "/state.json" and method in ("GET", "HEAD"):
            return await self._respond(writer, conn, 200, self.state_json(), head=method == "HEAD")
        if target == "/start" and method == "POST":
            status, payload = self._start(peer, body)
            return await self._respond(writer, conn, status, payload)
        if target in ("/", "/metrics") and method in ("GET", "HEAD"):
            page, kind = (status_page(), HTML) if target == "/" else (exposition(self.state()), METRICS)
            return await self._respond(writer, conn, 200, page, head=method == "HEAD", content_type=kind)
        await self._respond(writer, conn, 404, {"error": f"no route {method} {target}"})

    def _start(self, peer: str, body: bytes) -> tuple[int, dict[str, Any]]:
        if not is_loopback(peer):
            offered = parse_qs(body.decode("utf-8", "replace")).get("token", [""])[0]
            if self.settings.token is None:
                return 403, {
                    "error": "this run has no join.token: fire the start on the controller host "
                    "or through the ssh tunnel"
                }
            if not hmac.compare_digest(offered.lower().encode(), self.settings.token.encode()):
                self.guard.penalize(peer, self.clock())
                return 403, {"error": "bad token: pass the run's join.token (FDL_TOKEN or --token -)"}
        reply = self.window.request_start(self.clock())
        if reply.accepted:
            self.log("operator start accepted")
            self._apply(self.window.decide(self.clock()))
            return reply.status, {"armed": True, "reason": reply.reason}
        return reply.status, {"armed": False, "error": reply.reason}

    async def _respond(
        self,
        writer: asyncio.StreamWriter,
        conn: h11.Connection,
        status: int,
        payload: dict[str, Any] | bytes,
        head: bool = False,
        content_type: str = "application/json",
    ) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        headers = [
            ("content-type", content_type),
            ("content-length", str(len(data))),
            ("cache-control", "no-store"),
            ("connection", "close"),
        ]
        out = conn.send(h11.Response(status_code=status, headers=headers)) or b""
        if not head:
            out += conn.send(h11.Data(data=data)) or b""
        out += conn.send(h11.EndOfMessage()) or b""
        writer.write(out)
        await writer.drain()

"""The controller: one port, the join window, host links.

The IO shell around the pure cores: ``join_protocol`` speaks every join
connection, ``admission`` judges each hello, ``window`` decides when the world
forms, ``supervision`` judges the formed world (exits, the failure budget,
deadlines), ``hub`` averages the CPU plane and ``http_surface`` answers the
status surface. This module moves bytes, arms the timers the cores ask for and
wires them together. Everything dials in; the controller never dials out.

Two names that are easy to mix up: the *launch* is one opening of the join
window (an 8-hex label, ``Settings.launch``); the *published run* is what
``fdl publish`` made (a 32-hex identity that walk-ins carry as ``run_id``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from ..address import is_loopback
from ..config.ranks import rank_span
from ..names import safe_lines
from ..observe.metrics import RankBoard
from ..protocol import wire
from ..protocol.join_protocol import Closed, Event, Message
from ..protocol.messages import Average, BadMessage, Heartbeat, RankExited, Stream
from ..protocol.streams import take_over
from ..train.hub import Hub
from ..train.rendezvous import StreamRouter
from . import admission
from .admission import Cohort, Roster
from .forming import Forming
from .hellos import Hellos
from .host_link import Link
from .journal import Journal
from .journaling import restored
from .listener import Listener, Timeouts
from .readoption import Readoption
from .reforming import Reforming
from .settings import Settings
from .supervision import Cut, Evict, FailRun, Regrow, Shutdown, Stalled, Supervisor, Verdict, exit_words
from .traffic import RoundFailed, Traffic
from .view import ControllerView
from .window import Fail, Form, Keep, Window

# Admissions between moves of everything alive into the collector's permanent generation:
# a fleet-sized window holds thousands of links' objects, and a full collection that walks
# them all (hundreds of ms at 10,000) would stall the status page and the formation.
FREEZE_EVERY = 256


class Controller(Hellos, Forming, Reforming):
    def __init__(
        self,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.monotonic,
        log: Callable[[str], None] = lambda line: None,
        timeouts: Timeouts | None = None,
        resume: Journal | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        # Log lines quote peers (host names, refusal reasons, ssh's words): never raw to a terminal.
        self.log = log = safe_lines(log)
        self.timeouts = timeouts = timeouts or Timeouts()
        # A resumed launch keeps its salt: its hosts' keys (and an open run's key) derive from it.
        self.salt = bytes.fromhex(resume.salt) if resume is not None else wire.new_salt()
        self.key = wire.run_key(settings.token, self.salt)
        # A configured token always forces credential-checked admission, names bound to host keys.
        self.open = settings.token is None and (settings.open_admission or is_loopback(settings.bind))
        self.window = Window(settings.window, self.clock())
        self.links: dict[str, Link] = {}
        window = settings.window
        self.cohort = Cohort(Roster.of(settings.roster, settings.capacity, window.target, window.discovery))
        self.view = ControllerView(self)
        self.note = self.view.note  # log an event of the window, and keep it for the page's timeline
        self.listener = Listener(
            settings.bind,
            settings.port,
            on_join=self._join,
            routes=self.view,
            tls=settings.tls,
            timeouts=timeouts,
            clock=clock,
            log=log,
            note=self.note,
            local=settings.local_socket,
        )
        self.refused: Counter[str] = Counter()
        self.admitted = 0
        self.finished = asyncio.Event()
        self.exit_code = 1
        self.reason = ""
        self.formed: list[tuple[Link, int]] = []  # the world as formed (host, first rank): for the report
        self.run_id = ""  # the published run the formed world holds ("" when none)
        self.supervisor: Supervisor | None = None  # the formed world's exits, failures and deadlines
        self.traffic: Traffic | None = None  # rendezvous streams and averaging rounds, once formed
        self.board = RankBoard()  # per-rank progress from the heartbeats
        self.port = settings.port
        self._timer: asyncio.TimerHandle | None = None  # the window's next decision
        self._watch: asyncio.TimerHandle | None = None  # the supervisor's next deadline
        self._handshakes = 0
        self.handed_off = False  # the world was handed to the next controller: it is not ours to judge
        self.readoption: Readoption | None = None  # a journaled launch being taken back (resume)
        self._grace: asyncio.TimerHandle | None = None  # readoption's end: missing hosts are lost
        if resume is not None:
            self._resume(resume)

    def _resume(self, journal: Journal) -> None:
        """Take the journaled world back as it stood: training, its supervision restored, its
        rounds and streams routed anew; its hosts walk back in with resume hellos."""
        now = self.clock()
        grace = self.settings.controller_grace
        self.readoption = readoption = Readoption(journal, now, grace)
        members = [(span.host, len(span.ranks)) for span in journal.world]
        self.window = Window.resumed(self.settings.window, members, now)
        if self.settings.elastic is not None:  # growth goes on after the resume, to the same ceiling
            self.ceiling = self.settings.elastic.ceiling(max((s.stop for s in journal.world), default=0))
        self.run_id = journal.run_id
        self.supervisor = supervisor = restored(journal, self.settings.limits, now)
        supervisor.regrows = self.regrows
        # Silence is judged from the grace's end: until then a missing host is only missing.
        supervisor.seen = dict.fromkeys(readoption.expected, readoption.deadline)
        expected = set(readoption.expected)
        for span in journal.world:
            if span.host not in expected:
                self.window.leave(span.host, now)  # finished or evicted before the restart
        self.traffic = Traffic([s.host for s in journal.world], self.links, supervisor, self.dropped)
        for host in set(supervisor.world) - expected:
            self.traffic.left(host)

    @property
    def hub(self) -> Hub | None:
        return self.traffic.hub if self.traffic else None

    @property
    def streams(self) -> StreamRouter | None:
        return self.traffic.streams if self.traffic else None

    @property
    def failed_ranks(self) -> set[int]:
        return self.supervisor.failed if self.supervisor else set()

    @property
    def exits(self) -> dict[str, dict[int, int]]:
        return self.supervisor.exits if self.supervisor else {}

    # --- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        self.port = await self.listener.open()
        if self.readoption is not None:
            self.note(
                "resume", f"resuming launch {self.settings.launch}: waiting for its hosts to walk back in"
            )
            self._grace = self._arm(None, self.readoption.deadline, self._grace_over)
            if self.readoption.complete():  # every host had finished: nobody to wait for
                self._readoption_over()
            self._rearm()
        self._apply(self.window.decide(self.clock()))

    async def close(self) -> None:
        for timer in (self._timer, self._watch, self._grace, self._reform_timer):
            if timer is not None:
                timer.cancel()
        await self.listener.close()
        gc.unfreeze()  # what the run left behind is the collector's again

    # --- the window's verdicts -----------------------------------------------

    def fail(self, reason: str) -> None:
        """Fail the run from outside (the launcher): Abort goes down every link."""
        self._apply(self.window.fail(reason, self.clock()))

    def hand_off(self) -> bool:
        """Step away from a training world without ending it (the launcher's --handoff): every
        link is cut, no Abort, so the hosts train on for their grace and the next controller
        resumes the journaled launch. False when there is no such world to hand over."""
        # Port 0 has no journal to resume from: nobody could take the world over.
        if self.window.phase != "training" or self.settings.controller_grace <= 0 or not self.settings.port:
            return False
        if self.reformation is not None and self.reformation.stopping is not None:
            return False  # its ranks are stopped: there is nothing training to hand over
        self.handed_off = True  # OperatorStop asks once: its handlers are gone after a signal
        self.exit_code = 0  # this controller's part ended as it should
        for link in list(self.links.values()):
            link.writer.transport.abort()  # as a kill would: the agents' grace begins
        self.finished.set()
        return True

    def _apply(self, decision: Keep | Form | Fail) -> None:
        if isinstance(decision, Form):
            self._form(decision)
        elif isinstance(decision, Fail):
            self._fail(decision.reason)
        elif self.window.phase == "done":
            self.note("verdict", "run complete: every host link closed")
            self.exit_code = 0
            self.finished.set()
        self._timer = self._arm(self._timer, self.window.next_deadline(), self._decide)

    def _decide(self) -> None:
        self._apply(self.window.decide(self.clock()))

    def _arm(
        self, timer: asyncio.TimerHandle | None, deadline: float | None, fire: Callable[[], None]
    ) -> asyncio.TimerHandle | None:
        if timer is not None:
            timer.cancel()
        if deadline is None:
            return None
        return asyncio.get_running_loop().call_later(max(0.0, deadline - self.clock()), fire)

    def _fail(self, reason: str) -> None:
        self.note("verdict", f"run failed: {reason}")
        self.reason = reason
        for link in self.links.values():
            with contextlib.suppress(Exception):
                link.send(wire.Kind.ABORT, {"reason": reason})
        self.exit_code = 1
        self.finished.set()

    # --- supervision: its verdicts and its one timer -----------------------------

    def _rearm(self) -> None:
        """Arm the supervisor's next deadline (while training: nothing to watch after)."""
        deadline = self.supervisor.next_deadline() if self.supervisor else None
        if self.window.phase != "training":
            deadline = None
        self._watch = self._arm(self._watch, deadline, self._tick)

    def _tick(self) -> None:
        if self.supervisor is not None and self.window.phase == "training":
            for verdict in self.supervisor.tick(self.clock()):
                self._verdict(verdict)
        self._rearm()

    def _verdict(self, verdict: Verdict | None) -> bool:
        """Act on a supervision verdict; True when the run goes on as before."""
        if verdict is None:
            return False
        if isinstance(verdict, Evict):
            self.note("eviction", verdict.describe())
            return True
        if isinstance(verdict, Cut):
            # The backstop behind exit reports and link ends: a frozen agent, or a partition without a reset.
            self.note("cut", f"host {verdict.host} sent nothing for {verdict.silence:.0f}s; cutting its link")
            link = self.links.get(verdict.host)
            if link is not None:
                link.writer.close()
            return True
        if isinstance(verdict, Stalled):
            # A host is alive but not averaging (hung, or deadlocked).
            if self.traffic is None or self.window.phase != "training":
                return True
            missing = ", ".join(sorted(self.traffic.hub.missing(verdict.round))) or "nobody"
            return self._shutdown_with_save(
                f"averaging round {verdict.round} stalled for {self.settings.stall_ceiling:g}s "
                f"waiting on {missing}"
            )
        if isinstance(verdict, Regrow):
            return self._regrow(verdict.reason)
        if isinstance(verdict, Shutdown):
            self.note("save", f"ShutdownWithSave: {verdict.reason}; rank {verdict.saver} saves a checkpoint")
            assert self.traffic is not None  # only averaging ranks are asked to save
            self.traffic.shutdown()
            self._rearm()  # the grace's deadline
            return False
        assert isinstance(verdict, FailRun)
        self._apply(self.window.fail(verdict.reason, self.clock()))
        return False

    @property
    def averaging(self) -> bool:
        return self.traffic is not None and self.traffic.averaging

    def _shutdown_with_save(self, reason: str) -> bool:
        assert self.supervisor is not None
        return self._verdict(
            self.supervisor.shutdown_with_save(reason, averaging=self.averaging, now=self.clock())
        )

    def _rank_failed(self, reason: str, ranks: set[int], started: bool = True) -> bool:
        """Ranks were lost (``started``: False when their command never ran); True when the run goes on."""
        if self.supervisor is None:
            return False
        lost = self.supervisor.rank_failed
        return self._verdict(lost(reason, ranks, averaging=self.averaging, now=self.clock(), started=started))

    # --- links ---------------------------------------------------------------

    async def _link(self, reader: asyncio.StreamReader, link: Link) -> None:
        """The host's control link for the whole run; its EOF is the host's exit."""
        host = link.hello.host

        def heard(event: Event) -> None:  # every frame, as it verifies (a round's pieces among them)
            if isinstance(event, Closed):
                return
            if self.supervisor is not None:
                self.supervisor.heard(host, self.clock())
            if isinstance(event, Message):
                self._on_message(link, event)

        try:
            await take_over(reader, link.writer, link.conn, heard).done
        except (wire.Dropped, BadMessage) as exc:
            self.dropped[getattr(exc, "cause", "payload")] += 1
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            if self.links.get(host) is link:
                self._unregister(link)
                self._closed(host)

    def _readopted(self, link: Link) -> None:
        """A journaled host walked back in: its link is the one its ranks report through now."""
        readoption, hello = self.readoption, link.hello
        assert readoption is not None and hello.resume is not None and self.supervisor is not None
        claim = hello.resume
        link.ranks = range(claim.first, claim.first + claim.count)
        self.links[hello.host] = link
        self.cohort.add(hello)  # what a walk-in into the resumed world is held to
        self.formed = [(f, r) for f, r in self.formed if f.hello.host != hello.host] + [(link, claim.first)]
        self.view.arrived(link, claim.first)
        readoption.admitted(hello.host)
        self.supervisor.heard(hello.host, self.clock())
        if self.traffic is not None:
            self.traffic.resumed(hello.host, claim.round)
        span = rank_span(link.ranks, noun=True)
        self.note("resume", f"host {hello.host} ({link.peer}) is back: {span} trained on")
        if readoption.complete() and not readoption.said:
            self._readoption_over()

    def _grace_over(self) -> None:
        """The grace ran out: the hosts not back are lost, as a host whose link closed is."""
        if (readoption := self.readoption) is None or readoption.said:
            return
        missing = readoption.missing()
        self._readoption_over()
        for host in (h for h in missing if self.window.phase == "training"):
            self.note("lost", f"host {host} did not come back within {readoption.grace:g}s")
            if self.traffic is not None:
                self.traffic.left(host)  # its rounds no longer wait for it, as a closed link's
            self._closed(host)

    def _readoption_over(self) -> None:
        assert self.readoption is not None
        if self._grace is not None:
            self._grace.cancel()
        self.note("resumed", self.readoption.words(self.clock()))

    def _on_message(self, link: Link, event: Message) -> None:
        host, message = link.hello.host, event.message
        if isinstance(message, Heartbeat):
            own = {r: rep.model_dump() for r, rep in message.ranks.items() if link.ranks and r in link.ranks}
            if len(own) < len(message.ranks):
                self.dropped["rank"] += 1  # reports for ranks that are not this host's
            self.board.update(host, own, self.clock())
        elif isinstance(message, Stream):
            if self.traffic is None:
                self.dropped["stream"] += 1  # no world formed yet
            else:
                self._verdict(self.traffic.route(host, message))  # the first far stream may end the run
        elif isinstance(message, Average):
            self._average(host, message, event.blob)
        elif isinstance(message, RankExited):
            self._exited(host, message)

    def _exited(self, host: str, exited: RankExited) -> None:
        supervisor = self.supervisor
        if supervisor is not None and exited.rank in supervisor.exits.get(host, {}):
            return  # a host walking back in says again what it said before the gap
        if self._stopped_for_reform(host, exited):
            return
        if supervisor is None or not supervisor.exited(host, exited.rank, exited.code):
            self.dropped["rank"] += 1  # not one of this host's ranks: ignore, never count
            return
        if supervisor.all_exited(host) and self.traffic is not None:
            self.traffic.ranks_done(host)
        # An agent whose ranks could not start says why: its command is missing, say.
        how = f"could not start: {exited.error}" if exited.error else exit_words(exited.code, exited.reason)
        ended = f"rank {exited.rank} on {host} {how}"
        self.note("exit", ended)
        if exited.code != 0 and self.window.phase == "training":
            self._rank_failed(ended, {exited.rank}, started=not exited.error)
        self._release(host)

    def _average(self, host: str, pushed: Average, blob: wire.Blob) -> None:
        traffic = self.traffic
        if self.window.phase != "training" or traffic is None:
            self.dropped["average"] += 1
            return
        try:
            if traffic.push(host, pushed, blob, self.clock()):
                self._rearm()  # the round's stall ceiling
        except RoundFailed as exc:
            self._apply(self.window.fail(str(exc), self.clock()))

    def _register(self, link: Link, first: int) -> None:
        self.links[link.hello.host] = link
        if len(self.links) % FREEZE_EVERY == 0:
            gc.freeze()
        self.cohort.add(link.hello)
        self.view.arrived(link, first)

    def _unregister(self, link: Link) -> None:
        del self.links[link.hello.host]
        if self.traffic is not None:
            self.traffic.left(link.hello.host)
        self.cohort.remove(link.hello.host)
        self.view.invalidate()

    def _closed(self, host: str) -> None:
        phase = self.window.phase
        if phase in ("done", "failed") or self.handed_off or self._held_left(host):
            return
        if self.readoption is not None:
            self.readoption.lost.add(host)  # handled as lost: it may not resume after this
        supervisor = self.supervisor
        if supervisor is not None and supervisor.shutdown:
            self.note("leave", f"host {host} closed its link")
            if not self.links:  # every survivor has saved and gone
                self._apply(self.window.fail(supervisor.shutdown, self.clock()))
            return
        if phase == "training" and self._gone_in_reform(host):
            return
        if phase == "training" and supervisor is not None:
            verdict = supervisor.host_closed(host, averaging=self.averaging, now=self.clock())
            if verdict is not None and not self._verdict(verdict):
                return
        self.note("leave", f"host {host} closed its link")
        self._apply(self.window.leave(host, self.clock()))

    # --- the status surface's one action (its views: ControllerView) ------------------

    def request_start(self, peer: str, body: bytes) -> tuple[int, dict[str, Any]]:
        """POST /start: the operator fires a manual or hybrid window."""
        refused = admission.start_refusal(is_loopback(peer), body, self.settings.token)
        if refused is not None:
            if refused.penalize:
                self.listener.gate.guard.penalize(peer, self.clock())
            return 403, {"error": refused.error}
        reply = self.window.request_start(self.clock())
        if reply.accepted:
            self.note("start", "operator start accepted")
            self._apply(self.window.decide(self.clock()))
            return reply.status, {"armed": True, "reason": reply.reason}
        return reply.status, {"armed": False, "error": reply.reason}

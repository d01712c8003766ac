"""The controller's growth by re-formation: walk-ins into a process-group world.

Mixed into ``Controller``, which owns the state; the rules are ``reformation``'s. A walk-in
admitted into a training process group is held (its link up, its ranks provisional); once
the elastic interval allows, every training host is sent ``Reform`` and stops its ranks, and
when the last asked rank has stopped the world forms again with the walk-ins after the old
ranks: every host gets a new share (``restart_count`` one more, the same launch), rank 0's
host serves a fresh store, and supervision starts over on the bigger world.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..config.ranks import rank_span
from ..protocol import wire
from ..protocol.join_protocol import JoinServer
from ..protocol.messages import RankExited
from .host_link import Link
from .reformation import Reformation
from .settings import Settings
from .supervision import FailRun, Supervisor, Verdict, exit_words
from .traffic import Traffic
from .view import ControllerView
from .window import Fail, Form, Keep, Window


class Reforming:
    """The half of the controller that re-forms a process-group world to grow it."""

    settings: Settings
    window: Window
    links: dict[str, Link]
    formed: list[tuple[Link, int]]
    supervisor: Supervisor | None
    traffic: Traffic | None
    view: ControllerView
    admitted: int
    ceiling: int
    clock: Callable[[], float]
    note: Callable[[str, str], None]
    reformation: Reformation | None = None  # an elastic process-group world's re-formations
    _reform_timer: asyncio.TimerHandle | None = None  # the next re-formation, or its stop's end

    if TYPE_CHECKING:  # the controller's and the formation half's: a stub would shadow them in the MRO

        @property
        def averaging(self) -> bool: ...
        def _apply(self, decision: Keep | Form | Fail) -> None: ...
        def _verdict(self, verdict: Verdict | None) -> bool: ...
        def _rearm(self) -> None: ...
        def _register(self, link: Link, first: int) -> None: ...
        def _arm(
            self, timer: asyncio.TimerHandle | None, deadline: float | None, fire: Callable[[], None]
        ) -> asyncio.TimerHandle | None: ...

        def _share(self, link: Link, common: wire.SharedMap, ranks: range, group: int) -> None: ...
        def _common(
            self, size: int, hosts: int, midrun: bool = False, restart: int = 0
        ) -> wire.SharedMap: ...

    def _reformations(self) -> Reformation:
        if self.reformation is None:
            elastic = self.settings.elastic
            assert elastic is not None  # only an elastic launch holds walk-ins
            # The interval counts from the formation (``_form`` starts it); a resumed launch,
            # which formed under another controller, counts it from its first walk-in held.
            self.reformation = Reformation(elastic.reform_interval, self.clock())
        return self.reformation

    def _hold(self, link: Link, writer: asyncio.StreamWriter, conn: JoinServer) -> None:
        """An admitted walk-in into a process group: held, its ranks provisional (after every
        rank numbered and held so far), until the world re-forms with it."""
        hello, now = link.hello, self.clock()
        reformation = self._reformations()
        first = self.window.joined_ranks + reformation.waiting
        count = len(hello.devices)
        reformation.hold(hello.host, count)
        self._register(link, first)
        writer.write(conn.accept(first, count))
        self.admitted += 1
        due = reformation.due(now)
        if reformation.stopping is not None:
            when = "in the re-formation under way"
        else:
            when = "now" if due is None or due <= now else f"in {due - now:.0f}s (elastic reform_interval)"
        self.note(
            "hold",
            f"{hello.host} ({link.peer}) walked in: {rank_span(range(first, first + count), noun=True)} "
            f"(provisional) on {', '.join(hello.devices)}; the world is a torch.distributed process "
            f"group, so it grows by re-formation: the world restarts with it {when}",
        )
        self._arm_reform()

    def _arm_reform(self) -> None:
        reformation = self.reformation
        if reformation is None:
            return
        if reformation.stopping is not None:
            self._reform_timer = self._arm(self._reform_timer, reformation.deadline, self._reform_late)
        else:
            self._reform_timer = self._arm(self._reform_timer, reformation.due(self.clock()), self._reform)

    def _reform(self) -> None:
        """The re-formation is due: every training host is asked to stop its ranks."""
        reformation, supervisor = self.reformation, self.supervisor
        if reformation is None or supervisor is None or self.window.phase != "training":
            return
        if supervisor.shutdown or not reformation.held:
            return
        if supervisor.exits or self.averaging:
            # Ranks that began to end would be restarted at the end of their run, and a world
            # that averages now (a Trainer rendezvouses before its first round) grows live.
            why = (
                "the world averages through the controller now: walk in again to join it live"
                if self.averaging
                else "the world's ranks have begun to end: it does not re-form; join the next run"
            )
            for host in reformation.held:
                self.links[host].send(wire.Kind.ABORT, {"reason": why})  # its link's end releases it
            self.note("hold", f"the held walk-ins are turned away: {why}")
            return
        running = {host: supervisor.running(host) for host in supervisor.world if host in self.links}
        asked = reformation.begin(running, self.clock(), self.settings.shutdown_grace)
        names = ", ".join(reformation.held)
        # Bounded on the wire (the names stay in the timeline): any count of walk-ins fits.
        reason = f"the world re-forms to take in {len(reformation.held)} walk-in(s)"
        for host in asked:
            self.links[host].send(wire.Kind.REFORM, {"restart": reformation.restarts, "reason": reason})
        self.note(
            "reform",
            f"re-forming the world to take in {names} (restart {reformation.restarts}): "
            f"{len(asked)} host(s) asked to stop their ranks",
        )
        if reformation.complete:
            self._reformed()
        else:
            self._arm_reform()

    def _stopped_for_reform(self, host: str, exited: RankExited) -> bool:
        """A rank's exit that a re-formation asked for: noted, never judged. True when it was."""
        reformation = self.reformation
        if reformation is None or not reformation.stopped(host, exited.rank):
            return False
        assert self.supervisor is not None  # only a formed world re-forms
        self.supervisor.exited(host, exited.rank, exited.code)  # it runs no more: its link may close
        words = exit_words(exited.code)
        self.note("stop", f"rank {exited.rank} on {host} stopped for the re-formation ({words})")
        if reformation.complete and self.window.phase == "training":
            self._reformed()
        return True

    def _reform_late(self) -> None:
        reformation = self.reformation
        if reformation is None or reformation.stopping is None or self.window.phase != "training":
            return
        late = "; ".join(
            f"host {h}'s ranks {', '.join(map(str, sorted(r)))}" for h, r in reformation.late().items()
        )
        self._verdict(
            FailRun(
                f"the re-formation asked every rank to stop, and {late} had not stopped within "
                f"{self.settings.shutdown_grace:g}s (shutdown_grace): the run ends"
            )
        )

    def _reformed(self) -> None:
        """Every asked rank stopped: the world forms again with the held walk-ins after it."""
        reformation, old, now = self.reformation, self.supervisor, self.clock()
        assert reformation is not None and old is not None
        world, taken = reformation.world(
            {host: span for host, span in old.world.items() if host in self.links}, self.ceiling
        )
        missing = [host for host in old.world if host not in world and set(old.world[host]) - old.failed]
        if missing:
            self._verdict(
                FailRun(
                    f"host {', '.join(missing)} left while the world re-formed: a torch.distributed "
                    "process group cannot form again without its ranks: the run ends"
                )
            )
            return
        for host in taken:
            self.window.grow(host, world[host], now)
        self.supervisor = supervisor = Supervisor(dict(world), self.settings.limits, now, rendezvous=True)
        assert self.traffic is not None  # a formed world routes its streams
        self.traffic.reformed(list(world), supervisor)
        self.formed = [(self.links[host], span.start) for host, span in world.items()]
        size = max(span.stop for span in world.values())
        common = self._common(size, len(world), restart=reformation.restarts)
        for group, (host, span) in enumerate(world.items()):
            link = self.links[host]
            link.ranks = span
            self._share(link, common, span, group)
        reformation.formed(now)
        came = f"{', '.join(taken)} walked in" if taken else "nobody walked in"
        self.note(
            "grow",
            f"world re-formed (restart {reformation.restarts}): {size} ranks on {len(world)} hosts, "
            f"{came}; the world is {size} of {self.ceiling} ranks; training",
        )
        self.view.invalidate()
        self._rearm()
        self._arm_reform()  # a walk-in that did not fit, or arrived meanwhile, waits for the next

    def _held_left(self, host: str) -> bool:
        """A held walk-in's link closed before the world took it: it simply never joined."""
        reformation = self.reformation
        if reformation is None or not reformation.release(host):
            return False
        self.note("leave", f"host {host} closed its link while it waited for the re-formation")
        self.view.invalidate()
        if not reformation.held and reformation.stopping is None and self._reform_timer is not None:
            self._reform_timer.cancel()
            self._reform_timer = None
        return True

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
from .readoption import Readoption
from .reformation import Reformation
from .settings import Settings
from .supervision import FailRun, Supervisor, Verdict, exit_words, failure_budget
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
    readoption: Readoption | None
    reformation: Reformation | None = None  # an elastic process-group world's re-formations
    _reform_timer: asyncio.TimerHandle | None = None  # the next re-formation, or its stop's end

    if TYPE_CHECKING:  # the controller's and the formation half's: a stub would shadow them in the MRO

        @property
        def averaging(self) -> bool: ...
        def _apply(self, decision: Keep | Form | Fail) -> None: ...
        def _verdict(self, verdict: Verdict | None) -> bool: ...
        def _rearm(self) -> None: ...
        @property
        def regrows(self) -> bool: ...
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
        after = self.window.joined_ranks + reformation.waiting  # after every rank numbered and held
        count = len(hello.devices)
        reformation.hold(hello.host, count)
        assert self.supervisor is not None  # only a formed world holds walk-ins
        placed = reformation.placed(self.supervisor.world, self.ceiling)[0]  # a lost host's span first
        first = placed[hello.host].start if hello.host in placed else after
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
        self._settle()  # a world stopped and waiting for a lost host's span may form now

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
        held = list(reformation.held)
        # Bounded on the wire (the names stay in the timeline): any count of walk-ins fits.
        asked = self._ask_to_stop(f"the world re-forms to take in {len(held)} walk-in(s)")
        self.note(
            "reform",
            f"re-forming the world to take in {', '.join(held)} (restart {reformation.restarts}): "
            f"{asked} host(s) asked to stop their ranks",
        )
        self._settle()

    @property
    def _replace_timeout(self) -> float:
        elastic = self.settings.elastic
        assert elastic is not None  # only an elastic launch re-forms
        return elastic.replace_timeout

    def _ask_to_stop(self, reason: str) -> int:
        """Begin a re-formation: every linked host of the world is sent Reform (one whose ranks
        all ended waits for it, and runs them again); the hosts with ranks running stop them.
        Returns how many were asked to stop."""
        reformation, supervisor = self.reformation, self.supervisor
        assert reformation is not None and supervisor is not None  # only a formed world re-forms
        linked = [host for host in supervisor.world if host in self.links]
        running = {host: supervisor.running(host) for host in linked}
        asked = reformation.begin(running, self.clock(), self.settings.shutdown_grace)
        for host in linked:
            self.links[host].send(wire.Kind.REFORM, {"restart": reformation.restarts, "reason": reason})
        return len(asked)

    def _settle(self) -> None:
        """The re-formation's next step: the world forms once every asked rank stopped."""
        reformation = self.reformation
        if reformation is not None and reformation.complete and self.window.phase == "training":
            self._reformed()
        else:
            self._arm_reform()

    def _regrow(self, reason: str) -> bool:
        """Ranks lost within the budget in an elastic process group (``Regrow``): it cannot go
        on without them, so it re-forms: a host that keeps its link runs its ranks again, and
        a host that is gone leaves its span to the next walk-in. False when the run ends."""
        supervisor, reformation = self.supervisor, self._reformations()
        assert supervisor is not None  # only a formed world loses ranks
        under_way = reformation.stopping is not None  # it mends this loss too
        if not under_way and (why := self._no_restart(supervisor, reformation)):
            return self._verdict(FailRun(f"{reason}; {why}: the run ends"))  # the lost ranks stay failed
        # A linked host runs its ranks again: only the ranks of hosts gone count as lost.
        supervisor.failed -= {r for h, span in supervisor.world.items() if h in self.links for r in span}
        if under_way:
            goes_on = self._mend()
            if goes_on:
                self._settle()
            return goes_on
        if not self._mend():
            return False
        asked = self._ask_to_stop("the world re-forms: ranks were lost")
        self.note(
            "reform",
            f"{reason}: the world is a torch.distributed process group, so it re-forms (restart "
            f"{reformation.restarts}): {asked} host(s) asked to stop their ranks; "
            "lost ranks go to the next walk-in",
        )
        self._settle()
        return True

    def _no_restart(self, supervisor: Supervisor, reformation: Reformation) -> str:
        """Why a failure may not restart the world ("": it may)."""
        if self.readoption is not None and not self.readoption.said:
            # A host still within its grace is neither linked nor lost: the world cannot be
            # told apart into who runs again and whose ranks a walk-in takes.
            return "the controller is still taking the world back (its hosts' controller_grace)"
        budget = failure_budget(self.settings.limits.max_failure, supervisor.size)
        ended = sorted(r for codes in supervisor.exits.values() for r, code in codes.items() if code == 0)
        if ended:
            return (
                f"rank {ended[0]} had already ended (exit 0): a process group does not re-form "
                "at the end of its run"
            )
        if not reformation.failed(self.clock(), budget):
            return (
                f"the world re-formed after a failure {reformation.failures - 1} time(s) in a row, each "
                f"within {reformation.interval:g}s (elastic reform_interval) of forming, and max_failure "
                f"{budget} allows no more"
            )
        return ""

    def _mend(self) -> bool:
        """The hosts of the world that are gone leave their spans to fill (within the failure
        budget, and never rank 0's: the store's host). False when the run ends instead."""
        reformation, supervisor = self.reformation, self.supervisor
        assert reformation is not None and supervisor is not None
        for host, span in supervisor.world.items():
            if host not in self.links and host not in reformation.lost:
                reformation.lose(host, span)
                supervisor.failed |= set(span)  # free: a walk-in's hello may take it (elastic.place)
                supervisor.left(host)
        budget = failure_budget(self.settings.limits.max_failure, supervisor.size)
        gone = ", ".join(reformation.lost)
        if any(0 in span for span in reformation.lost.values()):
            why = f"{gone} served the world's rendezvous store (rank 0): a process group re-forms around it"
        elif reformation.missing > budget:
            why = f"{reformation.missing} lost rank(s) exceed max_failure {budget}"
        else:
            return True
        return self._verdict(
            FailRun(
                f"host {gone} left while the world re-formed, and {why}: a torch.distributed process "
                "group cannot form again without its ranks: the run ends"
            )
        )

    def _gone_in_reform(self, host: str) -> bool:
        """A host of the world closed its link while it re-forms: said, and its span is filled
        before the world forms again. True when that is how its end was handled."""
        reformation, supervisor = self.reformation, self.supervisor
        if reformation is None or reformation.stopping is None or supervisor is None:
            return False
        if host not in supervisor.world:
            return False
        self.note("leave", f"host {host} closed its link while the world re-formed")
        if supervisor.finished(host):  # its ranks had ended on their own: the run was ending
            self._verdict(
                FailRun(
                    f"host {host}'s ranks had ended (exit 0) as the world re-formed: a process group "
                    "does not re-form at the end of its run, and cannot go on without them: the run ends"
                )
            )
            return True
        if self._mend():  # the run may end with it (the budget, rank 0's host)
            self._apply(self.window.leave(host, self.clock()))
            self._settle()
        return True

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
        reformation, supervisor = self.reformation, self.supervisor
        if reformation is None or reformation.stopping is None or self.window.phase != "training":
            return
        grace = f"{self.settings.shutdown_grace:g}s (shutdown_grace)"
        if reformation.filling and supervisor is not None:  # stopped, waiting for walk-ins
            lost = supervisor.lost({r for span in reformation.lost.values() for r in span})
            why = (
                f"no walk-in took {lost} within {self._replace_timeout:g}s (elastic replace_timeout), "
                "and a process group forms only whole"
            )
        else:
            late = "; ".join(
                f"host {h}'s ranks {', '.join(map(str, sorted(r)))}" for h, r in reformation.late().items()
            )
            why = f"the re-formation asked every rank to stop, and {late} had not stopped within {grace}"
        self._verdict(FailRun(f"{why}: the run ends"))

    def _reformed(self) -> None:
        """Every asked rank stopped: the world forms again, the held walk-ins in the lost
        hosts' spans first, then after every rank; it waits while a span is unfilled."""
        reformation, old, now = self.reformation, self.supervisor, self.clock()
        assert reformation is not None and old is not None
        if not self._mend():  # a host gone unseen is lost, as one seen to go
            return
        world, taken, unfilled = reformation.world(old.world, self.ceiling)
        if unfilled:
            timeout = self._replace_timeout
            if reformation.wait(now, timeout):
                lost = old.lost({r for span in unfilled for r in span})
                self.note(
                    "hold",
                    f"the world waits for a walk-in to take {lost} before it forms again "
                    f"(within {timeout:g}s, elastic replace_timeout)",
                )
            self._arm_reform()
            return
        for host in taken:
            self.window.grow(host, world[host], now)
        self.supervisor = supervisor = Supervisor(
            dict(world), self.settings.limits, now, rendezvous=True, regrows=self.regrows
        )
        assert self.traffic is not None  # a formed world routes its streams
        self.traffic.reformed(list(world), supervisor)
        self.formed = [(self.links[host], span.start) for host, span in world.items()]
        size = max(span.stop for span in world.values())
        common = self._common(size, len(world), restart=reformation.restarts)
        for group, (host, span) in enumerate(world.items()):
            link = self.links[host]
            link.ranks = span
            self._share(link, common, span, group)
        replaced = ", ".join(reformation.lost)
        reformation.formed(now)
        came = f"{', '.join(taken)} walked in" if taken else "nobody walked in"
        instead = f" in place of lost host {replaced}" if replaced else ""
        self.note(
            "grow",
            f"world re-formed (restart {reformation.restarts}): {size} ranks on {len(world)} hosts, "
            f"{came}{instead}; the world is {size} of {self.ceiling} ranks; training",
        )
        self.view.invalidate()
        self._rearm()
        self._arm_reform()  # a walk-in that did not fit, or arrived meanwhile, waits for the next

    def _release(self, host: str) -> None:
        """In an elastic launch a host whose ranks all ended, one failed, keeps its link for the
        controller's word (a process group may restart them): when the world goes on without
        them, it is told to hang up."""
        supervisor, reformation = self.supervisor, self.reformation
        if not self.ceiling or supervisor is None or self.window.phase != "training":
            return
        if reformation is not None and reformation.stopping is not None:
            return  # it re-forms: the host runs its ranks again in the new world
        codes = supervisor.exits.get(host, {})
        link = self.links.get(host)
        if link is not None and supervisor.all_exited(host) and any(codes.values()):
            link.send(wire.Kind.RELEASE, {"reason": "the world goes on without this host's ranks"})

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

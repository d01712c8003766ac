"""The controller's formation: the world frozen, each host's share shipped, and, in an
elastic launch, a walk-in taken into the world that already trains.

Mixed into ``Controller``, which owns the state. A share is what one host needs of the
world (its ranks, its index among the hosts, the launch's command and knobs), never the
whole roster: formation stays O(N) at fleet size. A walk-in admitted mid-run gets a
share like any host's, with ranks after every rank numbered so far and ``midrun`` set:
its ranks take the next round's average before their first step (``hub.join``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from ..config.ranks import rank_span, world_ranges
from ..observe.metrics import RankBoard
from ..placement.fleet import PlacementError
from ..placement.parallel import check_world
from ..protocol import wire
from ..protocol.join_protocol import JoinServer
from ..protocol.messages import Hello
from . import elastic
from .admission import Cohort, Refusal
from .host_link import Link
from .listener import Listener, Timeouts
from .reformation import Reformation
from .settings import Settings
from .supervision import Supervisor
from .traffic import Traffic
from .view import ControllerView
from .window import Fail, Form, Keep, Window


class Forming:
    """The half of the controller that forms (and grows) the world."""

    settings: Settings
    window: Window
    links: dict[str, Link]
    cohort: Cohort
    formed: list[tuple[Link, int]]
    run_id: str
    supervisor: Supervisor | None
    traffic: Traffic | None
    view: ControllerView
    listener: Listener
    timeouts: Timeouts
    board: RankBoard
    admitted: int
    clock: Callable[[], float]
    note: Callable[[str, str], None]
    ceiling = 0  # an elastic launch's ceiling of ranks, fixed at formation (0: not elastic)
    reformation: Reformation | None = None  # a process-group world's growth (Reforming)

    def _apply(self, decision: Keep | Form | Fail) -> None: ...
    def _rearm(self) -> None: ...
    def _register(self, link: Link, first: int) -> None: ...

    if TYPE_CHECKING:  # the re-formation half's (Reforming): a stub here would shadow it in the MRO

        def _hold(self, link: Link, writer: asyncio.StreamWriter, conn: JoinServer) -> None: ...

    @property
    def regrows(self) -> bool:
        """An elastic launch whose plane grows: its process group re-forms around a lost host."""
        elastic = self.settings.elastic
        return elastic is not None and self.settings.plane in elastic.planes

    def _common(self, size: int, hosts: int, midrun: bool = False, restart: int = 0) -> wire.SharedMap:
        """What every host's share of the world says alike, packed once."""
        return wire.SharedMap.of(
            {
                "world_size": size,
                "hosts": hosts,
                "command": self.settings.command,
                "env": self.settings.env,
                "launch": self.settings.launch,
                "controller_grace": self.settings.controller_grace,
                "max_world_size": self.ceiling,
                "midrun": midrun,
                "restart_count": restart,
            }
        )

    def _share(self, link: Link, common: wire.SharedMap, ranks: range, group: int) -> None:
        host = link.hello.host
        share = {"host": host, "first_rank": ranks.start, "count": len(ranks)}
        if facts := self.settings.facts(host):
            share.update(facts)
        link.send_shared(wire.Kind.WORLD_FORMED, common, {"host": share, "group": group})

    def _form(self, decision: Form) -> None:
        # One pass, no more: this is the formation's critical path, once per host of a fleet.
        world = world_ranges(((m.host, m.ranks) for m in decision.members), self.settings.roster)
        if self.settings.parallelism:
            try:
                check_world(self.settings.parallelism, [len(ranks) for ranks in world.values()])
            except PlacementError as exc:
                reason = f"the formed world cannot satisfy the parallelism request: {exc.message}"
                self._apply(self.window.fail(reason, self.clock()))
                return
        size = next(reversed(world.values())).stop if world else 0
        if self.settings.elastic is not None:
            self.ceiling = self.settings.elastic.ceiling(size)
            self.reformation = Reformation(self.settings.elastic.reform_interval, self.clock())
            # After the freeze the ceiling, not the roster's room, bounds who walks in.
            self.cohort.roster = replace(self.cohort.roster, room=None)
        common = self._common(size, len(world))  # each host's frame adds its own share
        # Training starts at the freeze: a host that gets its share early may
        # finish (or die) before the last one is sent, and training judges that.
        self.window.formed(self.clock())
        linked = {host: ranks for host, ranks in world.items() if host in self.links}
        for host, ranks in linked.items():
            self.links[host].ranks = ranks
        self.formed = [(self.links[host], ranks.start) for host, ranks in linked.items()]
        self.run_id = self.cohort.run_id
        nccl = self.settings.plane == "nccl"  # its collectives are a process group: it rendezvouses
        self.supervisor = Supervisor(
            linked, self.settings.limits, self.clock(), rendezvous=nccl, regrows=self.regrows
        )
        if world:
            self.traffic = Traffic(list(world), self.links, self.supervisor, self.listener.gate.dropped)
        self.view.invalidate()  # the final ranks replace the provisional ones
        self._rearm()
        self.listener.spawn(self._ship(world, common))

    async def _ship(self, world: dict[str, range], common: wire.SharedMap) -> None:
        """Send every host its share of the world, yielding to other work between batches."""
        batch = self.timeouts.ship_batch
        try:
            for group, (host, ranks) in enumerate(world.items()):
                if self.window.phase == "failed":
                    return  # a host died meanwhile: Abort went out instead
                link = self.links.get(host)
                if link is None:
                    continue  # its link closed after the freeze; training already judged it
                self._share(link, common, ranks, group)
                if group % batch == batch - 1:
                    await asyncio.sleep(0)  # let status requests through during a fleet-sized fan-out
        except Exception as exc:  # a formation that cannot ship must fail loudly, not hang
            self._apply(self.window.fail(f"the world could not be formed: {exc}", self.clock()))
            return
        size = next(reversed(world.values())).stop if world else 0
        self.note("formed", f"world formed: {size} ranks on {len(world)} hosts; training")

    # --- elastic growth ------------------------------------------------------------

    def _room(self, host: str) -> elastic.Room:
        """The training world as growth's rules see a walk-in named ``host``."""
        supervisor, traffic = self.supervisor, self.traffic
        averaging = traffic is not None and traffic.averaging
        reformation = self.reformation
        held = reformation.waiting if reformation is not None else 0
        process_group = supervisor is not None and supervisor.rendezvous and not averaging
        stopping = reformation is not None and reformation.stopping is not None
        return elastic.Room(
            plane=self.settings.plane,
            ceiling=self.ceiling,
            numbered=self.window.joined_ranks + held,
            averaging=averaging,
            process_group=process_group,
            shutdown=supervisor is not None and bool(supervisor.shutdown),
            free=supervisor.free() if supervisor is not None else (),
            finished=supervisor is not None and supervisor.finished(host),
            # Its exits during a re-formation's stop are the re-formation's own.
            ending=process_group and supervisor is not None and bool(supervisor.exits) and not stopping,
        )

    def _growth_refusal(self, hello: Hello) -> Refusal | None:
        """Why a walk-in may not join the training world now (elastic's rules)."""
        return elastic.refusal(self.settings.elastic, self._room(hello.host), len(hello.devices))

    def _grown(self, link: Link, writer: asyncio.StreamWriter, conn: JoinServer) -> None:
        """Take an admitted walk-in into the training world: a lost host's ranks, or ranks after
        the numbered ones; watched and counted as the formed ones are; its share with
        ``midrun`` set, the world's size the ranks it holds now."""
        hello, now = link.hello, self.clock()
        supervisor = self.supervisor
        assert supervisor is not None  # only a formed world grows
        room = self._room(hello.host)
        if room.process_group:  # a fixed-size group: it grows by re-formation (Reforming)
            self._hold(link, writer, conn)
            return
        ranks = elastic.place(room, len(hello.devices))
        assert ranks is not None  # _admit asked elastic.refusal, on the same room
        self.window.grow(hello.host, ranks, now)
        link.ranks = ranks
        self._register(link, ranks.start)
        writer.write(conn.accept(ranks.start, len(ranks)))  # it rekeys the link: the share follows
        self.admitted += 1
        replaced = supervisor.grow(hello.host, ranks, now)
        self.formed = [(f, r) for f, r in self.formed if f.hello.host != hello.host] + [(link, ranks.start)]
        step = max((stat.step for stat in self.board.ranks.values()), default=0)
        link.midrun_step = step
        size, hosts = supervisor.world_now()
        group = list(supervisor.world).index(hello.host)
        self._share(link, self._common(size, hosts, midrun=True), ranks, group)
        instead = f", in place of lost host {replaced}" if replaced else ""
        self.note(
            "grow",
            f"{hello.host} ({link.peer}) joined mid-run at step {step}: {rank_span(ranks, noun=True)} on "
            f"{', '.join(hello.devices)}{instead}; the world is {size} of {self.ceiling} ranks",
        )
        self.view.invalidate()  # a lost host's ranks moved to it
        self._rearm()  # its silence is watched from now

"""What the status surface shows of a controller: /state.json, /metrics, the run's report.

Read-only over the controller's state. /state.json is polled by every status
page and ``fdl status --watch`` while a fleet-sized window fills and trains, so
it never walks the fleet per request: the live head is small and built per
request; the three parts that grow with the fleet are kept as JSON text and
spliced in. The roster: each host's JSON is rendered once on arrival and
appended; a departure or the formation re-renders only the hosts whose ranks
moved. The ranks' progress and the hosts' heartbeat ages: rebuilt when they
changed (and as their ages tick, every tenth of a second), and for a fleet of
more than ``LARGE`` entries at most once a second (its ages up to that much
older).
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from ..observe.history import Timeline
from ..observe.metrics import RankBoard, exposition
from ..train.hub import Hub
from .admission import Cohort
from .host_link import Link
from .settings import Settings
from .supervision import Supervisor
from .traffic import Traffic
from .window import Window

HISTORY_EVERY = 1.0  # seconds: /history.json is rendered at most this often, however many pages poll
AGE_STEP = 0.1  # seconds: the ages /state.json shows are rounded to this
LARGE = 1000  # entries past which a part of /state.json is rebuilt at most once a second


def host_json(link: Link, first: int) -> str:
    hello = link.hello
    return json.dumps(
        {
            "host": hello.host,
            "ranks": [first, first + len(hello.devices)],
            "devices": hello.devices,
            "device_labels": hello.device_labels,
            "variant": hello.variant,
            "command": hello.command,  # "": the launch's command
            "joined_at": round(link.joined_at, 1),
        }
        | ({} if link.midrun_step is None else {"midrun_step": link.midrun_step})
    )


class _Part:
    """A part of /state.json that grows with the fleet, kept as JSON text (see the module's doc)."""

    def __init__(self) -> None:
        self.key: object = None
        self.at = -math.inf
        self.text = "{}"

    def get(self, key: object, now: float, size: int, render: Callable[[], object]) -> str:
        age = now - self.at
        if age >= (1.0 if size > LARGE else AGE_STEP) or (key != self.key and size <= LARGE):
            self.key, self.at, self.text = key, now, json.dumps(render())
        return self.text


class Shown(Protocol):
    """What the view reads: the controller's state as the controller keeps it (the view holds
    no controller, so the controller's shell and its view never import each other)."""

    settings: Settings
    window: Window
    cohort: Cohort
    links: dict[str, Link]
    refused: Counter[str]
    admitted: int
    exit_code: int
    reason: str
    formed: list[tuple[Link, int]]
    run_id: str
    supervisor: Supervisor | None
    traffic: Traffic | None
    board: RankBoard
    port: int
    ceiling: int  # an elastic launch's ceiling of ranks (0: the world is frozen)

    @property
    def dropped(self) -> Counter[str]: ...

    @property
    def hub(self) -> Hub | None: ...

    @property
    def exits(self) -> dict[str, dict[int, int]]: ...

    def clock(self) -> float: ...

    def log(self, line: str) -> None: ...

    def request_start(self, peer: str, body: bytes) -> tuple[int, dict[str, Any]]: ...


class ControllerView:
    def __init__(self, controller: Shown) -> None:
        self.ctl = controller
        self._roster: dict[str, tuple[int, str]] = {}  # host -> (first rank, its JSON), in rank order
        self._moved = False  # a departure or the formation: ranks may have moved
        self._roster_text: str | None = None  # the roster's JSON list, until it changes
        self._ranks, self._beats = _Part(), _Part()
        self.timeline = Timeline()  # the window's joins, refusals and verdicts, for the page
        self.polled: float | None = None  # the controller's clock at the last /state.json
        self.on_poll: Callable[[], None] = lambda: None  # the launcher's linger waits on a poll
        self.listeners: list[Callable[[str, str], None]] = []  # told every note (kind, line)
        self._history: tuple[tuple[int, ...], float, bytes] | None = None  # (versions, at, JSON)
        config = controller.window.config
        self.timeline.add(
            controller.clock(),
            "open",
            f"join window opened (quorum {config.quorum}, target {config.target or 'none'}, "
            f"start {config.start})",
        )

    def note(self, kind: str, line: str) -> None:
        """An event of the window: the controller's log line, the timeline's entry, and the
        listeners' (the launch's journal)."""
        self.ctl.log(line)
        self.timeline.add(self.ctl.clock(), kind, line)
        for listen in self.listeners:
            listen(kind, line)

    def watched(self, within: float) -> bool:
        """Someone polled /state.json in the last ``within`` seconds (a page, ``fdl status --watch``)."""
        return self.polled is not None and self.ctl.clock() - self.polled <= within

    def arrived(self, link: Link, first: int) -> None:
        if not self._moved:  # an arrival appends; nobody's ranks move
            self._roster[link.hello.host] = (first, host_json(link, first))
            self._roster_text = None

    def invalidate(self) -> None:
        """A departure shifted ranks, or the world formed: re-render who moved on the next read."""
        self._moved = True
        self._roster_text = None

    def _roster_json(self) -> str:
        if self._moved:
            ctl = self.ctl
            roster, start = {}, 0
            for m in ctl.window.members:  # contiguous ranks, in the window's order
                link = ctl.links.get(m.host)
                if link is not None:
                    first = link.ranks.start if link.ranks is not None else start
                    kept = self._roster.get(m.host)
                    roster[m.host] = kept if kept and kept[0] == first else (first, host_json(link, first))
                start += m.ranks
            self._roster, self._moved = roster, False
        if self._roster_text is None:
            self._roster_text = "[" + ",".join(text for _, text in self._roster.values()) + "]"
        return self._roster_text

    def _live(self, now: float) -> dict[str, Any]:
        """The head of /state.json: everything but the parts that grow with the fleet."""
        ctl = self.ctl
        return (
            ctl.window.snapshot(now, members=False)
            | self._world()
            | {
                "now": round(time.time(), 1),
                "launch": ctl.settings.launch,
                "run_id": ctl.run_id or ctl.cohort.run_id,
                "port": ctl.port,
                "plane": ctl.settings.plane,
                "admitted": ctl.admitted,
                "refused": dict(ctl.refused),
                "dropped": dict(ctl.dropped),
                "elastic": {"max_ranks": ctl.ceiling} if ctl.ceiling else None,
                "averaging": (
                    {
                        "rounds": ctl.hub.rounds_done,
                        "bytes": ctl.hub.bytes_in,
                        "round_s": ctl.traffic.rounds.seconds_json(),
                    }
                    if ctl.hub and ctl.traffic
                    else None
                ),
            }
        )

    def _world(self) -> dict[str, Any]:
        """After losses, the renormalized world (the survivors) replaces the window's counts, so
        the headline, the page and /metrics count who trains on, not who formed the world."""
        supervisor = self.ctl.supervisor
        # A grown world counts who holds ranks now: a lost host whose ranks a walk-in took is gone.
        if supervisor is None or not (supervisor.failed or self.ctl.ceiling):
            return {"lost_ranks": []}
        ranks, hosts = supervisor.world_now()
        return {"joined_ranks": ranks, "joined_hosts": hosts, "lost_ranks": sorted(supervisor.failed)}

    def _heartbeats(self, now: float) -> dict[str, float]:
        ctl, supervisor = self.ctl, self.ctl.supervisor
        if supervisor is None or ctl.window.phase != "training":
            return {}
        return {host: round(now - seen, 1) for host, seen in supervisor.seen.items() if host in ctl.links}

    def head(self) -> dict[str, Any]:
        now = self.ctl.clock()
        return self._live(now) | {"ranks": self.ctl.board.snapshot(now), "heartbeats": self._heartbeats(now)}

    def state_json(self) -> bytes:
        """/state.json: the small live head, with the fleet-sized parts spliced in as built."""
        self.polled = now = self.ctl.clock()
        self.on_poll()
        ctl = self.ctl
        ranks = self._ranks.get(ctl.board.version, now, len(ctl.board.ranks), lambda: ctl.board.snapshot(now))
        beats = self._beats.get(
            (ctl.supervisor, ctl.window.phase, len(ctl.links)),
            now,
            len(ctl.links),
            lambda: self._heartbeats(now),
        )
        live = json.dumps(self._live(now))
        return (
            f'{live[:-1]}, "ranks": {ranks}, "heartbeats": {beats}, "hosts": {self._roster_json()}}}'.encode()
        )

    def state(self) -> dict[str, Any]:
        return self.head() | {"hosts": json.loads(self._roster_json())}

    def history_json(self) -> bytes:
        """/history.json: the charts' series and the timeline (times on the wall clock).

        Bigger than /state.json and changing with every heartbeat, so it is its own
        route (the page polls it less often) and, while the run goes on, rendered at
        most once a second however many pages poll."""
        ctl = self.ctl
        rounds = ctl.traffic.rounds if ctl.traffic else None
        versions = (ctl.board.version, self.timeline.version, rounds.version if rounds else -1)
        now = ctl.clock()
        cached = self._history
        final = ctl.window.phase in ("done", "failed")  # nothing more will change: exact from here
        if cached is None or (cached[0] != versions and (final or now - cached[1] >= HISTORY_EVERY)):
            wall = time.time() - now  # the controller's clock -> seconds since the epoch
            body = {
                "now": round(now + wall, 1),
                "ranks": ctl.board.history_json(wall),
                "rounds": rounds.json() if rounds else None,
                "timeline": self.timeline.json(wall),
            }
            cached = self._history = (versions, now, json.dumps(body).encode())
        return cached[2]

    def metrics(self) -> bytes:
        return exposition(self.state())

    def request_start(self, peer: str, body: bytes) -> tuple[int, dict[str, Any]]:
        return self.ctl.request_start(peer, body)  # an action on the window, not a view

    def summary(self) -> dict[str, Any]:
        """The live head plus host names: what a spinner shows, without the roster's JSON."""
        return self.head() | {"hosts": [{"host": host} for host in self.ctl.links]}

    def report(self) -> dict[str, Any]:
        """The run's verdict (`fdl launch --json`): the world as formed and how every rank exited."""
        ctl = self.ctl
        formed = [json.loads(host_json(link, first)) for link, first in ctl.formed]
        hosts = [
            host
            | {"exits": {str(rank): code for rank, code in sorted(ctl.exits.get(host["host"], {}).items())}}
            for host in formed
        ]
        return {
            "launch": ctl.settings.launch,
            "run_id": ctl.run_id,
            "ok": ctl.exit_code == 0,
            "phase": ctl.window.phase,
            "reason": ctl.reason,
            "world_size": sum(len(h["devices"]) for h in formed),
            "hosts": hosts,
            "admitted": ctl.admitted,
            "refused": dict(ctl.refused),
            "dropped": dict(ctl.dropped),
        }

"""What the status surface shows of a controller: /state.json, /metrics, the run's report.

Read-only over the controller's state. The roster is the one part worth caching:
/state.json is polled by every status page and ``fdl status --watch`` while a
fleet-sized window fills, so each host's JSON is rendered once on arrival and
spliced in, and only a departure (ranks shift) or the formation rebuilds it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .history import Timeline
from .metrics import exposition
from .ranks import assign_contiguous

if TYPE_CHECKING:
    from .controller import Controller, Link

HISTORY_EVERY = 1.0  # seconds: /history.json is rendered at most this often, however many pages poll


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
    )


class ControllerView:
    def __init__(self, controller: Controller) -> None:
        self.ctl = controller
        self._roster: dict[str, str] | None = {}  # host -> its JSON, in admission order; None = rebuild
        self.timeline = Timeline()  # the window's joins, refusals and verdicts, for the page
        self.polled: float | None = None  # the controller's clock at the last /state.json
        self.on_poll: Callable[[], None] = lambda: None  # the launcher's linger waits on a poll
        self._history: tuple[tuple[int, ...], float, bytes] | None = None  # (versions, at, JSON)
        config = controller.window.config
        self.timeline.add(
            controller.clock(),
            "open",
            f"join window opened (quorum {config.quorum}, target {config.target or 'none'}, "
            f"start {config.start})",
        )

    def note(self, kind: str, line: str) -> None:
        """An event of the window: the controller's log line, and the timeline's entry."""
        self.ctl.log(line)
        self.timeline.add(self.ctl.clock(), kind, line)

    def watched(self, within: float) -> bool:
        """Someone polled /state.json in the last ``within`` seconds (a page, ``fdl status --watch``)."""
        return self.polled is not None and self.ctl.clock() - self.polled <= within

    def arrived(self, link: Link, first: int) -> None:
        if self._roster is not None:  # an arrival appends; nobody's ranks move
            self._roster[link.hello.host] = host_json(link, first)

    def invalidate(self) -> None:
        """A departure shifted ranks, or the world formed: rebuild on the next read."""
        self._roster = None

    def _roster_json(self) -> str:
        if self._roster is None:
            ctl = self.ctl
            ranges = assign_contiguous([(m.host, m.ranks) for m in ctl.window.members])
            self._roster = {}
            for r in ranges:
                link = ctl.links.get(r.host)
                if link is not None:
                    first = link.ranks.start if link.ranks is not None else r.start
                    self._roster[r.host] = host_json(link, first)
        return "[" + ",".join(self._roster.values()) + "]"

    def head(self) -> dict[str, Any]:
        ctl = self.ctl
        now = ctl.clock()
        supervisor = ctl.supervisor
        training = supervisor is not None and ctl.window.phase == "training"
        return ctl.window.snapshot(now, members=False) | {
            "now": round(time.time(), 1),
            "launch": ctl.settings.launch,
            "run_id": ctl.run_id or ctl.cohort.run_id,
            "port": ctl.port,
            "plane": ctl.settings.plane,
            "admitted": ctl.admitted,
            "refused": dict(ctl.refused),
            "dropped": dict(ctl.dropped),
            "averaging": (
                {
                    "rounds": ctl.hub.rounds_done,
                    "bytes": ctl.hub.bytes_in,
                    "round_s": ctl.traffic.rounds.seconds_json(),
                }
                if ctl.hub and ctl.traffic
                else None
            ),
            "ranks": ctl.board.snapshot(now),
            "heartbeats": (
                {host: round(now - seen, 1) for host, seen in supervisor.seen.items() if host in ctl.links}
                if training and supervisor is not None
                else {}
            ),
        }

    def state_json(self) -> bytes:
        """/state.json: the small live head, with the cached roster spliced in."""
        self.polled = self.ctl.clock()
        self.on_poll()
        head = json.dumps(self.head())
        return f'{head[:-1]}, "hosts": {self._roster_json()}}}'.encode()

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
        hosts = [
            host
            | {"exits": {str(rank): code for rank, code in sorted(ctl.exits.get(host["host"], {}).items())}}
            for host in ctl.formed
        ]
        return {
            "launch": ctl.settings.launch,
            "run_id": ctl.run_id,
            "ok": ctl.exit_code == 0,
            "phase": ctl.window.phase,
            "reason": ctl.reason,
            "world_size": sum(len(h["devices"]) for h in ctl.formed),
            "hosts": hosts,
            "admitted": ctl.admitted,
            "refused": dict(ctl.refused),
            "dropped": dict(ctl.dropped),
        }

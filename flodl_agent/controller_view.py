"""What the status surface shows of a controller: /state.json, /metrics, the run's report.

Read-only over the controller's state. The roster is the one part worth caching:
/state.json is polled by every status page and ``fdl status --watch`` while a
fleet-sized window fills, so each host's JSON is rendered once on arrival and
spliced in, and only a departure (ranks shift) or the formation rebuilds it.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from .metrics import exposition
from .ranks import assign_contiguous

if TYPE_CHECKING:
    from .controller import Controller, Link


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
            "averaging": {"rounds": ctl.hub.rounds_done, "bytes": ctl.hub.bytes_in} if ctl.hub else None,
            "ranks": ctl.board.snapshot(now),
            "heartbeats": (
                {host: round(now - seen, 1) for host, seen in supervisor.seen.items() if host in ctl.links}
                if training and supervisor is not None
                else {}
            ),
        }

    def state_json(self) -> bytes:
        """/state.json: the small live head, with the cached roster spliced in."""
        head = json.dumps(self.head())
        return f'{head[:-1]}, "hosts": {self._roster_json()}}}'.encode()

    def state(self) -> dict[str, Any]:
        return self.head() | {"hosts": json.loads(self._roster_json())}

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

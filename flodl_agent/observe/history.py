"""What the status page draws: bounded records of a run over time (pure: times are arguments).

Three recorders, each bounded whatever the run's length or the fleet's size:

- :class:`Series`, one line of a chart: at most ``limit`` points; when full,
  every other point goes and new points come no closer than the spacing left,
  so the line always spans the whole run at an even resolution.
- :class:`RoundLog`, the CPU plane's rounds: each round's seconds (a series
  over round numbers), the last round's share per host and each host's share
  over the run (a host's weight in a round is its ranks' batches: its share).
- :class:`Timeline`, the window's events (joins, refusals, verdicts): the first
  and the last ``limit // 2`` kept, with a count of those left out between, so
  a fleet-sized window still shows how it opened and how it ended.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

Point = tuple[float, ...]


def _rounded(value: float | None, digits: int = 4) -> float | None:
    """A value for JSON: None stays None, a non-finite value is none, others keep ``digits`` figures."""
    if value is None or not math.isfinite(value):
        return None
    return float(f"{value:.{digits}g}")


@dataclass
class Series:
    """A chart's line: (x, *values) points, bounded by ``limit``."""

    limit: int = 150
    points: list[Point] = field(default_factory=list)
    spacing: float = 0.0  # the least x between kept points (grows as the series thins)

    def add(self, x: float, *values: float | None) -> None:
        point = (x, *(math.nan if v is None else float(v) for v in values))
        points = self.points
        if len(points) >= 2 and x - points[-2][0] < self.spacing:
            points[-1] = point  # too close to the one before: the newest values stand in for it
            return
        points.append(point)
        if len(points) > self.limit:
            self.points = points = points[::-1][::2][::-1]  # every other one, keeping the newest
            self.spacing = (points[-1][0] - points[0][0]) / max(1, self.limit // 2)

    def json(self, x0: float = 0.0, x_digits: int = 1) -> list[list[float | None]]:
        """The points for JSON, x shifted by ``x0`` (NaN, i.e. no value, as null)."""
        return [[round(p[0] + x0, x_digits), *(_rounded(v) for v in p[1:])] for p in self.points]


@dataclass
class RoundLog:
    """The CPU plane's finished rounds: their seconds and each host's share."""

    limit: int = 150
    seconds: Series = field(init=False)
    last: int | None = None  # the last finished round's number
    last_seconds: float | None = None
    shares: dict[str, float] = field(default_factory=dict)  # host -> share of the last round
    totals: dict[str, float] = field(default_factory=dict)  # host -> weight over the run
    version: int = 0
    _opened: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.seconds = Series(self.limit)

    def opened(self, round_no: int, now: float) -> None:
        """A host pushed ``round_no``: the round's clock starts at its first push."""
        self._opened.setdefault(round_no, now)

    def dropped(self) -> None:
        """The open rounds went unanswered (ShutdownWithSave): they finish no time."""
        self._opened.clear()

    def closed(self, round_no: int, now: float, weights: Mapping[str, float]) -> None:
        """``round_no`` was averaged; ``weights`` is what each host brought to it."""
        started = self._opened.pop(round_no, None)
        self.last = round_no
        self.last_seconds = None if started is None else max(0.0, now - started)
        if self.last_seconds is not None:
            self.seconds.add(float(round_no), self.last_seconds)
        total = sum(weights.values())
        self.shares = {h: (w / total if total > 0 else 0.0) for h, w in weights.items()}
        for host, weight in weights.items():
            self.totals[host] = self.totals.get(host, 0.0) + weight
        self.version += 1

    def seconds_json(self) -> float | None:
        """The last round's seconds (for /state.json: cheap, no series)."""
        return _rounded(self.last_seconds)

    def json(self) -> dict[str, Any]:
        total = sum(self.totals.values())
        return {
            "last": self.last,
            "last_seconds": self.seconds_json(),
            "seconds": self.seconds.json(x_digits=0),
            "shares": {
                host: {
                    "last": _rounded(self.shares.get(host)),
                    "run": _rounded(weight / total if total > 0 else 0.0),
                }
                for host, weight in self.totals.items()
            },
        }


@dataclass(frozen=True)
class Event:
    at: float  # the controller's clock
    # open, join, refusal, start, formed, leave, exit, eviction, cut, save, verdict; after a
    # controller's restart: resume, resumed, lost
    kind: str
    text: str


class Timeline:
    """The window's events, bounded: the first and the last ``limit // 2``, and how many between."""

    def __init__(self, limit: int = 200) -> None:
        self.first: list[Event] = []
        self.last: deque[Event] = deque(maxlen=limit - limit // 2)
        self.keep_first = limit // 2
        self.omitted = 0
        self.version = 0

    def add(self, at: float, kind: str, text: str) -> None:
        event = Event(at, kind, text)
        self.version += 1
        if len(self.first) < self.keep_first:
            self.first.append(event)
            return
        if len(self.last) == self.last.maxlen:
            self.omitted += 1  # the oldest of the last ones falls into the gap
        self.last.append(event)

    def events(self) -> list[Event]:
        return [*self.first, *self.last]

    def json(self, x0: float = 0.0) -> dict[str, Any]:
        """Events in order (``at`` shifted by ``x0``), and where the gap falls."""
        return {
            "events": [{"at": round(e.at + x0, 1), "kind": e.kind, "text": e.text} for e in self.events()],
            "omitted": self.omitted,
            "gap_after": len(self.first) if self.omitted else None,
        }

"""Training metrics: what each rank reports, what the controller makes of it, and /metrics.

A rank reports its progress with :func:`report` (the Trainer does, every
round; a torchrun script may call it too): an atomic write of a small JSON
file in the agent's private per-run directory, named by ``FLODL_METRICS_FILE``,
with the rank's own step rate over its recent reports. The agent reads its
ranks' files into every heartbeat; the controller's :class:`RankBoard` keeps
the latest per rank and the charts' history (pure: the clock is an argument).
:func:`exposition` renders the controller's state in Prometheus' text format
with prometheus-client.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .history import Series

ENV = "FLODL_METRICS_FILE"
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
PHASES = ("waiting", "staging", "forming", "training", "done", "failed")


class RateWindow:
    """A rank's own step rate over its recent reports (pure: times are arguments).

    The rank knows every report it makes; the controller sees one per heartbeat.
    Rating here, over the last ``span`` seconds, gives a rate with the rank's first
    heartbeat instead of its second, smoothed over more than two samples."""

    def __init__(self, span: float = 10.0) -> None:
        self.span = span
        self.seen: deque[tuple[float, int]] = deque(maxlen=256)

    def add(self, step: int, at: float) -> float | None:
        if self.seen and (step < self.seen[-1][1] or at < self.seen[-1][0]):
            self.seen.clear()  # a new count (or the clock stepped back): rate from here
        elif self.seen and at == self.seen[-1][0]:
            self.seen.pop()  # two reports in one millisecond: the later stands
        self.seen.append((at, step))
        while len(self.seen) > 2 and at - self.seen[1][0] >= self.span:
            self.seen.popleft()  # keep one sample at or beyond the span: the window spans it
        first_at, first_step = self.seen[0]
        return (step - first_step) / (at - first_at) if at > first_at else None


_RATE = RateWindow()  # the reports of this process's rank (a rank is a process)


def report(step: int, loss: float | None = None) -> None:
    """Tell the agent where this rank is: ``step`` batches taken so far, the last loss.
    A no-op outside a walk-in (no ``FLODL_METRICS_FILE``)."""
    target = os.environ.get(ENV)
    if not target:
        return
    at = round(time.time(), 3)
    rate = _RATE.add(int(step), at)
    body = {"step": int(step), "loss": _finite(loss), "at": at, "step_rate": _finite(rate)}
    tmp = Path(f"{target}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):  # metrics never fail a run
        tmp.write_text(json.dumps(body))
        tmp.replace(target)  # the agent reads a whole report or the previous one


def _finite(value: float | None) -> float | None:
    """JSON (and the status page) has no NaN: a diverged loss is reported as none."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def read_reports(files: Mapping[int, Path]) -> dict[int, dict[str, Any]]:
    """The ranks' latest reports (rank -> step, loss, at); a rank that has not reported is absent."""
    found: dict[int, dict[str, Any]] = {}
    for rank, path in files.items():
        try:
            body = json.loads(path.read_text())
            rate = _finite(body.get("step_rate"))
            found[rank] = {
                "step": int(body["step"]),
                "loss": _finite(body.get("loss")),
                "at": float(body["at"]),
                "step_rate": rate if rate is not None and rate >= 0 else None,
            }
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            continue  # not reported yet (or not a report: a rank's file is no peer to trust)
    return found


@dataclass
class RankStat:
    host: str
    step: int
    loss: float | None
    step_rate: float | None  # batches per second: the rank's own rate, else between its last two reports
    at: float  # the rank's own clock when it reported (seconds since the epoch)
    seen: float  # the controller's clock when the report first arrived


class RankBoard:
    """Per-rank progress from the agents' heartbeats (the controller keeps one), and the
    charts' history: loss and step rate over time for the lowest ``history_ranks`` ranks."""

    def __init__(self, history_ranks: int = 32, history_points: int = 150) -> None:
        self.ranks: dict[int, RankStat] = {}
        self.history: dict[int, Series] = {}  # rank -> (controller time, loss, step rate)
        self.history_ranks = history_ranks
        self.history_points = history_points
        self.version = 0  # bumped by every new report: the history's cache key

    def update(self, host: str, reports: Mapping[int, Mapping[str, Any]], now: float) -> None:
        for rank, body in reports.items():
            step, at = int(body["step"]), float(body["at"])
            before = self.ranks.get(rank)
            if before is not None and before.host != host:
                before = None  # the rank moved host: a new line from here
                self.history.pop(rank, None)
            if before is not None and at <= before.at:
                continue  # the report the last heartbeat carried: nothing new, its age grows
            rate = _finite(body.get("step_rate"))  # the rank's own, over all its recent reports
            if rate is None and before is not None and step >= before.step:
                # The rank's own timestamps: heartbeat delivery jitter does not skew the rate.
                rate = (step - before.step) / (at - before.at)
            stat = self.ranks[rank] = RankStat(host, step, _finite(body.get("loss")), rate, at, now)
            if rank < self.history_ranks:
                self.history.setdefault(rank, Series(self.history_points)).add(now, stat.loss, rate)
            self.version += 1

    def forget(self, host: str) -> None:
        self.ranks = {r: s for r, s in self.ranks.items() if s.host != host}
        self.history = {r: line for r, line in self.history.items() if r in self.ranks}

    def history_json(self, x0: float = 0.0) -> dict[str, Any]:
        """rank -> its host and points [time + x0, loss, step rate], for the charts."""
        return {
            str(rank): {"host": self.ranks[rank].host, "points": line.json(x0)}
            for rank, line in sorted(self.history.items())
            if rank in self.ranks
        }

    def snapshot(self, now: float) -> dict[str, dict[str, Any]]:
        """For /state.json: rank -> host, step, loss, step rate, seconds since its last report."""
        return {
            str(rank): {
                "host": s.host,
                "step": s.step,
                "loss": s.loss,
                "step_rate": None if s.step_rate is None else round(s.step_rate, 3),
                "age": round(now - s.seen, 1),
            }
            for rank, s in sorted(self.ranks.items())
        }


def exposition(state: Mapping[str, Any]) -> bytes:
    """/metrics: the controller's /state.json in Prometheus' text exposition format."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StateCollector(state))
    return bytes(generate_latest(registry))


class _StateCollector:
    """One scrape: every family built from a snapshot (no global registry, no stale series)."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.state = state

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.state
        phase = GaugeMetricFamily(
            "flodl_window_phase", "1 for the join window's current phase", labels=["phase"]
        )
        for name in PHASES:
            phase.add_metric([name], 1.0 if s.get("phase") == name else 0.0)
        yield phase
        hosts = s.get("hosts", [])
        joined = len(hosts), sum(h["ranks"][1] - h["ranks"][0] for h in hosts)
        lost = s.get("lost_ranks") or []
        if lost:  # after losses: the renormalized world, as the headline counts it
            joined = s["joined_hosts"], s["joined_ranks"]
        yield GaugeMetricFamily("flodl_joined_hosts", "Hosts in the roster (the survivors)", value=joined[0])
        yield GaugeMetricFamily("flodl_joined_ranks", "Ranks in the roster (the survivors)", value=joined[1])
        yield GaugeMetricFamily("flodl_lost_ranks", "Ranks lost mid-run (evicted or failed)", value=len(lost))
        yield CounterMetricFamily("flodl_admissions", "Walk-ins admitted", value=s.get("admitted", 0))
        refused = CounterMetricFamily("flodl_refusals", "Hellos refused, by reason", labels=["reason"])
        for reason, count in sorted(s.get("refused", {}).items()):
            refused.add_metric([reason], count)
        yield refused
        dropped = CounterMetricFamily(
            "flodl_frames_dropped", "Connections and frames dropped", labels=["cause"]
        )
        for cause, count in sorted(s.get("dropped", {}).items()):
            dropped.add_metric([cause], count)
        yield dropped
        averaging = s.get("averaging") or {}
        yield CounterMetricFamily(
            "flodl_averaging_rounds", "CPU-plane averaging rounds completed", value=averaging.get("rounds", 0)
        )
        yield CounterMetricFamily(
            "flodl_averaging_bytes", "Parameter bytes received for averaging", value=averaging.get("bytes", 0)
        )
        if averaging.get("round_s") is not None:
            yield GaugeMetricFamily(
                "flodl_averaging_round_seconds",
                "Seconds the last CPU-plane round took, from its first push to its average",
                value=averaging["round_s"],
            )
        rate = GaugeMetricFamily("flodl_rank_step_rate", "Batches per second", labels=["rank", "host"])
        step = GaugeMetricFamily("flodl_rank_steps", "Batches taken by the rank", labels=["rank", "host"])
        loss = GaugeMetricFamily("flodl_rank_loss", "The rank's last reported loss", labels=["rank", "host"])
        for rank, r in s.get("ranks", {}).items():
            step.add_metric([rank, r["host"]], r["step"])
            if r["step_rate"] is not None:
                rate.add_metric([rank, r["host"]], r["step_rate"])
            if r["loss"] is not None:
                loss.add_metric([rank, r["host"]], r["loss"])
        yield from (rate, step, loss)
        age = GaugeMetricFamily(
            "flodl_heartbeat_age_seconds", "Seconds since the host's last frame", labels=["host"]
        )
        for host, seconds in sorted(s.get("heartbeats", {}).items()):
            age.add_metric([host], seconds)
        yield age

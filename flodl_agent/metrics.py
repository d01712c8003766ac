"""Training metrics: what each rank reports, what the controller makes of it, and /metrics.

A rank reports its progress with :func:`report` (the Trainer does, every
round; a torchrun script may call it too): an atomic write of a small JSON
file in the agent's private per-run directory, named by ``FLODL_METRICS_FILE``.
The agent reads its ranks' files into every heartbeat; the controller's
:class:`RankBoard` turns successive reports into step rates (pure: the clock
is an argument). :func:`exposition` renders the controller's state in
Prometheus' text format with prometheus-client.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV = "FLODL_METRICS_FILE"
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
PHASES = ("waiting", "staging", "forming", "training", "done", "failed")


def report(step: int, loss: float | None = None) -> None:
    """Tell the agent where this rank is: ``step`` batches taken so far, the last loss.
    A no-op outside a walk-in (no ``FLODL_METRICS_FILE``)."""
    target = os.environ.get(ENV)
    if not target:
        return
    body = {"step": int(step), "loss": _finite(loss), "at": round(time.time(), 3)}
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
            found[rank] = {
                "step": int(body["step"]),
                "loss": _finite(body.get("loss")),
                "at": float(body["at"]),
            }
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            continue  # not reported yet (or not a report: a rank's file is no peer to trust)
    return found


@dataclass
class RankStat:
    host: str
    step: int
    loss: float | None
    step_rate: float | None  # batches per second between the last two reports
    at: float  # the rank's own clock when it reported (seconds since the epoch)
    seen: float  # the controller's clock when the report arrived


class RankBoard:
    """Per-rank progress from the agents' heartbeats (the controller keeps one)."""

    def __init__(self) -> None:
        self.ranks: dict[int, RankStat] = {}

    def update(self, host: str, reports: Mapping[int, Mapping[str, Any]], now: float) -> None:
        for rank, body in reports.items():
            step, at = int(body["step"]), float(body["at"])
            before = self.ranks.get(rank)
            rate = before.step_rate if before is not None and before.host == host else None
            if before is not None and before.host == host and at > before.at and step >= before.step:
                # The rank's own timestamps: heartbeat delivery jitter does not skew the rate.
                rate = (step - before.step) / (at - before.at)
            self.ranks[rank] = RankStat(host, step, _finite(body.get("loss")), rate, at, now)

    def forget(self, host: str) -> None:
        self.ranks = {r: s for r, s in self.ranks.items() if s.host != host}

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
        yield GaugeMetricFamily("flodl_joined_hosts", "Hosts in the roster", value=len(hosts))
        ranks = sum(h["ranks"][1] - h["ranks"][0] for h in hosts)
        yield GaugeMetricFamily("flodl_joined_ranks", "Ranks in the roster", value=ranks)
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

"""The status page's records over time: bounded series, the rounds' shares, the timeline."""

from __future__ import annotations

import itertools
import math

from flodl_agent.observe.history import RoundLog, Series, Timeline


def test_a_series_stays_bounded_and_spans_the_whole_run_evenly() -> None:
    line = Series(limit=10)
    for t in range(1000):
        line.add(float(t), float(t) * 2)
        assert len(line.points) <= 10
    xs = [p[0] for p in line.points]
    assert xs[0] < 150 and xs[-1] == 999.0  # the start of the run is still drawn, and the newest point
    gaps = [b - a for a, b in itertools.pairwise(xs)]
    assert max(gaps) <= 2.5 * min(gaps)  # an even resolution, not a dense tail after a sparse head
    assert all(p[1] == p[0] * 2 for p in line.points)


def test_a_series_writes_no_value_as_null_and_shifts_its_times() -> None:
    line = Series()
    line.add(1.04, None, math.inf)
    line.add(2.0, 0.123456, 3.0)
    assert line.json(x0=100.0) == [[101.0, None, None], [102.0, 0.1235, 3.0]]


def test_the_round_log_times_rounds_and_shares_them_by_weight() -> None:
    log = RoundLog()
    log.opened(0, now=10.0)
    log.opened(0, now=10.5)  # a second host's push: the round started at the first
    log.closed(0, now=10.75, weights={"a": 1.0, "b": 3.0})
    log.opened(1, now=11.0)
    log.closed(1, now=11.5, weights={"a": 2.0, "b": 2.0})
    assert log.seconds.points == [(0.0, 0.75), (1.0, 0.5)]
    got = log.json()
    assert got["last"] == 1 and got["last_seconds"] == 0.5
    assert got["shares"] == {"a": {"last": 0.5, "run": 0.375}, "b": {"last": 0.5, "run": 0.625}}
    log.opened(2, now=12.0)
    log.dropped()  # ShutdownWithSave answered the open round: it finishes no time
    log.closed(2, now=13.0, weights={"a": 0.0})
    assert log.json()["last_seconds"] is None and log.json()["shares"]["b"]["last"] is None
    assert log.version == 3


def test_the_timeline_keeps_how_the_window_opened_and_how_it_ended() -> None:
    timeline = Timeline(limit=6)
    timeline.add(0.0, "open", "join window opened")
    for n in range(10):
        timeline.add(1.0 + n, "join", f"admitted box-{n}")
    timeline.add(20.0, "verdict", "run complete")
    texts = [e.text for e in timeline.events()]
    first, last = (
        ["join window opened", "admitted box-0", "admitted box-1"],
        ["admitted box-8", "admitted box-9"],
    )
    assert texts == [*first, *last, "run complete"]
    got = timeline.json(x0=1000.0)
    assert got["omitted"] == 6 and got["gap_after"] == 3
    assert got["events"][-1] == {"at": 1020.0, "kind": "verdict", "text": "run complete"}
    assert Timeline().json()["gap_after"] is None

"""Rank progress reports, the controller's board, and the Prometheus exposition."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from flodl_agent.observe.metrics import ENV, RankBoard, RateWindow, exposition, read_reports, report


def test_a_rank_reports_atomically_and_never_a_nan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report(3, 0.5)  # outside a walk-in: nothing to do, no error
    target = tmp_path / "metrics-0.json"
    monkeypatch.setenv(ENV, str(target))
    report(7, math.nan)
    (tmp_path / "metrics-1.json").write_text("{not json")
    got = read_reports({0: target, 1: tmp_path / "metrics-1.json", 2: tmp_path / "absent.json"})
    assert list(got) == [0] and got[0]["step"] == 7 and got[0]["loss"] is None
    assert not list(tmp_path.glob("*.tmp"))


def test_a_rank_rates_its_own_steps_over_its_recent_reports() -> None:
    window = RateWindow(span=10.0)
    assert window.add(0, 100.0) is None  # one report: no rate
    assert window.add(5, 101.0) == 5.0
    for t in range(2, 31):
        rate = window.add(5 * t if t < 20 else 100 + 20 * (t - 20), 100.0 + t)
    assert rate == 20.0  # the last 10 s only: the rank sped up to 20 steps/s at t=20
    assert window.add(3, 131.0) is None  # the count restarted: rate from there
    assert window.add(13, 132.0) == 10.0


def test_a_report_carries_the_ranks_own_rate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "metrics-0.json"
    monkeypatch.setenv(ENV, str(target))
    monkeypatch.setattr("flodl_agent.observe.metrics._RATE", RateWindow())
    clock = iter([1000.0, 1002.0])
    monkeypatch.setattr("flodl_agent.observe.metrics.time.time", lambda: next(clock))
    report(10, 0.5)
    assert read_reports({0: target})[0]["step_rate"] is None
    report(30, 0.25)
    assert read_reports({0: target})[0] == {"step": 30, "loss": 0.25, "at": 1002.0, "step_rate": 10.0}


def test_one_heartbeat_is_enough_for_a_rate_and_a_repeated_report_ages() -> None:
    board = RankBoard()
    board.update("a", {0: {"step": 40, "loss": 1.0, "at": 100.0, "step_rate": 8.0}}, now=5.0)
    assert board.ranks[0].step_rate == 8.0  # the rank's own: no second heartbeat needed
    board.update("a", {0: {"step": 40, "loss": 1.0, "at": 100.0, "step_rate": 8.0}}, now=20.0)
    assert board.snapshot(21.0)["0"]["age"] == 16.0  # the same report again: a stuck rank shows it
    assert [p[1:] for p in board.history[0].points] == [(1.0, 8.0)]  # and draws no new point


def test_the_boards_history_is_bounded_by_ranks_and_points() -> None:
    board = RankBoard(history_ranks=2, history_points=4)
    for t in range(20):
        board.update("a", {r: {"step": t, "loss": 1.0 / (t + 1), "at": float(t)} for r in range(3)}, float(t))
    assert sorted(board.history) == [0, 1] and len(board.ranks) == 3  # rank 2 is in the table, not charted
    assert all(len(line.points) <= 4 for line in board.history.values())
    got = board.history_json(x0=1000.0)
    assert got["0"]["host"] == "a" and got["0"]["points"][-1] == [1019.0, 0.05, 1.0]
    board.update("b", {0: {"step": 1, "loss": None, "at": 50.0}}, now=30.0)  # rank 0 on a new host
    assert board.history_json()["0"] == {"host": "b", "points": [[30.0, None, None]]}


def test_the_board_rates_steps_on_the_ranks_own_clock() -> None:
    board = RankBoard()
    board.update("a", {0: {"step": 10, "loss": 2.0, "at": 100.0}}, now=5.0)
    assert board.ranks[0].step_rate is None  # one report: no rate yet
    board.update("a", {0: {"step": 30, "loss": 1.0, "at": 104.0}}, now=50.0)  # a late heartbeat
    assert board.ranks[0].step_rate == 5.0  # 20 steps in the rank's 4 seconds
    board.update("a", {0: {"step": 30, "loss": 1.0, "at": 104.0}}, now=55.0)  # nothing new
    assert board.ranks[0].step_rate == 5.0
    board.update("b", {0: {"step": 2, "loss": None, "at": 200.0}}, now=60.0)  # rank 0 moved host
    assert board.ranks[0].step_rate is None and board.ranks[0].host == "b"
    assert board.snapshot(62.0) == {
        "0": {"host": "b", "step": 2, "loss": None, "step_rate": None, "age": 2.0}
    }
    board.forget("b")
    assert board.ranks == {}


def test_the_exposition_parses_back() -> None:
    state = {
        "phase": "training",
        "hosts": [{"host": "a", "ranks": [0, 2]}],
        "admitted": 1,
        "refused": {"bad_key": 3},
        "dropped": {"http": 1},
        "averaging": {"rounds": 5, "bytes": 1024, "round_s": 0.25},
        "ranks": {"0": {"host": "a", "step": 9, "loss": 0.5, "step_rate": 2.5, "age": 1.0}},
        "heartbeats": {"a": 1.5},
    }
    families = {f.name: f for f in text_string_to_metric_families(exposition(state).decode())}
    value = {f.name: [(s.labels, s.value) for s in f.samples] for f in families.values()}
    assert value["flodl_joined_ranks"] == [({}, 2.0)]
    assert value["flodl_refusals"] == [({"reason": "bad_key"}, 3.0)]
    assert value["flodl_averaging_bytes"] == [({}, 1024.0)]
    assert value["flodl_averaging_round_seconds"] == [({}, 0.25)]
    assert value["flodl_rank_step_rate"] == [({"rank": "0", "host": "a"}, 2.5)]
    assert value["flodl_heartbeat_age_seconds"] == [({"host": "a"}, 1.5)]
    assert families["flodl_admissions"].type == "counter"

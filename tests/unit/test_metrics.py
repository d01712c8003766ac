"""Rank progress reports, the controller's board, and the Prometheus exposition."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from flodl_agent.metrics import ENV, RankBoard, exposition, read_reports, report


def test_a_rank_reports_atomically_and_never_a_nan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report(3, 0.5)  # outside a walk-in: nothing to do, no error
    target = tmp_path / "metrics-0.json"
    monkeypatch.setenv(ENV, str(target))
    report(7, math.nan)
    (tmp_path / "metrics-1.json").write_text("{not json")
    got = read_reports({0: target, 1: tmp_path / "metrics-1.json", 2: tmp_path / "absent.json"})
    assert list(got) == [0] and got[0]["step"] == 7 and got[0]["loss"] is None
    assert not list(tmp_path.glob("*.tmp"))


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
        "averaging": {"rounds": 5, "bytes": 1024},
        "ranks": {"0": {"host": "a", "step": 9, "loss": 0.5, "step_rate": 2.5, "age": 1.0}},
        "heartbeats": {"a": 1.5},
    }
    families = {f.name: f for f in text_string_to_metric_families(exposition(state).decode())}
    value = {f.name: [(s.labels, s.value) for s in f.samples] for f in families.values()}
    assert value["flodl_joined_ranks"] == [({}, 2.0)]
    assert value["flodl_refusals"] == [({"reason": "bad_key"}, 3.0)]
    assert value["flodl_averaging_bytes"] == [({}, 1024.0)]
    assert value["flodl_rank_step_rate"] == [({"rank": "0", "host": "a"}, 2.5)]
    assert value["flodl_heartbeat_age_seconds"] == [({"host": "a"}, 1.5)]
    assert families["flodl_admissions"].type == "counter"

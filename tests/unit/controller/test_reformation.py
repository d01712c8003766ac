"""Growth by re-formation's rules (pure): who waits, when the next re-formation is due, whose
exits are the re-formation's, and the world it forms."""

from __future__ import annotations

import pytest

from flodl_agent.controller.reformation import Reformation


def test_a_walk_in_waits_for_the_interval_counted_from_the_last_formation() -> None:
    r = Reformation(interval=60.0, formed_at=100.0)
    assert r.due(120.0) is None  # nobody waits
    r.hold("c", 2)
    assert r.waiting == 2
    assert r.due(120.0) == 160.0  # held until the interval has passed
    assert r.due(170.0) == 170.0  # past it: at once
    r.hold("d", 1)
    assert r.waiting == 3 and list(r.held) == ["c", "d"]  # arrival order
    with pytest.raises(ValueError, match="already waiting"):
        r.hold("c", 1)
    with pytest.raises(ValueError, match="offers no ranks"):
        r.hold("e", 0)


def test_an_interval_of_zero_re_forms_at_once() -> None:
    r = Reformation(interval=0.0, formed_at=100.0)
    r.hold("c", 1)
    assert r.due(100.0) == 100.0


def test_a_held_walk_in_that_leaves_waits_no_more() -> None:
    r = Reformation(interval=60.0, formed_at=0.0)
    r.hold("c", 1)
    assert r.release("c") is True and r.release("c") is False
    assert r.due(100.0) is None and r.waiting == 0


def test_the_ranks_asked_to_stop_are_the_running_ones_and_their_exits_are_the_re_formations() -> None:
    r = Reformation(interval=0.0, formed_at=0.0)
    r.hold("c", 1)
    asked = r.begin({"a": {0, 1}, "b": {2}, "done": set()}, now=10.0, grace=60.0)
    assert asked == ["a", "b"]  # a host whose ranks all ended is not asked
    assert r.restarts == 1 and r.deadline == 70.0
    assert r.due(10.0) is None  # one is under way
    assert not r.complete
    assert r.stopped("a", 0) is True
    assert r.stopped("a", 0) is False  # said once
    assert r.stopped("c", 5) is False  # not a rank asked to stop
    assert r.late() == {"a": {1}, "b": {2}}
    assert r.stopped("a", 1) and not r.complete
    assert r.stopped("b", 2) and r.complete
    assert r.late() == {}


def test_with_no_re_formation_under_way_no_exit_is_the_re_formations() -> None:
    r = Reformation(interval=0.0, formed_at=0.0)
    assert r.stopped("a", 0) is False and not r.complete and r.late() == {}


def test_a_world_with_nothing_running_is_complete_at_once() -> None:
    r = Reformation(interval=0.0, formed_at=0.0)
    r.hold("c", 1)
    assert r.begin({"a": set()}, now=0.0, grace=5.0) == [] and r.complete


def test_the_re_formed_world_keeps_the_hosts_ranks_and_puts_walk_ins_after_them() -> None:
    r = Reformation(interval=0.0, formed_at=0.0)
    r.hold("c", 2)
    r.hold("big", 4)  # does not fit the ceiling: waits for the next
    r.hold("d", 1)
    world, taken = r.world({"b": range(2, 3), "a": range(0, 2)}, ceiling=6)
    assert world == {"a": range(0, 2), "b": range(2, 3), "c": range(3, 5), "d": range(5, 6)}
    assert list(world) == ["a", "b", "c", "d"]  # rank order: rank 0's host first
    assert taken == ["c", "d"] and r.held == {"big": 4}


def test_exactly_to_the_ceiling() -> None:
    r = Reformation(interval=0.0, formed_at=0.0)
    r.hold("c", 1)
    world, taken = r.world({"a": range(0, 2)}, ceiling=3)
    assert taken == ["c"] and world["c"] == range(2, 3)


def test_formed_restarts_the_interval() -> None:
    r = Reformation(interval=30.0, formed_at=0.0)
    r.hold("c", 1)
    r.begin({"a": {0}}, now=40.0, grace=5.0)
    r.stopped("a", 0)
    r.world({"a": range(0, 1)}, ceiling=4)
    r.formed(41.0)
    assert r.stopping is None and r.deadline is None and r.formed_at == 41.0
    r.hold("d", 1)
    assert r.due(50.0) == 71.0 and r.restarts == 1


def test_rank_order_not_name_order_and_an_empty_world_numbers_from_zero() -> None:
    r = Reformation(interval=0.0, formed_at=0.0)
    r.hold("c", 1)
    world, _ = r.world({"a": range(2, 3), "z": range(0, 2)}, ceiling=4)
    assert list(world) == ["z", "a", "c"] and world["c"] == range(3, 4)
    r.hold("d", 2)
    assert r.world({}, ceiling=2) == ({"d": range(0, 2)}, ["d"])


def test_each_re_formation_counts_one_restart_more() -> None:
    r = Reformation(interval=0.0, formed_at=0.0)
    for restart in (1, 2, 3):
        r.hold("c", 1)
        r.begin({"a": {0}}, now=0.0, grace=1.0)
        assert r.restarts == restart
        r.stopped("a", 0)
        r.world({"a": range(0, 1)}, ceiling=9)
        r.formed(0.0)

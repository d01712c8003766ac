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
    world, taken, holes = r.world({"b": range(2, 3), "a": range(0, 2)}, ceiling=6)
    assert world == {"a": range(0, 2), "b": range(2, 3), "c": range(3, 5), "d": range(5, 6)}
    assert list(world) == ["a", "b", "c", "d"]  # rank order: rank 0's host first
    assert taken == ["c", "d"] and r.held == {"big": 4} and holes == []


def test_exactly_to_the_ceiling() -> None:
    r = Reformation(interval=0.0, formed_at=0.0)
    r.hold("c", 1)
    world, taken, _ = r.world({"a": range(0, 2)}, ceiling=3)
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
    world, _, _ = r.world({"a": range(2, 3), "z": range(0, 2)}, ceiling=4)
    assert list(world) == ["z", "a", "c"] and world["c"] == range(3, 4)
    r.hold("d", 2)
    assert r.world({}, ceiling=2) == ({"d": range(0, 2)}, ["d"], [])


def test_each_re_formation_counts_one_restart_more() -> None:
    r = Reformation(interval=0.0, formed_at=0.0)
    for restart in (1, 2, 3):
        r.hold("c", 1)
        r.begin({"a": {0}}, now=0.0, grace=1.0)
        assert r.restarts == restart
        r.stopped("a", 0)
        r.world({"a": range(0, 1)}, ceiling=9)
        r.formed(0.0)


# --- replacement: a lost host's span filled before the world forms again ---------------


def test_a_lost_hosts_span_goes_to_the_first_walk_in_that_fits_it_before_any_growth() -> None:
    r = Reformation(interval=0.0, formed_at=0.0)
    r.begin({"a": {0}, "b": {1, 2}, "c": {3}}, now=0.0, grace=5.0)
    r.lose("b", range(1, 3))
    assert r.stopping == {"a": {0}, "c": {3}} and r.missing == 2  # b's ranks never stop: gone
    r.hold("big", 3)  # fits no hole: after every rank, below the ceiling
    r.hold("d", 2)
    world, taken, holes = r.world({"a": range(0, 1), "b": range(1, 3), "c": range(3, 4)}, ceiling=7)
    assert world == {"a": range(0, 1), "d": range(1, 3), "c": range(3, 4), "big": range(4, 7)}
    assert list(world) == ["a", "d", "c", "big"] and taken == ["big", "d"] and holes == []
    assert r.held == {}


def test_a_world_with_a_span_unfilled_takes_nobody_and_names_what_it_misses() -> None:
    r = Reformation(interval=0.0, formed_at=0.0)
    r.lose("b", range(1, 3))
    r.hold("d", 1)  # half the hole: the world is not whole yet
    world, taken, holes = r.world({"a": range(0, 1), "b": range(1, 3)}, ceiling=3)
    assert holes == [range(2, 3)] and taken == ["d"] and r.held == {"d": 1}  # still held
    assert world == {"a": range(0, 1), "d": range(1, 2)}
    r.hold("e", 1)
    world, taken, holes = r.world({"a": range(0, 1), "b": range(1, 3)}, ceiling=3)
    assert (holes, taken, r.held) == ([], ["d", "e"], {})
    assert world == {"a": range(0, 1), "d": range(1, 2), "e": range(2, 3)}


def test_a_box_lost_and_back_under_its_own_name_fills_its_own_span() -> None:
    r = Reformation(interval=0.0, formed_at=0.0)
    r.lose("b", range(1, 2))
    r.hold("b", 1)
    world, taken, holes = r.world({"a": range(0, 1), "b": range(1, 2)}, ceiling=2)
    assert world == {"a": range(0, 1), "b": range(1, 2)} and taken == ["b"] and holes == []


def test_a_lost_span_at_the_top_leaves_no_room_above_it_for_growth() -> None:
    r = Reformation(interval=0.0, formed_at=0.0)
    r.lose("b", range(1, 2))
    r.hold("big", 2)  # fits no hole, and the top of the world is b's rank: 1 + 2 > 2
    world, taken, holes = r.world({"a": range(0, 1), "b": range(1, 2)}, ceiling=2)
    assert (taken, holes, r.held) == ([], [range(1, 2)], {"big": 2}) and world == {"a": range(0, 1)}


def test_formed_forgets_the_lost_hosts() -> None:
    r = Reformation(interval=0.0, formed_at=0.0)
    r.lose("b", range(1, 2))
    r.formed(1.0)
    assert r.lost == {} and r.missing == 0


def test_losing_a_host_outside_a_re_formation_only_records_its_span() -> None:
    r = Reformation(interval=0.0, formed_at=0.0)
    r.lose("b", range(1, 2))
    assert r.stopping is None and r.lost == {"b": range(1, 2)}


@pytest.mark.parametrize(
    ("interval", "times", "limit", "allowed"),
    [
        (60.0, [10.0], 1, [True]),  # the first failure restarts the world
        (60.0, [10.0, 20.0], 1, [True, False]),  # again before it trained 60 s: the run ends
        (60.0, [10.0, 80.0], 1, [True, True]),  # it trained a full interval between: reset
        (60.0, [10.0, 20.0, 30.0], 2, [True, True, False]),
        (60.0, [10.0], 0, [False]),  # no budget: no restart
        (0.0, [0.0, 0.0, 0.0], 1, [True, True, True]),  # no interval: nothing counts as in a row
    ],
)
def test_failures_in_a_row_are_bounded(
    interval: float, times: list[float], limit: int, allowed: list[bool]
) -> None:
    r = Reformation(interval=interval, formed_at=0.0)
    got = []
    for now in times:
        got.append(r.failed(now, limit))
        r.formed(now)
    assert got == allowed


def test_failures_count_from_the_last_formation_not_the_last_failure() -> None:
    r = Reformation(interval=60.0, formed_at=0.0)
    assert r.failed(59.0, 1)  # formed at 0: in a row
    r.formed(100.0)
    assert r.failed(159.0, 1) is False  # formed at 100, failed within 60 s of it: the second in a row
    assert r.failures == 2


def test_holes_fill_in_rank_order_whatever_order_their_hosts_were_lost_in() -> None:
    r = Reformation(interval=0.0, formed_at=0.0)
    r.begin({"a": {0}, "b": set(), "c": set()}, now=0.0, grace=5.0)  # b's and c's ranks had ended
    r.lose("c", range(3, 4))  # never asked to stop: nothing to forget
    r.lose("b", range(1, 3))
    r.hold("d", 1)
    r.hold("e", 1)
    r.hold("f", 1)
    old = {"a": range(0, 1), "b": range(1, 3), "c": range(3, 4)}
    world, taken, holes = r.world(old, ceiling=4)
    assert world == {"a": range(0, 1), "d": range(1, 2), "e": range(2, 3), "f": range(3, 4)}
    assert taken == ["d", "e", "f"] and holes == [] and r.stopping == {"a": {0}}


def test_the_wait_for_walk_ins_is_set_once_and_ends_with_the_formation() -> None:
    r = Reformation(interval=0.0, formed_at=0.0)
    r.begin({"a": {0}}, now=1.0, grace=5.0)
    assert r.deadline == 6.0 and not r.filling  # the stop's end
    assert r.wait(3.0, timeout=300.0) and r.filling and r.deadline == 303.0
    assert not r.wait(50.0, timeout=300.0) and r.deadline == 303.0  # counted from the first time
    r.formed(60.0)
    assert not r.filling and r.deadline is None
    r.begin({"a": {0}}, now=70.0, grace=5.0)
    assert r.wait(71.0, timeout=10.0) and r.deadline == 81.0

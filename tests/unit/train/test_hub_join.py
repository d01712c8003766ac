"""The hub's walk-ins (an elastic launch): counted in from the next round, weight 0 in it."""

from __future__ import annotations

import pytest

from flodl_agent.train.hub import Hub, Mismatch
from tests.unit.train.test_hub import f32, floats


def test_a_walk_in_before_a_round_opens_takes_that_round_whole_and_holds_it_up_never() -> None:
    hub = Hub({"a", "b"})
    assert hub.join("c") == []
    assert hub.push("a", 0, 1.0, f32(2, 4)) == []
    assert hub.missing(0) == {"b"}  # the walk-in brings nothing: nobody waits for it
    (done,) = hub.push("b", 0, 1.0, f32(4, 8))
    assert done.hosts == {"a", "b", "c"}  # it takes the average as its starting point
    assert floats(done) == [3.0, 6.0] and done.weight == 2.0
    assert done.weights == {"a": 1.0, "b": 1.0, "c": 0.0}


def test_from_the_round_after_its_first_the_walk_in_is_waited_for_and_counted() -> None:
    hub = Hub({"a", "b"})
    hub.join("c")
    hub.push("a", 0, 1.0, f32(1))
    hub.push("b", 0, 1.0, f32(1))
    assert hub.push("a", 1, 1.0, f32(3)) == []
    assert hub.push("b", 1, 1.0, f32(3)) == []
    assert hub.missing(1) == {"c"}
    (done,) = hub.push("c", 1, 2.0, f32(6))  # pre-scaled: weight 2, parameters 3
    assert floats(done) == [3.0] and done.weight == 4.0


def test_a_walk_in_enters_an_open_round_only_while_none_of_it_went_out() -> None:
    hub = Hub({"a", "b"})
    hub.push("a", 0, 1.0, f32(1, 2), params=4)  # half of round 0 from a
    hub.join("c")  # nothing of round 0 went out yet: c is in it
    hub.push("a", 0, 1.0, f32(3, 4), offset=2, params=4)
    pieces = hub.push("b", 0, 1.0, f32(1, 2, 3, 4))
    assert all("c" in piece.hosts for piece in pieces)

    late = Hub({"a", "b"})
    late.push("a", 0, 1.0, f32(1, 2), params=4)
    (first,) = late.push("b", 0, 1.0, f32(1, 2), params=4)  # the first half went out
    assert first.offset == 0 and not first.last
    late.join("c")  # too late for round 0: it waits for round 1
    late.push("a", 0, 1.0, f32(3, 4), offset=2, params=4)
    (rest,) = late.push("b", 0, 1.0, f32(3, 4), offset=2, params=4)
    assert "c" not in rest.hosts and rest.last
    late.push("a", 1, 1.0, f32(1, 1, 1, 1))
    (one,) = late.push("b", 1, 1.0, f32(1, 1, 1, 1))
    assert one.hosts == {"a", "b", "c"}


def test_every_last_piece_says_the_weight_the_world_accepted_so_far() -> None:
    hub = Hub({"a", "b"})
    hub.push("a", 0, 2.0, f32(1, 1))
    (zero,) = hub.push("b", 0, 3.0, f32(1, 1))
    assert zero.taken == 5.0
    hub.push("a", 1, 1.0, f32(1, 1))
    (one,) = hub.push("b", 1, 1.0, f32(1, 1))
    assert one.taken == 7.0 and hub.taken == 7.0
    # A round whose pieces carry different weights (a host left mid-round) counts its least,
    # as the relay does: what its ranks add to their own count.
    hub.push("a", 2, 1.0, f32(1), params=2)
    (cut,) = hub.push("b", 2, 1.0, f32(1, 1))  # the stretch both delivered goes out at once
    (rest,) = hub.leave("a")
    assert (cut.weight, rest.weight) == (2.0, 1.0) and not cut.taken and rest.taken == 8.0


def test_a_walk_in_with_nobody_left_to_average_with_trains_alone() -> None:
    hub = Hub({"a"})
    hub.push("a", 0, 1.0, f32(1))
    hub.join("c")
    (alone,) = hub.leave("a")  # the only other host finished before a round opened
    assert alone.hosts == {"c"} and alone.weight == 0.0 and alone.round == 1 and alone.last
    assert alone.taken == 1.0

    empty = Hub({"a"})
    empty.leave("a")
    (alone,) = empty.join("c")
    assert alone.hosts == {"c"} and alone.weight == 0.0


def test_a_walk_in_that_leaves_before_its_round_is_forgotten_and_a_double_join_refused() -> None:
    hub = Hub({"a"})
    hub.join("c")
    with pytest.raises(Mismatch, match="joined twice"):
        hub.join("c")
    hub.leave("c")
    (done,) = hub.push("a", 0, 1.0, f32(1))
    assert done.hosts == {"a"}


def test_a_shutdown_answers_the_walk_ins_still_waiting() -> None:
    hub = Hub({"a", "b"})
    hub.push("a", 0, 1.0, f32(1))
    hub.push("b", 0, 1.0, f32(1))
    hub.join("c")
    hub.push("a", 1, 1.0, f32(1))
    hub2 = Hub({"a", "b"})
    hub2.push("a", 0, 1.0, f32(1))
    hub2.push("b", 0, 1.0, f32(1))
    hub2.join("c")
    assert hub2.shutdown() == [(1, {"c"})]
    assert hub.shutdown() == [(1, {"a", "c"})]


def test_who_waits_for_the_next_round_is_seen() -> None:
    hub = Hub({"a"})
    hub.join("c")
    assert hub.waiting == {"c"}
    hub.push("a", 0, 1.0, f32(1))  # the round opened with it in
    assert hub.waiting == frozenset()

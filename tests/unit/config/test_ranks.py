"""Rank capacity, contiguous assignment and the window plan's defaults."""

from __future__ import annotations

import pytest

from flodl_agent.config import Cluster, ClusterBuilder, JoinWindow
from flodl_agent.config.ranks import (
    CapacityUnknown,
    RankRange,
    assign_contiguous,
    fanout_ranks,
    known_ranks,
    next_range,
    plan_window,
    rank_span,
)


def cluster(*offers: object) -> Cluster:
    builder = ClusterBuilder().controller("10.0.0.1")
    for i, offer in enumerate(offers):
        builder.worker(f"w{i}", local_devices=offer, nccl_socket_ifname="eth0")
    return builder.build()


def spans(ranges: list[RankRange]) -> list[tuple[str, int, int]]:
    return [(r.host, r.start, r.stop) for r in ranges]


def test_capacity_per_worker_and_contiguous_ranges_in_worker_order() -> None:
    c = cluster([0, 1], "cpu:3", [2])
    assert [w.capacity for w in c.workers] == [2, 3, 1]
    assert c.capacity == 6
    assert spans(fanout_ranks(c)) == [("w0", 0, 2), ("w1", 2, 5), ("w2", 5, 6)]
    assert list(fanout_ranks(c)[1].ranks) == [2, 3, 4]


def test_all_is_resolved_by_a_probe() -> None:
    c = cluster([0], "all", "cpu:1")
    assert c.capacity is None
    with pytest.raises(CapacityUnknown) as caught:
        fanout_ranks(c)
    assert caught.value.host == "w1"
    assert spans(known_ranks(c)) == [("w0", 0, 1)]
    assert spans(fanout_ranks(c, probed={"w1": 4})) == [("w0", 0, 1), ("w1", 1, 5), ("w2", 5, 6)]


def test_walk_ins_take_ranges_in_admission_order() -> None:
    assigned: list[RankRange] = []
    for host, count in [("late-box", 2), ("first-box", 1), ("third", 4)]:
        assigned.append(next_range(assigned, host, count))
    assert spans(assigned) == [("late-box", 0, 2), ("first-box", 2, 3), ("third", 3, 7)]
    with pytest.raises(ValueError, match="host third already joined this run"):
        next_range(assigned, "third", 1)
    with pytest.raises(ValueError, match="at least one rank"):
        assign_contiguous([("empty", 0)])


@pytest.mark.parametrize(
    ("knobs", "capacity", "quorum", "target"),
    [
        ({}, 4, 4, 4),  # fan-out: close the instant every configured rank is in
        ({"min_rank_start": 2}, 4, 2, 4),  # degraded start allowed, still closes at full strength
        ({"target_ranks": 6}, 4, 4, 6),  # hold open for walk-ins beyond the roster
        ({"target_ranks": 3}, 4, 3, 3),  # quorum never above the target
        ({"min_rank_start": 6}, 4, 6, 6),  # walk-ins must make up the difference
        ({"start": "manual"}, 4, 4, None),  # only the operator forms the world
        ({"start": "hybrid"}, 4, 4, 4),
        ({"discovery": True, "min_rank_start": 2}, 0, 2, None),  # holds for join_timeout
        ({}, None, None, None),  # a worker offers `all`: known at dispatch
    ],
)
def test_window_plan_defaults(
    knobs: dict[str, object], capacity: int | None, quorum: int | None, target: int | None
) -> None:
    plan = plan_window(JoinWindow.model_validate(knobs), capacity)
    assert (plan.quorum, plan.target) == (quorum, target)
    assert (plan.join_timeout, plan.max_join_timeout) == (300, 600)


def test_ranks_read_as_people_count_them() -> None:
    assert rank_span(range(1, 3)) == "1\u20132"  # both ends, an en dash: never [1..3)
    assert rank_span(range(4, 5)) == "4"
    assert rank_span(range(0)) == "none"
    assert str(RankRange("a", 2, 3)) == "2\u20134"
    assert [rank_span(range(*r), noun=True) for r in ((0, 2), (5, 6), (0, 0))] == [
        "ranks 0\u20131",
        "rank 5",
        "no ranks",
    ]

"""One log line per key an interval: held-back lines counted and said with the next one."""

from __future__ import annotations

from flodl_agent.controller.log_limit import LogLimit, Say


def test_the_first_line_is_said_and_the_rest_of_the_interval_held_back() -> None:
    limit = LogLimit(interval=60.0)
    assert limit.admit(("10.0.0.7", "bad_key"), 0.0) == Say()
    assert [limit.admit(("10.0.0.7", "bad_key"), t) for t in (1.0, 30.0, 59.9)] == [None] * 3
    assert limit.admit(("10.0.0.8", "bad_key"), 2.0) == Say()  # another peer: its own line
    assert limit.admit(("10.0.0.7", "timeout"), 3.0) == Say()  # another reason: its own line
    said = limit.admit(("10.0.0.7", "bad_key"), 60.0)
    assert said == Say(same=3) and said.suffix(60.0) == " (3 more like it in the last 60s)"
    assert Say().suffix(60.0) == ""


def test_a_flood_from_many_peers_says_at_most_the_budget_and_the_overflow_once() -> None:
    limit = LogLimit(interval=60.0, per_interval=5)
    said = [limit.admit((f"10.0.{i // 256}.{i % 256}", "timeout"), 1.0) for i in range(1000)]
    assert sum(s is not None for s in said) == 5 and limit.held == 995
    later = limit.admit(("10.9.9.9", "timeout"), 61.0)  # a new interval: said, with the overflow
    assert later == Say(others=995) and limit.held == 0
    assert "995 other line(s) held back" in later.suffix(60.0)


def test_it_remembers_a_bounded_number_of_keys_and_loses_no_count() -> None:
    limit = LogLimit(interval=60.0, per_interval=10_000, max_keys=100)
    for i in range(100):
        limit.admit(("peer", str(i)), 0.0)
        limit.admit(("peer", str(i)), 1.0)  # one held back each
    for i in range(100, 150):
        limit.admit(("peer", str(i)), 2.0)  # pushes the 50 oldest out, their held-back lines with them
    assert len(limit._keys) == 100
    assert limit.held == 0  # each eviction's count was handed to the line that pushed it out

"""Supervision's deadlines and last words: the grace, a FailRun that fires once, the heartbeat
and stall edges, evictions within ``max_failure``, and what each verdict says."""

from __future__ import annotations

from typing import Any

import pytest

from flodl_agent.controller.supervision import (
    Cut,
    Evict,
    FailRun,
    Limits,
    Shutdown,
    Stalled,
    Supervisor,
    exit_words,
    teardown_note,
)

# Two hosts, four ranks: a has 0-1, b has 2-3; formed at t=100.
WORLD = {"a": range(0, 2), "b": range(2, 4)}


def supervisor(**limits: Any) -> Supervisor:
    return Supervisor(dict(WORLD), Limits(**limits), now=100.0)


# -- the grace -------------------------------------------------------------


def test_the_grace_is_the_next_deadline_when_it_comes_first() -> None:
    """A shutdown's grace ends the run at its instant, once; then only heartbeats remain."""
    sup = supervisor(max_failure="0", shutdown_grace=10.0, heartbeat_timeout=30.0)
    assert sup.rank_failed("rank 1 died", {1}, averaging=True, now=105.0) == Shutdown(
        "rank 1 died; 1 failed rank(s) exceed max_failure 0", saver=0
    )
    assert sup.next_deadline() == 115.0  # the grace, before the heartbeats at 130
    assert sup.tick(114.999) == []
    assert sup.tick(115.0) == [FailRun("rank 1 died; 1 failed rank(s) exceed max_failure 0")]
    assert sup.grace_until is None and sup.next_deadline() == 130.0
    assert sup.tick(116.0) == []  # the FailRun fired once


def test_a_fail_run_preempts_the_other_deadlines_of_its_tick() -> None:
    """When the grace ends, the tick says only that: cutting a host of a failed run is moot."""
    sup = supervisor(max_failure="0", shutdown_grace=60.0, heartbeat_timeout=30.0)
    sup.shutdown_with_save("round 4 stalled", averaging=True, now=100.0)
    assert sup.tick(160.0) == [FailRun("round 4 stalled")]
    assert sup.tick(160.0) == [Cut("a", 60.0), Cut("b", 60.0)]


@pytest.mark.parametrize("averaging", [False, True])
def test_without_anyone_to_save_the_run_fails_now_with_the_reason(averaging: bool) -> None:
    """Nobody averaging through the controller, or no survivor: FailRun at once, no grace."""
    sup = supervisor(max_failure="0")
    if averaging:
        for host, ranks in WORLD.items():
            for rank in ranks:
                sup.exited(host, rank, 0)
    assert sup.shutdown_with_save("round 2 stalled", averaging=averaging, now=101.0) == FailRun(
        "round 2 stalled"
    )
    assert sup.grace_until is None and sup.shutdown == ""


def test_the_saver_is_the_lowest_survivor_and_none_is_minus_one() -> None:
    """The lowest rank still running writes the checkpoint; with none left, no rank (-1)."""
    sup = supervisor()
    assert sup.saver() == 0
    sup.exited("a", 0, 0)
    sup.failed |= {1}
    assert sup.saver() == 2
    sup.exited("b", 2, 0)
    sup.exited("b", 3, 1)
    assert sup.survivors() == set() and sup.saver() == -1


# -- evictions -------------------------------------------------------------


def test_a_host_closing_within_the_budget_is_evicted_and_said_so() -> None:
    """An eviction names the loss, the count against the budget, and that training goes on."""
    sup = supervisor(max_failure="50%")
    verdict = sup.host_closed("b", averaging=True, now=120.0)
    assert verdict == Evict("host b closed its link with 2 rank(s) still running", 2, 2)
    assert isinstance(verdict, Evict) and verdict.describe() == (
        "host b closed its link with 2 rank(s) still running: evicted (2 of max_failure 2); "
        "the others train on and averaging renormalizes"
    )
    assert sup.failed == {2, 3} and sup.survivors() == {0, 1}


def test_a_host_closing_beyond_the_budget_asks_the_survivors_to_save() -> None:
    """Beyond max_failure, averaging survivors get the shutdown and the grace starts at ``now``."""
    sup = supervisor(max_failure="1", shutdown_grace=60.0, heartbeat_timeout=1e9)
    verdict = sup.host_closed("b", averaging=True, now=120.0)
    reason = "host b closed its link with 2 rank(s) still running; 2 failed rank(s) exceed max_failure 1"
    assert verdict == Shutdown(reason, saver=0)
    assert sup.shutdown == reason and sup.next_deadline() == 180.0


def test_a_host_closing_twice_or_never_known_loses_nothing_more() -> None:
    """A repeated close, or one from a host outside the world, is no verdict and no error."""
    sup = supervisor(max_failure="2")
    assert isinstance(sup.host_closed("b", averaging=True, now=120.0), Evict)
    assert sup.host_closed("ghost", averaging=True, now=121.0) is None
    sup.exited("b", 2, 0)
    sup.exited("b", 3, 0)
    assert sup.host_closed("b", averaging=True, now=122.0) is None
    assert sup.running("ghost") == set() and sup.failed == {2, 3}


def test_an_exit_is_recorded_with_its_code() -> None:
    """Each rank's exit code is kept per host, as the rank reported it."""
    sup = supervisor()
    assert sup.exited("a", 1, 3) and sup.exited("b", 2, -6)
    assert sup.exits == {"a": {1: 3}, "b": {2: -6}}
    assert sup.running("a") == {0} and sup.survivors() == {0, 3}


# -- heartbeats and stalls -------------------------------------------------


@pytest.mark.parametrize(("at", "cut"), [(129.999, False), (130.0, True), (130.001, True)])
def test_a_host_silent_for_the_heartbeat_timeout_is_cut_at_its_instant(at: float, cut: bool) -> None:
    """Silence of exactly ``heartbeat_timeout`` is enough; a frame resets the clock."""
    sup = supervisor(heartbeat_timeout=30.0)
    sup.heard("a", at)
    assert sup.tick(at) == ([Cut("b", at - 100.0)] if cut else [])
    assert ("b" in sup.silent) is cut


def test_a_cut_host_is_not_watched_and_an_unknown_host_is_not_heard() -> None:
    """The watchdog forgets a cut host; a frame from outside the world starts no watch."""
    sup = supervisor(heartbeat_timeout=30.0)
    sup.heard("ghost", 110.0)
    assert set(sup.seen) == {"a", "b"}
    sup.heard("a", 120.0)
    assert sup.tick(130.0) == [Cut("b", 30.0)]
    assert sup.next_deadline() == 150.0
    sup.left("a")
    sup.left("a")  # a second close of the same link is harmless
    assert sup.next_deadline() is None


@pytest.mark.parametrize(
    ("at", "stalled"), [(689.999, []), (690.0, [Stalled(3)]), (700.0, [Stalled(3), Stalled(7)])]
)
def test_rounds_stall_at_their_ceiling_in_round_order(at: float, stalled: list[Stalled]) -> None:
    """Every round at or past its ceiling stalls, lowest round first."""
    sup = supervisor(stall_ceiling=600.0, heartbeat_timeout=1e9)
    sup.round_opened(7, 100.0)
    sup.round_opened(3, 90.0)
    assert sup.next_deadline() == 690.0
    assert sup.tick(at) == stalled


def test_a_round_that_closes_after_it_stalled_is_forgotten_quietly() -> None:
    """A late close of a stalled (or never opened) round changes nothing."""
    sup = supervisor(stall_ceiling=10.0, heartbeat_timeout=1e9)
    sup.round_opened(1, 100.0)
    assert sup.tick(110.0) == [Stalled(1)]
    sup.round_closed(1)
    sup.round_closed(99)
    assert sup.stalls == {} and sup.next_deadline() == 100.0 + 1e9  # the heartbeats only


# -- last words ------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "words"),
    [(0, "exited with code 0"), (1, "exited with code 1"), (-1, "was killed by SIGHUP (-1)")],
)
def test_exit_words_at_the_sign_boundary(code: int, words: str) -> None:
    """Zero is an exit, not a signal; every negative code is one."""
    assert exit_words(code) == words


def test_the_teardown_race_note_in_full() -> None:
    """The note names the rank, the race, that it still fails, and where to read more."""
    assert teardown_note(3, -6, "terminate called without an active exception") == (
        "rank 3 ended like torch's gloo teardown race (SIGABRT after 'terminate called without an "
        "active exception': a gloo thread let go of a tensor while Python was shutting down); it "
        "counts as failed, as under torchrun: see docs/troubleshooting.md, a rank killed by SIGABRT "
        "as it exits"
    )

"""An eviction keeps its promise (issue 35): evicted only where nothing waits for the lost ranks,
else the run ends now with the host named; and the renormalized world the headline counts."""

from __future__ import annotations

from typing import Any

import pytest

from flodl_agent.controller.supervision import NOT_A_GROUP, Evict, FailRun, Limits, Shutdown, Supervisor

# Two hosts, four ranks: a has 0-1, b has 2-3; formed at t=100.
WORLD = {"a": range(0, 2), "b": range(2, 4)}
LOST = "rank 2 on b exited with code 3"
NEVER = (
    f"{LOST}; host b's rank 2 never started, and a world that rendezvouses through torch's store "
    "(a process group, the Trainer's formation check) cannot form without them: the run ends — "
    f"{NOT_A_GROUP}"
)
GROUP = (
    f"{LOST}; host b's rank 2 left a torch.distributed world (its ranks rendezvous through the store, "
    "not averaging through the controller), which cannot go on without them: the run ends — "
    f"{NOT_A_GROUP}"
)
LATER = (
    "host b's rank 2 had been evicted before the world averaged, and then the others rendezvoused "
    "through torch's store: a torch.distributed world cannot go on without them: the run ends — "
    f"{NOT_A_GROUP}"
)


def supervisor(rendezvous: bool = False, **limits: Any) -> Supervisor:
    return Supervisor(dict(WORLD), Limits(**limits), now=100.0, rendezvous=rendezvous)


# (averaging through the hub, the rank's command ran, the world seen to rendezvous) -> verdict
WITHIN = [
    (True, True, False, Evict(LOST, 1, 1)),  # the hub renormalizes: the CPU plane goes on
    (True, False, False, Evict(LOST, 1, 1)),  # averaging proves every live rank is past formation
    (True, True, True, Evict(LOST, 1, 1)),  # the Trainer's CPU plane: it formed through the store
    (
        False,
        False,
        False,
        FailRun(NEVER),
    ),  # never started: its keys never come; the store host's ranks wait unseen
    (False, False, True, FailRun(NEVER)),
    (False, True, True, FailRun(GROUP)),  # a process group cannot lose a rank
    (False, True, False, Evict(LOST, 1, 1)),  # nothing waits that anyone can see: evicted, unproven
]


@pytest.mark.parametrize("averaging, started, rendezvous, verdict", WITHIN)
def test_within_the_budget_a_loss_is_evicted_only_where_nothing_waits_for_it(
    averaging: bool, started: bool, rendezvous: bool, verdict: object
) -> None:
    sup = supervisor(rendezvous, max_failure="1")
    assert sup.rank_failed(LOST, {2}, averaging=averaging, now=101.0, started=started) == verdict
    assert sup.failed == {2}
    # Only an eviction nothing vouches for is kept, for the first sign that the world rendezvouses.
    assert sup.unproven == ({2} if (averaging, started, rendezvous) == (False, True, False) else set())


def test_a_rank_is_taken_to_have_started_and_a_world_not_to_rendezvous_unless_said() -> None:
    sup = Supervisor(dict(WORLD), Limits(max_failure="1"), now=100.0)
    assert sup.rendezvous is False
    assert sup.rank_failed(LOST, {2}, averaging=False, now=101.0) == Evict(LOST, 1, 1)


def test_beyond_the_budget_a_rank_that_never_started_takes_the_shutdowns_road() -> None:
    """The budget's breach decides first: ShutdownWithSave where ranks average, else FailRun."""
    sup = supervisor(max_failure="0")
    verdict = sup.rank_failed(LOST, {2}, averaging=True, now=101.0, started=False)
    assert verdict == Shutdown(f"{LOST}; 1 failed rank(s) exceed max_failure 0", saver=0)
    sup = supervisor(max_failure="0")
    verdict = sup.rank_failed(LOST, {2}, averaging=False, now=101.0, started=False)
    assert verdict == FailRun(f"{LOST}; 1 failed rank(s) exceed max_failure 0")


@pytest.mark.parametrize("averaging, shutdown, verdict", [(False, "", FailRun(LATER)), (True, "", None)])
def test_an_unproven_eviction_ends_the_run_when_a_far_rank_reaches_the_store(
    averaging: bool, shutdown: str, verdict: object
) -> None:
    sup = supervisor(max_failure="2")
    assert isinstance(sup.rank_failed(LOST, {2}, averaging=False, now=101.0), Evict)
    assert sup.rendezvoused(averaging=averaging) == verdict
    assert sup.rendezvous is True
    assert sup.rendezvoused(averaging=False) == (None if verdict else FailRun(LATER))  # said once


def test_a_shutdown_under_way_is_not_overtaken_by_the_store() -> None:
    sup = supervisor(max_failure="1", heartbeat_timeout=1e9)
    sup.rank_failed(LOST, {2}, averaging=False, now=101.0)
    sup.shutdown_with_save("round 3 stalled", averaging=True, now=102.0)
    assert sup.rendezvoused(averaging=False) is None and sup.unproven == {2}


def test_the_store_with_nothing_unproven_ends_nothing_and_later_losses_end_the_run() -> None:
    sup = supervisor(max_failure="2")
    assert sup.rendezvoused(averaging=False) is None
    assert sup.rank_failed(LOST, {2}, averaging=False, now=101.0) == FailRun(GROUP)


def test_every_unproven_host_is_named_when_the_store_shows_up() -> None:
    sup = supervisor(max_failure="3")
    sup.rank_failed("rank 3 on b exited with code 3", {3}, averaging=False, now=101.0)
    sup.rank_failed("rank 0 on a exited with code 3", {0}, averaging=False, now=102.0)
    verdict = sup.rendezvoused(averaging=False)
    assert isinstance(verdict, FailRun)
    assert verdict.reason.startswith(
        "host a's rank 0, host b's rank 3 had been evicted before the world averaged"
    )


def test_a_host_that_closes_on_a_process_group_ends_the_run() -> None:
    sup = supervisor(rendezvous=True, max_failure="2")
    verdict = sup.host_closed("b", averaging=False, now=120.0)
    assert verdict == FailRun(
        "host b closed its link with 2 rank(s) still running; host b's ranks 2\u20133 left a "
        "torch.distributed world (its ranks rendezvous through the store, not averaging through the "
        f"controller), which cannot go on without them: the run ends — {NOT_A_GROUP}"
    )


@pytest.mark.parametrize(
    "failed, world",
    [(set(), (4, 2)), ({1}, (3, 2)), ({2, 3}, (2, 1)), ({0, 2}, (2, 2)), ({0, 1, 2, 3}, (0, 0))],
)
def test_the_renormalized_world_counts_the_survivors(failed: set[int], world: tuple[int, int]) -> None:
    sup = supervisor()
    sup.failed |= failed
    assert sup.world_now() == world


@pytest.mark.parametrize(
    "ranks, words",
    [
        ({0, 1}, "host a's ranks 0\u20131"),
        ({1}, "host a's rank 1"),
        ({0, 2}, "host a's ranks 0, 2"),  # not a span: 1 is no loss
        ({2, 3}, "host a's rank 2, host b's rank 3"),
        ({3}, "host b's rank 3"),
        (set(), ""),
    ],
)
def test_lost_ranks_are_named_by_host(ranks: set[int], words: str) -> None:
    sup = Supervisor({"a": range(0, 3), "b": range(3, 4)}, Limits(), now=0.0)
    assert sup.lost(ranks) == words

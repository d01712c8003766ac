"""Supervising a formed world as tables: what happened and ``now`` in, verdicts out."""

from __future__ import annotations

from typing import Any

import pytest

from flodl_agent.controller.supervision import (
    Cut,
    Evict,
    FailRun,
    Limits,
    Regrow,
    Shutdown,
    Stalled,
    Supervisor,
    exit_words,
    failure_budget,
    parse_max_failure,
    ranks_failed,
    teardown_note,
)

RUNNING = "2 rank(s) still running"
# Two hosts, four ranks: a has 0-1, b has 2-3.
WORLD = {"a": range(0, 2), "b": range(2, 4)}


def supervisor(**limits: Any) -> Supervisor:
    return Supervisor(dict(WORLD), Limits(**limits), now=100.0)


@pytest.mark.parametrize(
    "spec, world, budget",
    [("0", 4, 0), ("2", 4, 2), ("25%", 4, 1), ("25%", 3, 0), ("100%", 8, 8), (" 50% ", 5, 2)],
)
def test_the_failure_budget_in_ranks(spec: str, world: int, budget: int) -> None:
    assert failure_budget(spec, world) == budget


@pytest.mark.parametrize("spec, normal", [(" 10% ", "10%"), ("2", "2"), ("0%", "0%"), ("100%", "100%")])
def test_a_max_failure_spelling_is_normalized(spec: str, normal: str) -> None:
    assert parse_max_failure(spec) == normal


@pytest.mark.parametrize("spec", ["x", "-1", "101%", "150%", "1.5", "2.5", ""])
def test_a_bad_max_failure_spelling_is_named(spec: str) -> None:
    with pytest.raises(ValueError, match="max_failure"):
        parse_max_failure(spec)


# (max_failure, failed rank sets in order, averaging) -> the verdict kinds in order
LOSSES = [
    ("0", [{1}], True, [Shutdown]),
    ("0", [{1}], False, [FailRun]),  # nobody averages through the controller: nobody can be asked to save
    ("1", [{1}], True, [Evict]),
    ("1", [{1}, {2}], True, [Evict, Shutdown]),
    ("50%", [{1}, {2}], True, [Evict, Evict]),
    ("50%", [{1}, {2}, {3}], True, [Evict, Evict, Shutdown]),
    ("0", [{1}, {2}], True, [Shutdown, type(None)]),  # the shutdown's grace decides what follows
]


@pytest.mark.parametrize("max_failure, losses, averaging, kinds", LOSSES)
def test_lost_ranks_are_evicted_within_the_budget_then_the_survivors_save(
    max_failure: str, losses: list[set[int]], averaging: bool, kinds: list[type]
) -> None:
    sup = supervisor(max_failure=max_failure)
    verdicts = [sup.rank_failed(f"rank {r} died", r, averaging=averaging, now=101.0) for r in losses]
    assert [type(v) for v in verdicts] == kinds


@pytest.mark.parametrize(
    "regrows, max_failure, started, kind",
    [
        (True, "1", True, Regrow),  # an elastic process group re-forms around the loss
        (False, "1", True, FailRun),  # a frozen one cannot go on without it
        (True, "0", True, FailRun),  # no budget: the loss ends the run, elastic or not
        (True, "1", False, FailRun),  # ranks that never started would fail the same way again
    ],
)
def test_a_process_group_that_loses_a_rank_re_forms_only_when_elastic_and_within_the_budget(
    regrows: bool, max_failure: str, started: bool, kind: type
) -> None:
    sup = Supervisor(
        dict(WORLD), Limits(max_failure=max_failure), now=100.0, rendezvous=True, regrows=regrows
    )
    verdict = sup.rank_failed("rank 2 died", {2}, averaging=False, now=101.0, started=started)
    assert type(verdict) is kind
    if kind is Regrow:
        assert verdict == Regrow("rank 2 died")


def test_an_elastic_world_that_averages_evicts_as_ever() -> None:
    sup = Supervisor(dict(WORLD), Limits(max_failure="1"), now=100.0, rendezvous=True, regrows=True)
    assert isinstance(sup.rank_failed("rank 2 died", {2}, averaging=True, now=101.0), Evict)


def test_the_lowest_survivor_saves_and_the_grace_ends_the_run() -> None:
    sup = supervisor(max_failure="0", shutdown_grace=60.0)
    assert sup.exited("a", 0, 0)  # rank 0 finished cleanly: it is no survivor
    verdict = sup.rank_failed("rank 1 died", {1}, averaging=True, now=110.0)
    assert verdict == Shutdown("rank 1 died; 1 failed rank(s) exceed max_failure 0", saver=2)
    assert sup.saver() == 2 and sup.survivors() == {2, 3}
    assert sup.next_deadline() == 130.0  # heartbeats (100 + 30) come before the grace (170)
    sup.heard("a", 160.0)
    sup.heard("b", 160.0)
    assert sup.tick(169.9) == []
    assert sup.tick(170.0) == [FailRun("rank 1 died; 1 failed rank(s) exceed max_failure 0")]


def test_no_survivor_means_no_save() -> None:
    sup = supervisor(max_failure="0")
    for host, ranks in WORLD.items():
        for r in ranks:
            sup.exited(host, r, 0 if r != 3 else 1)
    assert isinstance(sup.rank_failed("rank 3 died", {3}, averaging=True, now=101.0), FailRun)


def test_exits_count_only_for_the_hosts_own_ranks() -> None:
    sup = supervisor()
    assert not sup.exited("a", 2, 0)  # b's rank
    assert not sup.exited("nobody", 0, 0)
    assert sup.exits == {}
    assert sup.exited("a", 0, 0) and not sup.all_exited("a")
    assert sup.exited("a", 1, 0) and sup.all_exited("a")
    assert sup.running("a") == set() and sup.running("b") == {2, 3}


@pytest.mark.parametrize(
    "silent, exited, max_failure, expected",
    [
        (False, [], "2", Evict("host b closed its link with 2 rank(s) still running", 2, 2)),
        (
            True,
            [],
            "2",
            Evict("host b went silent (no heartbeat for 30s) with 2 rank(s) still running", 2, 2),
        ),
        (False, [2, 3], "0", None),  # it finished: nothing lost
        (False, [2], "1", Evict("host b closed its link with 1 rank(s) still running", 1, 1)),
    ],
)
def test_a_host_that_leaves_with_ranks_running_has_died(
    silent: bool, exited: list[int], max_failure: str, expected: object
) -> None:
    sup = supervisor(max_failure=max_failure)
    for r in exited:
        sup.exited("b", r, 0)
    if silent:
        sup.heard("a", 125.0)
        assert sup.tick(130.0) == [Cut("b", 30.0)]  # the watchdog cut it, so its end says why
    assert sup.host_closed("b", averaging=True, now=131.0) == expected
    assert "b" not in sup.seen  # nothing more to watch for it


def test_a_silent_host_is_cut_once_at_its_deadline() -> None:
    sup = supervisor(heartbeat_timeout=30.0)
    sup.heard("a", 120.0)
    assert sup.next_deadline() == 130.0  # b, heard at formation
    assert sup.tick(129.0) == []
    assert sup.tick(130.0) == [Cut("b", 30.0)]
    assert sup.tick(140.0) == []  # already cut: its link's end says the rest
    assert sup.next_deadline() == 150.0  # a's
    sup.left("a")
    assert sup.next_deadline() is None


def test_a_round_that_waits_past_the_ceiling_stalls_once() -> None:
    sup = supervisor(stall_ceiling=600.0, heartbeat_timeout=1e9)
    sup.round_opened(7, 100.0)
    sup.round_opened(7, 200.0)  # later pushes do not move the ceiling
    sup.round_opened(8, 150.0)
    sup.round_closed(8)
    assert sup.next_deadline() == 700.0
    assert sup.tick(699.0) == []
    assert sup.tick(700.0) == [Stalled(7)]
    assert sup.tick(800.0) == [] and sup.stalls == {}


def test_a_shutdown_clears_the_stalls_and_opens_no_new_ones() -> None:
    sup = supervisor(max_failure="0", heartbeat_timeout=1e9)
    sup.round_opened(1, 100.0)
    assert isinstance(sup.shutdown_with_save("round 0 stalled", averaging=True, now=101.0), Shutdown)
    assert sup.stalls == {}
    sup.round_opened(2, 102.0)
    assert sup.stalls == {}
    assert sup.rank_failed("rank 2 died", {2}, averaging=True, now=103.0) is None


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (3, "exited with code 3"),
        (-6, "was killed by SIGABRT (-6)"),
        (-9, "was killed by SIGKILL (-9)"),
        (-99, "was killed by signal 99 (-99)"),  # a number no signal has
    ],
)
def test_a_rank_exit_is_said_as_people_read_it(code: int, words: str) -> None:
    assert exit_words(code) == words


def test_the_failed_ranks_of_a_host_are_named_each_with_its_exit() -> None:
    assert ranks_failed("box-a", {2: 0, 3: 1}) == (
        "a rank failed on box-a: rank 3 exited with code 1; the run ended with errors"
    )
    assert ranks_failed("box-a", {5: -6, 4: 3}) == (
        "ranks failed on box-a: rank 4 exited with code 3, rank 5 was killed by SIGABRT (-6); "
        "the run ended with errors"
    )


def test_a_sigabrt_after_terminates_words_is_named_as_the_teardown_race_and_nothing_else_is() -> None:
    note = teardown_note(1, -6, "terminate called without an active exception")
    assert note is not None and note.startswith("rank 1 ended like torch's gloo teardown race")
    assert teardown_note(1, -6, "  terminate called without an active exception\r") is not None
    assert teardown_note(1, -6, "Fatal Python error: Aborted") is None  # another abort
    assert teardown_note(1, -11, "terminate called without an active exception") is None  # not SIGABRT
    assert teardown_note(1, 0, "terminate called without an active exception") is None
    assert teardown_note(1, -6, "") is None

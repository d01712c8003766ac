"""The join window at its edges: the instant of a deadline, a start armed by a host that
then leaves, the knobs it refuses, and the words every verdict and reply carries."""

from __future__ import annotations

import pytest

from flodl_agent.config.ranks import WindowPlan
from flodl_agent.controller.window import (
    Fail,
    Form,
    Keep,
    StartMode,
    StartReply,
    Window,
    WindowClosed,
    WindowConfig,
)


def window(
    quorum: int,
    target: int | None,
    start: StartMode = "auto",
    join_timeout: float = 300.0,
    max_join_timeout: float = 600.0,
) -> Window:
    return Window(WindowConfig(quorum, target, join_timeout, max_join_timeout, start), opened_at=1000.0)


# -- the knobs -------------------------------------------------------------


@pytest.mark.parametrize(
    ("quorum", "target", "join_timeout", "max_join_timeout"),
    [
        (1, 1, 300.0, 600.0),  # one rank closes it
        (1, None, 0.0, 0.0),  # no window at all: the cap is the window
        (2, 4, 0.5, 0.5),  # a sub-second window, capped where it ends
        (3, 3, 300.0, 300.0),
    ],
)
def test_workable_knobs_at_their_limits_are_accepted(
    quorum: int, target: int | None, join_timeout: float, max_join_timeout: float
) -> None:
    """Quorum and target of one rank, a zero window, and a cap equal to the window are legal."""
    config = WindowConfig(quorum, target, join_timeout, max_join_timeout, "auto")
    assert (config.quorum, config.target, config.join_timeout, config.max_join_timeout) == (
        quorum,
        target,
        join_timeout,
        max_join_timeout,
    )


@pytest.mark.parametrize(
    ("quorum", "target", "join_timeout", "max_join_timeout", "message"),
    [
        (
            0,
            None,
            300.0,
            600.0,
            "window quorum is 0: a world needs at least one rank; set min_rank_start >= 1",
        ),
        (
            -3,
            4,
            300.0,
            600.0,
            "window quorum is -3: a world needs at least one rank; set min_rank_start >= 1",
        ),
        (1, 0, 300.0, 600.0, "window target is 0: use None to never close early"),
        (1, None, -1.0, 600.0, "join_timeout is -1.0s: it cannot be negative"),
        (1, None, -0.5, 600.0, "join_timeout is -0.5s: it cannot be negative"),
        (
            1,
            None,
            2.5,
            1.5,
            "max_join_timeout (1.5s) is below join_timeout (2.5s): "
            "the hard cap must not end the window early",
        ),
    ],
)
def test_unworkable_knobs_are_refused_by_name(
    quorum: int, target: int | None, join_timeout: float, max_join_timeout: float, message: str
) -> None:
    """Each refused knob says its value and what to set instead."""
    with pytest.raises(ValueError) as refused:
        WindowConfig(quorum, target, join_timeout, max_join_timeout, "auto")
    assert str(refused.value) == message


def test_a_plan_with_an_unknown_quorum_says_how_to_learn_it() -> None:
    """A worker offering `all` devices must be probed before the window opens."""
    with pytest.raises(ValueError) as refused:
        WindowConfig.from_plan(WindowPlan(None, None, 300, 600, "auto"))
    assert str(refused.value) == (
        "the window's quorum is not known yet: a worker offers `local_devices: all`; probe its device "
        "count (or set min_rank_start) and re-plan before opening the window"
    )


# -- the deadlines ---------------------------------------------------------


@pytest.mark.parametrize(
    ("at", "decision"),
    [
        (1299.999, Keep("waiting", 1300.0)),  # just before the window's end
        (1300.0, Keep("waiting", 1600.0)),  # exactly at it: the window is over, the cap holds
        (1300.001, Keep("waiting", 1600.0)),
        (1599.999, Keep("waiting", 1600.0)),  # just before the cap
    ],
)
def test_a_window_below_quorum_holds_until_the_cap(at: float, decision: Keep) -> None:
    """The window's end is reached at its instant; below quorum the cap is the next deadline."""
    w = window(2, 4)
    w.join("a", 1, 1000.0)
    assert w.decide(at) == decision
    assert w.next_deadline() == decision.deadline


@pytest.mark.parametrize("at", [1600.0, 1600.001])
def test_the_cap_fails_a_window_below_quorum_at_its_instant(at: float) -> None:
    """At the cap, quorum unmet: the run fails with the count, the cap and what to change."""
    w = window(2, 4)
    w.join("a", 1, 1000.0)
    assert w.decide(at) == Fail(
        "quorum not met: 1 of 2 ranks joined before the hard cap (max_join_timeout 600s); start more "
        "workers (`fdl join`), lower min_rank_start, or raise max_join_timeout"
    )
    assert w.next_deadline() is None and w.decide(at + 1) == Keep("failed", None)


@pytest.mark.parametrize(("at", "formed"), [(1299.999, False), (1300.0, True), (1300.001, True)])
def test_an_auto_window_at_quorum_forms_at_the_instant_it_ends(at: float, formed: bool) -> None:
    """Auto with quorum but short of target forms exactly at the window's end, not a tick before."""
    w = window(2, 4)
    w.join("a", 2, 1000.0)
    decision = w.decide(at)
    assert isinstance(decision, Form) is formed
    assert w.next_deadline() == (None if formed else 1300.0)


@pytest.mark.parametrize(("at", "phase"), [(1599.999, "staging"), (1600.0, "failed")])
def test_a_staged_manual_window_fails_at_the_cap_without_a_start(at: float, phase: str) -> None:
    """Manual never forms on its own: a staged roster waits for `fdl start` until the cap."""
    w = window(2, None, "manual")
    w.join("a", 1, 1000.0)
    w.join("b", 1, 1001.0)
    decision = w.decide(at)
    assert w.phase == phase
    if phase == "failed":
        assert decision == Fail(
            "operator start not received before the hard cap (max_join_timeout 600s); the roster of 2 ranks "
            "was staged: run `fdl start` before the cap, or raise max_join_timeout to hold longer"
        )
        assert w.failure == decision.reason
    else:
        assert decision == Keep("staging", 1600.0)


def test_no_deadline_after_the_window_closes() -> None:
    """Once formed, failed or done, no timer is needed for the window."""
    w = window(1, 1)
    assert w.next_deadline() == 1300.0  # from the opening, before any event
    assert isinstance(w.join("a", 1, 1000.0), Form)
    assert w.next_deadline() is None
    w.formed(1001.0)
    assert w.next_deadline() is None


# -- a host lost while armed or staging ------------------------------------


def test_a_host_lost_after_the_start_keeps_the_arming_while_quorum_holds() -> None:
    """Losing a host above quorum keeps the start armed: the next decide forms without it."""
    w = window(2, None, "manual")
    w.join("a", 2, 1000.0)
    w.join("b", 1, 1001.0)
    assert w.request_start(1002.0) == StartReply(
        True, 202, "start accepted: forming the world with 3 ranks on 2 hosts"
    )
    decision = w.leave("b", 1003.0)  # exactly at quorum: still armed
    assert isinstance(decision, Form) and [m.host for m in decision.members] == ["a"]


def test_a_host_lost_after_the_start_below_quorum_disarms() -> None:
    """Below quorum the start is dropped, not queued: the window stages again, unarmed."""
    w = window(2, None, "manual")
    w.join("a", 1, 1000.0)
    w.join("b", 1, 1001.0)
    assert w.request_start(1002.0).accepted and w.armed is True
    assert w.leave("b", 1003.0) == Keep("waiting", 1300.0)
    assert w.armed is False and w.joined_ranks == 1
    assert w.snapshot(1003.0)["armed"] is False


def test_a_host_lost_while_staging_unstages_an_unarmed_window() -> None:
    """A staged, unarmed window that loses quorum goes back to waiting, its deadline unchanged."""
    w = window(2, 4, "hybrid")
    w.join("a", 1, 1000.0)
    assert w.join("b", 1, 1001.0) == Keep("staging", 1300.0)
    assert w.leave("a", 1002.0) == Keep("waiting", 1300.0)
    assert w.armed is False and [m.host for m in w.members] == ["b"]


def test_a_host_lost_while_forming_fails_the_run_naming_the_frozen_world() -> None:
    """The world size is frozen at forming: a lost host fails the run with the ranks frozen."""
    w = window(3, 3)
    w.join("a", 2, 1000.0)
    assert isinstance(w.join("b", 1, 1001.0), Form)
    reason = "host b disconnected while the world was forming (3 ranks frozen); relaunch the run"
    assert w.leave("b", 1002.0) == Fail(reason)
    assert (w.phase, w.failure) == ("failed", reason)


def test_a_join_after_the_freeze_is_refused_with_the_phase() -> None:
    """The refusal of a late join names the phase and the way forward."""
    w = window(1, 1)
    w.join("a", 1, 1000.0)
    with pytest.raises(WindowClosed) as refused:
        w.join("b", 1, 1001.0)
    assert (
        str(refused.value)
        == "join window closed (phase forming): the world is frozen; join the next run instead"
    )


# -- the snapshot at the deadlines -----------------------------------------


@pytest.mark.parametrize(
    ("at", "window_left", "cap_left"),
    [
        (1299.5, 0.5, 300.5),
        (1300.0, None, 300.0),  # exactly at the window's end: nothing left of it
        (1599.5, None, 0.5),
        (1600.0, None, None),  # exactly at the cap
    ],
)
def test_the_countdowns_reach_none_at_their_deadline(
    at: float, window_left: float | None, cap_left: float | None
) -> None:
    """A countdown shows time left, never a zero: at its instant it is gone."""
    w = window(2, None, "manual")
    w.join("a", 1, 1000.0)
    snap = w.snapshot(at)
    assert (snap["window_left_s"], snap["cap_left_s"]) == (window_left, cap_left)


def test_a_snapshot_without_members_leaves_out_the_roster() -> None:
    """``members=False`` returns the counters only."""
    w = window(2, None, "manual")
    w.join("a", 1, 1000.0)
    snap = w.snapshot(1000.0, members=False)
    assert "members" not in snap and snap["joined_hosts"] == 1
    assert w.snapshot(1000.0)["members"] == [{"host": "a", "ranks": 1, "joined_at": 1000.0}]

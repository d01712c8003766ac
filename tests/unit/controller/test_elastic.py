"""Elastic growth's rules (pure): who may walk into a training world, and the ceiling."""

from __future__ import annotations

import dataclasses

import pytest

from flodl_agent.controller import elastic
from flodl_agent.controller.elastic import Elastic, Room
from flodl_agent.controller.supervision import Limits, Supervisor
from flodl_agent.controller.window import Window, WindowClosed, WindowConfig

ROOM = Room(plane="cpu", ceiling=4, numbered=2, averaging=True, process_group=False, shutdown=False)
ON = Elastic(4)


@pytest.mark.parametrize(
    ("config", "room", "offered", "code"),
    [
        (ON, ROOM, 1, None),
        (ON, ROOM, 2, None),  # exactly to the ceiling
        (ON, ROOM, 3, "ceiling"),
        (None, ROOM, 1, "window_closed"),  # not elastic: the seed's frozen world
        (ON, dataclasses.replace(ROOM, shutdown=True), 1, "window_closed"),
        (ON, dataclasses.replace(ROOM, known=True), 1, "window_closed"),
        (ON, dataclasses.replace(ROOM, plane="nccl"), 1, "not_elastic"),
        (Elastic(4, ("nccl", "cpu")), dataclasses.replace(ROOM, plane="nccl"), 1, None),
        (ON, dataclasses.replace(ROOM, process_group=True, averaging=False), 1, "not_elastic"),
        (ON, dataclasses.replace(ROOM, averaging=False), 1, "not_yet"),
    ],
)
def test_who_may_walk_into_a_training_world(
    config: Elastic | None, room: Room, offered: int, code: str | None
) -> None:
    refusal = elastic.refusal(config, room, offered)
    assert (refusal.code if refusal else None) == code
    if refusal is not None:
        assert refusal.fix and not refusal.permanent  # a --persist unit stays up for later


def test_the_ceiling_refusal_says_how_much_room_is_left() -> None:
    refusal = elastic.refusal(ON, dataclasses.replace(ROOM, numbered=3), 2)
    assert refusal is not None and "3 of 4 ranks" in refusal.reason and "room for 1" in refusal.reason
    assert "max_ranks" in refusal.fix


def test_the_knob_checks_itself_and_its_planes_are_spelled_one_way() -> None:
    with pytest.raises(ValueError, match="max_ranks"):
        Elastic(0)
    with pytest.raises(ValueError, match="planes"):
        Elastic(4, ("gpu",))
    with pytest.raises(ValueError, match="planes"):
        Elastic(4, ())
    assert Elastic(4, ("nccl", "cpu", "cpu")).planes == ("cpu", "nccl")  # the digest's one form
    assert Elastic(4).ceiling(2) == 4 and Elastic(4).ceiling(6) == 6  # never below the formed world


def config() -> WindowConfig:
    return WindowConfig(quorum=2, target=2, join_timeout=10, max_join_timeout=20, start="auto")


def test_a_training_window_grows_with_ranks_after_every_numbered_one() -> None:
    window = Window(config(), 0.0)
    window.join("a", 1, 0.0)
    window.join("b", 1, 0.0)
    window.formed(1.0)
    with pytest.raises(WindowClosed):
        window.join("c", 1, 2.0)  # the seed's door stays shut: growth is its own event
    assert window.grow("c", 2, 2.0) == range(2, 4)
    assert window.joined_ranks == 4 and [m.host for m in window.members] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="already joined"):
        window.grow("c", 1, 3.0)
    with pytest.raises(ValueError, match="at least one rank"):
        window.grow("d", 0, 3.0)
    # Every member's link closing, the walk-in's too, ends the run.
    for host in ("a", "b"):
        window.leave(host, 4.0)
    assert window.phase == "training"
    window.leave("c", 5.0)
    assert window.phase == "done"


def test_only_a_training_window_grows() -> None:
    window = Window(config(), 0.0)
    with pytest.raises(WindowClosed):
        window.grow("c", 1, 0.0)


def test_the_supervisor_watches_a_walk_in_and_its_budget_counts_it() -> None:
    supervisor = Supervisor({"a": range(0, 2)}, Limits(max_failure="50%"), 0.0)
    supervisor.grow("c", range(2, 4), 5.0)
    assert supervisor.size == 4 and supervisor.seen["c"] == 5.0
    assert supervisor.exited("c", 3, 0) and not supervisor.exited("c", 1, 0)
    verdict = supervisor.host_closed("c", averaging=True, now=6.0)  # rank 2 still running
    assert verdict is not None and "evicted (1 of max_failure 2)" in verdict.describe()  # type: ignore[union-attr]

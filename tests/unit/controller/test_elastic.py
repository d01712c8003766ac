"""Elastic growth's rules (pure): who may walk into a training world, and the ceiling."""

from __future__ import annotations

import dataclasses

import pytest

from flodl_agent.config.join_window import JoinWindow
from flodl_agent.controller import elastic
from flodl_agent.controller.elastic import Elastic, Room
from flodl_agent.controller.supervision import Evict, Limits, Supervisor
from flodl_agent.controller.window import Window, WindowClosed, WindowConfig
from flodl_agent.fleet.launcher import LaunchOptions, elastic_for

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
        (ON, dataclasses.replace(ROOM, finished=True), 1, "window_closed"),
        (ON, dataclasses.replace(ROOM, numbered=4), 1, "ceiling"),
        (ON, dataclasses.replace(ROOM, numbered=4, free=(range(1, 2),)), 1, None),  # a lost host's slot
        (ON, dataclasses.replace(ROOM, numbered=4, free=(range(1, 2),)), 2, "ceiling"),
        (ON, dataclasses.replace(ROOM, plane="nccl"), 1, "not_elastic"),
        (Elastic(4, ("nccl", "cpu")), dataclasses.replace(ROOM, plane="nccl"), 1, None),
        # A process group grows by re-formation: it may take a walk-in before any round.
        (ON, dataclasses.replace(ROOM, process_group=True, averaging=False), 1, None),
        (ON, dataclasses.replace(ROOM, process_group=True, averaging=False, numbered=4), 1, "ceiling"),
        (
            ON,
            dataclasses.replace(ROOM, process_group=True, averaging=False, shutdown=True),
            1,
            "window_closed",
        ),
        (ON, dataclasses.replace(ROOM, process_group=True, ending=True), 1, "window_closed"),
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
    assert refusal is not None and "ceiling of 4 ranks (3 numbered, room for 1 more)" in refusal.reason
    assert "max_ranks" in refusal.fix
    full = elastic.refusal(ON, dataclasses.replace(ROOM, numbered=4, free=(range(1, 2),)), 2)
    assert full is not None and "room for none more, and 1 together where a lost host was" in full.reason


def test_the_knob_checks_itself_and_its_planes_are_spelled_one_way() -> None:
    with pytest.raises(ValueError, match="max_ranks"):
        Elastic(0)
    with pytest.raises(ValueError, match="planes"):
        Elastic(4, ("gpu",))
    with pytest.raises(ValueError, match="planes"):
        Elastic(4, ())
    assert Elastic(4, ("nccl", "cpu", "cpu")).planes == ("cpu", "nccl")  # the digest's one form
    assert Elastic(4).ceiling(2) == 4 and Elastic(4).ceiling(6) == 6  # never below the formed world
    with pytest.raises(ValueError, match="reform_interval is -1"):
        Elastic(4, reform_interval=-1)
    assert Elastic(4, reform_interval=0).reform_interval == 0
    with pytest.raises(ValueError, match="replace_timeout is 0: seconds, more than 0"):
        Elastic(4, replace_timeout=0)


def config() -> WindowConfig:
    return WindowConfig(quorum=2, target=2, join_timeout=10, max_join_timeout=20, start="auto")


def test_a_training_window_grows_and_counts_the_ranks_numbered() -> None:
    window = Window(config(), 0.0)
    window.join("a", 1, 0.0)
    window.join("b", 1, 0.0)
    window.formed(1.0)
    with pytest.raises(WindowClosed):
        window.join("c", 1, 2.0)  # the seed's door stays shut: growth is its own event
    window.grow("c", range(2, 4), 2.0)
    assert window.joined_ranks == 4 and [m.host for m in window.members] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="already joined"):
        window.grow("c", range(4, 5), 3.0)
    with pytest.raises(ValueError, match="at least one rank"):
        window.grow("d", range(4, 4), 3.0)
    window.leave("b", 4.0)
    window.grow("d", range(1, 2), 4.0)  # b's rank, taken by a replacement: nothing more numbered
    assert window.joined_ranks == 4
    window.grow("b", range(4, 5), 4.5)  # b walks in again, as a newcomer: last in the roster
    assert window.joined_ranks == 5 and [m.host for m in window.members] == ["a", "c", "d", "b"]
    # Every member's link closing, the walk-ins' too, ends the run.
    for host in ("a", "b", "c"):
        window.leave(host, 5.0)
    assert window.phase == "training"
    window.leave("d", 5.0)
    assert window.phase == "done"


def test_only_a_training_window_grows() -> None:
    window = Window(config(), 0.0)
    with pytest.raises(WindowClosed):
        window.grow("c", range(0, 1), 0.0)


def test_the_supervisor_watches_a_walk_in_and_its_budget_counts_it() -> None:
    supervisor = Supervisor({"a": range(0, 2)}, Limits(max_failure="50%"), 0.0)
    assert supervisor.grow("c", range(2, 4), 5.0) is None  # nobody's ranks taken
    assert supervisor.size == 4 and supervisor.seen["c"] == 5.0
    assert supervisor.exited("c", 3, 0) and not supervisor.exited("c", 1, 0)
    verdict = supervisor.host_closed("c", averaging=True, now=6.0)  # rank 2 still running
    assert isinstance(verdict, Evict) and verdict.failed == 1 and verdict.budget == 2


def test_a_lost_hosts_ranks_are_free_until_a_walk_in_takes_them_and_the_budget_heals() -> None:
    supervisor = Supervisor({"a": range(0, 1), "b": range(1, 4), "c": range(4, 5)}, Limits("3"), 0.0)
    assert supervisor.free() == ()
    assert isinstance(supervisor.host_closed("b", averaging=True, now=1.0), Evict)
    assert supervisor.free() == (range(1, 4),) and supervisor.failed == {1, 2, 3}
    supervisor.rank_failed("rank 4 died", {4}, averaging=True, now=1.5)
    assert supervisor.free() == (range(1, 4),)  # c's link is still up: its span is not free yet
    assert supervisor.grow("d", range(1, 3), 2.0) == "b"  # the head of b's span
    assert supervisor.world["b"] == range(3, 4) and supervisor.world["d"] == range(1, 3)
    assert supervisor.failed == {3, 4} and supervisor.free() == (range(3, 4),)
    assert supervisor.world_now() == (3, 2)  # a and d: c has lost its one rank
    assert supervisor.grow("e", range(3, 4), 3.0) == "b" and "b" not in supervisor.world
    assert supervisor.failed == {4} and supervisor.size == 5


def test_a_box_walking_in_again_starts_afresh() -> None:
    supervisor = Supervisor({"a": range(0, 1), "b": range(1, 2)}, Limits("1"), 0.0)
    supervisor.exited("b", 1, -9)
    supervisor.silent.add("b")
    supervisor.host_closed("b", averaging=True, now=1.0)
    assert supervisor.grow("b", range(1, 2), 2.0) is None  # its own old span: nobody else's
    assert supervisor.exits.get("b") is None and "b" not in supervisor.silent
    assert supervisor.running("b") == {1} and not supervisor.failed


def test_where_a_walk_in_goes() -> None:
    room = dataclasses.replace(ROOM, numbered=3, free=(range(1, 2), range(5, 8)))
    assert elastic.place(room, 1) == range(1, 2)  # the first lost span that holds it
    assert elastic.place(room, 2) == range(5, 7)
    assert elastic.place(dataclasses.replace(room, ceiling=8), 4) == range(3, 7)  # none holds 4
    assert elastic.place(room, 4) is None


def test_a_host_that_finished_its_part_is_not_a_newcomer() -> None:
    supervisor = Supervisor({"a": range(0, 2), "b": range(2, 3)}, Limits("1"), 0.0)
    assert not supervisor.finished("a")
    supervisor.exited("a", 0, 0)
    assert not supervisor.finished("a")  # rank 1 still runs
    supervisor.exited("a", 1, 0)
    assert supervisor.finished("a")
    supervisor.exited("b", 2, 3)
    assert not supervisor.finished("b") and not supervisor.finished("nobody")


# Every refusal as the walk-in reads it: its reason and its fix, word for word (the agent
# prints both, and the controller logs the reason).
SAID = [
    (
        None,
        ROOM,
        "join window closed (phase training): the world is frozen",
        "join the next run instead, or launch with controller.join.elastic to let walk-ins in mid-run",
    ),
    (
        ON,
        dataclasses.replace(ROOM, shutdown=True),
        "join window closed: the world is saving and stopping (ShutdownWithSave)",
        "join the next run instead",
    ),
    (
        ON,
        dataclasses.replace(ROOM, finished=True),
        "a host of this name already ran its ranks to a clean end in this run: a standing unit "
        "re-dialling after its part must not start the job again",
        "join the next run instead",
    ),
    (
        ON,
        dataclasses.replace(ROOM, process_group=True, ending=True),
        "the world's ranks have begun to end: a process group does not re-form at the end of its run",
        "join the next run instead",
    ),
    (
        ON,
        dataclasses.replace(ROOM, plane="nccl"),
        "this launch's nccl plane does not grow (elastic planes: cpu)",
        "add nccl to controller.join.elastic.planes, or join the next run",
    ),
    (
        ON,
        dataclasses.replace(ROOM, averaging=False),
        "the world has not averaged a round yet: a walk-in joins a world that averages "
        "through the controller",
        "retry in a moment (a --persist unit does)",
    ),
    (
        ON,
        dataclasses.replace(ROOM, numbered=4),
        "the world is at its elastic ceiling of 4 ranks (4 numbered, room for none more), "
        "and this box offers 1",
        "raise controller.join.elastic.max_ranks (or --elastic) for the next launch, or offer fewer devices",
    ),
]


@pytest.mark.parametrize(("config", "room", "reason", "fix"), SAID)
def test_each_refusal_says_why_and_the_fix(config: Elastic | None, room: Room, reason: str, fix: str) -> None:
    refusal = elastic.refusal(config, room, 1)
    assert refusal is not None and (refusal.reason, refusal.fix) == (reason, fix)


def test_a_ceiling_of_one_rank_is_a_ceiling_and_a_bad_plane_names_the_good_ones() -> None:
    assert Elastic(1).max_ranks == 1
    with pytest.raises(ValueError, match=r"^elastic planes must be among cpu, nccl, not \['gpu'\]$"):
        Elastic(4, ("cpu", "gpu"))
    with pytest.raises(ValueError, match=r"^elastic max_ranks is 0: a world holds at least one rank$"):
        Elastic(0)


def test_the_launch_takes_the_files_reform_interval_under_the_flags_ceiling() -> None:
    join = JoinWindow.model_validate(
        {"elastic": {"max_ranks": 4, "reform_interval": 7, "replace_timeout": 9}}
    )
    assert elastic_for(join, LaunchOptions(["x"])) == Elastic(4, ("cpu",), 7, 9)
    assert elastic_for(join, LaunchOptions(["x"], elastic=6)) == Elastic(6, ("cpu",), 7, 9)
    assert elastic_for(JoinWindow(), LaunchOptions(["x"], elastic=6)) == Elastic(6)

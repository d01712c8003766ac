"""Elastic growth: who may walk into a world that is already training (pure).

The seed's window freezes the world when it closes; that stays the default. A launch
with ``controller.join.elastic`` (or ``fdl launch --elastic N``) keeps admitting after
the freeze, with the same admission as before it (vendor, run identity, model signature,
host keys: ``admission.check``), up to a ceiling of ranks. This module holds the rules
that only growth adds; the controller asks it once per hello that arrives while training.

The ceiling is also the size of every rank's timing slots (the Trainer's), so it is fixed
for the launch: rank numbers stay below it, and the parameters every host averages keep
their count however the world grows.

A host lost within ``--max-failure`` leaves its rank numbers free: the next walk-in that
fits takes them (``place``), so a long run on spot capacity holds its size, and the
failure budget heals (it counts the ranks the world misses, not every loss it ever had).
A box that was lost may walk in again under its own name: it is a newcomer like any other
(one whose ranks all ended cleanly has done its part: a standing unit's re-dial after the
run's end must not start the job again).

Live growth is for a world that averages through the controller (the CPU plane's hub):
a newcomer takes the next round's average and is counted from the round after. A world
seen as a torch.distributed process group (its ranks rendezvous, nothing averages) is a
fixed-size group: it grows by re-formation (``reformation``), its walk-ins held until the
world restarts with them, and a lost host's span goes to a held walk-in the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from .admission import Refusal

PLANES = ("cpu", "nccl")


@dataclass(frozen=True)
class Elastic:
    """The elastic knob, resolved: the ceiling of ranks and the launch planes that grow."""

    max_ranks: int
    planes: tuple[str, ...] = ("cpu",)
    reform_interval: float = 60.0  # seconds a process-group world trains between re-formations
    replace_timeout: float = 300.0  # seconds a process group stopped after a loss waits for walk-ins

    def __post_init__(self) -> None:
        if self.max_ranks < 1:
            raise ValueError(f"elastic max_ranks is {self.max_ranks}: a world holds at least one rank")
        unknown = set(self.planes) - set(PLANES)
        if unknown or not self.planes:
            raise ValueError(f"elastic planes must be among {', '.join(PLANES)}, not {sorted(unknown)}")
        if self.reform_interval < 0:
            raise ValueError(f"elastic reform_interval is {self.reform_interval}: seconds, 0 or more")
        if self.replace_timeout <= 0:
            raise ValueError(f"elastic replace_timeout is {self.replace_timeout}: seconds, more than 0")
        # Sorted and once each: the settings' digest (a restart's "same launch?") must not
        # depend on how the planes were spelled.
        object.__setattr__(self, "planes", tuple(sorted(set(self.planes))))

    def ceiling(self, formed: int) -> int:
        """The launch's ceiling once its world formed with ``formed`` ranks (never below them)."""
        return max(self.max_ranks, formed)


@dataclass(frozen=True)
class Room:
    """What the controller knows of its training world when a walk-in arrives."""

    plane: str  # the launch's plane
    ceiling: int  # the launch's ceiling of ranks (``Elastic.ceiling``)
    numbered: int  # rank numbers handed out so far, held walk-ins' too (the next walk-in's first rank)
    averaging: bool  # the world averages through the controller (a round was seen)
    process_group: bool  # a far rank rendezvoused and nothing averages: a torch.distributed group
    shutdown: bool  # ShutdownWithSave is under way
    free: tuple[range, ...] = ()  # the rank numbers of hosts lost for good, in rank order
    finished: bool = False  # the walk-in's name already ran its ranks to a clean end in this run
    ending: bool = False  # a process group whose ranks have begun to end: it re-forms no more


def refusal(elastic: Elastic | None, room: Room, offered: int) -> Refusal | None:
    """Why a walk-in offering ``offered`` ranks may not join the training world now (None:
    it may, as ranks ``room.numbered`` on)."""
    if elastic is None:
        return Refusal(
            "window_closed",
            "join window closed (phase training): the world is frozen",
            "join the next run instead, or launch with controller.join.elastic to let walk-ins in mid-run",
        )
    if room.shutdown:
        return Refusal(
            "window_closed",
            "join window closed: the world is saving and stopping (ShutdownWithSave)",
            "join the next run instead",
        )
    if room.ending:
        return Refusal(
            "window_closed",
            "the world's ranks have begun to end: a process group does not re-form at the end of its run",
            "join the next run instead",
        )
    if room.finished:
        return Refusal(
            "window_closed",
            "a host of this name already ran its ranks to a clean end in this run: a standing "
            "unit re-dialling after its part must not start the job again",
            "join the next run instead",
        )
    if room.plane not in elastic.planes:
        return Refusal(
            "not_elastic",
            f"this launch's {room.plane} plane does not grow (elastic planes: {', '.join(elastic.planes)})",
            f"add {room.plane} to controller.join.elastic.planes, or join the next run",
        )
    if not room.averaging and not room.process_group:  # a process group grows by re-formation
        return Refusal(
            "not_yet",
            "the world has not averaged a round yet: a walk-in joins a world that averages "
            "through the controller",
            "retry in a moment (a --persist unit does)",
        )
    if place(room, offered) is None:
        left = room.ceiling - room.numbered
        freed = max((len(span) for span in room.free), default=0)  # pragma: no mutate (None reads as 0)
        room_words = f"{left} more" if left > 0 else "none more"
        if freed:
            room_words += f", and {freed} together where a lost host was"
        return Refusal(
            "ceiling",
            f"the world is at its elastic ceiling of {room.ceiling} ranks ({room.numbered} numbered, "
            f"room for {room_words}), and this box offers {offered}",
            "raise controller.join.elastic.max_ranks (or --elastic) for the next launch, "
            "or offer fewer devices",
        )
    return None


def place(room: Room, offered: int) -> range | None:
    """Where a walk-in's ``offered`` ranks go: the head of the first lost host's span that
    holds them (its replacement), else after every rank numbered so far while that stays
    below the ceiling; None: nowhere."""
    for span in room.free:
        if len(span) >= offered:
            return range(span.start, span.start + offered)
    if room.numbered + offered <= room.ceiling:
        return range(room.numbered, room.numbered + offered)
    return None

"""Elastic growth: who may walk into a world that is already training (pure).

The seed's window freezes the world when it closes; that stays the default. A launch
with ``controller.join.elastic`` (or ``fdl launch --elastic N``) keeps admitting after
the freeze, with the same admission as before it (vendor, run identity, model signature,
host keys: ``admission.check``), up to a ceiling of ranks. This module holds the rules
that only growth adds; the controller asks it once per hello that arrives while training.

The ceiling is also the size of every rank's timing slots (the Trainer's), so it is fixed
for the launch: rank numbers stay below it, and the parameters every host averages keep
their count however the world grows.

Live growth is for a world that averages through the controller (the CPU plane's hub):
a newcomer takes the next round's average and is counted from the round after. A world
seen as a torch.distributed process group (its ranks rendezvous, nothing averages) is a
fixed-size group: it grows by re-formation, which is not built yet, so such a walk-in is
refused (transiently: its ``--persist`` unit stays up for the next launch).
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

    def __post_init__(self) -> None:
        if self.max_ranks < 1:
            raise ValueError(f"elastic max_ranks is {self.max_ranks}: a world holds at least one rank")
        unknown = set(self.planes) - set(PLANES)
        if unknown or not self.planes:
            raise ValueError(f"elastic planes must be among {', '.join(PLANES)}, not {sorted(unknown)}")
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
    numbered: int  # rank numbers handed out so far (the next walk-in's first rank)
    averaging: bool  # the world averages through the controller (a round was seen)
    process_group: bool  # a far rank rendezvoused and nothing averages: a torch.distributed group
    shutdown: bool  # ShutdownWithSave is under way
    known: bool = False  # the walk-in's name already took part in this world


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
    if room.known:
        return Refusal(
            "window_closed",
            "a host of this name already took part in this run: its ranks are numbered, and taking "
            "them back (replacement) is not built yet",
            "join the next run instead, or walk in under another --host name",
        )
    if room.plane not in elastic.planes:
        return Refusal(
            "not_elastic",
            f"this launch's {room.plane} plane does not grow (elastic planes: {', '.join(elastic.planes)})",
            f"add {room.plane} to controller.join.elastic.planes, or join the next run",
        )
    if room.process_group:
        return Refusal(
            "not_elastic",
            "the world is a torch.distributed process group (its ranks rendezvous, nothing averages "
            "through the controller): it cannot take a rank live, and growth by re-formation "
            "is not built yet",
            "join the next run instead",
        )
    if not room.averaging:
        return Refusal(
            "not_yet",
            "the world has not averaged a round yet: a walk-in joins a world that averages "
            "through the controller",
            "retry in a moment (a --persist unit does)",
        )
    if room.numbered + offered > room.ceiling:
        left = max(0, room.ceiling - room.numbered)
        return Refusal(
            "ceiling",
            f"the world is at its elastic ceiling: {room.numbered} of {room.ceiling} ranks numbered, "
            f"room for {left}, and this box offers {offered}",
            "raise controller.join.elastic.max_ranks (or --elastic) for the next launch, "
            "or offer fewer devices",
        )
    return None

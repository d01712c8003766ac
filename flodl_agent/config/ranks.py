"""Rank capacity and assignment (pure).

Global ranks are contiguous per host: the first host owns ``[0, n0)``, the
next ``[n0, n0+n1)`` and so on — in worker order for a fan-out launch, in
admission order for walk-ins. One device is one rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # annotations only: the window core stays free of pydantic
    from .models import Cluster, JoinWindow


@dataclass(frozen=True)
class RankRange:
    host: str
    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count

    @property
    def ranks(self) -> range:
        return range(self.start, self.stop)

    def __str__(self) -> str:
        return rank_span(self.ranks)


def rank_span(ranks: range, noun: bool = False) -> str:
    """Ranks as people count them, both ends included: ``0\u20131``, ``3`` for one, ``none``
    for none; with ``noun``, ``ranks 0\u20131``, ``rank 3``, ``no ranks`` (for log lines)."""
    if not ranks:
        return "no ranks" if noun else "none"
    if len(ranks) == 1:
        return f"rank {ranks.start}" if noun else str(ranks.start)
    return f"{'ranks ' if noun else ''}{ranks.start}\u2013{ranks[-1]}"


class CapacityUnknown(ValueError):
    """A worker offers ``local_devices: all`` and has not been probed yet."""

    def __init__(self, host: str) -> None:
        super().__init__(
            f"worker {host} offers `local_devices: all`; its device count is known only "
            "once the box is probed"
        )
        self.host = host


def assign_contiguous(entries: Iterable[tuple[str, int]], first: int = 0) -> list[RankRange]:
    """Contiguous ranges for ``(host, count)`` pairs in the order given."""
    out: list[RankRange] = []
    nxt = first
    for host, count in entries:
        if count < 1:
            raise ValueError(f"host {host} offers {count} devices; a host carries at least one rank")
        out.append(RankRange(host, nxt, count))
        nxt += count
    return out


def world_ranges(members: Iterable[tuple[str, int]], roster: Sequence[str]) -> dict[str, range]:
    """The formed world: each ``(host, count)`` member's ranks, contiguous. Configured workers
    take theirs in worker order (the cluster file's promise); walk-ins follow in the order given
    (admission order)."""
    # Not assign_contiguous: its RankRange per host costs 5x this loop at 10,000 hosts (13 ms
    # against 2.5), on the formation's critical path; members carry at least one rank already.
    place = {host: i for i, host in enumerate(roster)}
    ordered = sorted(members, key=lambda m: place.get(m[0], len(place))) if place else members
    world: dict[str, range] = {}
    size = 0
    for host, count in ordered:
        world[host] = range(size, size + count)
        size += count
    return world


def next_range(assigned: Sequence[RankRange], host: str, count: int) -> RankRange:
    """The range the next admitted walk-in gets (admission order)."""
    if any(r.host == host for r in assigned):
        raise ValueError(f"host {host} already joined this run")
    start = assigned[-1].stop if assigned else 0
    return assign_contiguous([(host, count)], first=start)[0]


def fanout_ranks(cluster: Cluster, probed: Mapping[str, int] | None = None) -> list[RankRange]:
    """Ranges for the configured workers in worker order.

    ``probed`` supplies device counts for workers that offer ``all``.
    """
    probed = probed or {}
    entries: list[tuple[str, int]] = []
    for worker in cluster.workers:
        count = worker.capacity if worker.capacity is not None else probed.get(worker.host)
        if count is None:
            raise CapacityUnknown(worker.host)
        entries.append((worker.host, count))
    return assign_contiguous(entries)


def known_ranks(cluster: Cluster) -> list[RankRange]:
    """The ranges fixed before any probe: workers up to the first ``all``."""
    entries: list[tuple[str, int]] = []
    for worker in cluster.workers:
        if worker.capacity is None:
            break
        entries.append((worker.host, worker.capacity))
    return assign_contiguous(entries)


@dataclass(frozen=True)
class WindowPlan:
    """The window's knobs with their defaults resolved against capacity.

    ``None`` for quorum means "known at dispatch" (a worker offers ``all``);
    ``None`` for target means the window never closes early.
    """

    quorum: int | None
    target: int | None
    join_timeout: int
    max_join_timeout: int
    start: Literal["auto", "manual", "hybrid"]


def plan_window(join: JoinWindow, capacity: int | None) -> WindowPlan:
    """Fan-out defaults: quorum and target are the configured capacity, so the
    window closes the instant every configured rank is in. Under discovery
    there is no roster to close on, so the window holds for its timeout."""
    quorum = join.min_rank_start
    if quorum is None and capacity is not None:
        quorum = capacity if join.target_ranks is None else min(capacity, join.target_ranks)
    target = join.target_ranks
    if target is None and join.start != "manual" and not join.discovery and capacity is not None:
        target = max(capacity, quorum or 0)
    return WindowPlan(quorum, target, join.join_timeout, join.max_join_timeout, join.start)

"""Growth by re-formation: a process-group world restarted bigger, in the same launch (pure).

A torch.distributed process group has a fixed size: it cannot take a rank live. It grows
the way torchelastic's worlds do. The controller holds the walk-in (admitted, its ranks
provisional), asks every training host to stop its ranks (the agent sends them SIGTERM,
then the kill, as torchelastic's agent does; a torchrun-style script saves on it, or
resumes from its last checkpoint), and once every rank it asked has stopped it forms the
world again: the hosts keep their ranks, the walk-ins come after them, and every rank
starts with the same ``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_RESTART_COUNT`` one more.

A minimum interval between re-formations (``Elastic.reform_interval``, counted from the
world's last formation) keeps a flapping box from stalling the run with restarts: a walk-in
that arrives sooner is held until it is due, and every walk-in held by then joins the
same re-formation. Ranks asked to stop that have not stopped by ``deadline`` end the run.

A process group also re-forms to replace what it lost. A rank that fails takes the whole
group down (its peers' collectives fail with it), so within the failure budget the world
restarts: a host that keeps its link runs its ranks again, and a host that is gone leaves
its span to fill (``lost``). The world forms again only whole (a process group's ranks are
0..N-1, every one present): the held walk-ins fill the lost spans first, and the world,
stopped, waits for them (``wait``: ``Elastic.replace_timeout``). Failures that restart the
world in a row, each before it trained ``interval`` since it last formed, are bounded
(``failed``): a script that fails on its own would otherwise restart without end.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Reformation:
    """One launch's re-formations: who waits, who is asked to stop, when the next is due."""

    interval: float  # seconds between a formation and the next re-formation
    formed_at: float  # when the world last formed (or re-formed)
    restarts: int = 0  # re-formations begun so far: the restart count of the world they form
    held: dict[str, int] = field(default_factory=dict)  # walk-ins waiting: host -> ranks offered
    stopping: dict[str, set[int]] | None = None  # a re-formation under way: ranks yet to stop
    deadline: float | None = None  # the stop's end: past it, the run fails
    lost: dict[str, range] = field(default_factory=dict)  # hosts gone since the world formed: spans to fill
    failures: int = 0  # re-formations in a row begun by a failure (``failed``)
    filling: bool = False  # stopped, spans unfilled: ``deadline`` is the wait for walk-ins

    @property
    def waiting(self) -> int:
        """Ranks the held walk-ins offer (they are numbered after the world's)."""
        return sum(self.held.values())

    def hold(self, host: str, ranks: int) -> None:
        if ranks < 1:
            raise ValueError(f"host {host} offers no ranks; a host carries at least one rank")
        if host in self.held:
            raise ValueError(f"host {host} is already waiting for the re-formation")
        self.held[host] = ranks

    def release(self, host: str) -> bool:
        """A held walk-in's link closed: it waits no more. True when it was held."""
        return self.held.pop(host, None) is not None

    def due(self, now: float) -> float | None:
        """When the next re-formation should begin (None: nobody waits, or one is under way)."""
        if not self.held or self.stopping is not None:
            return None
        return max(now, self.formed_at + self.interval)

    def begin(self, running: dict[str, set[int]], now: float, grace: float) -> list[str]:
        """Begin a re-formation: the hosts whose ranks still run are asked to stop them (the
        list, in the world's order); the restart count it forms rises by one."""
        self.restarts += 1
        self.stopping = {host: set(ranks) for host, ranks in running.items() if ranks}
        self.deadline = now + grace
        return list(self.stopping)

    def failed(self, now: float, limit: int) -> bool:
        """A failure asks the world to restart: True when it may, at most ``limit`` times in
        a row without the world training ``interval`` between them (a longer run resets it)."""
        if now - self.formed_at >= self.interval:
            self.failures = 0
        self.failures += 1
        return self.failures <= limit

    def wait(self, now: float, timeout: float) -> bool:
        """The stop is complete and spans are unfilled: the world waits for walk-ins until
        ``timeout`` from the first time it found itself so (True then, False after)."""
        if self.filling:
            return False
        self.filling = True
        self.deadline = now + timeout
        return True

    def lose(self, host: str, span: range) -> None:
        """A host of the world is gone: its span is filled before the world forms again, and
        the ranks it was asked to stop never will."""
        self.lost[host] = span
        if self.stopping is not None:
            self.stopping.pop(host, None)

    @property
    def missing(self) -> int:
        """Ranks of the lost hosts (the failure budget counts them)."""
        return sum(len(span) for span in self.lost.values())

    def stopped(self, host: str, rank: int) -> bool:
        """A rank ended during a re-formation; True when it was one asked to stop (its exit
        is the re-formation's, never judged as a failure)."""
        stopping = self.stopping if self.stopping is not None else {}
        ranks = stopping.get(host, set())
        if rank not in ranks:
            return False
        ranks.discard(rank)
        if not ranks:
            del stopping[host]
        return True

    @property
    def complete(self) -> bool:
        """Every rank asked to stop has stopped: the world may form again."""
        return self.stopping == {}

    def late(self) -> dict[str, set[int]]:
        """The ranks that have not stopped (what the stop's deadline names)."""
        return {host: set(ranks) for host, ranks in (self.stopping or {}).items()}

    def world(self, old: dict[str, range], ceiling: int) -> tuple[dict[str, range], list[str], list[range]]:
        """The re-formed world: the old hosts with their ranks (the lost ones left out), the
        held walk-ins in arrival order into the lost spans first, then after every rank while
        they fit below ``ceiling``; the walk-ins it takes; and the ranks still unfilled. Only
        a whole world takes its walk-ins (they are held no more; one that does not fit waits
        for the next): while spans are unfilled, every walk-in stays held."""
        world, taken, unfilled = self.placed(old, ceiling)
        if not unfilled:
            for host in taken:
                del self.held[host]
        return world, taken, unfilled

    def placed(self, old: dict[str, range], ceiling: int) -> tuple[dict[str, range], list[str], list[range]]:
        """``world`` without taking anyone: where each held walk-in would go now."""
        world = {host: span for host, span in old.items() if host not in self.lost}
        holes = sorted(self.lost.values(), key=lambda span: span.start)
        numbered = max((span.stop for span in (*world.values(), *holes)), default=0)
        taken = []
        for host, count in list(self.held.items()):
            hole = next((i for i, span in enumerate(holes) if len(span) >= count), None)
            if hole is not None:
                span = holes[hole]
                world[host] = range(span.start, span.start + count)
                holes[hole] = range(span.start + count, span.stop)
            elif numbered + count <= ceiling:
                world[host] = range(numbered, numbered + count)
                numbered += count
            else:
                continue
            taken.append(host)
        world = dict(sorted(world.items(), key=lambda item: item[1].start))
        return world, taken, [span for span in holes if span]

    def formed(self, now: float) -> None:
        """The re-formed world's shares went out: the interval counts from here."""
        self.formed_at = now
        self.stopping = None
        self.deadline = None
        self.filling = False
        self.lost.clear()

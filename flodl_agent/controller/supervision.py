"""Supervising a formed world (pure): exits, the failure budget, survivors, deadlines.

The controller feeds it what happened (a rank exited, a host was heard from or
left, an averaging round opened or closed) with ``now``, and gets verdicts
back, the way ``window.Window`` works: no sockets, no timers, no asyncio. The
controller arms one timer at ``next_deadline()`` and calls ``tick(now)`` when
it fires.

Seed 000's rules: a lost rank within ``max_failure`` is evicted and the others
train on (averaging renormalizes); beyond it the survivors averaging through
the controller save a checkpoint (ShutdownWithSave: the lowest surviving rank
writes it) and the run fails after ``shutdown_grace``. An eviction is a promise
that nobody waits for the lost ranks, so it is made only where the controller
can keep it (see ``rank_failed``); elsewhere the loss ends the run at once. A
training host that sends nothing for ``heartbeat_timeout`` is cut off; an
averaging round that waits past ``stall_ceiling`` for its last host is a hung
host, and ends the run with a save.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

from ..config.ranks import rank_span


def exit_words(code: int, reason: str = "") -> str:
    """How a rank ended, as people read it: "exited with code 3", "was killed by SIGABRT (-6)";
    with the rank's own ``reason`` after a colon when it gave one."""
    if reason:
        return f"{exit_words(code)}: {reason}"
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name} ({code})"
    except ValueError:
        return f"was killed by signal {-code} ({code})"


def ranks_failed(host: str, codes: dict[int, int]) -> str:
    """The failed ranks of one host (rank -> exit code), each with how it ended."""
    failed = [f"rank {rank} {exit_words(code)}" for rank, code in sorted(codes.items()) if code != 0]
    what = "ranks" if len(failed) > 1 else "a rank"
    return f"{what} failed on {host}: {', '.join(failed)}; the run ended with errors"


# libstdc++'s last words when std::terminate runs with no exception in flight.
TERMINATE_LINE = "terminate called without an active exception"


def teardown_note(rank: int, code: int, last_line: str) -> str | None:
    """What to say of a rank killed by SIGABRT right after libstdc++'s terminate line: the
    signature of torch's gloo teardown race (docs/data-plane.md). Named, never excused: the
    exit stays a failure, since nothing outside the rank knows whether its outputs were complete."""
    if code != -signal.SIGABRT or last_line.strip() != TERMINATE_LINE:
        return None
    return (
        f"rank {rank} ended like torch's gloo teardown race (SIGABRT after {TERMINATE_LINE!r}: a gloo "
        "thread let go of a tensor while Python was shutting down); it counts as failed, as under "
        "torchrun: see docs/troubleshooting.md, a rank killed by SIGABRT as it exits"
    )


def failure_budget(spec: str, world_size: int) -> int:
    """``max_failure`` as a rank count: ``"2"``, or ``"25%"`` of the world (rounded down)."""
    text = spec.strip()
    if text.endswith("%"):
        return int(world_size * float(text[:-1]) / 100)
    return int(text)


def parse_max_failure(spec: str) -> str:
    """Check a ``max_failure`` spelling; returns it normalized or raises ValueError."""
    text = spec.strip()
    try:
        value = float(text[:-1]) if text.endswith("%") else int(text)
    except ValueError:
        raise ValueError(f"max_failure is a rank count (2) or a percentage (25%), not {spec!r}") from None
    if value < 0 or (text.endswith("%") and value > 100):
        raise ValueError(f"max_failure {spec!r} is out of range")
    return text


@dataclass(frozen=True)
class Limits:
    """The supervision's knobs (cluster file and ``fdl launch`` flags)."""

    max_failure: str = "0"  # ranks that may fail mid-run: "N", or "P%" of the formed world
    shutdown_grace: float = 60.0  # seconds survivors get to save before the run is aborted
    stall_ceiling: float = 600.0  # seconds an averaging round may wait for its last host
    heartbeat_timeout: float = 30.0  # a training host silent this long is cut off (agents beat every 5 s)


# --- verdicts ---------------------------------------------------------------------


@dataclass(frozen=True)
class Evict:
    """Ranks lost within the budget: the run goes on without them."""

    reason: str
    failed: int
    budget: int

    def describe(self) -> str:
        return (
            f"{self.reason}: evicted ({self.failed} of max_failure {self.budget}); "
            "the others train on and averaging renormalizes"
        )


@dataclass(frozen=True)
class Shutdown:
    """Beyond the budget: ask the survivors for a checkpoint (``saver`` writes it), then fail."""

    reason: str
    saver: int


@dataclass(frozen=True)
class FailRun:
    """End the run now."""

    reason: str


@dataclass(frozen=True)
class Regrow:
    """Ranks lost within the budget in an elastic process group: it cannot go on without
    them, so it re-forms (``reformation``): its other ranks stop, a walk-in takes the lost
    ones, and the world restarts whole."""

    reason: str


@dataclass(frozen=True)
class Cut:
    """A host went silent: cut its link (its end then reads as a lost host)."""

    host: str
    silence: float


@dataclass(frozen=True)
class Stalled:
    """An averaging round waited past the ceiling; the caller names who it waits on."""

    round: int


Verdict = Evict | Shutdown | FailRun | Regrow | Cut | Stalled

# Why a loss that nothing shows the world survives ends the run (a torchrun world fails the same way).
NOT_A_GROUP = "max_failure lets the CPU plane's averaging go on without a host, not a process group"


@dataclass
class Supervisor:
    """One formed world: ``world`` maps each host to its ranks."""

    world: dict[str, range]
    limits: Limits
    now: float
    exits: dict[str, dict[int, int]] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)  # ranks lost mid-run (evicted within max_failure)
    shutdown: str = ""  # ShutdownWithSave in progress: why
    seen: dict[str, float] = field(default_factory=dict)  # when each host's last frame arrived
    silent: set[str] = field(default_factory=set)  # cut by the watchdog: its end says why
    stalls: dict[int, float] = field(default_factory=dict)  # open averaging rounds: their ceiling
    grace_until: float | None = None
    # The world rendezvouses through torch's store: a far rank's store connection was routed,
    # or the plane's collectives (nccl) need a process group. Its ranks wait for everyone's keys.
    rendezvous: bool = False
    unproven: set[int] = field(default_factory=set)  # evicted while nothing showed the world survives it
    # An elastic launch whose plane grows: a process group that loses ranks within the budget
    # re-forms around a walk-in rather than end (``Regrow``).
    regrows: bool = False

    def __post_init__(self) -> None:
        self.seen = dict.fromkeys(self.world, self.now)

    @property
    def size(self) -> int:
        return sum(len(r) for r in self.world.values())

    def world_now(self) -> tuple[int, int]:
        """The renormalized world: (ranks, hosts) less the lost ones (what the headline counts)."""
        hosts = sum(1 for ranks in self.world.values() if set(ranks) - self.failed)
        return self.size - len(self.failed), hosts

    def lost(self, ranks: set[int]) -> str:
        """Whose ranks these are, as people read them: "host b's rank 2"; one host's ranks in order."""
        parts = []
        for host, span in self.world.items():
            mine = sorted(ranks & set(span))
            if mine and mine == list(range(mine[0], mine[-1] + 1)):
                parts.append(f"host {host}'s {rank_span(range(mine[0], mine[-1] + 1), noun=True)}")
            elif mine:
                parts.append(f"host {host}'s ranks {', '.join(map(str, mine))}")
        return ", ".join(parts)

    def survivors(self) -> set[int]:
        ranks = {r for ranks in self.world.values() for r in ranks}
        done = {r for exits in self.exits.values() for r in exits}
        return ranks - done - self.failed

    # --- what happened ------------------------------------------------------

    def heard(self, host: str, now: float) -> None:
        if host in self.seen:
            self.seen[host] = now

    def free(self) -> tuple[range, ...]:
        """The spans of hosts lost for good (every rank failed, the link gone), in rank order:
        an elastic launch's walk-ins may take them."""
        lost = (r for h, r in self.world.items() if r and h not in self.seen and set(r) <= self.failed)
        return tuple(sorted(lost, key=lambda span: span.start))

    def grow(self, host: str, ranks: range, now: float) -> str | None:
        """A walk-in joined the training world (an elastic launch): its ranks are watched as
        the formed ones are, and the failure budget counts them. Ranks it takes from a lost
        host's span are that host's no more, and no longer count as failed: the budget counts
        the ranks the world misses. Returns the lost host it replaces, if any."""
        replaced = None
        for other, span in list(self.world.items()):
            if other != host and ranks.start in span:
                replaced, rest = other, range(ranks.stop, span.stop)
                if rest:
                    self.world[other] = rest
                else:
                    del self.world[other]
        taken = set(ranks)
        self.failed -= taken
        self.unproven -= taken
        self.exits.pop(host, None)  # a box walking in again starts afresh
        self.silent.discard(host)
        self.world[host] = ranks
        self.seen[host] = now
        return replaced

    def owns(self, host: str, rank: int) -> bool:
        return rank in self.world.get(host, ())

    def exited(self, host: str, rank: int, code: int) -> bool:
        """Record a rank's exit; False (and nothing recorded) when it is not that host's rank."""
        if not self.owns(host, rank):
            return False
        self.exits.setdefault(host, {})[rank] = code
        return True

    def all_exited(self, host: str) -> bool:
        return len(self.exits.get(host, {})) == len(self.world.get(host, ()))

    def finished(self, host: str) -> bool:
        """Every rank of ``host`` ended cleanly (exit 0): it has done its part of the run."""
        codes = self.exits.get(host, {})
        return self.all_exited(host) and bool(codes) and not any(codes.values())

    def running(self, host: str) -> set[int]:
        return set(self.world.get(host, ())) - set(self.exits.get(host, {}))

    def left(self, host: str) -> None:
        """A host's link closed: nothing more to watch for it."""
        self.seen.pop(host, None)

    def round_opened(self, round_no: int, now: float) -> None:
        """A round's first push starts its ceiling."""
        if not self.shutdown and round_no not in self.stalls:
            self.stalls[round_no] = now + self.limits.stall_ceiling

    def round_closed(self, round_no: int) -> None:
        self.stalls.pop(round_no, None)

    # --- decisions -----------------------------------------------------------

    def rank_failed(
        self, reason: str, ranks: set[int], *, averaging: bool, now: float, started: bool = True
    ) -> Verdict | None:
        """Ranks were lost: Evict (the run goes on), FailRun, or the shutdown's verdict; None
        when a shutdown is already under way (its grace decides). ``started``: False when the
        ranks' command never ran (they reported a shell's 127 or 126 with the reason).

        Within the budget, the eviction keeps its promise only where nothing waits for the lost
        ranks. Averaging through the controller (the hub holds a round) proves it: every live
        rank is past formation and the hub renormalizes. A world seen to rendezvous through
        torch's store is a fixed-size process group (or still forming), which cannot go on
        without a rank. Ranks that never started never wrote their keys, and the store host's
        own ranks wait on it unseen (only far ranks' connections cross the controller), so
        such a loss ends the run too, rather than leave survivors to torch's store timeout.
        An elastic launch's process group re-forms around it instead (``Regrow``).
        """
        if self.shutdown:
            return None
        self.failed |= ranks
        budget = failure_budget(self.limits.max_failure, self.size)
        if len(self.failed) > budget:
            return self.shutdown_with_save(
                f"{reason}; {len(self.failed)} failed rank(s) exceed max_failure {budget}",
                averaging=averaging,
                now=now,
            )
        if averaging:
            return Evict(reason, len(self.failed), budget)
        who = self.lost(ranks)
        if not started:
            return FailRun(
                f"{reason}; {who} never started, and a world that rendezvouses through torch's "
                f"store (a process group, the Trainer's formation check) cannot form without them: "
                f"the run ends — {NOT_A_GROUP}"
            )
        if self.rendezvous and self.regrows:
            return Regrow(reason)
        if self.rendezvous:
            return FailRun(
                f"{reason}; {who} left a torch.distributed world (its ranks rendezvous through "
                f"the store, not averaging through the controller), which cannot go on without "
                f"them: the run ends — {NOT_A_GROUP}"
            )
        # Nothing shows that anyone waits (independent ranks, say): evicted, until a far rank
        # reaches the store and shows the world rendezvouses (``rendezvoused``).
        self.unproven |= ranks
        return Evict(reason, len(self.failed), budget)

    def rendezvoused(self, *, averaging: bool) -> FailRun | None:
        """A far rank reached the store (the first stream): the world rendezvouses. An eviction
        made before anything showed the world survives it now ends the run (the survivors wait
        for keys the lost ranks never wrote), unless the world averages through the controller."""
        self.rendezvous = True
        if not self.unproven or averaging or self.shutdown:
            return None
        lost, self.unproven = self.lost(self.unproven), set()  # said once: the run ends with it
        return FailRun(
            f"{lost} had been evicted before the world averaged, and then the "
            f"others rendezvoused through torch's store: a torch.distributed world cannot go on "
            f"without them: the run ends — {NOT_A_GROUP}"
        )

    def shutdown_with_save(self, reason: str, *, averaging: bool, now: float) -> Shutdown | FailRun:
        """Too many ranks lost, or a round stalled: the survivors save, then the run fails.

        Only ranks averaging through the controller can be asked (their next round is
        answered with the shutdown and the saver's rank); otherwise the run fails now.
        """
        survivors = self.survivors()
        if not averaging or not survivors:
            return FailRun(reason)
        self.shutdown = reason
        self.stalls.clear()
        self.grace_until = now + self.limits.shutdown_grace
        return Shutdown(reason, min(survivors))

    def saver(self) -> int:
        return min(self.survivors(), default=-1)

    def host_closed(self, host: str, *, averaging: bool, now: float) -> Verdict | None:
        """A host's link closed mid-run. A host that leaves with ranks still running has died,
        not finished: Evict (then it leaves the window as usual), the shutdown's verdict, or
        None when nothing was lost."""
        self.left(host)
        running = self.running(host)
        if not running:
            return None
        why = (
            f"host {host} went silent (no heartbeat for {self.limits.heartbeat_timeout:g}s)"
            if host in self.silent
            else f"host {host} closed its link"
        )
        return self.rank_failed(
            f"{why} with {len(running)} rank(s) still running",
            running - self.failed,
            averaging=averaging,
            now=now,
        )

    def next_deadline(self) -> float | None:
        deadlines = [
            seen + self.limits.heartbeat_timeout for h, seen in self.seen.items() if h not in self.silent
        ]
        deadlines += self.stalls.values()
        if self.grace_until is not None:
            deadlines.append(self.grace_until)
        return min(deadlines, default=None)

    def tick(self, now: float) -> list[Verdict]:
        """What the deadlines say at ``now``: silent hosts to cut, stalled rounds, the grace's end."""
        verdicts: list[Verdict] = []
        if self.grace_until is not None and now >= self.grace_until:
            self.grace_until = None
            return [FailRun(self.shutdown)]
        for host, seen in self.seen.items():
            if host not in self.silent and now - seen >= self.limits.heartbeat_timeout:
                self.silent.add(host)
                verdicts.append(Cut(host, now - seen))
        for round_no, ceiling in sorted(self.stalls.items()):
            if now >= ceiling:
                del self.stalls[round_no]
                verdicts.append(Stalled(round_no))
        return verdicts

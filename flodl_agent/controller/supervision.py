"""Supervising a formed world (pure): exits, the failure budget, survivors, deadlines.

The controller feeds it what happened (a rank exited, a host was heard from or
left, an averaging round opened or closed) with ``now``, and gets verdicts
back, the way ``window.Window`` works: no sockets, no timers, no asyncio. The
controller arms one timer at ``next_deadline()`` and calls ``tick(now)`` when
it fires.

Seed 000's rules: a lost rank within ``max_failure`` is evicted and the others
train on (averaging renormalizes); beyond it the survivors averaging through
the controller save a checkpoint (ShutdownWithSave: the lowest surviving rank
writes it) and the run fails after ``shutdown_grace``. A training host that
sends nothing for ``heartbeat_timeout`` is cut off; an averaging round that
waits past ``stall_ceiling`` for its last host is a hung host, and ends the
run with a save.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field


def exit_words(code: int) -> str:
    """How a rank ended, as people read it: "exited with code 3", "was killed by SIGABRT (-6)"."""
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
class Cut:
    """A host went silent: cut its link (its end then reads as a lost host)."""

    host: str
    silence: float


@dataclass(frozen=True)
class Stalled:
    """An averaging round waited past the ceiling; the caller names who it waits on."""

    round: int


Verdict = Evict | Shutdown | FailRun | Cut | Stalled


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

    def __post_init__(self) -> None:
        self.seen = dict.fromkeys(self.world, self.now)

    @property
    def size(self) -> int:
        return sum(len(r) for r in self.world.values())

    def survivors(self) -> set[int]:
        ranks = {r for ranks in self.world.values() for r in ranks}
        done = {r for exits in self.exits.values() for r in exits}
        return ranks - done - self.failed

    # --- what happened ------------------------------------------------------

    def heard(self, host: str, now: float) -> None:
        if host in self.seen:
            self.seen[host] = now

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

    def rank_failed(self, reason: str, ranks: set[int], *, averaging: bool, now: float) -> Verdict | None:
        """Ranks were lost: Evict (the run goes on), or the shutdown's verdict; None when a
        shutdown is already under way (its grace decides)."""
        if self.shutdown:
            return None
        self.failed |= ranks
        budget = failure_budget(self.limits.max_failure, self.size)
        if len(self.failed) <= budget:
            return Evict(reason, len(self.failed), budget)
        return self.shutdown_with_save(
            f"{reason}; {len(self.failed)} failed rank(s) exceed max_failure {budget}",
            averaging=averaging,
            now=now,
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

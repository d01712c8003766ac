"""The join window as a pure state machine.

No sockets, no clocks: every method that can move the window takes ``now``
(seconds, any monotonic origin shared with ``opened_at``). The controller feeds
events in (joins, link closures, the operator's ``fdl start``, timer ticks) and
acts on the verdicts that come out.

Verdicts are edge-triggered: :class:`Form` and :class:`Fail` are returned once,
on the transition; afterwards :meth:`Window.decide` answers :class:`Keep` with
the phase the window settled in, so a repeated tick never re-fires a freeze.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..config.ranks import WindowPlan

Phase = Literal["waiting", "staging", "forming", "training", "done", "failed"]
StartMode = Literal["auto", "manual", "hybrid"]

_OPEN: frozenset[Phase] = frozenset({"waiting", "staging"})
_TERMINAL: frozenset[Phase] = frozenset({"done", "failed"})


@dataclass(frozen=True)
class WindowConfig:
    """The knobs the window runs on, every default already resolved."""

    quorum: int
    target: int | None
    join_timeout: float
    max_join_timeout: float
    start: StartMode
    discovery: bool = False

    def __post_init__(self) -> None:
        if self.quorum < 1:
            raise ValueError(
                f"window quorum is {self.quorum}: a world needs at least one rank; set min_rank_start >= 1"
            )
        if self.target is not None and self.target < 1:
            raise ValueError(f"window target is {self.target}: use None to never close early")
        if self.join_timeout < 0:
            raise ValueError(f"join_timeout is {self.join_timeout}s: it cannot be negative")
        if self.max_join_timeout < self.join_timeout:
            raise ValueError(
                f"max_join_timeout ({self.max_join_timeout:g}s) is below join_timeout "
                f"({self.join_timeout:g}s): the hard cap must not end the window early"
            )

    @classmethod
    def from_plan(cls, plan: WindowPlan, discovery: bool = False) -> WindowConfig:
        """Build from a resolved plan; the quorum must be known by now."""
        if plan.quorum is None:
            raise ValueError(
                "the window's quorum is not known yet: a worker offers `local_devices: all`; "
                "probe its device count (or set min_rank_start) and re-plan before opening the window"
            )
        return cls(
            quorum=plan.quorum,
            target=plan.target,
            join_timeout=float(plan.join_timeout),
            max_join_timeout=float(plan.max_join_timeout),
            start=plan.start,
            discovery=discovery,
        )


@dataclass(frozen=True)
class Member:
    host: str
    ranks: int
    joined_at: float


@dataclass(frozen=True)
class Keep:
    """Nothing to do until ``deadline`` (or the next event); ``None``: no timer needed."""

    phase: Phase
    deadline: float | None


@dataclass(frozen=True)
class Form:
    """Freeze the world now with exactly these members (phase is ``forming``)."""

    members: tuple[Member, ...]


@dataclass(frozen=True)
class Fail:
    """The run fails (phase is ``failed``); ``reason`` is meant for the operator."""

    reason: str


Decision = Keep | Form | Fail


@dataclass(frozen=True)
class StartReply:
    """The answer to ``fdl start``; ``status`` is what the HTTP surface sends."""

    accepted: bool
    status: int
    reason: str


class WindowClosed(Exception):
    """A join arrived after the world froze (or the run ended)."""

    def __init__(self, phase: Phase) -> None:
        super().__init__(
            f"join window closed (phase {phase}): the world is frozen; join the next run instead"
        )
        self.phase: Phase = phase


class Window:
    """One run's membership window, from opening to the terminal verdict."""

    def __init__(self, config: WindowConfig, opened_at: float) -> None:
        self._config = config
        self._window_end = opened_at + config.join_timeout
        self._cap = opened_at + config.max_join_timeout
        self._phase: Phase = "waiting"
        self._armed = False
        # host -> member, in admission order; the running rank count keeps joins O(1)
        self._members: dict[str, Member] = {}
        self._ranks = 0
        self._closed: set[str] = set()
        self._failure: str | None = None
        self._failed_in: Phase | None = None  # the phase a failed run failed in
        self._deadline: float | None = self._window_end

    @classmethod
    def resumed(cls, config: WindowConfig, members: list[tuple[str, int]], now: float) -> Window:
        """A restarted controller's window over a journaled world: already ``training``, its
        members those the journal names (hosts and their rank counts), nobody admitted anew."""
        window = cls(config, now)
        window._members = {host: Member(host, ranks, now) for host, ranks in members}
        window._ranks = sum(ranks for _, ranks in members)
        window._phase = "training"
        return window

    # -- read side -------------------------------------------------------

    @property
    def config(self) -> WindowConfig:
        return self._config

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def armed(self) -> bool:
        return self._armed

    @property
    def members(self) -> tuple[Member, ...]:
        return tuple(self._members.values())

    @property
    def joined_ranks(self) -> int:
        return self._ranks

    @property
    def failure(self) -> str | None:
        return self._failure

    def can_admit(self) -> bool:
        return self._phase in _OPEN

    def next_deadline(self) -> float | None:
        """When decide() must run next if no event arrives."""
        return self._deadline if self._phase in _OPEN else None

    # -- events ----------------------------------------------------------

    def join(self, host: str, ranks: int, now: float) -> Decision:
        """Admit a host against the phase as last decided, then re-decide.

        Pending clock transitions are applied by the decide() that follows, so a
        join racing the timer is admitted and the freeze it triggers is returned
        here rather than lost in an exception.
        """
        if self._phase not in _OPEN:
            raise WindowClosed(self._phase)
        if ranks < 1:
            raise ValueError(f"host {host} offers {ranks} ranks; a host carries at least one rank")
        if host in self._members:
            raise ValueError(f"host {host} already joined this run")
        self._members[host] = Member(host, ranks, now)
        self._ranks += ranks
        return self.decide(now)

    def leave(self, host: str, now: float) -> Decision:
        """A host's join link closed."""
        if host not in self._members:
            raise ValueError(f"host {host} is not a member of this run")
        if self._phase in _OPEN:
            # Its dial died before the freeze: its ranks simply never happened.
            self._ranks -= self._members.pop(host).ranks
            if self._armed and self.joined_ranks < self._config.quorum:
                # Arming below quorum is refused, never queued: losing quorum disarms.
                self._armed = False
            return self.decide(now)
        if self._phase == "forming":
            # The world size is frozen; a missing host would hang the rendezvous.
            return self.fail(
                f"host {host} disconnected while the world was forming "
                f"({self.joined_ranks} ranks frozen); relaunch the run",
                now,
            )
        if self._phase == "training":
            self._closed.add(host)
            if len(self._closed) == len(self._members):
                self._phase = "done"
        # Terminal phases: links draining after the verdict change nothing.
        return Keep(self._phase, None)

    def grow(self, host: str, ranks: range, now: float) -> None:
        """An elastic launch admits a walk-in into the training world with ``ranks`` (after
        every rank numbered so far, or a lost host's: ``elastic.place``); a member whose link
        closed may walk in again. ``joined_ranks`` counts the ranks numbered."""
        if self._phase != "training":
            raise WindowClosed(self._phase)
        if not ranks:
            raise ValueError(f"host {host} offers no ranks; a host carries at least one rank")
        if host in self._members and host not in self._closed:
            raise ValueError(f"host {host} already joined this run")
        self._closed.discard(host)
        self._members.pop(host, None)  # a box walking in again comes last, as any walk-in
        self._members[host] = Member(host, len(ranks), now)
        self._ranks = max(self._ranks, ranks.stop)

    def start_refusal(self) -> StartReply | None:
        """Why an operator's start would be refused now (None: it would be accepted)."""
        if self._config.start == "auto":
            return StartReply(False, 409, "auto mode: the window forms on its own; there is nothing to start")
        if self._phase not in _OPEN:
            return StartReply(False, 409, f"window already closed (phase {self._phase})")
        joined, quorum = self.joined_ranks, self._config.quorum
        if joined < quorum:
            return StartReply(False, 409, f"quorum not met: {joined} of {quorum} ranks joined")
        return None

    def request_start(self, now: float) -> StartReply:
        """The operator's ``fdl start``: arm the freeze; the next decide() forms."""
        refused = self.start_refusal()
        if refused is not None:
            return refused
        joined = self.joined_ranks
        self._armed = True
        hosts = len(self._members)
        return StartReply(
            True, 202, f"start accepted: forming the world with {joined} ranks on {hosts} hosts"
        )

    def decide(self, now: float) -> Decision:
        """The verdict at ``now``, applying any transition it implies."""
        if self._phase not in _OPEN:
            return Keep(self._phase, None)
        cfg = self._config
        joined = self.joined_ranks
        quorate = joined >= cfg.quorum
        if self._armed and quorate:
            return self._form()
        if cfg.start != "manual" and cfg.target is not None and joined >= cfg.target and quorate:
            return self._form()
        # Auto never holds for an operator, so it never shows as staging.
        self._phase = "staging" if cfg.start != "auto" and quorate else "waiting"
        if now < self._window_end:
            self._deadline = self._window_end
            return Keep(self._phase, self._deadline)
        if quorate and cfg.start != "manual":
            return self._form()
        if now < self._cap:
            self._deadline = self._cap
            return Keep(self._phase, self._deadline)
        cap = f"max_join_timeout {cfg.max_join_timeout:g}s"
        if not quorate:
            return self.fail(
                f"quorum not met: {joined} of {cfg.quorum} ranks joined before the hard cap ({cap}); "
                "start more workers (`fdl join`), lower min_rank_start, or raise max_join_timeout",
                now,
            )
        return self.fail(
            f"operator start not received before the hard cap ({cap}); the roster of {joined} ranks "
            "was staged: run `fdl start` before the cap, or raise max_join_timeout to hold longer",
            now,
        )

    def formed(self, now: float) -> None:
        """Artifacts shipped and relays dialed in: forming -> training."""
        if self._phase != "forming":
            raise RuntimeError(f"world formed reported in phase {self._phase}; only a forming window trains")
        self._phase = "training"

    def fail(self, reason: str, now: float) -> Decision:
        """Fail the run from any live phase; after a terminal verdict the first one stands."""
        if self._phase in _TERMINAL:
            return Keep(self._phase, None)
        self._failed_in = self._phase  # the page's phase line: how far the run got
        self._phase = "failed"
        self._failure = reason
        self._deadline = None  # pragma: no mutate (equivalent: next_deadline() reads it only while open)
        return Fail(reason)

    def snapshot(self, now: float, members: bool = True) -> dict[str, object]:
        """What ``fdl status`` shows: JSON-able, countdowns relative to ``now``.

        ``members=False`` leaves out the roster (O(N)) for callers that keep their own.
        """
        live = self._phase in _OPEN
        cfg = self._config
        return {
            "phase": self._phase,
            "start": cfg.start,
            "armed": self._armed,
            "quorum": cfg.quorum,
            "target": cfg.target,
            "joined_ranks": self.joined_ranks,
            "joined_hosts": len(self._members),
            "window_left_s": self._window_end - now if live and now < self._window_end else None,
            "cap_left_s": self._cap - now if live and now < self._cap else None,
            "can_start": self.start_refusal() is None and not self._armed,
            "failure": self._failure,
            "failed_in": self._failed_in,
        } | (
            {"members": [{"host": m.host, "ranks": m.ranks, "joined_at": m.joined_at} for m in self.members]}
            if members
            else {}
        )

    # -- internals -------------------------------------------------------

    def _form(self) -> Form:
        self._phase = "forming"
        self._deadline = None  # pragma: no mutate (equivalent: next_deadline() reads it only while open)
        return Form(self.members)

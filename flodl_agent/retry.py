"""Retry as a type: what a failed attempt means for the next one, and how long to wait.

An attempt ends in a :class:`Transient` failure (re-dial: a window may open, a
mount may come back) or a :class:`Permanent` one (stop: nothing a re-dial can
fix). The agent exits with the failure's ``code`` (DESIGN §11: 1 and 2), and
``--persist`` waits :meth:`Backoff.delay` between attempts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .errors import PERMANENT, TRANSIENT, Failure

BACKOFF_START = 5.0
BACKOFF_MAX = 60.0
LONG_ATTEMPT = 120.0  # an attempt this long was a real run: the next wait starts over
JITTER = 0.2  # a wait is cut by up to this share, so a fleet that lost its controller spreads out


class AgentFailure(Failure):
    """An attempt that failed: ``code`` is the exit code, transient (re-dial) or permanent (stop)."""

    code: int = TRANSIENT

    def __init__(self, message: str, fix: str = "", code: int | None = None) -> None:
        super().__init__(message, fix)
        if code is not None:
            self.code = code


class Transient(AgentFailure):
    """A re-dial can help: no window yet, the link broke, a refusal that may pass."""

    code = TRANSIENT

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message, fix)


class Permanent(AgentFailure):
    """Nothing a re-dial can fix: the systemd unit pairs exit 2 with RestartPreventExitStatus=2."""

    code = PERMANENT

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message, fix)


def failure(message: str, fix: str, code: int) -> AgentFailure:
    """A failure of the kind ``code`` names (another layer's failure carried over)."""
    return Permanent(message, fix) if code == PERMANENT else Transient(message, fix)


def next_backoff(previous: float | None, attempt_seconds: float, start: float = BACKOFF_START) -> float:
    """5 s doubling to 60 s; an attempt that ran long (a real run) resets it."""
    if previous is None or attempt_seconds >= LONG_ATTEMPT:
        return start
    return min(BACKOFF_MAX, previous * 2)


@dataclass
class Backoff:
    """The persist loop's wait: :func:`next_backoff`'s schedule, jittered.

    ``random`` returns a float in [0, 1); tests pass a fixed one so the waits are exact.
    The schedule doubles the un-jittered wait, so jitter never compounds.
    """

    random: Callable[[], float]
    start: float = BACKOFF_START
    jitter: float = JITTER
    scheduled: float | None = None  # the last un-jittered wait; None before the first

    def delay(self, attempt_seconds: float) -> float:
        self.scheduled = next_backoff(self.scheduled, attempt_seconds, self.start)
        return self.scheduled * (1.0 - self.jitter * self.random())

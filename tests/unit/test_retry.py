"""Retry as a type: transient and permanent failures, and the persist loop's jittered backoff."""

from __future__ import annotations

import pytest

from flodl_agent.errors import PERMANENT, TRANSIENT, Failure
from flodl_agent.retry import AgentFailure, Backoff, Permanent, Transient, failure, next_backoff


def test_backoff_doubles_from_5s_to_60s_and_resets_after_a_long_attempt() -> None:
    delays, delay = [], None
    for _ in range(7):
        delay = next_backoff(delay, attempt_seconds=1.0)
        delays.append(delay)
    assert delays == [5, 10, 20, 40, 60, 60, 60]
    assert next_backoff(60, attempt_seconds=121.0) == 5  # a real run happened: start over
    assert next_backoff(None, 1.0, start=0.1) == 0.1


@pytest.mark.parametrize(
    ("draw", "waits"),
    [
        (0.0, [5.0, 10.0, 20.0, 40.0, 60.0, 60.0]),  # no jitter drawn: the schedule itself
        (0.5, [4.5, 9.0, 18.0, 36.0, 54.0, 54.0]),  # cut by up to a fifth, never lengthened
        (0.999, [4.001, 8.002, 16.004, 32.008, 48.012, 48.012]),
    ],
)
def test_the_jitter_cuts_each_wait_and_never_compounds(draw: float, waits: list[float]) -> None:
    backoff = Backoff(lambda: draw)
    assert [backoff.delay(1.0) for _ in waits] == pytest.approx(waits)


def test_a_long_attempt_starts_the_jittered_schedule_over() -> None:
    draws = iter([0.0, 0.0, 0.25, 0.5])
    backoff = Backoff(lambda: next(draws), start=2.0)
    waits = [backoff.delay(1.0), backoff.delay(1.0), backoff.delay(500.0), backoff.delay(1.0)]
    assert waits == pytest.approx([2.0, 4.0, 2.0 * 0.95, 4.0 * 0.9])


@pytest.mark.parametrize(
    ("made", "kind", "code"),
    [
        (Transient("no window", "--persist re-dials"), Transient, TRANSIENT),
        (Permanent("no GPU", "--devices cpu:N"), Permanent, PERMANENT),
        (failure("refused", "fix it", PERMANENT), Permanent, PERMANENT),
        (failure("busy", "later", TRANSIENT), Transient, TRANSIENT),
        (AgentFailure("broke"), AgentFailure, TRANSIENT),  # the default: a re-dial may help
        (AgentFailure("pin", "check it", PERMANENT), AgentFailure, PERMANENT),
    ],
)
def test_failures_carry_their_exit_code(made: AgentFailure, kind: type[AgentFailure], code: int) -> None:
    assert isinstance(made, kind) and isinstance(made, Failure) and made.code == code


def test_a_failure_renders_its_cause_and_fix() -> None:
    assert Permanent("no usable GPU on this box", "offer CPU ranks").render() == (
        "no usable GPU on this box\n    fix: offer CPU ranks"
    )
    assert Transient("the controller went away").render() == "the controller went away"

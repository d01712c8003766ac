"""The launch's signal handling: which signals stay caught, and for how long."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from flodl_agent.fleet.launcher import OperatorStop


class Run:
    """What OperatorStop asks of the controller: whether it has finished, and fail()."""

    def __init__(self) -> None:
        self.finished = asyncio.Event()
        self.failed: list[str] = []

    def fail(self, reason: str) -> None:
        self.failed.append(reason)
        self.finished.set()


@pytest.fixture
def hangup_kept() -> Iterator[None]:
    before = signal.getsignal(signal.SIGHUP)
    yield
    signal.signal(signal.SIGHUP, before)


async def stop_by(sig: signal.Signals) -> tuple[OperatorStop, Run, list[str]]:
    run, said = Run(), list[str]()
    stop = OperatorStop(run, said.append)  # type: ignore[arg-type]
    stop.install()
    os.kill(os.getpid(), sig)
    await asyncio.wait_for(run.finished.wait(), 10)
    stop.release()
    return stop, run, said


def test_after_a_hangup_stop_a_later_hangup_is_ignored_to_the_exit(hangup_kept: None) -> None:
    # The shell's hangup may come after the whole stop: it must not kill the launch (exit -1).
    stop, run, said = asyncio.run(stop_by(signal.SIGHUP))
    assert run.failed == ["the operator stopped the launch (SIGHUP on the controller)"]
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    os.kill(os.getpid(), signal.SIGHUP)  # ignored, or this test process would die here
    assert stop.exit_code(1) == 129 and said[-1] == "launch stopped by the operator (SIGHUP): exit 129"


def test_a_launch_ended_by_its_verdict_gives_the_hangup_back(hangup_kept: None) -> None:
    async def verdict() -> Any:
        run = Run()
        stop = OperatorStop(run, lambda _: None)  # type: ignore[arg-type]
        stop.install()
        run.fail("done")
        stop.release()
        return stop

    stop = asyncio.run(verdict())
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    assert stop.exit_code(0) == 0

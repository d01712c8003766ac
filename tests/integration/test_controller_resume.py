"""A world outliving its controller, in one process over loopback (issue 37): the agents'
grace, a restarted controller's readoption, and what happens to a host that does not come
back or to a resume hello that meets a new window. The controller "dies" as under kill -9:
every link's transport is aborted at once (no Abort, no goodbye), then its port closes.
The SIGKILLed `fdl launch` itself: tests/e2e/test_controller_restart.py."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import replace
from pathlib import Path

from flodl_agent.agent.agent import AgentFailure
from flodl_agent.controller.controller import Controller
from flodl_agent.controller.journal import Journal
from flodl_agent.controller.journaling import Journaler
from tests.support import free_port
from tests.support.control_plane import agent, run, settings, until, walk_in

LAUNCH = "0a1b2c3d"
# A rank that trains until the test lets it go.
WAITS = [
    sys.executable,
    "-c",
    "import os, time\nwhile not os.path.exists(os.environ['GO']): time.sleep(0.02)",
]


async def killed(ctl: Controller) -> Journal:
    """The controller as kill -9 leaves it: its journal as last written, its links cut."""
    journal = Journaler(ctl, Path("unused"), print).snapshot()
    assert journal is not None
    for link in list(ctl.links.values()):
        link.writer.transport.abort()
    await ctl.close()
    return journal


# A rank that averages every step through the controller until the test lets it go.
AVERAGES = [
    sys.executable,
    "-c",
    "import os, torch\nfrom flodl_agent.train import Averager\navg, w = Averager(), torch.zeros(2)\n"
    "while not os.path.exists(os.environ['GO']): avg.average([w], 1.0)",
]


def _world(tmp_path: Path, command: list[str] = WAITS, **knobs: object) -> tuple[Controller, int]:
    port = free_port()
    base = settings(command, launch=LAUNCH, controller_grace=30.0, env={"GO": str(tmp_path / "go")})
    return Controller(replace(base, port=port, **knobs), log=print), port


def test_a_host_that_does_not_come_back_is_lost_within_the_budget(tmp_path: Path) -> None:
    async def body() -> None:
        # Its ranks average: the rounds after the grace must stop waiting for the lost host.
        first, port = _world(tmp_path, AVERAGES, max_failure="1")
        await first.start()
        logs: dict[str, list[str]] = {"a": [], "b": []}
        boxes = {h: asyncio.ensure_future(walk_in(agent(first, h), logs[h])) for h in ("a", "b")}
        await until(lambda: first.window.phase == "training" and len(first.board.ranks) == 0, 20)
        await until(lambda: all("world formed" in " ".join(logs[h]) for h in logs), 20)
        journal = await killed(first)
        boxes["b"].cancel()  # b's box went down with its controller: it never comes back
        await until(lambda: any("re-dialling to resume" in line for line in logs["a"]), 10)

        again = Controller(replace(first.settings, controller_grace=1.0), log=print, resume=journal)
        await again.start()
        assert again.port == port
        await until(lambda: "a" in again.links, 10)
        await until(lambda: again.readoption is not None and again.readoption.said, 10)  # b's grace ran out
        timeline = [e.text for e in again.view.timeline.events()]
        assert any(t.startswith("controller resumed: 1 of 2 hosts back in") for t in timeline), timeline
        assert any("host b did not come back within 1s" in t for t in timeline), timeline
        assert any("evicted (1 of max_failure 1)" in t for t in timeline), timeline
        (tmp_path / "go").write_text("")
        assert await boxes["a"] == 0
        await asyncio.wait_for(again.finished.wait(), 10)
        assert again.exit_code == 0 and again.exits == {"a": {0: 0}}
        assert any("resumed: the controller re-adopted this host after" in line for line in logs["a"])
        await again.close()

    run(body)


def test_a_resume_hello_meets_a_new_window_and_its_ranks_stop(tmp_path: Path) -> None:
    async def body() -> None:
        first, _ = _world(tmp_path, window=replace(settings().window, quorum=1, target=1))
        await first.start()
        log: list[str] = []
        box = asyncio.ensure_future(walk_in(agent(first, "a"), log))
        await until(lambda: any("world formed" in line for line in log), 20)
        await killed(first)
        fresh = Controller(replace(first.settings, launch="ffffffff"), log=print)  # no journal: a new window
        await fresh.start()
        ended = await asyncio.wait_for(box, 20)
        assert isinstance(ended, AgentFailure)
        assert (
            "did not re-adopt this host" in ended.message and f"it resumes launch {LAUNCH}" in ended.message
        )
        assert fresh.refused["no_resume"] == 1 and fresh.window.phase == "waiting"
        await fresh.close()

    run(body)


def test_without_a_grace_a_lost_controller_stops_the_ranks_at_once(tmp_path: Path) -> None:
    async def body() -> None:
        first, _ = _world(
            tmp_path, window=replace(settings().window, quorum=1, target=1), controller_grace=0.0
        )
        await first.start()
        log: list[str] = []
        box = asyncio.ensure_future(walk_in(agent(first, "a"), log))
        await until(lambda: any("world formed" in line for line in log), 20)
        await killed(first)
        ended = await asyncio.wait_for(box, 20)
        assert isinstance(ended, AgentFailure) and "the controller went away mid-run" in ended.message
        assert not any("re-dialling to resume" in line for line in log)

    run(body)

"""Operators see refusals: every refused or bad dial is counted by reason, logged once per
peer and reason a minute however hard it is repeated, and shown by `fdl status` and on the
status page's timeline. Real walk-ins over loopback against a controller with a join.token."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from flodl_agent.agent.agent import PERMANENT, AgentFailure
from flodl_agent.controller.controller import Controller
from flodl_agent.observe.status import refusal_counts, render
from flodl_agent.protocol import preamble, wire
from tests.support.control_plane import agent, run, settings, until, walk_in

TOKEN = "00112233445566778899aabbccddeeff"
FDL = Path(sys.executable).with_name("fdl")
WRONG = (
    "refused box-w: its hello does not verify under the key of host box-w (a wrong join.token, "
    "another host's key, or one from before the token changed)"
)


def test_wrong_and_missing_keys_are_logged_once_a_minute_and_every_one_counted() -> None:
    lines: list[str] = []
    now = [1000.0]  # the controller's clock, moved by hand past the log's interval

    async def scenario() -> None:
        ctl = Controller(settings(token=TOKEN, quorum=1, target=1), log=lines.append, clock=lambda: now[0])
        await ctl.start()
        wrong = replace(agent(ctl, "box-w"), key=b"\x01" * 16)
        outcomes = [await walk_in(wrong) for _ in range(5)]
        outcomes += [await walk_in(agent(ctl, "box-n")) for _ in range(2)]  # no key at all
        assert all(isinstance(o, AgentFailure) and o.code == PERMANENT for o in outcomes)
        assert "cannot verify this box's hello under the key of host box-w" in str(outcomes[0])
        await until(lambda: ctl.refused["bad_key"] == 7)
        assert not ctl.dropped  # a refusal, not junk
        said = [line for line in lines if line.startswith("refused ")]
        assert said == [
            WRONG,  # a wrong key is caught by the controller: it knows the name the hello gave
            "refused 127.0.0.1: it has no join key and this run requires one (no join.token on that box)",
        ]
        now[0] += 61  # a minute on: the next one is said again, with how many were held back
        assert isinstance(await walk_in(wrong), AgentFailure)
        await until(lambda: ctl.refused["bad_key"] == 8)
        assert lines[-1] == f"{WRONG} (4 more like it in the last 60s)"
        timeline = [e.text for e in ctl.view.timeline.events() if e.kind == "refusal"]
        assert timeline == [*said, lines[-1]]  # the status page's timeline holds the same lines
        assert ctl.view.state()["refused"] == {"bad_key": 8}
        await ctl.close()

    run(scenario)


def test_a_huge_unproven_name_under_a_wrong_key_is_cut_in_the_log() -> None:
    # A hello may be 64 KiB: its name is not proven yet, so the log quotes it cut, not whole.
    lines: list[str] = []

    async def scenario() -> None:
        ctl = Controller(settings(token=TOKEN), log=lines.append)
        await ctl.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", ctl.port)
        writer.write(preamble.Channel.JOIN.value)
        await reader.read(65536)  # the challenge; the hello below need not answer it
        name = "x" * 40_000
        writer.write(wire.Codec(bytes(16)).encode(wire.Kind.HELLO, {"host": name}))
        assert await reader.read(65536) == preamble.WRONG_KEY
        writer.close()
        await until(lambda: ctl.refused["bad_key"] == 1)
        await ctl.close()

    run(scenario)
    (line,) = [line for line in lines if line.startswith("refused ")]
    assert len(line) < 500 and "x…" in line, line[:200]


def test_a_flood_of_refused_hellos_is_counted_exactly_and_logged_once() -> None:
    lines: list[str] = []

    async def scenario() -> None:
        ctl = Controller(settings(quorum=1, target=2, join_timeout=60.0), log=lines.append)
        await ctl.start()
        # The first box-a is admitted and stays; every later box-a is refused by name.
        first = asyncio.ensure_future(walk_in(agent(ctl, "box-a")))
        await until(lambda: "box-a" in ctl.links)
        twins = await asyncio.gather(*(walk_in(agent(ctl, "box-a")) for _ in range(40)))
        assert all(isinstance(t, AgentFailure) and "already joined" in str(t) for t in twins)
        assert ctl.refused["host_joined"] == 40
        assert sum("refused box-a: host box-a already joined" in line for line in lines) == 1
        # Another host's refusal through the same address is its own line.
        assert isinstance(await walk_in(agent(ctl, "box-b", cpus=0)), AgentFailure)
        assert sum(line.startswith("refused box-b") for line in lines) == 1
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await ctl.close()

    run(scenario)


def test_fdl_status_shows_the_counts_by_reason() -> None:
    async def scenario() -> None:
        ctl = Controller(settings(token=TOKEN))
        await ctl.start()
        for _ in range(3):
            await walk_in(replace(agent(ctl, "box-w"), key=b"\x01" * 16))
        await until(lambda: ctl.refused["bad_key"] == 3)
        shown = await asyncio.to_thread(
            subprocess.run,
            [str(FDL), "status", "--addr", f"127.0.0.1:{ctl.port}"],
            capture_output=True,
            text=True,
            env={**os.environ, "NO_COLOR": "1", "COLUMNS": "200"},
            check=False,
        )
        assert shown.returncode == 0, shown.stderr
        assert "refused: bad_key 3" in shown.stdout
        await ctl.close()

    run(scenario)


def test_the_counts_render_most_first_and_nothing_when_none() -> None:
    state = {"phase": "waiting", "refused": {"run_mismatch": 1, "bad_key": 4}, "dropped": {"timeout": 9}}
    assert refusal_counts(state) == "refused: bad_key 4, run_mismatch 1 \u00b7 dropped: timeout 9"
    assert refusal_counts({"refused": {}, "dropped": {}}) == ""
    assert any("refused: bad_key 4" in str(part) for part in render(state))

"""A process-group world's re-formation as a host lives it: the request to stop and the new
world, in whatever batch they arrive; the road ending, or the controller going away, while
no ranks run here."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from flodl_agent.agent.regrowth import Regrowth
from flodl_agent.agent.uplink import Uplink
from flodl_agent.protocol.messages import HostEnvelope, Reform, WorldFormed
from flodl_agent.retry import Transient


def _world(restart: int) -> WorldFormed:
    host = HostEnvelope(host="box-a", first_rank=0, count=1)
    return WorldFormed(world_size=3, host=host, group=0, hosts=3, command=["x"], restart_count=restart)


def _uplink() -> Uplink:
    return Uplink(cast(Any, None), cast(Any, None), cast(Any, None))


async def _never() -> str:
    await asyncio.Event().wait()
    return ""


def test_a_reform_read_with_the_new_world_is_the_next_re_formations() -> None:
    async def body() -> None:
        regrowth, abort = Regrowth(), asyncio.ensure_future(_never())
        regrowth.ask(Reform(restart=1))
        assert regrowth.asked.is_set() and regrowth.restart == 1
        regrowth.acted()  # the agent stops its ranks for it
        regrowth.formed(_world(1))
        regrowth.ask(Reform(restart=2))  # the same batch as the world
        assert (await regrowth.next_world(abort, _uplink())).restart_count == 1
        assert regrowth.asked.is_set() and regrowth.restart == 2  # kept: the next pass stops at once
        abort.cancel()

    asyncio.run(body())


def test_the_controller_going_away_meanwhile_fails_the_attempt() -> None:
    async def body() -> None:
        regrowth, abort, uplink = Regrowth(), asyncio.ensure_future(_never()), _uplink()
        waiting = asyncio.ensure_future(regrowth.next_world(abort, uplink))
        await asyncio.sleep(0)  # it waits (no world yet)
        assert not waiting.done()
        uplink.lost()
        with pytest.raises(Transient, match="the controller went away while the world re-formed"):
            await waiting
        abort.cancel()

    asyncio.run(body())


def test_the_road_ending_meanwhile_fails_the_attempt_with_its_reason() -> None:
    async def body() -> None:
        async def aborted() -> str:
            return "the controller aborted the run: x"

        regrowth, abort = Regrowth(), asyncio.ensure_future(aborted())
        with pytest.raises(Transient, match=r"aborted the run: x \(while the world re-formed\)"):
            await regrowth.next_world(abort, _uplink())

    asyncio.run(body())


def test_the_uplinks_down_follows_the_break_and_the_rebind() -> None:
    uplink = _uplink()
    assert not uplink.down.is_set()
    uplink.lost()
    assert uplink.down.is_set() and not uplink.up.is_set()
    uplink.writer = cast(Any, type("W", (), {"close": lambda self: None})())
    client = type("C", (), {"send": lambda self, kind, body: []})()
    uplink.rebind(cast(Any, None), cast(Any, None), cast(Any, client), cast(Any, None))
    assert not uplink.down.is_set() and uplink.up.is_set()


def test_a_host_whose_ranks_failed_runs_them_again_on_reform_and_hangs_up_on_release() -> None:
    async def body() -> None:
        lines: list[str] = []
        for word, again in (("reform", True), ("release", False)):
            regrowth, abort, uplink = Regrowth(), asyncio.ensure_future(_never()), _uplink()
            waiting = asyncio.ensure_future(regrowth.word(abort, uplink, lines.append))
            await asyncio.sleep(0)
            assert not waiting.done()  # it keeps its link for the controller's word
            if word == "reform":
                regrowth.ask(Reform(restart=1))
            else:
                regrowth.release("")
            assert await waiting is again
            abort.cancel()
        assert lines[-1] == "released: the world goes on without this host's ranks"

    asyncio.run(body())


def test_a_reform_that_came_first_needs_no_wait() -> None:
    async def body() -> None:
        regrowth, abort = Regrowth(), asyncio.ensure_future(_never())
        regrowth.ask(Reform(restart=1))
        lines: list[str] = []
        assert await regrowth.word(abort, _uplink(), lines.append) is True and lines == []
        abort.cancel()

    asyncio.run(body())


def test_the_word_wait_ends_with_the_controller_or_the_run() -> None:
    async def body() -> None:
        regrowth, abort, uplink = Regrowth(), asyncio.ensure_future(_never()), _uplink()
        uplink.lost()  # the controller went away: the exits wait for its return instead
        assert await regrowth.word(abort, uplink, lambda _: None) is False
        abort.cancel()
        aborted = asyncio.ensure_future(asyncio.sleep(0, result="the controller aborted the run: x"))
        with pytest.raises(Transient, match="aborted the run: x"):
            await Regrowth().word(aborted, _uplink(), lambda _: None)

    asyncio.run(body())

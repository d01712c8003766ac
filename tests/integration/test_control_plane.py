"""The control plane over real sockets on loopback: controller, agents, HTTP.

Each test runs a real Controller (asyncio server on 127.0.0.1, port 0) and
real agents in one event loop; ranks are real subprocesses.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from typing import Any

import pytest

from flodl_agent.agent.agent import PERMANENT, TRANSIENT, AgentFailure, join
from flodl_agent.controller.controller import Controller
from flodl_agent.controller.settings import Settings
from flodl_agent.controller.window import WindowConfig
from flodl_agent.protocol import preamble, wire
from flodl_agent.protocol.messages import Challenge, Hello
from flodl_agent.protocol.messages import parse as parse_message
from tests.support.control_plane import OK, agent, api, run, settings, until, walk_in

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]
TOKEN = "0123456789abcdef0123456789abcdef"


# --- windows -------------------------------------------------------------------


def test_auto_window_forms_the_instant_the_target_is_in_and_runs_to_done() -> None:
    async def scenario() -> None:
        ctl = Controller(settings(quorum=3, target=3))
        await ctl.start()
        logs: list[str] = []
        results = await asyncio.gather(walk_in(agent(ctl, "a", 2), logs), walk_in(agent(ctl, "b", 1)))
        await ctl.finished.wait()
        assert results == [0, 0]
        assert ctl.exit_code == 0 and ctl.window.phase == "done"
        assert any("world formed: 3 ranks" in line for line in logs)
        await ctl.close()

    run(scenario)


def test_manual_window_holds_in_staging_until_fdl_start() -> None:
    async def scenario() -> None:
        ctl = Controller(settings(start="manual", quorum=2, target=None))
        await ctl.start()
        status, refused = await api(ctl, "POST", "/start")
        assert (status, refused["armed"]) == (409, False) and "quorum not met: 0 of 2" in refused["error"]
        a = asyncio.ensure_future(walk_in(agent(ctl, "a", 2)))
        await until(lambda: ctl.window.phase == "staging")
        # a late walk-in is still admitted during the hold
        b = asyncio.ensure_future(walk_in(agent(ctl, "b", 1)))
        await until(lambda: ctl.window.joined_ranks == 3)
        assert ctl.window.phase == "staging"
        _, state = await api(ctl, "GET", "/state.json")
        assert state["phase"] == "staging" and [h["ranks"] for h in state["hosts"]] == [[0, 2], [2, 3]]
        status, armed = await api(ctl, "POST", "/start")
        assert (status, armed["armed"]) == (202, True)
        assert await a == 0 and await b == 0
        await ctl.finished.wait()
        assert ctl.exit_code == 0
        status, closed = await api(ctl, "POST", "/start")
        assert status == 409 and closed["error"].startswith("window already closed")
        await ctl.close()

    run(scenario)


def test_hybrid_window_forms_at_expiry_with_quorum() -> None:
    async def scenario() -> None:
        ctl = Controller(settings(start="hybrid", quorum=1, target=5, join_timeout=0.5, max_join_timeout=5))
        await ctl.start()
        t0 = time.monotonic()
        assert await walk_in(agent(ctl, "a", 1)) == 0
        await ctl.finished.wait()
        assert ctl.exit_code == 0 and time.monotonic() - t0 >= 0.5
        await ctl.close()

    run(scenario)


def test_discovery_holds_for_the_window_then_forms_with_whoever_walked_in() -> None:
    async def scenario() -> None:
        ctl = Controller(
            settings(discovery=True, quorum=1, target=None, join_timeout=0.6, max_join_timeout=5)
        )
        await ctl.start()
        a = asyncio.ensure_future(walk_in(agent(ctl, "a", 1)))
        await until(lambda: ctl.window.joined_ranks == 1)
        assert ctl.window.phase == "waiting"  # quorum met, but discovery holds for join_timeout
        b = asyncio.ensure_future(walk_in(agent(ctl, "b", 2)))
        assert (await a, await b) == (0, 0)
        await ctl.finished.wait()
        assert ctl.exit_code == 0
        await ctl.close()

    run(scenario)


def test_quorum_never_met_fails_at_the_hard_cap_and_aborts_the_members() -> None:
    async def scenario() -> None:
        ctl = Controller(settings(quorum=3, target=3, join_timeout=0.2, max_join_timeout=0.5))
        await ctl.start()
        result = await walk_in(agent(ctl, "a", 1))
        await ctl.finished.wait()
        assert ctl.exit_code == 1 and "quorum not met" in (ctl.window.failure or "")
        assert isinstance(result, AgentFailure) and result.code == TRANSIENT
        assert "aborted the run: quorum not met" in result.message
        await ctl.close()

    run(scenario)


def test_start_refusals_by_name() -> None:
    async def scenario() -> None:
        ctl = Controller(settings(quorum=1, target=1))
        await ctl.start()
        status, auto = await api(ctl, "POST", "/start")
        assert status == 409 and auto["error"].startswith("auto mode")
        # off the controller host a token is required
        assert ctl.request_start("10.1.2.3", b"")[0] == 403
        await ctl.close()
        tokened = Controller(settings(start="manual", quorum=1, target=None, token=TOKEN))
        await tokened.start()
        assert tokened.request_start("10.1.2.3", b"token=bad")[0] == 403
        code, body = tokened.request_start("10.1.2.3", f"token={TOKEN}".encode())
        assert code == 409 and "quorum not met" in body["error"]
        await tokened.close()

    run(scenario)


# --- admission -----------------------------------------------------------------


def test_duplicate_host_is_refused_by_name_and_only_that_dial_fails() -> None:
    async def scenario() -> None:
        ctl = Controller(settings(start="manual", quorum=1, target=None))
        await ctl.start()
        first = asyncio.ensure_future(walk_in(agent(ctl, "box", 1)))
        await until(lambda: ctl.window.joined_ranks == 1)
        second = await walk_in(agent(ctl, "box", 1))
        assert isinstance(second, AgentFailure) and "host box already joined this run" in second.message
        assert "--host renames a walk-in" in second.fix and second.code == TRANSIENT
        assert ctl.window.phase == "staging" and ctl.window.joined_ranks == 1
        await api(ctl, "POST", "/start")
        assert await first == 0
        await ctl.close()

    run(scenario)


def test_token_run_admits_the_right_key_and_turns_a_wrong_one_away_for_good() -> None:
    async def scenario() -> None:
        ctl = Controller(settings(quorum=1, target=1, token=TOKEN))
        await ctl.start()
        assert not ctl.open
        wrong = await walk_in(agent(ctl, "intruder", 1, key=bytes(16)))
        assert isinstance(wrong, AgentFailure) and wrong.code == PERMANENT
        assert "cannot verify this box's hello under the key of host intruder" in wrong.message
        # a peer that ignores the challenge's bound flag and says hello under zeros: counted as a
        # bad key, and told so in fixed bytes before the hang-up
        reader, writer = await asyncio.open_connection("127.0.0.1", ctl.port)
        writer.write(preamble.Channel.JOIN.value)
        assert await reader.read(65536)  # the challenge
        forged = wire.Codec(bytes(16))
        writer.write(forged.encode(wire.Kind.HELLO, {"host": "x"}))
        assert await reader.read(65536) == preamble.WRONG_KEY
        assert await reader.read(65536) == b""
        writer.close()
        await until(lambda: ctl.refused["bad_key"] == 2)
        assert ctl.window.joined_ranks == 0
        assert await walk_in(agent(ctl, "real", 1, key=bytes.fromhex(TOKEN))) == 0
        await ctl.finished.wait()
        assert ctl.exit_code == 0
        await ctl.close()

    run(scenario)


async def _raw_hello(port: int, key: bytes, host: str, nonce: bytes | None = None) -> tuple[bytes, bytes]:
    """A hand-driven join holding the run key ``key``: returns the hello bytes sent (tagged with
    ``host``'s key) and whatever came back."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(preamble.Channel.JOIN.value)
    codec = wire.Codec(wire.OPEN_KEY)
    codec.feed(await reader.read(65536))
    frame = codec.next_frame()
    assert frame is not None
    challenge = parse_message(frame)
    assert isinstance(challenge, Challenge) and challenge.bound
    codec.rekey(wire.host_key(key, host))
    # a raw map, not the model: the point is to send what a hostile peer would
    hello = {
        "nonce": nonce or challenge.nonce,
        "client_nonce": wire.new_nonce(),
        "host": host,
        "devices": ["cpu:0"],
    }
    sent = codec.encode(wire.Kind.HELLO, hello)
    writer.write(sent)
    reply = await reader.read(65536)
    writer.close()
    return sent, reply


def test_a_captured_hello_cannot_be_replayed_on_another_connection() -> None:
    async def scenario() -> None:
        ctl = Controller(settings(start="manual", quorum=5, target=None, token=TOKEN))
        await ctl.start()
        key = bytes.fromhex(TOKEN)
        sent, reply = await _raw_hello(ctl.port, key, "honest")
        assert reply  # admitted: an Accept came back
        assert ctl.window.joined_ranks == 1
        # replay the exact bytes on a fresh connection: the challenge differs
        reader, writer = await asyncio.open_connection("127.0.0.1", ctl.port)
        writer.write(preamble.Channel.JOIN.value + sent)
        assert await reader.read(65536) != b""  # the challenge arrives
        assert await reader.read(65536) == b""  # then the connection is dropped without a reply
        writer.close()
        await until(lambda: ctl.dropped["replay"] == 1)
        assert ctl.window.joined_ranks == 0  # the honest link closed; the replay admitted nothing
        await ctl.close()

    run(scenario)


def test_a_tampered_frame_is_dropped() -> None:
    async def scenario() -> None:
        ctl = Controller(settings(start="manual", quorum=5, target=None, token=TOKEN))
        await ctl.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", ctl.port)
        writer.write(preamble.Channel.JOIN.value)
        codec = wire.Codec(wire.OPEN_KEY)
        codec.feed(await reader.read(65536))
        frame = codec.next_frame()
        assert frame is not None
        challenge = parse_message(frame)
        assert isinstance(challenge, Challenge)
        codec.rekey(wire.host_key(bytes.fromhex(TOKEN), "evil"))
        hello = Hello(nonce=challenge.nonce, client_nonce=wire.new_nonce(), host="evil", devices=["cpu:0"])
        data = bytearray(codec.encode(wire.Kind.HELLO, hello.model_dump()))
        data[-3] ^= 0x01
        writer.write(bytes(data))
        assert await reader.read(65536) == preamble.WRONG_KEY  # a bad tag, whatever made it bad
        assert await reader.read(65536) == b""
        writer.close()
        await until(lambda: ctl.refused["bad_key"] == 1)
        assert ctl.window.joined_ranks == 0
        await ctl.close()

    run(scenario)


def test_junk_channels_and_garbage_are_dropped_and_counted() -> None:
    async def scenario() -> None:
        ctl = Controller(settings(start="manual", quorum=5, target=None))
        await ctl.start()
        for junk in (b"xxxx", preamble.Channel.JOIN.value + b"\x00" * 64):
            reader, writer = await asyncio.open_connection("127.0.0.1", ctl.port)
            writer.write(junk)
            await reader.read(65536)
            writer.close()
        await until(lambda: ctl.dropped["channel"] == 1 and ctl.dropped["magic"] == 1)
        assert ctl.window.phase == "waiting"
        await ctl.close()

    run(scenario)


# --- failures mid-run ----------------------------------------------------------


def test_controller_lost_mid_run_agents_exit_transient_and_persist_rejoins_the_next_run() -> None:
    async def scenario() -> None:
        first = Controller(settings(SLEEP, quorum=1, target=1))
        await first.start()
        port = first.port
        logs: list[str] = []
        opts = agent(first, "a", 1)
        persistent = asyncio.ensure_future(
            join(opts, persist=True, log=logs.append, backoff_start=0.1, attempts=2)
        )
        await until(lambda: first.window.phase == "training")
        await first.close()  # the controller dies: links drop
        await until(lambda: any("went away" in line for line in logs))
        second = Controller(Settings(window=WindowConfig(1, 1, 30.0, 60.0, "auto"), command=OK, port=port))
        await second.start()
        assert await persistent == 0  # the second attempt joined the next run and finished it
        await second.finished.wait()
        assert second.exit_code == 0
        assert any("re-dialling" in line for line in logs)
        await second.close()

    run(scenario)


def test_sigusr1_cuts_the_backoff_short_so_a_nudged_agent_dials_now() -> None:
    async def scenario() -> None:
        first = Controller(settings(OK, quorum=1, target=1))
        await first.start()
        port = first.port
        logs: list[str] = []
        # a backoff far longer than the test may take: only the nudge can bring the next dial
        persistent = asyncio.ensure_future(
            join(agent(first, "a", 1), persist=True, log=logs.append, backoff_start=3600, attempts=2)
        )
        await first.finished.wait()
        await first.close()
        await until(lambda: any("re-dialling in" in line for line in logs))
        second = Controller(Settings(window=WindowConfig(1, 1, 30.0, 60.0, "auto"), command=OK, port=port))
        await second.start()
        os.kill(os.getpid(), signal.SIGUSR1)  # what run.yml's nudge sends the join unit
        assert await persistent == 0
        await second.finished.wait()
        assert second.exit_code == 0 and any("nudged" in line for line in logs)
        await second.close()

    run(scenario)


def test_agent_lost_mid_run_fails_the_run_and_aborts_the_rest() -> None:
    async def scenario() -> None:
        ctl = Controller(settings(SLEEP, quorum=2, target=2))
        await ctl.start()
        doomed = asyncio.ensure_future(walk_in(agent(ctl, "doomed", 1)))
        survivor = asyncio.ensure_future(walk_in(agent(ctl, "survivor", 1)))
        await until(lambda: ctl.window.phase == "training")
        doomed.cancel()  # the agent dies: its link closes with its rank still running
        with pytest.raises(asyncio.CancelledError):
            await doomed
        await ctl.finished.wait()
        assert ctl.exit_code == 1
        assert "host doomed closed its link with 1 rank(s) still running" in (ctl.window.failure or "")
        result = await survivor
        assert isinstance(result, AgentFailure) and "aborted the run" in result.message
        await ctl.close()

    run(scenario)


def test_a_failing_rank_fails_the_run() -> None:
    async def scenario() -> None:
        ctl = Controller(settings([sys.executable, "-c", "raise SystemExit(3)"], quorum=1, target=1))
        await ctl.start()
        assert await walk_in(agent(ctl, "a", 1)) == TRANSIENT
        await ctl.finished.wait()
        assert ctl.exit_code == 1 and "exited with code 3" in (ctl.window.failure or "")
        await ctl.close()

    run(scenario)


def test_a_rank_killed_by_a_signal_is_named_by_the_signal() -> None:
    async def scenario() -> None:
        abort = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGABRT)"]
        logs: list[str] = []
        ctl = Controller(settings(abort, quorum=1, target=1), log=logs.append)
        await ctl.start()
        assert await walk_in(agent(ctl, "a", 1), logs) == TRANSIENT
        await ctl.finished.wait()
        assert "rank 0 on a was killed by SIGABRT (-6)" in (ctl.window.failure or "")
        assert any("rank 0 on a was killed by SIGABRT (-6)" in line for line in logs)
        assert not any("teardown" in line for line in logs)  # an abort without terminate's words
        await ctl.close()

    run(scenario)


def test_a_rank_that_dies_in_std_terminate_is_named_and_still_fails_the_run() -> None:
    # libstdc++'s own terminate handler: its words, then SIGABRT, as when gloo's teardown races Python's.
    terminate = [
        sys.executable,
        "-c",
        "import ctypes; print('results written', flush=True); "
        "ctypes.CDLL('libstdc++.so.6')._ZSt9terminatev()",
    ]

    async def scenario() -> None:
        logs: list[str] = []
        ctl = Controller(settings(terminate, quorum=1, target=1))
        await ctl.start()
        assert await walk_in(agent(ctl, "a", 1), logs) == TRANSIENT
        await ctl.finished.wait()
        assert ctl.exit_code == 1 and "rank 0 on a was killed by SIGABRT (-6)" in (ctl.window.failure or "")
        (note,) = [line for line in logs if "teardown" in line]
        assert note.startswith("rank 0 ended like torch's gloo teardown race") and "counts as failed" in note
        await ctl.close()

    run(scenario)


def test_rank_environment_is_torchrun_compatible(tmp_path: Any) -> None:
    out = tmp_path / "env"
    script = (
        "import json, os, sys; keys = ['RANK','WORLD_SIZE','LOCAL_RANK','LOCAL_WORLD_SIZE','GROUP_RANK',"
        "'MASTER_ADDR','MASTER_PORT','FLODL_DEVICE']; "
        f"open(r'{out}' + os.environ['RANK'], 'w').write(json.dumps({{k: os.environ[k] for k in keys}}))"
    )

    async def scenario() -> None:
        ctl = Controller(settings([sys.executable, "-c", script], quorum=3, target=3))
        await ctl.start()
        assert await asyncio.gather(walk_in(agent(ctl, "a", 2)), walk_in(agent(ctl, "b", 1))) in ([0, 0],)
        await ctl.close()

    run(scenario)
    envs = [json.loads((tmp_path / f"env{r}").read_text()) for r in range(3)]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"}
    by_group = sorted(
        (e["GROUP_RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["FLODL_DEVICE"]) for e in envs
    )
    assert len({e["GROUP_RANK"] for e in envs}) == 2
    assert all(e["MASTER_ADDR"] == "127.0.0.1" for e in envs)
    assert sorted(b[3] for b in by_group) == ["cpu:0", "cpu:0", "cpu:1"]


def test_refusals_are_counted_by_code_and_hostile_hellos_are_dropped() -> None:
    async def scenario() -> None:
        ctl = Controller(settings(start="manual", quorum=5, target=None, token=TOKEN))
        await ctl.start()
        key = bytes.fromhex(TOKEN)
        holder = asyncio.ensure_future(walk_in(agent(ctl, "box", 1, key=key)))
        await until(lambda: ctl.window.joined_ranks == 1)
        # a second hello naming the same host: refused by name, counted under a fixed code
        _, reply = await _raw_hello(ctl.port, key, "box")
        assert reply
        await until(lambda: ctl.refused["host_joined"] == 1)
        assert list(ctl.refused) == ["host_joined"]
        # a host name carrying terminal escapes never reaches the roster or a log
        await _raw_hello(ctl.port, key, "evil\x1b[2J")
        await until(lambda: ctl.dropped["payload"] == 1)
        assert "evil" not in json.dumps(ctl.view.state())
        await ctl.close()
        assert isinstance(await holder, AgentFailure)

    run(scenario)


def test_configured_workers_take_ranks_in_worker_order_whoever_dials_first(tmp_path: Any) -> None:
    out = tmp_path / "ranks"
    out.mkdir()
    script = (
        f"import os; open(os.path.join(r'{out}', os.environ['FLODL_HOST']), 'w').write(os.environ['RANK'])"
    )

    async def scenario() -> None:
        # target_ranks above the roster's capacity: one rank of room for a walk-in
        roster = {"roster": ["first", "second"], "capacity": 2}
        s = settings([sys.executable, "-c", script], quorum=3, target=3, **roster)
        s.env = {}
        ctl = Controller(s)
        await ctl.start()
        late_first = agent(ctl, "first", 1)
        late_first.env = {"FLODL_HOST": "first"}
        second = agent(ctl, "second", 1)
        second.env = {"FLODL_HOST": "second"}
        walker = agent(ctl, "walk-in", 1)
        walker.env = {"FLODL_HOST": "walk-in"}
        b = asyncio.ensure_future(walk_in(second))
        await until(lambda: ctl.window.joined_ranks == 1)
        w = asyncio.ensure_future(walk_in(walker))
        await until(lambda: ctl.window.joined_ranks == 2)
        assert await asyncio.gather(walk_in(late_first), b, w) == [0, 0, 0]
        await ctl.close()

    run(scenario)
    assert {p.name: p.read_text() for p in out.iterdir()} == {"first": "0", "second": "1", "walk-in": "2"}

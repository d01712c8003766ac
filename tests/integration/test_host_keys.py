"""A walk-in's name is bound to its credential, over real sockets on loopback.

Each worker holds the key derived from the run's token for its own name (what
site.yml writes as join.host_key, and what a fan-out hands each agent); the
token itself proves any name. A roster window admits its roster's names, and
names outside it only into the room its target leaves beyond the roster.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from flodl_agent.agent.agent import PERMANENT, TRANSIENT, AgentFailure
from flodl_agent.controller.controller import Controller
from flodl_agent.protocol import wire
from tests.support.control_plane import agent, run, settings, until, walk_in

TOKEN = "00112233445566778899aabbccddeeff"
RUN_KEY = bytes.fromhex(TOKEN)


def own(host: str) -> bytes:
    """The key site.yml writes on ``host``'s box."""
    return wire.host_key(RUN_KEY, host)


def roster_window(**knobs: object) -> Controller:
    """Workers w1 and w2, one rank each; the window's target is theirs unless ``knobs`` say."""
    window = {"quorum": 2, "target": 2} | knobs
    return Controller(settings(token=TOKEN, roster=["w1", "w2"], capacity=2, **window))


def test_a_stolen_workers_key_takes_no_other_name_and_the_real_worker_then_walks_in() -> None:
    async def scenario() -> None:
        ctl = roster_window()
        await ctl.start()
        # worker 1's key, claiming worker 2's name: refused for good, and w2's slot stays free
        stolen = await walk_in(agent(ctl, "w2", host_key=own("w1")))
        assert isinstance(stolen, AgentFailure) and stolen.code == PERMANENT
        assert "cannot verify this box's hello under the key of host w2" in stolen.message
        assert "join.host" in stolen.fix
        await until(lambda: ctl.refused["bad_key"] == 1)  # counted and logged, never admitted
        # nor a name of its own making
        made_up = await walk_in(agent(ctl, "w3", host_key=own("w1")))
        assert isinstance(made_up, AgentFailure) and made_up.code == PERMANENT
        assert ctl.window.joined_ranks == 0 and not ctl.links and ctl.refused == {"bad_key": 2}
        assert not ctl.dropped  # a refusal the log names, not junk
        # the real w2 with its own key (and w1 with its) walk in and train
        results = await asyncio.gather(
            walk_in(agent(ctl, "w2", host_key=own("w2"))), walk_in(agent(ctl, "w1", host_key=own("w1")))
        )
        assert results == [0, 0]
        await ctl.finished.wait()
        assert ctl.exit_code == 0 and [link.hello.host for link, _ in ctl.formed] == ["w1", "w2"]
        await ctl.close()

    run(scenario)


def test_a_roster_window_refuses_a_name_in_no_roster_whatever_key_it_holds() -> None:
    async def scenario() -> None:
        ctl = roster_window()
        await ctl.start()
        # the run's own token proves the name; the roster still has no place for it
        stranger = await walk_in(agent(ctl, "stranger", key=RUN_KEY))
        assert isinstance(stranger, AgentFailure) and stranger.code == PERMANENT
        assert "host stranger is not in this run's roster" in stranger.message
        assert "target_ranks above the roster's ranks, or discovery: true" in stranger.fix
        assert ctl.refused["not_in_roster"] == 1 and ctl.window.joined_ranks == 0
        await ctl.close()

    run(scenario)


def test_walk_ins_fill_the_room_a_target_above_the_roster_leaves_and_no_more() -> None:
    async def scenario() -> None:
        ctl = roster_window(quorum=3, target=3)  # one rank beyond the roster's two
        await ctl.start()
        first = asyncio.ensure_future(walk_in(agent(ctl, "cloud-1", key=RUN_KEY)))
        await until(lambda: ctl.window.joined_ranks == 1)
        second = await walk_in(agent(ctl, "cloud-2", key=RUN_KEY))
        assert isinstance(second, AgentFailure) and second.code == TRANSIENT
        assert "walk-ins already hold 1 of the 1 ranks" in second.message
        # the roster's ranks were kept for it
        roster = [walk_in(agent(ctl, w, host_key=own(w))) for w in ("w1", "w2")]
        assert await asyncio.gather(first, *roster) == [0, 0, 0]
        assert [link.hello.host for link, _ in ctl.formed] == ["w1", "w2", "cloud-1"]
        await ctl.close()

    run(scenario)


def test_a_discovery_window_admits_any_name_the_shared_token_proves() -> None:
    async def scenario() -> None:
        ctl = Controller(settings(quorum=2, target=2, discovery=True, token=TOKEN, roster=["w1"], capacity=1))
        await ctl.start()
        # a box holding the token may claim a name of its own; a worker's key still proves its name alone
        taken = await walk_in(agent(ctl, "cloud-7", host_key=own("w1")))
        assert isinstance(taken, AgentFailure) and taken.code == PERMANENT
        results = await asyncio.gather(
            walk_in(agent(ctl, "cloud-7", key=RUN_KEY)), walk_in(agent(ctl, "w1", host_key=own("w1")))
        )
        assert results == [0, 0]
        await ctl.close()

    run(scenario)


def test_a_box_holding_a_key_refuses_a_controller_that_asks_for_none() -> None:
    async def scenario() -> None:
        ctl = Controller(settings(quorum=1, target=1))  # loopback, no token: open admission
        await ctl.start()
        assert ctl.open
        keyed = await walk_in(agent(ctl, "w1", host_key=own("w1")))
        assert isinstance(keyed, AgentFailure) and keyed.code == PERMANENT
        assert "cannot prove it is this run's controller" in keyed.message
        assert await walk_in(agent(ctl, "w1")) == 0  # open admission: the name is what the box says
        await ctl.close()

    run(scenario)


def test_fdl_join_with_a_stolen_fdl_yml_exits_2_naming_the_key(tmp_path: Path) -> None:
    """The attack as it is done: worker 1's fdl.yml, its host line edited to worker 2's name."""

    async def scenario() -> None:
        ctl = roster_window()
        await ctl.start()
        config = tmp_path / "fdl.yml"
        config.write_text(
            f"join:\n  controller: 127.0.0.1:{ctl.port}\n  host: w2\n  host_key: {own('w1').hex()}\n"
            "  devices: cpu:1\n"
        )
        env = {k: v for k, v in os.environ.items() if k != "FDL_TOKEN"} | {"NO_COLOR": "1"}
        env["PYTHONPATH"] = str(Path(__file__).parents[2])  # this checkout's code
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            "from flodl_agent.cli.main import main; raise SystemExit(main())",
            "join",
            "--config",
            str(config),
            env=env,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        text = err.decode()
        assert proc.returncode == 2, text
        assert "the controller cannot verify this box's hello under the key of host w2" in text
        assert "w2" not in ctl.links
        await ctl.close()

    run(scenario)

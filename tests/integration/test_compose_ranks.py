"""Ranks in a compose service, for real: podman, podman-compose (Debian's 1.0.3) and the lab's
node image on this machine, a real Controller on loopback, real agents.

The ranks check, from inside their containers, what a rank needs: its rank environment (and
none of the agent's own), the agent's store and CPU plane on loopback (the host's network),
the run's private directory at the same path, the agent's user. Whatever way the run ends, no
container is left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from flodl_agent.agent.agent import AgentFailure
from flodl_agent.controller.controller import Controller
from flodl_agent.errors import PERMANENT, TRANSIENT
from tests.support import compose as kit
from tests.support.control_plane import agent, run, settings, until, walk_in

SERVICE = "train"
ODD = "odd-7d1 a=b $HOME 'quoted' \"double\"\nsecond line"  # no shell or compose tool may touch it

RANK = """
import json, os, socket, sys, time
from pathlib import Path

rank = int(os.environ["RANK"])

def reach(port):
    try:
        socket.create_connection(("127.0.0.1", int(port)), timeout=5).close()
        return True
    except OSError:
        return False

plane = Path(os.environ["FLODL_AVERAGE_DIR"])
(plane / f"written-by-{rank}").write_text("x")
names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "ODD", "FLODL_TEST_LEAK", "FLODL_DEVICE")
facts = {
    "container": Path("/run/.containerenv").exists(),
    "env": {k: os.environ.get(k) for k in names},
    "key": os.environ["FLODL_AVERAGE_KEY"],
    "store": reach(os.environ["MASTER_PORT"]),
    "plane": reach(os.environ["FLODL_AVERAGE_PORT"]),
    "path": os.environ.get("PATH", ""),
    "cwd": os.getcwd(),
    "uid": os.getuid(),
    "metrics": str(Path(os.environ["FLODL_METRICS_FILE"]).parent) == str(plane),
}
# Written whole, then renamed: the test reads it as soon as it exists.
Path(f"ready-{rank}.tmp").write_text(json.dumps(facts))
os.replace(f"ready-{rank}.tmp", f"ready-{rank}.json")
while not Path("GO").exists():  # the test's cue (it never comes when the run is to be stopped)
    time.sleep(0.05)
sys.exit(3 if rank == 1 else 0)
"""


# One xdist worker runs the podman tests, one after another: one lab image build, one engine.
pytestmark = pytest.mark.xdist_group("podman")


async def ranks_ready(proj: Path, ranks: int, ended: Callable[[], object]) -> list[dict[str, Any]]:
    """What each rank saw, once all have written it from their containers (or ``ended()``
    says the agent is gone: its result is the failure's message)."""
    ready = [proj / f"ready-{rank}.json" for rank in range(ranks)]
    await until(lambda: all(p.exists() for p in ready) or bool(ended()), timeout=60)
    assert not ended(), ended()
    return [json.loads(p.read_text()) for p in ready]


@pytest.fixture(scope="module")
def podman() -> None:
    if why := kit.missing():
        pytest.skip(why)


@pytest.fixture
def proj(tmp_path: Path, podman: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The compose project, as the agent's working directory; its containers and network go after."""
    name = f"flodlc{secrets.token_hex(3)}"
    where = kit.project(tmp_path / name, SERVICE, RANK)
    monkeypatch.chdir(where)
    monkeypatch.setenv("FLODL_TEST_LEAK", "the agent's own environment")
    yield where
    kit.remove(f"flodl.host={name}", name)


def test_a_walk_in_runs_its_ranks_in_the_service_the_cluster_file_names(proj: Path) -> None:
    host = proj.name

    async def scenario() -> None:
        # The roster's docker: rides this host's envelope (the box names no service of its own).
        knobs = {"env": {"ODD": ODD}, "launch": "c0ffee01", "max_failure": "1"}  # rank 1's exit: evicted
        roster = {host: {"docker": SERVICE}}
        ctl = Controller(settings(["python3", "rank.py"], quorum=2, target=2, host_facts=roster, **knobs))
        await ctl.start()
        joined = asyncio.ensure_future(walk_in(agent(ctl, host, 2)))
        facts = await ranks_ready(proj, 2, lambda: joined.done() and joined.result())
        running = sorted(kit.containers(f"flodl.host={host}", "running"))
        assert [n.startswith("flodl-c0ffee01-") for n in running] == [True, True]  # per launch and rank
        assert [n.rsplit("-", 1)[1] for n in running] == ["r0", "r1"]
        # The plane's key reached the ranks through a file, never an argv (compose tools print theirs).
        for secret in (facts[0]["key"], "odd-7d1"):
            assert kit.argv_holding(secret) == []
        env = subprocess.run(
            ["podman", "inspect", "--format", "{{.Config.Env}}", *running], capture_output=True, text=True
        )
        assert facts[0]["key"] not in env.stdout
        (proj / "GO").touch()
        result = await joined
        await ctl.finished.wait()
        # Rank 1 exits 3: the controller hears the container's code (podman-compose 1.0.3's run exits 0).
        assert ctl.exits[host] == {0: 0, 1: 3}
        assert result == TRANSIENT
        await ctl.close()
        for rank, seen in enumerate(facts):
            assert seen["container"], "the rank did not run in a container"
            assert seen["env"] == {
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "ODD": ODD,
                "FLODL_TEST_LEAK": None,  # the agent's own environment stays out
                "FLODL_DEVICE": f"cpu:{rank}",
            }
            assert seen["store"] and seen["plane"], "the agent's loopback ports are not reachable"
            assert seen["metrics"]
            assert seen["cwd"] == str(proj) and seen["uid"] == os.getuid()
            assert str(Path(sys.executable).parent) not in seen["path"]  # the image's PATH, not the venv's
        assert kit.containers(f"flodl.host={host}") == []

    run(scenario)


def test_an_abort_mid_run_stops_and_removes_the_containers(proj: Path) -> None:
    host = proj.name

    async def scenario() -> None:
        ctl = Controller(settings(["python3", "rank.py"], quorum=2, target=2))
        await ctl.start()
        opts = agent(ctl, host, 2)
        opts.docker = SERVICE  # the box's own join.docker
        joined = asyncio.ensure_future(walk_in(opts))
        await ranks_ready(proj, 2, lambda: joined.done() and joined.result())
        ctl.fail("the operator stopped the run")
        result = await joined
        assert isinstance(result, AgentFailure) and "aborted the run" in result.message
        assert kit.containers(f"flodl.host={host}") == []
        await ctl.close()

    run(scenario)


def test_sigterm_to_the_agent_mid_run_leaves_no_container(proj: Path) -> None:
    host = proj.name

    async def scenario() -> None:
        # A mixed world: rank 0 on the box itself (its agent serves the store), 1-2 in the service.
        ctl = Controller(settings(["python3", "rank.py"], quorum=3, target=3))
        await ctl.start()
        bare = asyncio.ensure_future(walk_in(agent(ctl, "bare", 1)))
        await until(lambda: ctl.window.joined_ranks == 1)
        fdl = Path(sys.executable).parent / "fdl"
        argv = [str(fdl), "join", f"127.0.0.1:{ctl.port}", "--devices", "cpu:2", "--host", host]
        proc = await asyncio.create_subprocess_exec(
            *argv, "--docker", SERVICE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        facts = await ranks_ready(proj, 3, lambda: proc.returncode is not None and f"exit {proc.returncode}")
        assert [seen["container"] for seen in facts] == [False, True, True]
        assert len(kit.containers(f"flodl.host={host}", "running")) == 2
        proc.send_signal(signal.SIGTERM)
        _, stderr = await proc.communicate()
        assert proc.returncode == 1, stderr.decode()
        assert "stopped by a signal" in stderr.decode()
        assert kit.containers(f"flodl.host={host}") == []
        assert isinstance(await bare, AgentFailure)  # the run ends for everyone
        await ctl.close()

    run(scenario)


def test_a_service_the_project_lacks_is_refused_before_the_dial(proj: Path) -> None:
    async def scenario() -> None:
        ctl = Controller(settings(["python3", "rank.py"], quorum=2, target=2))
        await ctl.start()
        opts = agent(ctl, proj.name, 1)
        opts.docker = "cuda"
        result = await walk_in(opts)
        assert isinstance(result, AgentFailure) and result.code == PERMANENT
        assert f"no service `cuda` in {proj / 'compose.yaml'} (its services: {SERVICE})" in result.message
        assert result.message.startswith("docker (join.docker")
        assert ctl.window.joined_ranks == 0  # nothing was dialled
        await ctl.close()

    run(scenario)


def test_a_service_the_cluster_file_names_and_the_project_lacks_is_that_runs_failure(proj: Path) -> None:
    host = proj.name

    async def scenario() -> None:
        said: list[str] = []
        roster = {host: {"docker": "cuda"}}  # the run's own setting, not this box's
        ctl = Controller(
            settings(["python3", "rank.py"], quorum=1, target=1, host_facts=roster), log=said.append
        )
        await ctl.start()
        result = await walk_in(agent(ctl, host, 1))
        await ctl.finished.wait()
        # The controller hears why the rank never started, and the walk-in stays for the next run.
        assert isinstance(result, AgentFailure) and result.code == TRANSIENT, result
        assert f"no service `cuda` in {proj / 'compose.yaml'}" in result.message
        assert ctl.exits == {host: {0: 126}}
        assert ctl.reason.startswith(f"rank 0 on {host} could not start: docker"), ctl.reason
        assert not [line for line in said if "still running" in line], said
        await ctl.close()

    run(scenario)

"""Rendezvous on the controller port: an unmodified torchrun-style script
(`init_process_group("gloo")` with env://) forms one world across walk-ins,
with rank 0's agent serving torch's TCPStore and every other host reaching it
through its control link."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from flodl_agent.controller.controller import Controller
from flodl_agent.protocol import wire
from flodl_agent.protocol.join_protocol import Accepted, Challenged, JoinClient
from flodl_agent.protocol.messages import Stream
from flodl_agent.protocol.streams import next_event, write_parts
from tests.support.control_plane import run, settings, until, walk_ins

torch = pytest.importorskip("torch")

# What a user writes for torchrun, unchanged: env:// rendezvous, a collective, a barrier.
SCRIPT = """
import os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
dist.barrier()
open(os.path.join(sys.argv[1], os.environ["RANK"]), "w").write(f"{t.item():g} {dist.get_world_size()}")
dist.destroy_process_group()
"""


def test_an_unmodified_gloo_script_forms_one_world_across_walk_ins(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, "-c", SCRIPT, str(out)]

    async def scenario() -> None:
        ctl = Controller(settings(command, quorum=3, target=3, env={"GLOO_SOCKET_IFNAME": "lo"}))
        await ctl.start()
        logs: list[str] = []
        codes = await walk_ins(ctl, ("box-a", 2), ("box-b", 1), log=logs)
        assert codes == [0, 0], logs
        await ctl.finished.wait()
        assert ctl.exit_code == 0
        # the store host's own ranks dial it directly; the other host's went through the controller
        assert ctl.streams is not None and ctl.streams.opened >= 1
        assert ctl.dropped.get("stream", 0) == 0
        await ctl.close()

    run(scenario)
    assert {p.name: p.read_text() for p in out.iterdir()} == {"0": "6 3", "1": "6 3", "2": "6 3"}


# Rank 0 (the store host's only rank) finishes first; rank 1, on the other host, uses the store
# through the relay only after the test has seen rank 0 exit (its GO file).
LAST_WORD = """
import os, sys, time
from datetime import timedelta
from pathlib import Path
import torch.distributed as dist

out = Path(sys.argv[1])
dist.init_process_group("gloo", timeout=timedelta(seconds=20))
if dist.get_rank() == 1:
    while not (out / "go").exists():
        time.sleep(0.02)
    store = dist.distributed_c10d._get_default_store()
    store.set("late", "still served")
    (out / "late").write_text(store.get("late").decode())
dist.destroy_process_group()
"""


def test_the_store_host_serves_until_the_other_hosts_ranks_let_go(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, "-c", LAST_WORD, str(out)]

    async def scenario() -> None:
        ctl = Controller(settings(command, quorum=2, target=2, env={"GLOO_SOCKET_IFNAME": "lo"}))
        await ctl.start()
        logs: list[str] = []
        joined = asyncio.ensure_future(walk_ins(ctl, ("box-a", 1), ("box-b", 1), log=logs))
        await until(lambda: ctl.supervisor is not None and ctl.streams is not None, timeout=60)
        assert ctl.supervisor is not None and ctl.streams is not None
        store_host, supervisor = ctl.streams.store_host, ctl.supervisor
        # The store host's own rank is gone: its agent has every exit it waits for.
        await until(lambda: supervisor.exits.get(store_host) == {0: 0}, timeout=120)
        (out / "go").touch()
        assert await joined == [0, 0], logs
        await ctl.finished.wait()
        assert ctl.exit_code == 0
        await ctl.close()

    run(scenario)
    # Rank 1's store ops came after rank 0 had exited, and were answered.
    assert (out / "late").read_text() == "still served"


def test_a_stream_frame_before_the_world_formed_is_dropped_not_routed() -> None:
    async def scenario() -> None:
        ctl = Controller(settings(quorum=2, target=2))
        await ctl.start()
        # One host admitted, the world not formed: its rendezvous bytes have nowhere to go.
        client = JoinClient(None)
        reader, writer = await asyncio.open_connection("127.0.0.1", ctl.port)
        writer.write(client.start())
        assert isinstance(await next_event(reader, client, 10), Challenged)
        writer.write(client.hello({"host": "box-a", "devices": ["cpu:0"]}))
        assert isinstance(await next_event(reader, client, 10), Accepted)
        write_parts(writer, client.send(wire.Kind.STREAM, Stream(id=1, data=b"x").model_dump()))
        await until(lambda: ctl.dropped.get("stream", 0) == 1)
        assert "box-a" in ctl.links  # a dropped stream costs the host nothing
        writer.close()
        await ctl.close()

    run(scenario)

"""A controller here and walk-in hosts as processes of their own, as on a real fleet."""

from __future__ import annotations

import asyncio
import socket
import sys

from flodl_agent.controller import Controller
from flodl_agent.controller_settings import Settings
from flodl_agent.window import WindowConfig

AGENT = """
import asyncio, sys
from flodl_agent.agent import AgentOptions, join_once
from flodl_agent.config import DeviceOffer

port, host, cpus = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
options = AgentOptions(controller_port=port, host=host, devices=DeviceOffer("cpu", cpus=cpus))
sys.exit(asyncio.run(join_once(options, lambda _: None)))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world(command: list[str], hosts: list[tuple[str, int]], env: dict[str, str] | None = None) -> None:
    """Open a window for exactly ``hosts`` (name, CPU ranks); run ``command`` on every rank."""
    ranks = sum(cpus for _, cpus in hosts)

    async def run() -> None:
        window = WindowConfig(ranks, ranks, 60.0, 120.0, "auto")
        ctl = Controller(Settings(window, command=command, port=0, env=dict(env or {})))
        await ctl.start()
        agents = [
            await asyncio.create_subprocess_exec(sys.executable, "-c", AGENT, str(ctl.port), name, str(cpus))
            for name, cpus in hosts
        ]
        codes = [await a.wait() for a in agents]
        await ctl.finished.wait()
        await ctl.close()
        if codes != [0] * len(hosts) or ctl.exit_code != 0:
            sys.exit(f"the run failed: agents {codes}, controller: {ctl.reason}")

    asyncio.run(run())

"""A controller and walk-in hosts as processes of their own, as on a real fleet.

``run_world`` holds the controller in this process, on loopback. ``python -m
bench.walkins serve BIND PORT RANKS -- COMMAND...`` is a controller on its own
(a shaped network's controller namespace runs one): the run's token comes in
``FDL_TOKEN``, it prints ``listening`` once the window is open and exits 0 when
the run is done. ``AGENT`` is one walk-in host (the controller's address, and
``FDL_TOKEN`` when the controller is not on loopback).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys

from flodl_agent.controller import Controller
from flodl_agent.controller_settings import Settings
from flodl_agent.window import WindowConfig

AGENT = """
import asyncio, os, sys
from flodl_agent import wire
from flodl_agent.agent import AgentOptions, join_once
from flodl_agent.config import DeviceOffer

port, host, cpus = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
address = sys.argv[4] if len(sys.argv) > 4 else "127.0.0.1"
token = os.environ.get("FDL_TOKEN")
options = AgentOptions(
    controller_host=address, controller_port=port, host=host, devices=DeviceOffer("cpu", cpus=cpus),
    key=wire.host_key(bytes.fromhex(token), host) if token else None,  # what fdl join derives
)
sys.exit(asyncio.run(join_once(options, lambda _: None)))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def settings(command: list[str], ranks: int, env: dict[str, str] | None = None, **where: object) -> Settings:
    window = WindowConfig(ranks, ranks, 60.0, 120.0, "auto")
    return Settings(window, command=command, env=dict(env or {}), **where)  # type: ignore[arg-type]


async def serve(ctl: Controller, announce: bool = False) -> None:
    """Run one window to its end; the run must be done."""
    await ctl.start()
    if announce:
        print("listening", flush=True)
    await ctl.finished.wait()
    await ctl.close()
    if ctl.exit_code != 0:
        sys.exit(f"the run failed: {ctl.reason}")


def run_world(command: list[str], hosts: list[tuple[str, int]], env: dict[str, str] | None = None) -> None:
    """Open a window for exactly ``hosts`` (name, CPU ranks); run ``command`` on every rank."""
    ranks = sum(cpus for _, cpus in hosts)

    async def run() -> None:
        ctl = Controller(settings(command, ranks, env, port=0))
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


def main() -> None:
    if len(sys.argv) < 6 or sys.argv[1] != "serve" or sys.argv[5] != "--":
        sys.exit("usage: python -m bench.walkins serve BIND PORT RANKS -- COMMAND... (FDL_TOKEN in the env)")
    bind, port, ranks, command = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[6:]
    where = {"bind": bind, "port": port, "token": os.environ.get("FDL_TOKEN") or None}
    asyncio.run(serve(Controller(settings(command, ranks, **where)), announce=True))


if __name__ == "__main__":
    main()

"""The control plane's test kit: a controller's settings, agents walking in over loopback,
the HTTP surface as JSON. Shared by the integration and e2e suites."""

from __future__ import annotations

import asyncio
import http.client
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from flodl_agent.agent.agent import AgentFailure, join_once
from flodl_agent.agent.options import AgentOptions
from flodl_agent.config import DeviceOffer
from flodl_agent.controller.controller import Controller
from flodl_agent.controller.settings import Settings
from flodl_agent.controller.window import WindowConfig
from flodl_agent.protocol import wire

OK = [sys.executable, "-c", "import os; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])"]

# A rank that reports progress until the test lets it finish (the sleep stands in for a step).
REPORTING = """
import os, time
from pathlib import Path
from flodl_agent.observe.metrics import report
step = 0
while not Path(os.environ["GO"]).exists():
    step += 1
    report(step, loss=1.0 / step)
    time.sleep(0.05)
"""


def settings(command: list[str] = OK, **knobs: Any) -> Settings:
    window: dict[str, Any] = {
        "quorum": 2,
        "target": 2,
        "join_timeout": 30.0,
        "max_join_timeout": 60.0,
        "start": "auto",
    }
    window.update({k: v for k, v in knobs.items() if k in window or k == "discovery"})
    rest = {k: v for k, v in knobs.items() if k not in window and k != "discovery"}
    return Settings(window=WindowConfig(**window), command=command, port=0, **rest)


def agent(
    ctl: Controller, host: str, cpus: int = 1, key: bytes | None = None, host_key: bytes | None = None
) -> AgentOptions:
    """A box named ``host``; ``key``: the run key it holds (it dials with the key derived from
    it for its name, as `fdl join` with FDL_TOKEN does), or ``host_key``: the key it was given."""
    return AgentOptions(
        controller_host="127.0.0.1",
        controller_port=ctl.port,
        host=host,
        devices=DeviceOffer("cpu", cpus=cpus),
        key=wire.host_key(key, host) if key is not None else host_key,
    )


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait for a condition the event loop will make true (checked each loop turn)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 60))


async def walk_in(opts: AgentOptions, log: list[str] | None = None) -> int | AgentFailure:
    try:
        return await join_once(opts, (log if log is not None else []).append)
    except AgentFailure as exc:
        return exc


async def walk_ins(ctl: Controller, *boxes: tuple[str, int], log: list[str] | None = None) -> list[object]:
    """Walk ``(host, cpus)`` boxes in at once; their join results, in order."""
    return list(await asyncio.gather(*(walk_in(agent(ctl, host, cpus), log) for host, cpus in boxes)))


def get_json(
    ctl: Controller, method: str, path: str, body: str | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", ctl.port, timeout=5)
    sent = {"content-type": "application/x-www-form-urlencoded"} if body else {}
    conn.request(method, path, body=body, headers=sent | (headers or {}))
    response = conn.getresponse()
    data = json.loads(response.read())
    conn.close()
    return response.status, data


async def api(
    ctl: Controller, method: str, path: str, body: str | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    return await asyncio.to_thread(get_json, ctl, method, path, body, headers)

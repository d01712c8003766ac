"""A controller and walk-in hosts as processes of their own, as on a real fleet.

``run_world`` holds the controller in this process, on loopback. ``python -m
bench.walkins serve BIND PORT RANKS -- COMMAND...`` is a controller on its own
(a shaped network's controller namespace runs one): the run's token comes in
``FDL_TOKEN``, it prints ``listening`` once the window is open and exits 0 when
the run is done. ``AGENT`` is one walk-in host (the controller's address, and
``FDL_TOKEN`` when the controller is not on loopback).

``launch_join`` drives the operator's own commands instead: `fdl launch --no-fanout` on
loopback and one `fdl join --devices OFFER` per walk-in host, each a process of its own
with its output in a log file, held to one deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from flodl_agent.controller.controller import Controller
from flodl_agent.controller.settings import Settings
from flodl_agent.controller.window import WindowConfig
from flodl_agent.observe.status import Unreachable, request

AGENT = """
import asyncio, os, sys
from flodl_agent.protocol import wire
from flodl_agent.agent.agent import join_once
from flodl_agent.agent.options import AgentOptions
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


def run_world(
    command: list[str], hosts: list[tuple[str, int]], env: dict[str, str] | None = None, local: bool = True
) -> None:
    """Open a window for exactly ``hosts`` (name, CPU ranks); run ``command`` on every rank
    (``local``: the agents reach the controller through its local socket, as on one box)."""
    ranks = sum(cpus for _, cpus in hosts)

    async def run() -> None:
        ctl = Controller(settings(command, ranks, env, port=0, local_socket=local))
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


class WorldFailed(RuntimeError):
    """A walk-in world that did not finish cleanly: what went wrong and the processes' log tails."""


def fdl_command() -> list[str]:
    """`fdl` run by this interpreter from the package on its path (a checkout on PYTHONPATH
    has no console script)."""
    return [
        sys.executable,
        "-c",
        "import sys; sys.argv[0] = 'fdl'; from flodl_agent.cli.main import main; main()",
    ]


def stop(proc: subprocess.Popen[Any]) -> None:
    """Kill a process started in a session of its own, and whatever it started."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def wait_for_window(port: int, launch: subprocess.Popen[Any], deadline: float) -> None:
    """Until the controller's /state.json (what `fdl status` reads) shows the window waiting."""
    while launch.poll() is None and time.monotonic() < deadline:
        try:
            if request(f"127.0.0.1:{port}", "GET", "/state.json", timeout=2).body.get("phase") == "waiting":
                return
        except Unreachable:
            time.sleep(0.05)  # not listening yet: the launcher is still starting
    if launch.poll() is None:
        raise WorldFailed("the join window did not open in time")
    raise WorldFailed(f"fdl launch exited with {launch.returncode} before its window opened")


def launch_join(
    work: Path, command: list[str], offers: list[str], ranks: int, plane: str = "cpu", timeout: float = 120.0
) -> float:
    """A window on loopback for ``ranks`` ranks (``fdl launch --plane PLANE --no-fanout --
    COMMAND``, from ``work``), then one walk-in per offer (``fdl join --host hN --devices
    OFFER``); every process must exit 0 within ``timeout`` seconds. Returns the wall time.
    Logs: ``work/launch.log``, ``work/hN.log``; on failure WorldFailed quotes their tails."""
    port = free_port()
    join = {"discovery": True, "min_rank_start": ranks, "target_ranks": ranks, "join_timeout": 60}
    cluster = {"cluster": {"controller": {"host": "127.0.0.1", "port": port, "join": join}}}
    (work / "fdl.cluster.yml").write_text(json.dumps(cluster))
    fdl, logs = fdl_command(), [work / "launch.log", *(work / f"h{i}.log" for i in range(len(offers)))]
    started, deadline = time.perf_counter(), time.monotonic() + timeout
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv, cwd=work, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        procs.append(proc)
        return proc

    try:
        launch = spawn([*fdl, "launch", "--no-fanout", "--plane", plane, "--", *command], logs[0])
        wait_for_window(port, launch, deadline)
        for i, offer in enumerate(offers):
            spawn([*fdl, "join", f"127.0.0.1:{port}", "--host", f"h{i}", "--devices", offer], logs[i + 1])
        codes = [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        running = [p.poll() for p in procs]  # None: still running
        raise WorldFailed(f"not done within {timeout:.0f} s (exit codes {running})" + _tails(logs)) from None
    except WorldFailed as exc:
        raise WorldFailed(str(exc) + _tails(logs)) from None
    finally:
        for p in procs:
            stop(p)
    if any(codes):
        raise WorldFailed(f"exit codes: launch {codes[0]}, joins {codes[1:]}" + _tails(logs))
    return time.perf_counter() - started


def _tails(logs: list[Path]) -> str:
    return "".join(f"\n--- {log.name}\n{tail(log)}" for log in logs if log.exists())


def main() -> None:
    if len(sys.argv) < 6 or sys.argv[1] != "serve" or sys.argv[5] != "--":
        sys.exit("usage: python -m bench.walkins serve BIND PORT RANKS -- COMMAND... (FDL_TOKEN in the env)")
    bind, port, ranks, command = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[6:]
    token = os.environ.get("FDL_TOKEN") or None
    asyncio.run(serve(Controller(settings(command, ranks, bind=bind, port=port, token=token)), announce=True))


if __name__ == "__main__":
    main()

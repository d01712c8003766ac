"""A controller's restart under a training world (issue 37), on loopback.

N walk-in agents (one CPU rank each, on the CPU plane: every step averages through the
controller) train; the controller dies as under kill -9 (every link's transport aborted,
then its port closed) and a new one is started at once from the journal the first one
would have left. Measured, for each size:

- ``back_s``: from the new controller's start, ``--delay`` seconds after the kill (run.yml's
  RestartSec, default 1), to every host re-adopted (the timeline's "controller resumed"
  line): the agents' re-dial, every 0.25 s doubling to 1 s, finds it; the goal is under 2 s;
- ``formation_s``, the baseline from the same run: the first controller's start to its
  world formed with the same hosts (``ratio`` = back_s / formation_s);
- ``abandoned``: the most averaging rounds a rank saw abandoned (at most the one in flight
  when the controller died is the goal), and whether every rank kept its process and its
  step counter, and ended with the others' weights.

``python -m bench.controller_restart [--quick]``: 2, 4 and 8 hosts (``--quick``: 2 and 4);
the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from flodl_agent.agent.agent import join_once
from flodl_agent.agent.options import AgentOptions
from flodl_agent.config import DeviceOffer
from flodl_agent.controller.controller import Controller
from flodl_agent.controller.journaling import Journaler
from flodl_agent.controller.settings import Settings
from flodl_agent.controller.window import WindowConfig
from flodl_agent.retry import AgentFailure

# Each step averages; the rank writes its steps, pid, abandoned rounds and weights at the end.
RANK = """
import json, os, sys
import torch
from flodl_agent.train import Averager
rank, out, go = int(os.environ["RANK"]), sys.argv[1], os.environ["GO"]
avg, w, steps, abandoned = Averager(), torch.zeros(4), 0, 0
while True:
    w += rank + 1
    if avg.average([w], 1.0) == 0.0:
        abandoned += 1
    steps += 1
    last = open(go).read().strip() if os.path.exists(go) else ""
    if last and avg.round > int(last):
        break
    open(os.path.join(out, f"{rank}.tmp"), "w").write(str(avg.round))
    os.replace(os.path.join(out, f"{rank}.tmp"), os.path.join(out, f"{rank}.steps"))  # whole, for the bench
json.dump({"pid": os.getpid(), "steps": steps, "abandoned": abandoned, "w": w.tolist()},
          open(os.path.join(out, f"{rank}.json"), "w"))
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def until(predicate: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("not reached")
        await asyncio.sleep(0.005)  # polling the controller's own state, as the page does


def rounds(out: Path, hosts: int) -> int:
    got = []
    for rank in range(hosts):
        try:
            got.append(int((out / f"{rank}.steps").read_text()))
        except FileNotFoundError:
            got.append(0)
    return min(got)


async def one(hosts: int, work: Path, delay: float) -> dict[str, Any]:
    out, go = work / f"out-{hosts}", work / f"go-{hosts}"
    out.mkdir()
    window = WindowConfig(quorum=hosts, target=hosts, join_timeout=60.0, max_join_timeout=120.0, start="auto")
    settings = Settings(
        window=window, command=[sys.executable, "-c", RANK, str(out)], port=free_port(), launch="0a1b2c3d",
        controller_grace=30.0, env={"GO": str(go), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    first = Controller(settings)
    began = time.monotonic()
    await first.start()
    boxes = [
        asyncio.ensure_future(join_once(AgentOptions(
            controller_port=settings.port, host=f"h{i}", devices=DeviceOffer("cpu", cpus=1)), lambda _: None))
        for i in range(hosts)
    ]  # fmt: skip
    await until(lambda: first.window.phase == "training", 60)
    formation = time.monotonic() - began
    await until(lambda: rounds(out, hosts) >= 5, 60)
    journal = Journaler(first, Path("unused"), lambda _: None).snapshot()
    assert journal is not None
    for link in list(first.links.values()):
        link.writer.transport.abort()  # kill -9: no Abort, no goodbye
    await first.close()
    await asyncio.sleep(delay)  # the scenario: systemd's RestartSec before the new controller
    again = Controller(settings, resume=journal)
    started = time.monotonic()
    await again.start()
    readoption = again.readoption
    assert readoption is not None
    await until(lambda: readoption.said, 30)
    back = time.monotonic() - started
    all_back = readoption.complete()
    go.write_text(str(rounds(out, hosts) + 3))
    ended = await asyncio.gather(*boxes, return_exceptions=True)
    await asyncio.wait_for(again.finished.wait(), 30)
    await again.close()
    ranks = [json.loads((out / f"{r}.json").read_text()) for r in range(hosts)]
    return {
        "hosts": hosts,
        "restart_after_s": delay,
        "back_s": round(back, 3),
        "formation_s": round(formation, 3),
        "ratio": round(back / formation, 3) if formation > 0 else None,
        "all_back": all_back,
        "abandoned": max(r["abandoned"] for r in ranks),
        "agents_ok": all(code == 0 and not isinstance(code, AgentFailure) for code in ended),
        "run_ok": again.exit_code == 0,
        "weights_equal": all(r["w"] == ranks[0]["w"] for r in ranks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.controller_restart")
    parser.add_argument("--quick", action="store_true", help="2 and 4 hosts")
    parser.add_argument(
        "--delay", type=float, default=1.0, help="seconds between the kill and the new start (RestartSec)"
    )
    args = parser.parse_args()
    sizes = [2, 4] if args.quick else [2, 4, 8]
    results = []
    with tempfile.TemporaryDirectory() as work:
        for hosts in sizes:
            result = asyncio.run(one(hosts, Path(work), args.delay))
            print(json.dumps(result), flush=True)
            results.append(result)
    print(json.dumps({"bench": "controller_restart", "results": results}))


if __name__ == "__main__":
    main()

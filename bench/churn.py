"""Churn on an elastic CPU-plane world (issue 38), on loopback.

Four walk-in agents (real ``fdl join`` processes, one CPU rank each) train a small
regression with the Trainer (cpu_cadence) to a budget of world batches, under an
in-process controller with ``elastic`` (a ceiling of four ranks) and ``max_failure 1``.
Every ``--every`` seconds (15) for the first ``--seconds`` (120) of the run, the oldest
live agent is killed with its ranks (SIGKILL to its process group: a spot instance
vanishing) and, once the controller has handled it as lost, a fresh agent walks in and
takes its rank. Measured:

- ``completed``: the run ends with exit 0 (every loss healed by a replacement);
- ``loss``: the final model's loss on a held-out set, against ``baseline_loss``, the same
  budget trained without churn in the same run (``ratio`` = loss / baseline_loss; the goal
  is within 5 %);
- ``lag_rounds``: for each newcomer, the rounds from the last one pushed when its ranks
  were ready (their join round reached the hub) to the first it contributed weight to (the
  goal: at most 2), and the most; ``newcomer_start_s``: the seconds from its admission to
  that readiness (its ranks' start: torch's import, the model, the dataset);
- ``kills``, ``refused`` (walk-ins turned away, by refusal code), ``late`` (fresh agents the
  run ended before admitting), and the runs' seconds.

The budget is set from two short calibration runs so that the baseline takes about
``--seconds`` (or given: ``--batches N``). ``python -m bench.churn [--quick]`` (``--quick``:
30 s, churn every 7.5 s); the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.controller_restart import until
from bench.walkins import fdl_command, free_port, stop
from flodl_agent.controller.controller import Controller
from flodl_agent.controller.elastic import Elastic
from flodl_agent.controller.settings import Settings
from flodl_agent.controller.window import WindowConfig

HOSTS = 4
RANK = """
import json, os, sys
import torch
from flodl_agent.train import ElCheConfig, Trainer

out, batches = sys.argv[1], int(sys.argv[2])
g = torch.Generator().manual_seed(7)
w = torch.randn(16, 1, generator=g)
def task(n):
    x = torch.randn(n, 16, generator=g)
    return x, torch.tanh(x @ w) + 0.05 * torch.randn(n, 1, generator=g)
x, y = task(4096)
held_x, held_y = task(1024)
model = lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
trainer = Trainer(model, list(zip(x, y)), lambda p: torch.optim.SGD(p, lr=0.05),
                  torch.nn.functional.mse_loss, ElCheConfig.cpu_cadence(), batch_size=32)
trained = trainer.fit(batches=batches)
with torch.no_grad():
    loss = float(torch.nn.functional.mse_loss(trained(held_x), held_y))
said = {"loss": loss, "rounds": len(trainer.reports), "world": trainer.world}
with open(os.path.join(out, f"{os.environ['RANK']}-{os.getpid()}.json"), "w") as f:
    json.dump(said, f)
"""


@dataclass
class Watch:
    """When each newcomer was admitted, when its ranks were ready (its join round reached the
    hub), and the first round it brought weight to."""

    ctl: Controller | None = None
    admitted: dict[str, float] = field(default_factory=dict)  # host -> when its link was admitted
    ready: dict[str, tuple[int, float]] = field(default_factory=dict)  # host -> (last round then, when)
    lag: dict[str, int] = field(default_factory=dict)  # host -> rounds from ready to contributing
    start_s: dict[str, float] = field(default_factory=dict)  # host -> seconds from admitted to ready

    def log(self, line: str) -> None:
        if " joined mid-run at step " in line:
            self.admitted[line.split(" ", 1)[0]] = time.monotonic()

    def hook(self, ctl: Controller) -> None:
        """Hear every walk-in's join and every closed round's weights (the hub's own record)."""
        traffic = ctl.traffic
        assert traffic is not None
        joined, closed = traffic.joined, traffic.rounds.closed

        def ready(host: str, params: int = 0) -> None:
            self.ready[host] = (traffic.hub.last_round, time.monotonic())
            if host in self.admitted:
                self.start_s[host] = round(time.monotonic() - self.admitted[host], 2)
            joined(host, params)

        def heard(round_no: int, now: float, weights: Any) -> None:
            closed(round_no, now, weights)
            for host, (at, _) in self.ready.items():
                if host not in self.lag and weights.get(host, 0.0) > 0:
                    self.lag[host] = round_no - at

        traffic.joined = ready  # type: ignore[method-assign]
        traffic.rounds.closed = heard  # type: ignore[method-assign]


async def world(work: Path, batches: int, every: float | None, churn_for: float) -> dict[str, Any]:
    """One run to ``batches`` world batches; with ``every``, the churn."""
    out = work / f"out-{secrets.token_hex(2)}"
    out.mkdir()
    port, watch = free_port(), Watch()
    window = WindowConfig(quorum=HOSTS, target=HOSTS, join_timeout=60.0, max_join_timeout=120.0, start="auto")
    settings = Settings(
        window=window, command=[sys.executable, "-c", RANK, str(out), str(batches)], port=port,
        launch=secrets.token_hex(4), elastic=Elastic(HOSTS), max_failure="1",
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    ctl = watch.ctl = Controller(settings, log=watch.log)
    await ctl.start()
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def walk_in() -> None:
        host = f"h{len(procs)}"
        argv = [*fdl_command(), "join", f"127.0.0.1:{port}", "--host", host, "--devices", "cpu:1"]
        with (work / f"{host}.log").open("wb") as log:
            procs[host] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    for _ in range(HOSTS):
        walk_in()
    kills = 0
    try:
        await until(lambda: ctl.window.phase == "training" and ctl.traffic is not None, 60)
        watch.hook(ctl)
        # Churn from the first round on: before it, a CPU-plane world is not seen to average,
        # and a loss there is a process group's (the run ends, as under torchrun).
        await until(lambda: ctl.hub is not None and ctl.hub.rounds_done > 0, 60)
        began = time.monotonic()
        while every is not None and time.monotonic() - began + every <= churn_for:
            try:
                await asyncio.wait_for(ctl.finished.wait(), began + (kills + 1) * every - time.monotonic())
                break  # the run ended before the next churn
            except TimeoutError:
                pass
            victim = next(h for h, p in procs.items() if p.poll() is None)  # the oldest alive
            os.killpg(procs[victim].pid, signal.SIGKILL)
            kills += 1
            supervisor = ctl.supervisor
            assert supervisor is not None
            await until(lambda s=supervisor: bool(s.free()), 30)  # the controller handled it as lost
            walk_in()
        await asyncio.wait_for(ctl.finished.wait(), 600)
        seconds = time.monotonic() - began
    finally:
        for proc in procs.values():
            stop(proc)
        await ctl.close()
    said = [json.loads(p.read_text()) for p in out.glob("*.json")]
    return {
        "completed": ctl.exit_code == 0,
        "reason": ctl.reason,
        "seconds": round(seconds, 1),
        "loss": statistics.median(s["loss"] for s in said) if said else None,
        "kills": kills,
        "newcomers": len(watch.admitted),
        "refused": dict(ctl.refused),  # walk-ins turned away, by code
        "late": kills - len(watch.admitted),  # fresh agents the run ended before it admitted
        "lag_rounds": watch.lag,
        "start_s": watch.start_s,
        "rounds": max((s["rounds"] for s in said), default=0),
    }


async def calibrated(work: Path, seconds: float) -> int:
    """The budget the baseline trains for about ``seconds``: cadence rounds grow (the anchor
    doubles while averaging costs more than its share), so the rate is measured twice, the
    second time over a quarter of the goal, mostly at the steady anchor."""
    batches = 4000
    for share in (0.25, 1.0):
        took = (await world(work, batches, None, 0.0))["seconds"]
        batches = max(batches, int(batches * seconds * share / max(took, 1e-3)))
    return batches


async def bench(seconds: float, every: float, budget: int | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        batches = budget
        if batches is None:
            batches = await calibrated(work, seconds)
        baseline = await world(work, batches, None, 0.0)
        churned = await world(work, batches, every, seconds)
    lags = list(churned["lag_rounds"].values())
    return {
        "bench": "churn",
        "hosts": HOSTS,
        "every_s": every,
        "batches": batches,
        "completed": churned["completed"] and baseline["completed"],
        "loss": churned["loss"],
        "baseline_loss": baseline["loss"],
        "ratio": round(churned["loss"] / baseline["loss"], 4)
        if churned["loss"] and baseline["loss"]
        else None,
        "kills": churned["kills"],
        "refused": churned["refused"],
        "late": churned["late"],
        "lag_rounds": lags,
        "max_lag_rounds": max(lags, default=None),
        "newcomer_start_s": sorted(churned["start_s"].values()),
        "seconds": churned["seconds"],
        "baseline_seconds": baseline["seconds"],
        "reason": churned["reason"] or baseline["reason"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.churn")
    parser.add_argument("--quick", action="store_true", help="30 s of training, churn every 7.5 s")
    parser.add_argument("--seconds", type=float, help="the baseline's training, and the churn's (120)")
    parser.add_argument("--every", type=float, help="seconds between kills (15)")
    parser.add_argument("--batches", type=int, help="the world's batch budget (default: calibrated)")
    args = parser.parse_args()
    seconds = args.seconds or (30.0 if args.quick else 120.0)
    every = args.every or (7.5 if args.quick else 15.0)
    if seconds <= 0 or every <= 0 or (args.batches is not None and args.batches < 1):
        parser.error("--seconds, --every and --batches must be above 0")
    print(json.dumps(asyncio.run(bench(seconds, every, args.batches))))


if __name__ == "__main__":
    main()

"""Losing ranks mid-run: eviction within max_failure (averaging renormalizes and
the rest finish), ShutdownWithSave beyond it (a survivor writes a checkpoint
that loads, then the run fails with the reason)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from flodl_agent.controller.controller import Controller
from tests.support.control_plane import agent, run, settings, walk_in, walk_ins

torch = pytest.importorskip("torch")

SCRIPT = """
import json, os, sys, time
import torch
from flodl_agent.train.trainer import ElCheConfig, ShutdownWithSave, Trainer

out = sys.argv[1]
rank = int(os.environ["RANK"])

class Flaky(torch.nn.Linear):
    calls = 0
    def forward(self, x):
        Flaky.calls += 1
        if rank == 2 and Flaky.calls == 4:
            if sys.argv[2] == "hang":
                time.sleep(600)  # alive, but never averages again
            os._exit(3)  # this rank's box dies mid-run
        return super().forward(x)

data = [(torch.tensor([float(i)]), torch.tensor([2.0 * i + 1])) for i in range(-8, 8)]
trainer = Trainer(lambda: Flaky(1, 1), data, lambda p: torch.optim.SGD(p, lr=0.01),
                  torch.nn.functional.mse_loss, ElCheConfig.cpu_sync(), batch_size=4,
                  checkpoint=os.path.join(out, "checkpoint.pt"))
try:
    trainer.fit(rounds=12)
except ShutdownWithSave as exc:
    open(os.path.join(out, f"shutdown-{rank}"), "w").write(str(exc))
    sys.exit(1)
open(os.path.join(out, f"done-{rank}"), "w").write(json.dumps([r.weight for r in trainer.reports]))
"""


def launch(tmp_path: Path, max_failure: str, how: str = "die", **knobs: float) -> tuple[Controller, Path]:
    out = tmp_path / "out"
    out.mkdir()
    holder: list[Controller] = []

    async def scenario() -> None:
        command = [sys.executable, "-c", SCRIPT, str(out), how]
        ctl = Controller(settings(command, quorum=3, target=3, max_failure=max_failure, **knobs))
        holder.append(ctl)
        await ctl.start()
        await walk_ins(ctl, ("box-a", 1), ("box-b", 1), ("box-c", 1))
        await ctl.finished.wait()
        await ctl.close()

    run(scenario)
    return holder[0], out


def test_within_max_failure_a_lost_rank_is_evicted_and_the_rest_finish(tmp_path: Path) -> None:
    ctl, out = launch(tmp_path, "1")
    assert ctl.exit_code == 0 and ctl.window.phase == "done"
    assert ctl.failed_ranks == {2}
    survivors = {p.name: json.loads(p.read_text()) for p in out.glob("done-*")}
    assert sorted(survivors) == ["done-0", "done-1"]
    # rounds before the loss carried three ranks' weight, rounds after it two: renormalized
    weights = survivors["done-0"]
    assert weights[0] == 3.0 and weights[-1] == 2.0 and len(weights) == 12
    report = ctl.view.report()
    (lost,) = [h for h in report["hosts"] if h["exits"] == {"2": 3}]
    assert report["ok"] and lost["ranks"] == [2, 3]


def test_beyond_max_failure_the_survivors_save_a_checkpoint_then_the_run_fails(tmp_path: Path) -> None:
    ctl, out = launch(tmp_path, "0")
    assert ctl.exit_code == 1 and ctl.window.phase == "failed"
    assert "rank 2 on box-" in ctl.reason and "exceed max_failure 0" in ctl.reason
    assert "checkpoint saved to" in (out / "shutdown-0").read_text()  # the lowest survivor saves
    assert "another rank saves the checkpoint" in (out / "shutdown-1").read_text()
    checkpoint = torch.load(out / "checkpoint.pt")
    assert set(checkpoint) == {"model", "optimizer", "round", "rank", "world_size"}
    assert checkpoint["rank"] == 0 and checkpoint["world_size"] == 3 and checkpoint["round"] >= 1
    assert not list(out.glob(".checkpoint.pt.*"))  # the temp file was renamed, not left behind


def test_a_round_stalled_past_the_ceiling_ends_with_save(tmp_path: Path) -> None:
    ctl, out = launch(tmp_path, "1", how="hang", stall_ceiling=1.0, shutdown_grace=2.0)
    assert ctl.exit_code == 1
    assert "stalled for 1s waiting on box-" in ctl.reason
    assert "checkpoint saved to" in (out / "shutdown-0").read_text()
    assert torch.load(out / "checkpoint.pt")["rank"] == 0


SLEEPY = [sys.executable, "-c", "import time; time.sleep(2)"]


def test_a_host_that_goes_silent_is_cut_off_and_one_that_beats_is_not() -> None:
    def launched(beat: float) -> Controller:
        holder: list[Controller] = []

        async def scenario() -> None:
            ctl = Controller(settings(SLEEPY, quorum=1, target=1, heartbeat_timeout=0.6))
            holder.append(ctl)
            await ctl.start()
            await walk_in(replace(agent(ctl, "box-a"), heartbeat_every=beat))
            await ctl.finished.wait()
            await ctl.close()

        run(scenario)
        return holder[0]

    assert launched(0.1).exit_code == 0  # beating: the 2 s rank finishes
    frozen = launched(3600)  # a frozen agent: cut off long before its rank would finish
    assert frozen.exit_code == 1 and "box-a went silent (no heartbeat for 0.6s)" in frozen.reason

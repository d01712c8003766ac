"""gpu_ram_share from the cluster file and the box to the Trainer, through the real command line:
the cluster's default, a worker's entry over it, and a walk-in's own join.gpu_ram_share over both,
as each rank's Trainer resolves its knob."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from flodl_agent.config import ClusterBuilder
from tests.support import free_port

pytestmark = [
    pytest.mark.skipif(shutil.which("fdl") is None, reason="the fdl console script is not on PATH"),
    # Alone, after the parallel pass: beside other tests its walk-ins hung after the world formed
    # (twice in four parallel runs, never alone); why is not yet known (see the note).
    pytest.mark.serial,
]
pytest.importorskip("torch")

RANK = """
import json, os, sys
import torch
from flodl_agent.train import ElCheConfig, Trainer

data = [(torch.zeros(1), torch.zeros(1))] * 6
trainer = Trainer(lambda: torch.nn.Linear(1, 1), data, lambda p: torch.optim.SGD(p, lr=0.1),
                  torch.nn.functional.mse_loss, ElCheConfig.cpu_sync(), batch_size=2)
trainer.fit(rounds=1)
seen = {"share": trainer.gpu_ram_share, "env": os.environ.get("FLODL_GPU_RAM_SHARE"),
        "budget": trainer.memory.bytes, "resident": trainer.resident}
open(os.path.join(sys.argv[1], os.environ["RANK"]), "w").write(json.dumps(seen))
"""


def _window_open(cwd: Path) -> bool:
    proc = subprocess.run(["fdl", "status", "--json"], cwd=cwd, capture_output=True, text=True, check=False)
    return proc.returncode == 0 and json.loads(proc.stdout).get("phase") == "waiting"


def test_the_walk_ins_own_share_beats_its_worker_entry_which_beats_the_cluster_default(
    tmp_path: Path,
) -> None:
    port = free_port()
    cluster = (
        ClusterBuilder()
        .controller("127.0.0.1", port=port)
        .join(min_rank_start=3, target_ranks=3, join_timeout=60, max_join_timeout=120)
        .gpu_ram_share(0.5)
        .worker("apu", local_devices="cpu:1", gpu_ram_share=0.75, nccl_socket_ifname="lo")
        .worker("apu-own", local_devices="cpu:1", gpu_ram_share=0.75, nccl_socket_ifname="lo")
    )
    (tmp_path / "fdl.cluster.yml").write_text(yaml.safe_dump(cluster.to_data()))
    own = tmp_path / "own"
    own.mkdir()
    (own / "fdl.yml").write_text(yaml.safe_dump({"join": {"gpu_ram_share": 0.9}}))
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "NO_COLOR": "1"}
    launch = subprocess.Popen(
        ["fdl", "launch", "--no-fanout", "--json", "--", sys.executable, "-c", RANK, str(out)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not _window_open(tmp_path):
            assert launch.poll() is None and time.monotonic() < deadline, "no join window opened"
            time.sleep(0.1)  # polling the controller's status, the operator's own view
        walk_ins = [
            subprocess.Popen(
                ["fdl", "join", f"127.0.0.1:{port}", "--host", host, "--devices", "cpu:1"],
                cwd=cwd,  # apu-own's ./fdl.yml holds its own join.gpu_ram_share
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for host, cwd in (("apu", tmp_path), ("apu-own", own), ("plain", tmp_path))
        ]
        results = [w.communicate(timeout=120)[0] for w in walk_ins]
        assert [w.returncode for w in walk_ins] == [0, 0, 0], results
        report, log = launch.communicate(timeout=30)
        assert launch.returncode == 0, log
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait()
    ranks = {h["host"]: h["ranks"][0] for h in json.loads(report)["hosts"]}
    seen = {host: json.loads((out / str(rank)).read_text()) for host, rank in ranks.items()}
    assert {host: s["share"] for host, s in seen.items()} == {"apu": 0.75, "apu-own": 0.9, "plain": 0.5}
    assert {host: s["env"] for host, s in seen.items()} == {"apu": "0.75", "apu-own": "0.9", "plain": "0.5"}
    # CPU ranks ignore the knob: no device budget, the data stays where the dataset keeps it.
    assert all(s["budget"] is None and s["resident"] is False for s in seen.values())

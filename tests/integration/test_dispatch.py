"""`local_devices: all` counted at dispatch over real OpenSSH.

The "workers" are this machine through a private sshd on loopback whose sessions
find a fake nvidia-smi first on PATH (sshd's SetEnv); the KFD topology is a fake
tree under tmp_path, handed to the count as its root.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from flodl_agent.config import Cluster, load_config
from flodl_agent.fleet.dispatch import DispatchError, count_devices
from tests.support import NO_GPU, free_port
from tests.support import sshd as sshd_kit
from tests.support.sshd import Sshd, loopback_cluster

ROOT = Path(__file__).parents[2]
H100 = "NVIDIA H100 80GB HBM3"


def launch(config: Path, *command: str) -> subprocess.CompletedProcess[str]:
    """`fdl launch` of ``config`` with the repository's fdl (the one fan-out runs on the workers)."""
    argv = [str(ROOT / ".venv" / "bin" / "fdl"), "launch", "--config", str(config), "--", *command]
    env = {**os.environ, "NO_COLOR": "1"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, check=False)


class Box:
    """The sshd, and the GPUs its fake tools list (rewritten per test)."""

    def __init__(self, server: Sshd, tmp: Path) -> None:
        self.server, self.tmp = server, tmp
        self.csv = tmp / "nvidia.csv"
        self.kfd = tmp / "kfd"
        self.kfd.mkdir()

    def nvidia(self, count: int) -> None:
        self.csv.write_text("".join(f"{i}, {H100}, 81559, 9.0\n" for i in range(count)))

    def amd(self, *versions: int) -> None:
        for node, version in enumerate((0, *versions)):  # node 0: the CPU (version 0)
            (self.kfd / str(node)).mkdir()
            (self.kfd / str(node) / "properties").write_text(
                f"cpu_cores_count 8\ngfx_target_version {version}\n"
            )

    def cluster(self, *devices: str) -> Cluster:
        path = loopback_cluster(self.tmp, self.server, free_port())
        data = yaml.safe_load(path.read_text())
        for worker, offer in zip(data["cluster"]["workers"], devices, strict=True):
            worker["local_devices"] = offer
        path.write_text(yaml.safe_dump(data))
        cluster = load_config(path).config.cluster
        assert cluster is not None
        return cluster


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Box]:
    if why := sshd_kit.missing():
        pytest.skip(why)
    tools = tmp_path / "tools"
    tools.mkdir()
    smi = tools / "nvidia-smi"
    csv = tmp_path / "nvidia.csv"
    # As the real one: the query's CSV, or "No devices were found" and a failure.
    smi.write_text(f'#!/bin/sh\n[ -s {csv} ] && exec cat {csv}\necho "No devices were found"\nexit 6\n')
    smi.chmod(0o755)
    path = f"{tools}:/usr/local/bin:/usr/bin:/bin"
    with sshd_kit.serve(tmp_path / "sshd", env={"PATH": path}) as server:
        yield Box(server, tmp_path)


def count(box: Box, cluster: Cluster) -> tuple[dict[str, int], list[str]]:
    log: list[str] = []
    counts = asyncio.run(count_devices(cluster, log.append, kfd=str(box.kfd)))
    return dict(counts), log


def test_nvidia_and_amd_workers_offering_all_are_counted_and_others_left_alone(box: Box) -> None:
    box.nvidia(2)
    counts, log = count(box, box.cluster("all", "cpu:1"))
    assert counts == {"fan-a": 2}  # fan-b lists its devices: nobody asks it
    assert f"fan-a: 2x {H100}: 2 rank(s)" in log
    box.nvidia(0)
    box.amd(90402, 90402, 90010)  # two MI300X and an MI250X, no ROCm runtime needed
    counts, log = count(box, box.cluster("all", "all"))
    assert counts == {"fan-a": 3, "fan-b": 3}
    assert "fan-b: AMD gfx90a, 2x AMD gfx942: 3 rank(s)" in log


def test_a_box_with_no_gpu_or_two_vendors_is_named_with_the_fix(box: Box) -> None:
    with pytest.raises(DispatchError) as none:
        count(box, box.cluster("all", "cpu:1"))
    assert "fan-a offers `local_devices: all`, but nvidia-smi and the KFD topology list no GPU" in str(
        none.value
    )
    assert "cpu:N" in none.value.fix and "min_rank_start" in none.value.fix
    box.nvidia(1)
    box.amd(90402)
    with pytest.raises(DispatchError, match="1 NVIDIA and 1 AMD GPU"):
        count(box, box.cluster("all", "cpu:1"))


def test_a_box_ssh_cannot_reach_names_the_host_the_ssh_error_and_the_fixes(box: Box) -> None:
    box.nvidia(1)
    cluster = box.cluster("all", "all")
    box.server.authorized_keys.write_text("")  # nobody may log in any more
    with pytest.raises(DispatchError) as refused:
        count(box, cluster)
    message = str(refused.value)
    assert "cannot count the devices of fan-a" in message and "cannot count the devices of fan-b" in message
    assert "Permission denied" in message  # the ssh client's own words
    assert "ssh: block" in refused.value.fix and "min_rank_start" in refused.value.fix


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "fdl").exists(), reason="needs the repository's .venv")
def test_a_default_shaped_cluster_launches_with_the_counted_capacity_as_its_plan(box: Box) -> None:
    box.nvidia(2)
    path = loopback_cluster(box.tmp, box.server, free_port(), join_timeout=300, max_join_timeout=600)
    data = yaml.safe_load(path.read_text())
    for worker in data["cluster"]["workers"]:
        worker.pop("local_devices")  # the default: all
    path.write_text(yaml.safe_dump(data))
    proc = launch(path, "true")
    assert "min_rank_start" not in proc.stderr, proc.stderr  # no hand-set quorum needed
    assert f"fan-a: 2x {H100}: 2 rank(s)" in proc.stderr and f"fan-b: 2x {H100}: 2 rank(s)" in proc.stderr
    assert "quorum 4, target 4" in proc.stderr
    # This box's torch drives no GPU: the agents stop at their GPU gate, and the launch fails
    # at once instead of holding the window (a counted capacity makes quorum's reach known).
    assert (
        proc.returncode == 1 and "no usable GPU" in proc.stderr and "quorum 4 is out of reach" in proc.stderr
    )


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "fdl").exists(), reason="needs the repository's .venv")
def test_a_launch_whose_all_worker_cannot_be_counted_fails_before_the_window_opens(box: Box) -> None:
    path = loopback_cluster(box.tmp, box.server, free_port())
    data = yaml.safe_load(path.read_text())
    data["cluster"]["workers"][0]["local_devices"] = "all"
    path.write_text(yaml.safe_dump(data))
    box.server.authorized_keys.write_text("")
    proc = launch(path, "true")
    assert proc.returncode == 1
    assert "fdl launch: cannot count the devices of fan-a (local_devices: all) over ssh" in proc.stderr
    assert "Permission denied" in proc.stderr and "join window open" not in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "fdl").exists(), reason="needs the repository's .venv")
def test_on_a_gpu_box_a_worker_offering_all_runs_one_rank_per_counted_gpu(sshd: Sshd, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or shutil.which("nvidia-smi") is None:
        pytest.skip(f"{NO_GPU} needs a CUDA device and nvidia-smi")
    out = tmp_path / "ranks"
    out.mkdir()
    path = loopback_cluster(tmp_path, sshd, free_port())
    data = yaml.safe_load(path.read_text())
    data["cluster"]["workers"] = [data["cluster"]["workers"][0] | {"local_devices": "all"}]
    path.write_text(yaml.safe_dump(data))
    rank = [sys.executable, "-c", f"import os; open(os.path.join(r'{out}', os.environ['FLODL_DEVICE']), 'w')"]
    proc = launch(path, *rank)
    gpus = torch.cuda.device_count()
    assert proc.returncode == 0, proc.stderr
    assert f"quorum {gpus}, target {gpus}" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [f"cuda:{i}" for i in range(gpus)]

"""init_ray in local-dev mode: a head per device set, reused by the next process without
a cold start, replaced when it is gone. Real `ray start` heads on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray")

CONNECT = """
import json, os, sys
from pathlib import Path
import ray
from flodl_agent.placement.ray_cluster import init_ray
address = init_ray(state=Path(sys.argv[1]))
print(json.dumps({"address": address, "gpus": ray.cluster_resources().get("GPU", 0)}))
"""


# After the parallel pass, alone: a Ray cluster holds fixed ports and /tmp/ray, and its start
# times out on a box that is busy with other tests.
pytestmark = pytest.mark.serial


def ray_stop() -> None:
    ray = Path(sys.executable).with_name("ray")
    subprocess.run([str(ray), "stop", "--force"], capture_output=True, timeout=120, check=False)


@pytest.fixture
def heads() -> Iterator[None]:
    ray_stop()  # nothing else runs Ray on a test box; a previous test's heads must not count
    try:
        yield
    finally:
        ray_stop()


def connect(state: Path, devices: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["CUDA_VISIBLE_DEVICES"] = devices
    done = subprocess.run(
        [sys.executable, "-c", CONNECT, str(state)], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_device_set_keeps_its_own_head_across_processes(tmp_path: Path, heads: None) -> None:
    first = connect(tmp_path, "0,1")
    assert first["gpus"] == 2
    again = connect(tmp_path, "0,1")
    assert again["address"] == first["address"]  # reused: no second cold start
    other = connect(tmp_path, "2")
    assert other["address"] != first["address"] and other["gpus"] == 1
    assert len(list(tmp_path.glob("*.json"))) == 2
    ray_stop()  # every head gone: the recorded address is stale
    fresh = connect(tmp_path, "0,1")
    assert fresh["gpus"] == 2


SMI = (
    "GPU 00000000:18:00.0\n    Fabric\n        CliqueId : 3\n"
    "        ClusterUUID : 2CC9B0F4-1111-2222-3333-444455556666\n"
)
NODES = """
import json, sys
import ray
from flodl_agent.placement.segments import decode_topology
ray.init(address=sys.argv[1])
print(json.dumps({"topology": decode_topology(ray.nodes()), "role": ray.get(ray.remote(
    lambda: __import__("os").environ.get("DOCKYARD_FLEET_ROLE")).remote())}))
"""


def test_a_fleet_node_registers_its_nvlink_domain_and_topological_rank(tmp_path: Path, heads: None) -> None:
    """What flodl-ray.service runs: `fdl placement node`, a real `ray start --block` head."""
    from tests.support import free_port

    (tmp_path / "smi.txt").write_text(SMI)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(FLODL_TOPO_RANK="0", DOCKYARD_FLEET_ROLE="trainer")
    fdl = Path(sys.executable).with_name("fdl")
    node = subprocess.Popen(
        [
            str(fdl),
            "placement",
            "node",
            "--port",
            str(port),
            "--smi",
            str(tmp_path / "smi.txt"),
            "--temp-dir",
            f"/tmp/flodl-rn-{os.getpid()}",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        # ray.init waits for the head to answer: the node's own readiness, no sleep.
        done = subprocess.run(
            [sys.executable, "-c", NODES, f"127.0.0.1:{port}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        seen = json.loads(done.stdout.strip().splitlines()[-1])
        (place,) = seen["topology"].values()
        # Rank 0 registered as topo_rank 1 (a resource of quantity 0 would vanish), decoded back to 0.
        assert place == ["2cc9b0f4111122223333444455556666_3", 0]
        assert seen["role"] == "trainer"  # the node's environment reaches its workers
    finally:
        node.terminate()
        node.wait(timeout=120)


def test_a_fleet_node_without_ray_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from flodl_agent.cli.main import cli

    dry = CliRunner().invoke(cli, ["placement", "node", "--address", "head.example", "--dry-run"])
    assert dry.exit_code == 0 and "--address=head.example:6379" in dry.output and "--block" in dry.output
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))  # a venv without Ray
    done = CliRunner().invoke(cli, ["placement", "node"])
    assert done.exit_code == 2 and "Ray is not installed in this venv" in done.output
    assert "flodl-fleet[ray]" in done.output

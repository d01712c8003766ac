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

"""The seed's own example files and the shipped examples validate as documented."""

from __future__ import annotations

from pathlib import Path

import pytest

from flodl_agent.config import DeviceOffer, load_config
from flodl_agent.config.ranks import known_ranks, plan_window

DATA = Path(__file__).parents[2] / "data"
EXAMPLES = Path(__file__).parents[3] / "flodl_agent" / "examples"


def test_seed_cluster_example_every_field() -> None:
    loaded = load_config(DATA / "seed-000.fdl.cluster.yml")
    cluster = loaded.config.cluster
    assert cluster is not None
    ctl = cluster.controller
    assert (ctl.host, ctl.port, ctl.path, ctl.docker, ctl.arch) == (
        "192.168.122.1",
        1337,
        "/opt/flodl",
        "cuda",
        "precompiled/cu128",
    )
    join = ctl.join
    assert (join.min_rank_start, join.join_timeout, join.target_ranks, join.max_join_timeout) == (
        2,
        300,
        4,
        600,
    )
    assert join.open_admission is False and join.start == "auto"
    a, b = cluster.workers
    assert a.local_devices == DeviceOffer("gpus", gpus=(0,)) and a.capacity == 1
    assert b.local_devices == DeviceOffer("all") and b.capacity is None
    assert (
        b.ssh is not None
        and b.ssh.port == 2222
        and b.ssh.options == ["ProxyJump=bastion", "StrictHostKeyChecking=no"]
    )
    assert b.tunnel and b.data_path == "/flodl/data" and b.env == {"NCCL_SOCKET_NTHREADS": "2"}
    assert cluster.env == {"NCCL_DEBUG": "INFO"}
    # node-b is probed at dispatch: capacity unknown, node-a's range is fixed already
    assert cluster.capacity is None
    assert [(r.host, r.start, r.stop) for r in known_ranks(cluster)] == [("node-a", 0, 1)]
    plan = plan_window(join, cluster.capacity)
    assert (plan.quorum, plan.target) == (2, 4)
    # the seed's example turns off host key checking: valid, but warned about
    (warning,) = loaded.warnings
    assert warning.path == "cluster.workers[1].ssh.options[1]" and warning.line == 32
    assert warning.severity == "warning"


def test_seed_fdl_yml_walk_in_recipes() -> None:
    config = load_config(DATA / "seed-000.fdl.yml").config
    assert config.join is not None and config.publish is not None
    assert config.join.ssh is not None and config.join.ssh.target == "ctrl.example.com"
    assert config.join.args == ["--model", "resnet"] and config.join.persist
    assert config.join.source is not None and config.join.source.from_.startswith("rsync://")
    assert config.publish.args[-1] == "20"


def test_overlay_of_the_seed_files() -> None:
    loaded = load_config(DATA / "seed-000.fdl.cluster.yml", base=DATA / "seed-000.fdl.yml")
    assert loaded.config.cluster is not None and loaded.config.join is not None
    assert loaded.files == [str(DATA / "seed-000.fdl.yml"), str(DATA / "seed-000.fdl.cluster.yml")]


@pytest.mark.parametrize("name", ["lab", "local", "gpu", "reference"])
def test_shipped_examples_are_valid_and_quiet(name: str) -> None:
    loaded = load_config(EXAMPLES / f"{name}.fdl.cluster.yml")
    assert loaded.config.cluster is not None
    assert loaded.warnings == []

"""ClusterBuilder mirrors the file one to one."""

from __future__ import annotations

from pathlib import Path

import pytest

from flodl_agent.config import ClusterBuilder, ConfigError, load_config

SEED = Path(__file__).parents[2] / "data" / "seed-000.fdl.cluster.yml"


def test_builder_produces_the_same_model_as_the_seed_file() -> None:
    built = (
        ClusterBuilder()
        .controller("192.168.122.1", port=1337, path="/opt/flodl", docker="cuda", arch="precompiled/cu128")
        .join(min_rank_start=2, join_timeout=300, target_ranks=4, max_join_timeout=600, open_admission=False)
        .worker(
            "node-a",
            local_devices=[0],
            nccl_socket_ifname="virbr0",
            path="/opt/flodl",
            arch="precompiled/cu128",
            docker="cuda",
        )
        .worker(
            "node-b",
            ssh={
                "target": "node-b",
                "port": 2222,
                "user": "ubuntu",
                "identity_file": "/home/me/.ssh/cluster_key",
                "options": ["ProxyJump=bastion", "StrictHostKeyChecking=no"],
            },
            tunnel=True,
            local_devices="all",
            nccl_socket_ifname="enp1s0",
            path="/srv/flodl",
            arch="builds/sm61-sm120",
            data_path="/flodl/data",
            env={"NCCL_SOCKET_NTHREADS": "2"},
        )
        .env(NCCL_DEBUG="INFO")
        .build()
    )
    assert built == load_config(SEED).config.cluster


def test_builder_errors_read_like_file_errors() -> None:
    builder = ClusterBuilder().controller("h").worker("a", local_devics=[0]).worker("b", local_devices=[1])
    with pytest.raises(ConfigError) as caught:
        builder.build()
    (p,) = caught.value.problems
    assert p.path == "cluster.workers[0].local_devics" and p.hint == "did you mean `local_devices`?"
    with pytest.raises(ConfigError) as caught:
        ClusterBuilder().controller("h").worker("a").worker("b").build()
    assert {p.path for p in caught.value.problems} == {
        "cluster.workers[0].nccl_socket_ifname",
        "cluster.workers[1].nccl_socket_ifname",
    }


def test_builder_needs_a_controller() -> None:
    with pytest.raises(ConfigError) as caught:
        ClusterBuilder().worker("a").build()
    assert caught.value.problems[0].path == "cluster.controller"


def test_gpu_ram_share_and_join_knobs_land_where_the_file_puts_them() -> None:
    builder = ClusterBuilder().controller("h").join(start="manual").gpu_ram_share(0.5).worker("a")
    assert builder.to_data() == {
        "cluster": {
            "controller": {"host": "h", "join": {"start": "manual"}},
            "workers": [{"host": "a"}],
            "gpu_ram_share": 0.5,
        }
    }


def test_host_facts_take_the_worker_entry_over_the_cluster_default() -> None:
    cluster = (
        ClusterBuilder()
        .controller("h")
        .gpu_ram_share(0.5)
        .worker("apu", gpu_ram_share=0.75, docker="train", nccl_socket_ifname="eth0")
        .worker("plain", nccl_socket_ifname="eth0")
        .build()
    )
    assert cluster.host_facts("apu") == {"docker": "train", "gpu_ram_share": 0.75}
    assert cluster.host_facts("plain") == {"gpu_ram_share": 0.5}  # the fleet default
    assert cluster.host_facts(None) == {"gpu_ram_share": 0.5}  # a walk-in in no entry
    assert ClusterBuilder().controller("h").worker("a").build().host_facts("a") == {}


def test_elastic_lands_in_the_join_block_beside_the_other_knobs() -> None:
    builder = ClusterBuilder().controller("h").join(target_ranks=2).elastic(8).worker("a")
    assert builder.to_data()["cluster"]["controller"]["join"] == {
        "target_ranks": 2,
        "elastic": {"max_ranks": 8, "planes": ["cpu"]},
    }
    elastic = builder.build().controller.join.elastic
    assert elastic is not None and (elastic.max_ranks, elastic.planes) == (8, ["cpu"])
    both = ClusterBuilder().controller("h").elastic(4, ("cpu", "nccl")).worker("a").build()
    assert both.controller.join.elastic is not None and both.controller.join.elastic.planes == ["cpu", "nccl"]
    assert both.controller.join.elastic.reform_interval == 60  # the default: a process group's pace
    assert both.controller.join.elastic.replace_timeout == 300  # a lost host's replacement: minutes
    quick = (
        ClusterBuilder().controller("h").elastic(4, reform_interval=0, replace_timeout=5).worker("a").build()
    )
    assert quick.controller.join.elastic is not None and quick.controller.join.elastic.reform_interval == 0
    assert quick.controller.join.elastic.replace_timeout == 5


def test_a_bad_elastic_ceiling_from_code_reads_like_the_file_s() -> None:
    with pytest.raises(ConfigError) as caught:
        ClusterBuilder().controller("h").join(min_rank_start=3).elastic(2).worker("a").build()
    (p,) = caught.value.problems
    assert p.path == "cluster.controller.join.elastic.max_ranks" and "below min_rank_start (3)" in p.message

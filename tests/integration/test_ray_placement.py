"""Placement on a real multi-node Ray cluster on this machine (ray.cluster_utils.Cluster):
fake GPUs, NVLink domains and topological ranks as custom resources per node."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from flodl_agent.placement import UNKNOWN, FleetSpec, ParallelismSpec, PlacementError, select_segment_nodes

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group_table  # noqa: E402

from flodl_agent.placement.ray_cluster import (  # noqa: E402
    RayVirtualCluster,
    build_cluster,
    get_ray_cluster_topology,
)

# Two NVLink domains of two 2-GPU nodes each; topo_rank is rank + 1 (a 0 would vanish).
NODES = [("A", 0), ("A", 1), ("B", 2), ("B", 3)]


# After the parallel pass, alone: a Ray cluster holds fixed ports and /tmp/ray, and its start
# times out on a box that is busy with other tests.
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Any, list[Any]]]:
    lab = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    nodes = [
        lab.add_node(num_cpus=2, num_gpus=2, resources={f"nvlink_domain_{domain}": 1, "topo_rank": rank + 1})
        for domain, rank in NODES
    ]
    lab.wait_for_nodes()
    ray.init(address=lab.address)
    try:
        yield lab, nodes
    finally:
        ray.shutdown()
        lab.shutdown()


def placed_on(group: Any) -> set[str]:
    return set(placement_group_table(group)["bundles_to_node_id"].values())


def test_the_topology_is_read_from_the_live_cluster(cluster: tuple[Any, list[Any]]) -> None:
    topology = get_ray_cluster_topology()
    known = sorted(v for v in topology.values() if v[0] != UNKNOWN)
    assert known == sorted(NODES)
    assert sum(1 for v in topology.values() if v[0] == UNKNOWN) == 1  # the head registered nothing


def test_a_segment_pinned_trainer_gets_strict_pack_groups_inside_one_domain(
    cluster: tuple[Any, list[Any]],
) -> None:
    topology = get_ray_cluster_topology()
    virtual = build_cluster(
        FleetSpec("trainer", 2, 2, segment_size=2), ParallelismSpec(tensor=2, data=2), topology
    )
    try:
        groups = virtual.get_placement_groups()
        assert len(groups) == 2
        nodes = [placed_on(g) for g in groups]
        assert all(len(n) == 1 for n in nodes)  # STRICT_PACK: each logical node on one physical node
        chosen = {next(iter(n)) for n in nodes}
        assert len(chosen) == 2 and {topology[n][0] for n in chosen} == {"A"}  # one segment, first domain
    finally:
        virtual.shutdown()


def test_a_replica_larger_than_a_node_gets_one_unified_group(cluster: tuple[Any, list[Any]]) -> None:
    virtual = build_cluster(FleetSpec("inference", 2, 2), ParallelismSpec(tensor=4))
    try:
        (group,) = virtual.get_placement_groups()
        assert len(placed_on(group)) == 2  # PACK over two nodes: one cross-node group
    finally:
        virtual.shutdown()


def test_a_sandbox_claims_no_gpu(cluster: tuple[Any, list[Any]]) -> None:
    virtual = build_cluster(FleetSpec("sandbox", 3, 0))
    try:
        assert len(virtual.get_placement_groups()) == 3
        assert all("GPU" not in b for group in virtual.bundles() for b in group)
    finally:
        virtual.shutdown()


def test_an_infeasible_group_fails_in_bounded_time_naming_what_is_missing(
    cluster: tuple[Any, list[Any]],
) -> None:
    too_big = RayVirtualCluster([4], num_gpus_per_node=4)  # STRICT_PACK 4 GPUs: no node has 4
    with pytest.raises(PlacementError) as caught:
        too_big._init_placement_groups(timeout=3)
    assert (
        "not ready after 3s" in caught.value.message and "no node has that much free" in caught.value.message
    )
    too_many = RayVirtualCluster([2] * 5, num_gpus_per_node=2)
    with pytest.raises(PlacementError) as caught:
        too_many._init_placement_groups(timeout=3)
    assert (
        "GPU 10 (the cluster has 8)" in caught.value.message and "2 x {CPU 1, GPU 1}" in caught.value.message
    )
    # Nothing is left pending: the same request that fits still places at once.
    fits = RayVirtualCluster([2] * 4, num_gpus_per_node=2)
    try:
        assert len(fits._init_placement_groups(timeout=30)) == 4
    finally:
        fits.shutdown()


def test_init_ray_attaches_to_ray_address_and_forwards_the_environment(
    cluster: tuple[Any, list[Any]],
) -> None:
    lab, _ = cluster
    script = (
        "import os, ray\n"
        "from flodl_agent.placement.ray_cluster import init_ray\n"
        "init_ray()\n"
        "print(ray.get(ray.remote(lambda: os.environ.get('DOCKYARD_FLEET_ROLE')).remote()))\n"
    )
    env = {**__import__("os").environ, "RAY_ADDRESS": lab.address, "DOCKYARD_FLEET_ROLE": "trainer"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "trainer"


def test_a_node_removed_mid_run_leaves_the_topology_and_its_segment(cluster: tuple[Any, list[Any]]) -> None:
    lab, nodes = cluster
    before = get_ray_cluster_topology()
    assert select_segment_nodes(before, 2, 4)[0]
    lab.remove_node(nodes[3])  # a node of domain B goes away
    after = get_ray_cluster_topology()
    assert sorted(v for v in after.values() if v[0] != UNKNOWN) == sorted(NODES[:3])
    with pytest.raises(PlacementError, match="need 2 complete segments; the NVLink domains hold 1"):
        select_segment_nodes(after, 2, 4)


def test_fdl_plan_reads_the_live_cluster_and_picks_its_segments(cluster: tuple[Any, list[Any]]) -> None:
    import json

    from click.testing import CliRunner

    from flodl_agent.cli.main import cli

    lab, _ = cluster
    runner = CliRunner()
    shown = runner.invoke(
        cli, ["plan", "--ray", lab.address, "--nodes", "2", "--segment-size", "2", "--tensor", "2", "--json"]
    )
    assert shown.exit_code == 0, shown.output
    report = json.loads(shown.output)
    assert report["fleet"]["gpus_per_node"] == 2 and report["parallelism"]["data"] == 2
    topology = get_ray_cluster_topology()
    assert {topology[n][0] for n in report["segment_nodes"]} == {"A"}
    refused = runner.invoke(cli, ["plan", "--ray", lab.address, "--nodes", "2", "--tensor", "4"])
    assert refused.exit_code == 1 and "tensor-parallel size 4 exceeds a node's 2 GPUs" in refused.output

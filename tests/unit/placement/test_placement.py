"""Fleet placement's pure parts (seed 001): roles, FleetSpec invariants, pre-flight
parallelism arithmetic, and NVLink-segment selection (hypothesis for its invariants)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_agent.placement import (
    UNKNOWN,
    FleetSpec,
    ParallelismSpec,
    PlacementError,
    decode_topology,
    get_fleet_role,
    preflight,
    select_segment_nodes,
    topology_resources,
)


def refused(call: object) -> PlacementError:
    with pytest.raises(PlacementError) as caught:
        call()  # type: ignore[operator]
    return caught.value


# --- roles and FleetSpec -------------------------------------------------------------


@pytest.mark.parametrize("role", ["trainer", "inference", "sandbox"])
def test_a_declared_role_is_read(role: str) -> None:
    assert get_fleet_role({"DOCKYARD_FLEET_ROLE": role}) == role


@pytest.mark.parametrize(
    ("env", "said"), [({}, "is not set"), ({"DOCKYARD_FLEET_ROLE": "trainr"}, "is `trainr`")]
)
def test_a_missing_or_unknown_role_names_the_allowed_values(env: dict[str, str], said: str) -> None:
    error = refused(lambda: get_fleet_role(env))
    assert said in error.message and error.fix == "set it to one of: trainer, inference, sandbox"


def test_from_env_builds_the_spec_with_the_roles_default_strategy() -> None:
    env = {"DOCKYARD_FLEET_ROLE": "inference", "DOCKYARD_NUM_NODES": "4", "DOCKYARD_GPUS_PER_NODE": "8"}
    spec = FleetSpec.from_env(env)
    assert (spec.num_nodes, spec.gpus_per_node, spec.placement_strategy) == (4, 8, "PACK")
    assert (
        FleetSpec.from_env({**env, "DOCKYARD_PG_STRATEGY": "strict_pack"}).placement_strategy == "STRICT_PACK"
    )
    assert FleetSpec("trainer", 2, 8).placement_strategy == "SPREAD"
    sandbox = FleetSpec.from_env({"DOCKYARD_FLEET_ROLE": "sandbox", "DOCKYARD_NUM_NODES": "16"})
    assert (sandbox.gpus_per_node, sandbox.placement_strategy) == (0, "SPREAD")
    with pytest.raises(AttributeError):
        spec.num_nodes = 3  # type: ignore[misc]  # immutable


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        (
            {"DOCKYARD_FLEET_ROLE": "sandbox", "DOCKYARD_NUM_NODES": "2", "DOCKYARD_GPUS_PER_NODE": "1"},
            "DOCKYARD_GPUS_PER_NODE",
        ),
        (
            {"DOCKYARD_FLEET_ROLE": "trainer", "DOCKYARD_NUM_NODES": "2", "DOCKYARD_GPUS_PER_NODE": "0"},
            "DOCKYARD_GPUS_PER_NODE",
        ),
        ({"DOCKYARD_FLEET_ROLE": "trainer", "DOCKYARD_NUM_NODES": "2"}, "DOCKYARD_GPUS_PER_NODE"),
        (
            {"DOCKYARD_FLEET_ROLE": "trainer", "DOCKYARD_NUM_NODES": "two", "DOCKYARD_GPUS_PER_NODE": "8"},
            "DOCKYARD_NUM_NODES",
        ),
        (
            {
                "DOCKYARD_FLEET_ROLE": "trainer",
                "DOCKYARD_NUM_NODES": "2",
                "DOCKYARD_GPUS_PER_NODE": "8",
                "DOCKYARD_PG_STRATEGY": "RANDOM",
            },
            "DOCKYARD_PG_STRATEGY",
        ),
        (
            {
                "DOCKYARD_FLEET_ROLE": "trainer",
                "DOCKYARD_NUM_NODES": "6",
                "DOCKYARD_GPUS_PER_NODE": "8",
                "DOCKYARD_SEGMENT_SIZE": "4",
            },
            "DOCKYARD_SEGMENT_SIZE",
        ),
        (
            {
                "DOCKYARD_FLEET_ROLE": "trainer",
                "DOCKYARD_NUM_NODES": "2",
                "DOCKYARD_GPUS_PER_NODE": "8",
                "DOCKYARD_MAX_COLOCATED_WORKER_GROUPS": "0",
            },
            "DOCKYARD_MAX_COLOCATED_WORKER_GROUPS",
        ),
    ],
)
def test_every_broken_invariant_names_its_variable(env: dict[str, str], variable: str) -> None:
    assert variable in refused(lambda: FleetSpec.from_env(env)).message


# --- pre-flight ----------------------------------------------------------------------


def test_a_replica_within_a_node_gets_per_node_groups() -> None:
    plan = preflight(ParallelismSpec(tensor=4, pipeline=2, data=2, expert=4), FleetSpec("trainer", 2, 8))
    assert (plan.replica_gpus, plan.replicas, plan.unified, plan.strategy) == (8, 2, False, "SPREAD")
    assert plan.bundles_per_node == [8, 8]


def test_a_replica_larger_than_a_node_needs_a_unified_group_and_says_so() -> None:
    plan = preflight(ParallelismSpec(tensor=8, pipeline=2, data=1), FleetSpec("inference", 2, 8))
    assert (
        plan.unified
        and "must use a unified cross-node placement group (2 nodes per replica)" in plan.notes[0]
    )
    assert "promotes" in plan.notes[1]
    # A trainer may span nodes with pipeline stages, its tensor-parallel ranks inside a node.
    assert preflight(ParallelismSpec(tensor=8, pipeline=2, data=1), FleetSpec("trainer", 2, 8)).unified


@pytest.mark.parametrize(
    ("spec", "fleet", "arithmetic"),
    [
        (ParallelismSpec(tensor=4, expert=6, data=2), FleetSpec("trainer", 1, 8), "(6 % 4 = 2)"),
        (
            ParallelismSpec(tensor=2, pipeline=2, data=3),
            FleetSpec("trainer", 2, 4),
            "2 x 2 x 3 = 12 GPUs, but the fleet has 2 nodes x 4 GPUs = 8",
        ),
        (
            ParallelismSpec(tensor=3, data=4),
            FleetSpec("trainer", 3, 4),
            "do not tile a 4-GPU node (4 % 3 = 1)",
        ),
        (ParallelismSpec(tensor=2, pipeline=3, data=2), FleetSpec("inference", 3, 4), "spans 1.5 nodes of 4"),
        (
            ParallelismSpec(tensor=16),
            FleetSpec("trainer", 2, 8),
            "tensor-parallel size 16 exceeds a node's 8 GPUs",
        ),
        (
            ParallelismSpec(tensor=8, pipeline=4),
            FleetSpec("inference", 4, 8, segment_size=2),
            "spans 32 / 8 = 4 nodes, an NVLink segment has 2",
        ),
        (ParallelismSpec(), FleetSpec("sandbox", 4, 0), "a sandbox fleet has no GPUs"),
    ],
)
def test_impossible_requests_fail_with_the_arithmetic(
    spec: ParallelismSpec, fleet: FleetSpec, arithmetic: str
) -> None:
    assert arithmetic in refused(lambda: preflight(spec, fleet)).message


def test_the_product_fix_suggests_the_data_size() -> None:
    error = refused(lambda: preflight(ParallelismSpec(tensor=2, data=3), FleetSpec("trainer", 2, 4)))
    assert error.fix == "set data = 4 to use every GPU"
    assert "data-parallel" in refused(lambda: ParallelismSpec(data=0)).message


# --- segments ------------------------------------------------------------------------


def test_decoding_ray_nodes_reads_domains_and_ranks_and_leaves_the_unregistered_unknown() -> None:
    nodes = [
        {"NodeID": "a", "Alive": True, "Resources": {"nvlink_domain_x": 1.0, "topo_rank": 1.0, "GPU": 8.0}},
        {"NodeID": "b", "Alive": True, "Resources": {"nvlink_domain_x": 1.0, "topo_rank": 3.0}},
        {"NodeID": "c", "Alive": True, "Resources": {"GPU": 8.0}},
        {"NodeID": "d", "Alive": False, "Resources": {"nvlink_domain_y": 1.0, "topo_rank": 2.0}},
    ]
    assert decode_topology(nodes) == {"a": ("x", 0), "b": ("x", 2), "c": (UNKNOWN, -1)}


def test_a_node_registers_its_fabric_and_rank_plus_one() -> None:
    smi = (
        "    Fabric\n        State : Completed\n        CliqueId : 7\n"
        "        ClusterUUID : 2CC9B0F4-1111-2222-3333-444455556666\n"
    )
    assert topology_resources(smi * 4, {"SLURM_NODEID": "0"}) == {
        "nvlink_domain_2cc9b0f4111122223333444455556666_7": 1.0,
        "topo_rank": 1.0,  # rank 0 as 1: a resource of quantity 0 vanishes from Ray
    }
    none = "        ClusterUUID : 00000000-0000-0000-0000-000000000000\n"
    assert topology_resources(none, {}) == {} and topology_resources("no fabric here", {}) == {}


def test_segments_are_taken_whole_per_domain_in_topological_order() -> None:
    topology = {
        "n1": ("A", 0),
        "n2": ("A", 1),
        "n3": ("A", 2),  # 3 nodes: one segment of 2, one left over
        "n4": ("B", 3),
        "n5": ("B", 4),
        "n6": (UNKNOWN, -1),
    }
    assert select_segment_nodes(topology, 2, 4) == (["n1", "n2", "n4", "n5"], ["n3", "n6"])
    error = refused(lambda: select_segment_nodes(topology, 2, 6))
    assert (
        "need 3 complete segments; the NVLink domains hold 2 (A: 3, B: 2; 1 nodes without topology"
        in error.message
    )
    assert "(5 % 2 = 1)" in refused(lambda: select_segment_nodes(topology, 2, 5)).message


topologies = st.dictionaries(
    st.text("abcdefgh", min_size=1, max_size=4),
    st.tuples(st.sampled_from(["A", "B", "C", UNKNOWN]), st.integers(0, 50)),
    max_size=24,
)


@settings(max_examples=300, deadline=None)
@given(topologies, st.integers(1, 4), st.integers(0, 6))
def test_selection_invariants(topology: dict[str, tuple[str, int]], size: int, segments: int) -> None:
    wanted = size * segments
    try:
        selected, rest = select_segment_nodes(topology, size, wanted)
    except PlacementError:
        # Refused only when the domains truly cannot supply the complete segments.
        whole = sum(sum(1 for d, _ in topology.values() if d == domain) // size for domain in {"A", "B", "C"})
        assert whole < segments
        return
    assert len(selected) == wanted
    assert not set(selected) & set(rest) and set(selected) | set(rest) == set(topology)  # disjoint, complete
    assert all(topology[n][0] != UNKNOWN for n in selected)  # the unknown pseudo-domain is never chosen
    for i in range(0, wanted, size):  # no segment spans two domains
        assert len({topology[n][0] for n in selected[i : i + size]}) == 1


# --- fdl plan ------------------------------------------------------------------------


def test_fdl_plan_checks_a_request_against_flags_a_cluster_file_or_the_environment(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from click.testing import CliRunner

    from flodl_agent.cli.main import cli

    runner = CliRunner()
    ok = runner.invoke(
        cli, ["plan", "--role", "trainer", "--nodes", "2", "--gpus-per-node", "8", "--tensor", "4", "--json"]
    )
    assert ok.exit_code == 0, ok.output
    report = json.loads(ok.output)
    assert report["parallelism"]["data"] == 4 and report["replicas"] == 4 and not report["unified"]
    env = {"DOCKYARD_FLEET_ROLE": "inference", "DOCKYARD_NUM_NODES": "2", "DOCKYARD_GPUS_PER_NODE": "4"}
    unified = runner.invoke(cli, ["plan", "--tensor", "8", "--json"], env=env)
    assert json.loads(unified.output)["unified"] is True
    bad = runner.invoke(cli, ["plan", "--tensor", "4", "--expert", "6"], env=env)
    assert bad.exit_code == 1 and "(6 % 4 = 2)" in bad.output
    cluster = tmp_path / "fdl.cluster.yml"
    cluster.write_text(
        json.dumps(
            {
                "cluster": {
                    "controller": {"host": "10.0.0.1"},
                    "workers": [
                        {"host": "gpu-a", "local_devices": [0, 1, 2, 3], "nccl_socket_ifname": "eth0"},
                        {"host": "gpu-b", "local_devices": [0, 1], "nccl_socket_ifname": "eth0"},
                    ],
                }
            }
        )
    )
    uneven = runner.invoke(cli, ["plan", "--config", str(cluster), "--tensor", "2"], env={})
    said = "cluster.workers[1] (gpu-b) has 2 GPUs, cluster.workers[0] (gpu-a) 4 GPUs"
    assert uneven.exit_code == 1 and said in uneven.output


def test_fdl_plan_given_a_fleet_by_flags_plans_a_trainer_fleet_and_words_its_errors_in_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from click.testing import CliRunner

    from flodl_agent.cli.main import cli

    for var in (
        "DOCKYARD_FLEET_ROLE",
        "DOCKYARD_NUM_NODES",
        "DOCKYARD_GPUS_PER_NODE",
        "DOCKYARD_SEGMENT_SIZE",
    ):
        monkeypatch.delenv(var, raising=False)
    runner = CliRunner()
    readme = runner.invoke(
        cli, ["plan", "--tensor", "4", "--nodes", "2", "--gpus-per-node", "8"]
    )  # as README.md
    assert readme.exit_code == 0 and "placeable: trainer fleet, 2 nodes x 8 GPUs" in readme.output
    cases = {
        ("--nodes", "2"): ("--gpus-per-node is not given", "give --gpus-per-node a whole number"),
        ("--nodes", "2", "--gpus-per-node", "0"): ("--gpus-per-node is 0 for a trainer fleet", "needs GPUs"),
        ("--nodes", "3", "--gpus-per-node", "8", "--segment-size", "2"): (
            "--segment-size 2 does not divide --nodes 3 (3 % 2 = 1)",
            "divides the node count",
        ),
    }
    for argv, (message, fix) in cases.items():
        said = runner.invoke(cli, ["plan", *argv, "--json"])
        assert said.exit_code == 1 and json.loads(said.output)["error"] == message, said.output
        assert fix in json.loads(said.output)["fix"] and "DOCKYARD" not in said.output
    # No fleet given at all: the container's variables, and how to give one by flags instead.
    bare = runner.invoke(cli, ["plan", "--tensor", "4", "--json"])
    assert bare.exit_code == 1 and json.loads(bare.output)["error"] == "DOCKYARD_FLEET_ROLE is not set"
    assert "or describe the fleet: --nodes N --gpus-per-node G" in json.loads(bare.output)["fix"]
    # A container's declared role stands under flags that only count the fleet.
    monkeypatch.setenv("DOCKYARD_FLEET_ROLE", "inference")
    inference = runner.invoke(cli, ["plan", "--tensor", "8", "--nodes", "2", "--gpus-per-node", "4"])
    assert inference.exit_code == 0 and "placeable: inference fleet" in inference.output


def test_fdl_placement_resources_prints_what_ray_start_takes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from click.testing import CliRunner

    from flodl_agent.cli.main import cli

    smi = tmp_path / "smi.txt"
    smi.write_text(
        "    Fabric\n        CliqueId : 3\n        ClusterUUID : 2CC9B0F4-1111-2222-3333-444455556666\n"
    )
    shown = CliRunner().invoke(cli, ["placement", "resources", "--smi", str(smi)], env={"SLURM_NODEID": "5"})
    assert shown.exit_code == 0
    resources = json.loads(shown.output)
    assert resources == {"nvlink_domain_2cc9b0f4111122223333444455556666_3": 1.0, "topo_rank": 6.0}
    # What a node registers decodes back to its domain and rank.
    decoded = decode_topology([{"NodeID": "n", "Alive": True, "Resources": resources}])
    assert decoded == {"n": ("2cc9b0f4111122223333444455556666_3", 5)}


def test_fdl_plan_counts_the_gpu_example_and_asks_for_what_a_file_cannot_say(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from flodl_agent.cli.main import cli

    runner = CliRunner()

    def cluster_file(name: str, workers: list[dict[str, object]] | None = None) -> str:
        path = tmp_path / f"{name}.yml"
        if workers is None:  # a shipped example, as docs/placement.md writes it out
            path.write_text(runner.invoke(cli, ["config", "example", name]).output)
        else:
            path.write_text(json.dumps({"cluster": {"controller": {"host": "10.0.0.1"}, "workers": workers}}))
        return str(path)

    def plan(path: str, *flags: str) -> dict[str, Any]:
        result = runner.invoke(cli, ["plan", "--config", path, "--tensor", "2", *flags, "--json"], env={})
        return dict(json.loads(result.output), exit_code=result.exit_code)

    gpu = plan(cluster_file("gpu"), "--pipeline", "2")
    assert gpu["ok"] and gpu["fleet"] == {
        "role": "trainer", "nodes": 2, "gpus_per_node": 8, "strategy": "SPREAD", "segment_size": None,
    }  # fmt: skip
    assert gpu["parallelism"]["data"] == 4
    smaller = plan(cluster_file("gpu"), "--gpus-per-node", "4")  # a flag beats the file's count
    assert smaller["fleet"]["gpus_per_node"] == 4 and smaller["fleet"]["nodes"] == 2
    walk_ins = plan(cluster_file("local"))
    assert walk_ins["exit_code"] == 1 and "lists no workers" in walk_ins["error"]
    assert walk_ins["fix"] == "give the fleet to expect: --nodes N --gpus-per-node G"
    assert plan(cluster_file("local"), "--nodes", "3", "--gpus-per-node", "2")["fleet"]["nodes"] == 3

    def boxes(offer: str) -> list[dict[str, object]]:
        return [{"host": f"box-{i}", "local_devices": offer, "nccl_socket_ifname": "eth0"} for i in range(2)]

    probed = boxes("all")
    unknown = plan(cluster_file("all", probed))
    assert unknown["exit_code"] == 1 and "only when the box is probed" in unknown["error"]
    assert "--gpus-per-node" in unknown["fix"]
    assert plan(cluster_file("all", probed), "--gpus-per-node", "8")["ok"]
    cpu = plan(cluster_file("cpu", boxes("cpu:2")))
    assert cpu["fleet"]["gpus_per_node"] == 2
    assert any("CPU ranks: 2 per node" in note for note in cpu["notes"])
    uneven = plan(cluster_file("lab"))
    assert "(lab-worker-2) has 1 CPU rank, cluster.workers[0] (lab-worker-1) 2 CPU ranks" in uneven["error"]

"""The rank environment as a function of its inputs: no /sys, no os.environ, no interpreter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flodl_agent.agent.rank_env import Box, box_env, rank_envs
from flodl_agent.protocol.messages import HostEnvelope, WorldFormed

BASE = {"HOME": "/home/flodl", "PATH": "/usr/bin", "FDL_TOKEN": "0" * 32, "FLODL_INTERNAL_AGENT_JSON": "7b7d"}


def world(first: int = 0, count: int = 1, size: int = 1, group: int = 0, **fields: Any) -> WorldFormed:
    return WorldFormed(
        world_size=size,
        host=HostEnvelope(host="a", first_rank=first, count=count),
        group=group,
        hosts=group + 1,
        command=["x"],
        **fields,
    )


@pytest.mark.parametrize(
    ("box", "expected"),
    [
        (Box(BASE, "/venv/bin:/usr/bin"), {"HOME": "/home/flodl", "PATH": "/venv/bin:/usr/bin"}),
        (
            Box(BASE, "/venv/bin", data_path="/flodl/data", env={"X": "1"}),
            {
                "HOME": "/home/flodl",
                "PATH": "/venv/bin",
                "FLODL_DATA_PATH": "/flodl/data",
            },  # env: is the caller's
        ),
        (Box({"FLODL_INTERNAL_X": "1", "FLODL_DATA": "kept"}, ""), {"FLODL_DATA": "kept", "PATH": ""}),
    ],
)
def test_a_box_env_drops_the_credential_and_our_plumbing(box: Box, expected: dict[str, str]) -> None:
    assert box_env(box) == expected


def test_two_ranks_on_the_second_host_get_torchrun_s_variables() -> None:
    formed = world(first=3, count=2, size=5, group=1, launch="nightly")
    box = Box(BASE, "/venv/bin", data_path="/flodl/data")
    envs = rank_envs(box, formed, ["cuda:0", "cuda:3"], "127.0.0.1:40111", 45000)
    shared = {
        "HOME": "/home/flodl",
        "PATH": "/venv/bin",
        "FLODL_DATA_PATH": "/flodl/data",
        "WORLD_SIZE": "5",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "45000",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_RUN_ID": "nightly",
        "FLODL_CONTROLLER": "127.0.0.1:40111",
        "FLODL_LAUNCH": "nightly",
        "OMP_NUM_THREADS": "1",  # ranks sharing a box must not oversubscribe it
    }
    assert envs == [
        shared | {"RANK": "3", "LOCAL_RANK": "0", "FLODL_DEVICE": "cuda:0", "CUDA_VISIBLE_DEVICES": "0"},
        shared | {"RANK": "4", "LOCAL_RANK": "1", "FLODL_DEVICE": "cuda:3", "CUDA_VISIBLE_DEVICES": "3"},
    ]


@pytest.mark.parametrize(
    ("box", "formed", "devices", "key", "values"),
    [
        # the launch's label names the torchelastic run; none is "flodl"
        (Box({}, ""), world(), ["cpu:0"], "TORCHELASTIC_RUN_ID", ["flodl"]),
        # host env beats cluster env; the cluster env beats the agent's own
        (
            Box({"NCCL_DEBUG": "TRACE"}, ""),
            world(env={"NCCL_DEBUG": "WARN"}),
            ["cpu:0"],
            "NCCL_DEBUG",
            ["WARN"],
        ),
        (
            Box({}, "", env={"NCCL_DEBUG": "INFO"}),
            world(env={"NCCL_DEBUG": "WARN"}),
            ["cpu:0"],
            "NCCL_DEBUG",
            ["INFO"],
        ),
        # an env: entry cannot move a rank: the rank's own variables win
        (Box({}, "", env={"RANK": "9"}), world(), ["cpu:0"], "RANK", ["0"]),
        # the interfaces: given unless an env: entry names them
        (Box({}, "", ifnames={"GLOO_SOCKET_IFNAME": "lo"}), world(), ["cpu:0"], "GLOO_SOCKET_IFNAME", ["lo"]),
        (
            Box({}, "", env={"GLOO_SOCKET_IFNAME": "eth9"}, ifnames={"GLOO_SOCKET_IFNAME": "lo"}),
            world(),
            ["cpu:0"],
            "GLOO_SOCKET_IFNAME",
            ["eth9"],
        ),
        # one rank alone keeps the agent's thread count; a set one is kept when ranks share
        (Box({"OMP_NUM_THREADS": "16"}, ""), world(), ["cpu:0"], "OMP_NUM_THREADS", ["16"]),
        (
            Box({}, ""),
            world(count=2, size=2, env={"OMP_NUM_THREADS": "8"}),
            ["cpu:0", "cpu:1"],
            "OMP_NUM_THREADS",
            ["8", "8"],
        ),
        # CPU ranks see no CUDA_VISIBLE_DEVICES from us (the agent's own one passes through)
        (Box({"CUDA_VISIBLE_DEVICES": "7"}, ""), world(), ["cpu:0"], "CUDA_VISIBLE_DEVICES", ["7"]),
        (Box({"CUDA_VISIBLE_DEVICES": "7"}, ""), world(), ["cuda:2"], "CUDA_VISIBLE_DEVICES", ["2"]),
    ],
)
def test_which_source_wins(
    box: Box, formed: WorldFormed, devices: list[str], key: str, values: list[str]
) -> None:
    assert [env.get(key) for env in rank_envs(box, formed, devices, "h:1", 1)] == values


def test_the_plane_and_the_progress_reports_reach_each_rank(tmp_path: Path) -> None:
    reports = {r: tmp_path / f"metrics-{r}.json" for r in (2, 3)}
    plane = {"FLODL_PLANE": "cpu", "FLODL_PLANE_DIR": str(tmp_path)}
    envs = rank_envs(
        Box({}, ""), world(first=2, count=2, size=4), ["cpu:0", "cpu:1"], "h:1", 1, plane, reports
    )
    assert [e["FLODL_METRICS_FILE"] for e in envs] == [str(reports[2]), str(reports[3])]
    assert all(e["FLODL_PLANE"] == "cpu" and e["FLODL_PLANE_DIR"] == str(tmp_path) for e in envs)
    assert "FLODL_METRICS_FILE" not in rank_envs(Box({}, ""), world(), ["cpu:0"], "h:1", 1)[0]


def _enveloped(share: float | None) -> WorldFormed:
    host = HostEnvelope(host="a", first_rank=0, count=1, gpu_ram_share=share)
    return WorldFormed(world_size=1, host=host, group=0, hosts=1, command=["x"])


@pytest.mark.parametrize(
    ("own", "enveloped", "expected"),
    [
        (None, 0.5, "0.5"),  # what the cluster file says of the host
        (0.9, 0.5, "0.9"),  # the box's own join.gpu_ram_share beats it
        (0.9, None, "0.9"),
        (None, None, None),  # neither: the rank's Trainer keeps its own default
    ],
)
def test_gpu_ram_share_reaches_the_ranks_the_box_over_the_envelope(
    own: float | None, enveloped: float | None, expected: str | None
) -> None:
    envs = rank_envs(Box({}, "", gpu_ram_share=own), _enveloped(enveloped), ["cuda:0"], "h:1", 1)
    assert envs[0].get("FLODL_GPU_RAM_SHARE") == expected


def test_an_elastic_world_tells_each_rank_its_ceiling_and_a_walk_in_that_it_syncs_first() -> None:
    cases: list[tuple[dict[str, Any], dict[str, str]]] = [
        ({}, {}),  # a world that cannot grow: neither
        ({"max_world_size": 8}, {"FLODL_MAX_WORLD_SIZE": "8"}),  # every rank of an elastic world
        ({"max_world_size": 8, "midrun": True}, {"FLODL_MAX_WORLD_SIZE": "8", "FLODL_MIDRUN": "1"}),
        ({"midrun": True}, {"FLODL_MIDRUN": "1"}),
    ]
    names = ("FLODL_MAX_WORLD_SIZE", "FLODL_MIDRUN")
    for fields, expected in cases:
        envs = rank_envs(Box({}, ""), world(count=2, size=2, **fields), ["cpu:0", "cpu:1"], "h:1", 1)
        assert [{k: e[k] for k in names if k in e} for e in envs] == [expected] * 2, fields


def test_a_box_env_entry_cannot_move_a_rank_out_of_its_elastic_world() -> None:
    box = Box({}, "", env={"FLODL_MAX_WORLD_SIZE": "99", "FLODL_MIDRUN": "0"})
    (env,) = rank_envs(box, world(max_world_size=8, midrun=True), ["cpu:0"], "h:1", 1)
    assert (env["FLODL_MAX_WORLD_SIZE"], env["FLODL_MIDRUN"]) == ("8", "1")


def test_a_re_formed_worlds_ranks_count_its_restarts() -> None:
    formed = world().model_copy(update={"restart_count": 2})
    (env,) = rank_envs(Box({}, ""), formed, ["cpu:0"], "127.0.0.1:1", 2)
    assert env["TORCHELASTIC_RESTART_COUNT"] == "2"

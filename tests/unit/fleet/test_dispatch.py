"""`local_devices: all` at dispatch, the pure parts: the remote line, its answer, the capacity;
and the window a counted capacity plans (tests/integration/test_dispatch.py asks a real sshd)."""

from __future__ import annotations

import pytest

from flodl_agent.config import Cluster, ClusterBuilder
from flodl_agent.fleet.dispatch import MARK, DispatchError, Found, capacity, count_command, parse_count
from flodl_agent.fleet.launcher import LaunchError, LaunchOptions, controller_for
from flodl_agent.fleet.launcher import capacity as cluster_capacity
from flodl_agent.hardware.gpus import Gpu

ANSWER = f"""{MARK} nvidia
0, NVIDIA A100-SXM4-80GB, 81920, 8.0
1, NVIDIA A100-SXM4-80GB, 81920, 8.0
{MARK} kfd 0
cpu_cores_count 64
gfx_target_version 0
{MARK} kfd 1
gfx_target_version 90402
"""


def test_the_remote_line_asks_the_vendor_tools_and_the_kfd_root_it_is_given() -> None:
    line = count_command("/fake/kfd nodes")
    assert "nvidia-smi --query-gpu=index,name,memory.total,compute_cap" in line
    assert "'/fake/kfd nodes'/*" in line  # quoted root, unquoted glob
    assert line.endswith("exit 0")  # only ssh itself answers non-zero


def test_the_answer_splits_into_each_tools_gpus() -> None:
    found = parse_count(ANSWER)
    assert [g.arch for g in found.nvidia] == ["sm_80", "sm_80"] and found.amd == ["gfx942"]
    assert (
        parse_count(f"{MARK} nvidia\nNo devices were found\n{MARK} kfd 0\ngfx_target_version 0\n") == Found()
    )


def test_capacity_is_one_rank_per_gpu_of_the_one_vendor() -> None:
    two = Found([Gpu(i, "nvidia", "H100", "sm_90") for i in range(2)])
    assert capacity("a", two) == 2 and two.describe() == "2x H100"
    assert capacity("b", Found(amd=["gfx942"] * 8)) == 8
    with pytest.raises(DispatchError, match=r"b offers `local_devices: all`, but .* no GPU"):
        capacity("b", Found())
    with pytest.raises(DispatchError, match="2 NVIDIA and 1 AMD"):
        capacity("c", Found(two.nvidia, ["gfx942"]))


def _cluster(**join: object) -> Cluster:
    builder = ClusterBuilder().controller("127.0.0.1").join(**join)
    builder.worker("a", nccl_socket_ifname="lo").worker("b", local_devices="cpu:1", nccl_socket_ifname="lo")
    return builder.build()


def test_counted_workers_give_the_window_its_quorum_and_target() -> None:
    cluster = _cluster()
    assert cluster_capacity(cluster, None) is None and cluster_capacity(cluster, {"a": 4}) == 5
    window = controller_for(cluster, LaunchOptions(["true"], port=0), print, {"a": 4}).settings.window
    assert (window.quorum, window.target) == (5, 5)
    assert (
        controller_for(
            _cluster(target_ranks=3), LaunchOptions(["true"], port=0), print, {"a": 4}
        ).settings.window.quorum
        == 3
    )
    with pytest.raises(LaunchError) as uncounted:  # --no-fanout: nothing counted them
        controller_for(cluster, LaunchOptions(["true"], port=0, fanout=False), print)
    assert "min_rank_start" in uncounted.value.fix and "fan-out" in uncounted.value.fix

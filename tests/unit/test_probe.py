"""`fdl probe`'s checks: facts in, findings out (no IO)."""

from __future__ import annotations

from flodl_agent.config import DeviceOffer
from flodl_agent.config.models import Cluster, Join
from flodl_agent.probe import Facts, Finding, Torch, check

CPU_TORCH = Torch(version="2.13.0+cpu", gloo=True)
CUDA_TORCH = Torch(version="2.13.0+cu128", cuda="12.8", usable_gpus=2, nccl="2.27.3", gloo=True)


def levels(findings: list[Finding], name: str) -> list[str]:
    return [f.level for f in findings if f.check == name]


def test_a_cpu_torch_on_an_nvidia_box_fails_naming_libtorch_auto() -> None:
    found = check(Facts(torch=CPU_TORCH, gpus={"nvidia": ["H200", "H200"]}))
    (variant,) = [f for f in found if f.check == "variant"]
    assert variant.level == "fail" and "2 NVIDIA GPU(s)" in variant.message
    assert "libtorch: auto" in variant.fix and "--devices cpu:N" in variant.fix


def test_a_cuda_torch_on_an_amd_box_and_a_gpu_build_on_a_cpu_box() -> None:
    amd = check(Facts(torch=CUDA_TORCH, gpus={"amd": ["MI300X"]}))
    assert levels(amd, "variant") == ["fail"]
    bare = check(Facts(torch=CUDA_TORCH))
    assert levels(bare, "variant") == ["warn"]
    good = check(Facts(torch=CUDA_TORCH, gpus={"nvidia": ["A100", "A100"]}))
    assert levels(good, "variant") == [] and levels(good, "nccl") == ["ok"]


def test_no_torch_fails_a_worker_but_not_a_controller() -> None:
    facts = Facts(torch=Torch(error="ModuleNotFoundError: No module named 'torch'"))
    (torch,) = check(facts)
    assert torch.level == "fail" and "flodl_worker_libtorch: auto" in torch.fix
    join_window = {"discovery": True, "min_rank_start": 1}
    cluster = Cluster.model_validate({"controller": {"host": "0.0.0.0", "join": join_window}})
    controller = check(facts, cluster=cluster)
    assert levels(controller, "torch") == ["ok"]


def test_join_devices_beyond_the_usable_gpus() -> None:
    join = Join(devices=DeviceOffer("gpus", gpus=(0, 3)))
    found = check(Facts(torch=CUDA_TORCH, gpus={"nvidia": ["A100", "A100"]}), join)
    (devices,) = [f for f in found if f.check == "devices"]
    assert devices.level == "fail" and "GPU 3" in devices.message and "0..1" in devices.fix


def test_socket_interfaces_named_checked_or_missing() -> None:
    facts = Facts(torch=CPU_TORCH, interfaces=["eth0", "lo"])
    assert levels(check(facts, Join()), "ifname") == ["warn"]
    assert levels(check(facts, Join(nccl_socket_ifname="eth0")), "ifname") == ["ok"]
    bad = [f for f in check(facts, Join(nccl_socket_ifname="ib0")) if f.check == "ifname"]
    assert bad[0].level == "fail" and "join.nccl_socket_ifname" in bad[0].message


def test_the_data_root_missing_unreadable_or_its_mount_dead() -> None:
    def data(**d: object) -> list[Finding]:
        return [
            f
            for f in check(Facts(torch=CPU_TORCH, data={"path": "/flodl/data", **d}), Join())
            if f.check == "data"
        ]

    assert data(exists=False)[0].level == "fail"
    assert "not connected" in data(exists=True, error="not connected")[0].message
    assert data(exists=True, readable=False, error="Permission denied")[0].level == "fail"
    assert data(exists=True, readable=True, entries=3)[0].level == "ok"


def test_the_cache_on_tmpfs_or_nearly_full_is_reported_not_refused() -> None:
    cache = {"path": "/home/flodl/.flodl/data", "writable": True, "free": 10**9, "fstype": "tmpfs"}
    found = [f for f in check(Facts(torch=CPU_TORCH, cache=cache), Join()) if f.check == "cache"]
    assert [f.level for f in found] == ["ok", "warn", "warn"]
    locked = {"path": "/x", "writable": False, "error": "Read-only file system"}
    assert levels(check(Facts(torch=CPU_TORCH, cache=locked), Join()), "cache") == ["fail"]


def test_walk_in_tooling_follows_the_transports_the_join_block_names() -> None:
    join = Join.model_validate(
        {
            "source": {"from": "git+ssh://git.example.com/o/r#v1"},
            "data_path": "/flodl/data",
            "data_source": "sshfs://flodl-data@ctrl:2222:/",
        }
    )
    facts = Facts(torch=Torch(version="2.13.0", gloo=True))
    facts.tools = {"rsync": True, "git": False, "ssh": True, "sshfs": False, "fuse": False}
    failed = {f.message: f.fix for f in check(facts, join) if f.check == "tools"}
    assert failed == {
        "git is missing: join.source is a git+ssh spec": "apt-get install git",
        "sshfs is missing: join.data_source mounts over sshfs": "apt-get install sshfs",
        "fuse is missing: an sshfs mount needs /dev/fuse": (
            "apt-get install fuse3 (and give containers /dev/fuse)"
        ),
    }
    facts.tools = dict.fromkeys(facts.tools, True)
    assert levels(check(facts, join), "tools") == ["ok"]
    assert levels(check(facts, Join()), "tools") == []  # a join naming no transport needs none

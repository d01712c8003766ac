"""`fdl probe`'s checks: facts in, findings out (no IO)."""

from __future__ import annotations

import pytest

from flodl_agent.config import DeviceOffer
from flodl_agent.config.models import Cluster, Join
from flodl_agent.fleet.cluster_probe import Report, across
from flodl_agent.fleet.cluster_probe import as_json as cluster_json
from flodl_agent.hardware.gpus import AmdAccess, Torch
from flodl_agent.hardware.offer import resolve_offer
from flodl_agent.probing.data_root import data_findings
from flodl_agent.probing.probe import Facts, Finding, check
from flodl_agent.retry import Permanent

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


def test_an_amd_box_out_of_reach_reads_as_the_agents_gate_words_it() -> None:
    fresh = AmdAccess(gpus=["gfx942"], kfd="Permission denied", render={"renderD128": "ok"}, user="flodl")
    found = [
        f for f in check(Facts(torch=CPU_TORCH, gpus={"amd": ["AMD gfx942"]}, amd=fresh)) if f.check == "amd"
    ]
    with pytest.raises(Permanent) as caught:
        resolve_offer(DeviceOffer("all"), CPU_TORCH, [], fresh)
    gate = caught.value
    assert [f.level for f in found] == ["fail", "fail"]  # no ROCm runtime; /dev/kfd denied
    assert gate.message == "no usable GPU: " + "; and ".join(
        f.message.removeprefix("no usable GPU: ") for f in found
    )
    assert gate.fix == "; ".join(f.fix for f in found)
    assert "sudo usermod -aG render,video flodl" in found[1].fix
    seen = Torch(version="2.13.0+rocm6.4", hip="6.4", usable_gpus=1)  # torch reaches the card: nothing to say
    assert levels(check(Facts(torch=seen, gpus={"amd": ["AMD gfx942"]}, amd=fresh)), "amd") == []


def test_no_torch_fails_a_worker_but_not_a_controller() -> None:
    facts = Facts(torch=Torch(error="ModuleNotFoundError: No module named 'torch'"))
    (torch,) = check(facts)
    assert torch.level == "fail" and "flodl_worker_libtorch: auto" in torch.fix
    join_window = {"discovery": True, "min_rank_start": 1, "token": "ab" * 16}
    cluster = Cluster.model_validate({"controller": {"host": "0.0.0.0", "join": join_window}})
    controller = check(facts, cluster=cluster)
    assert levels(controller, "torch") == ["ok"]


def test_a_build_without_kernels_for_an_offered_card_fails_naming_auto_and_devices() -> None:
    torch = Torch(**{**CUDA_TORCH.__dict__, "archs": ["sm_80", "sm_90"]})
    facts = Facts(torch=torch, gpus={"nvidia": ["A100", "RTX 5090"]}, archs={"nvidia": ["sm_80", "sm_120"]})
    (gap,) = [f for f in check(facts) if f.check == "variant"]
    assert gap.level == "fail"
    assert "ships no kernel for part of what this box offers: GPU 1 (RTX 5090, sm_120)" in gap.message
    assert "libtorch: auto" in gap.fix and "--devices" in gap.fix
    scoped = check(facts, Join(devices=DeviceOffer("gpus", gpus=(0,))))
    assert [f.level for f in scoped if f.check == "variant"] == ["ok"]  # the offer leaves the card out


def test_torch_that_needs_a_newer_glibc_says_so() -> None:
    error = (
        "OSError: /lib/x86_64-linux-gnu/libc.so.6: version `GLIBC_2.38' not found "
        "(required by libtorch_cpu.so)"
    )
    (torch,) = check(Facts(torch=Torch(error=error, libc="glibc 2.36")))
    assert torch.level == "fail"
    assert torch.message.endswith("it needs GLIBC 2.38, this box has glibc 2.36")
    assert "older glibc" in torch.fix


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
            for f in check(Facts(torch=CPU_TORCH, data={"path": "/srv/data", **d}), Join())
            if f.check == "data"
        ]

    assert data(exists=False)[0].level == "fail"
    assert "not connected" in data(exists=True, error="not connected")[0].message
    assert data(exists=True, readable=False, error="Permission denied")[0].level == "fail"
    unsignable = data(exists=True, readable=True, entries=3, signature_error="Permission denied: /srv/data/x")
    assert unsignable[0].level == "fail" and "signs it before every dial" in unsignable[0].message
    (ok,) = data(exists=True, readable=True, entries=3, signature="ab" * 32)
    assert ok.level == "ok" and "3 entries, signature abababababab" in ok.message


def test_an_undeclared_convention_root_is_checked_never_required() -> None:
    def data(**d: object) -> Finding:
        (found,) = data_findings({"path": "/flodl/data", "declared": False, **d})
        return found

    absent = data(exists=False, readable=False)
    assert absent.level == "ok" and absent.message.endswith("checked the convention root /flodl/data: absent")
    there = data(exists=True, readable=True, entries=1, signature="ab" * 32)
    assert there.level == "ok" and "signature abababababab" in there.message
    assert "no FLODL_DATA_PATH" in there.message
    locked = data(exists=True, readable=False, error="Permission denied")
    assert locked.level == "warn" and "declare data_path" in locked.fix  # nothing declared it
    assert data(exists=True, error="not connected").level == "fail"  # someone mounted it; it died


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


def _report(
    host: str,
    nccl: str = "",
    torch: str = "2.13.0",
    gpus: dict[str, list[str]] | None = None,
    data: dict[str, object] | None = None,
) -> Report:
    facts = {"torch": {"version": torch, "nccl": nccl}, "gpus": gpus or {}, "data": data or {}}
    return Report(host, {"ok": True, "findings": [], "facts": facts})


def test_across_the_cluster_nccl_skew_names_the_boxes_to_pin_and_the_version() -> None:
    found = across([_report("a", "2.27.3"), _report("b", "2.27.5"), _report("c", "2.26.2")])
    (skew,) = [f for f in found if f.check == "nccl"]
    assert skew.level == "fail"
    assert "NCCL version skew: 2.27.3 on a; 2.27.5 on b; 2.26.2 on c" in skew.message
    assert skew.fix.startswith("on c: fdl nccl pin 2.27.3")  # the fewest boxes change
    assert [f.level for f in across([_report("a", "2.27.3"), _report("b", "2.27.5")])] == ["ok"]


def test_across_the_cluster_torch_and_vendor_skew_warn() -> None:
    found = across(
        [_report("a", gpus={"nvidia": ["H100"]}), _report("b", torch="2.12.0", gpus={"amd": ["MI300X"]})]
    )
    levels = {f.check: f.level for f in found}
    assert levels == {"torch": "warn", "vendors": "warn"}
    assert "cpu plane" in next(f.fix for f in found if f.check == "vendors")


def test_across_the_cluster_declared_data_roots_must_sign_the_same() -> None:
    good = {"path": "/data", "declared": True, "exists": True, "readable": True, "entries": 4}
    good |= {"signature": "ab" * 32}
    other = good | {"signature": "cd" * 32}  # the same count of entries: a listing would agree
    gone = {"path": "/data", "declared": True, "exists": True, "readable": False, "error": "not connected"}
    (same,) = across([_report("a", data=good), _report("b", data=good)])
    assert same.level == "ok" and "same on 2 boxes: signature abababababab (4 entries)" in same.message
    (diverged,) = across([_report("a", data=good), _report("b", data=gone)])
    assert diverged.level == "fail" and "(4 entries) on a; not connected on b" in diverged.message
    (differs,) = across([_report("a", data=good), _report("b", data=other)])
    assert differs.level == "fail" and "dataset mismatch" in differs.message
    assert "signature abababababab (4 entries) on a; signature cdcdcdcdcdcd (4 entries) on b" in (
        differs.message
    )


def test_across_the_cluster_convention_roots_warn_and_absent_ones_are_no_finding() -> None:
    root = {"path": "/flodl/data", "declared": False, "exists": True, "readable": True, "entries": 2}
    absent = {"path": "/flodl/data", "declared": False, "exists": False, "readable": False}
    (differs,) = across(
        [_report("a", data=root | {"signature": "ab"}), _report("b", data=root | {"signature": "cd"})]
    )
    assert differs.level == "warn" and "no data_path declared" in differs.message
    assert "declare data_path" in differs.fix
    assert across([_report("a", data=root | {"signature": "ab"}), _report("b", data=absent)]) == []
    # A declared root and a convention root are never compared: admission would not either.
    declared = root | {"declared": True, "path": "/data", "signature": "cd"}
    assert across([_report("a", data=root | {"signature": "ab"}), _report("b", data=declared)]) == []


def test_a_box_that_could_not_be_probed_fails_the_cluster() -> None:
    (lost,) = across([Report("a", error="exit 255: ssh: connect to host a port 22: Connection refused")])
    assert lost.level == "fail" and lost.message.startswith("a: not probed (exit 255")
    payload = cluster_json([_report("b"), Report("a", error="x")], [lost])
    assert payload["ok"] is False and payload["hosts"]["a"] == {"error": "x"}

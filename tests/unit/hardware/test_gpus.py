"""GPU discovery: the vendor tools' outputs parsed (pure), and the thin readers over them."""

from __future__ import annotations

import json
import os
import select
import stat
from pathlib import Path

import pytest

from flodl_agent.hardware.gpus import (
    AmdAccess,
    Card,
    Gpu,
    amd_access,
    amd_arch,
    by_vendor,
    compute_cap_arch,
    cuda_arch,
    discover,
    gfx_name,
    kfd_archs,
    parse_kfd,
    parse_nvidia,
    parse_rocm,
    read_cards,
    read_torch,
    tool_output,
)

NVIDIA = "0, NVIDIA A100-SXM4-80GB, 81920, 8.0\n1, NVIDIA GeForce RTX 4090, 24564, 8.9\n"
ROCM = json.dumps(
    {
        "card1": {"Card Series": "AMD Instinct MI210", "GFX Version": "gfx90a:sramecc+:xnack-"},
        "card0": {
            "Card Series": "AMD Instinct MI300X",
            "GFX Version": "gfx942",
            "VRAM Total Memory (B)": "206141652992",
        },
        "system": {"Driver version": "6.8.5"},
    }
)


@pytest.mark.parametrize(
    ("text", "arch"),
    [("8.0", "sm_80"), ("8.6", "sm_86"), ("12.0", "sm_120"), (" 9.0 ", "sm_90"), ("[N/A]", ""), ("", "")],
)
def test_compute_capabilities_are_spelled_as_torch_spells_its_archs(text: str, arch: str) -> None:
    assert compute_cap_arch(text) == arch


def test_one_spelling_for_both_vendors() -> None:
    assert (cuda_arch(8, 0), cuda_arch(12, 0)) == ("sm_80", "sm_120")
    assert [amd_arch(a) for a in ("gfx90a:sramecc+:xnack-", "gfx942", " gfx1100 ")] == [
        "gfx90a",
        "gfx942",
        "gfx1100",
    ]
    assert [gfx_name(v) for v in (90402, 90010, 110000, 100300)] == ["gfx942", "gfx90a", "gfx1100", "gfx1030"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            NVIDIA,
            [
                Gpu(0, "nvidia", "NVIDIA A100-SXM4-80GB", "sm_80", 81920),
                Gpu(1, "nvidia", "NVIDIA GeForce RTX 4090", "sm_89", 24564),
            ],
        ),
        ("0, Tesla K80, Rev 2, [N/A], [N/A]\n", [Gpu(0, "nvidia", "Tesla K80, Rev 2", "", None)]),
        ("No devices were found\n", []),
        ("", []),
    ],
)
def test_nvidia_smi_csv(text: str, expected: list[Gpu]) -> None:
    assert parse_nvidia(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            ROCM,
            [
                Gpu(0, "amd", "AMD Instinct MI300X", "gfx942", 196592),
                Gpu(1, "amd", "AMD Instinct MI210", "gfx90a", None),
            ],
        ),
        (
            json.dumps({"card10": {"Card series": "b"}, "card9": {"Card model": "a"}}),
            [
                Gpu(9, "amd", "a", ""),
                Gpu(10, "amd", "b", ""),
            ],
        ),
        ("not json", []),
        ("[]", []),
    ],
)
def test_rocm_smi_json(text: str, expected: list[Gpu]) -> None:
    assert parse_rocm(text) == expected


def test_amd_gpus_are_read_from_the_kfd_topology(tmp_path: Path) -> None:
    nodes = {"0": 0, "2": 90010, "1": 90402}  # node 0: the CPU
    texts = {n: f"cpu_cores_count 0\ngfx_target_version {v}\n" for n, v in nodes.items()}
    assert parse_kfd(texts) == ["gfx942", "gfx90a"]  # in node order
    assert parse_kfd({"properties": "x", "3": "gfx_target_version\n"}) == []
    for node, text in texts.items():
        (tmp_path / node).mkdir()
        (tmp_path / node / "properties").write_text(text)
    assert kfd_archs(tmp_path) == ["gfx942", "gfx90a"]
    assert kfd_archs(tmp_path / "absent") == []


@pytest.mark.parametrize(
    ("gpus", "kfd", "names", "archs"),
    [
        ([], [], {}, {}),
        (
            parse_nvidia(NVIDIA),
            [],
            {"nvidia": ["NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 4090"]},
            {"nvidia": ["sm_80", "sm_89"]},
        ),
        ([Gpu(0, "nvidia", "T4", "")], [], {"nvidia": ["T4"]}, {"nvidia": ["?"]}),
        (  # rocm-smi's names line up with the KFD's GPUs
            parse_rocm(ROCM),
            ["gfx942", "gfx90a"],
            {"amd": ["AMD Instinct MI300X", "AMD Instinct MI210"]},
            {"amd": ["gfx942", "gfx90a"]},
        ),
        ([], ["gfx942"], {"amd": ["AMD gfx942"]}, {"amd": ["gfx942"]}),  # no ROCm installed
        (parse_rocm(ROCM), [], {"amd": ["AMD Instinct MI300X", "AMD Instinct MI210"]}, {"amd": []}),
    ],
)
def test_the_probe_sees_names_and_archs_by_vendor(
    gpus: list[Gpu], kfd: list[str], names: dict[str, list[str]], archs: dict[str, list[str]]
) -> None:
    assert by_vendor(gpus, kfd) == (names, archs)


def _tool(bin_dir: Path, name: str, output: str, code: int = 0) -> None:
    script = bin_dir / name
    script.write_text(f"#!/bin/sh\ncat <<'EOF'\n{output}EOF\nexit {code}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


def test_discovery_runs_the_vendor_tools_and_reads_sysfs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir, kfd = tmp_path / "bin", tmp_path / "kfd"
    bin_dir.mkdir()
    kfd.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    _tool(bin_dir, "nvidia-smi", NVIDIA)
    _tool(bin_dir, "rocm-smi", "error\n", code=2)  # a failing tool is a vendor this box lacks
    assert discover(kfd) == (
        {"nvidia": ["NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 4090"]},
        {"nvidia": ["sm_80", "sm_89"]},
    )
    _tool(bin_dir, "nvidia-smi", "No devices were found\n", code=6)
    _tool(bin_dir, "rocm-smi", ROCM + "\n")
    assert discover(kfd) == ({"amd": ["AMD Instinct MI300X", "AMD Instinct MI210"]}, {"amd": []})


def test_torch_is_read_without_touching_a_device() -> None:
    torch = read_torch()
    if not torch.version:
        assert torch.error and torch.usable_gpus == 0
        return
    assert torch.error == "" and torch.usable_gpus >= 0
    if not (torch.cuda or torch.hip):
        assert torch.nccl == "" and read_cards(0) == []


def test_cards_carry_torch_names_and_one_arch_spelling(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: ["A40", "RTX PRO 6000"][i])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: [(8, 6), (12, 0)][i])
    assert read_cards(2) == [Card(0, "A40", "sm_86"), Card(1, "RTX PRO 6000", "sm_120")]

    class Props:
        gcnArchName = "gfx90a:sramecc+:xnack-"

    monkeypatch.setattr(torch.version, "hip", "6.4.1", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    assert read_cards(1) == [Card(0, "A40", "gfx90a")]


def amd_root(root: Path, *, devices: bool = True) -> Path:
    """A box's root as AMD facts are read from it: a KFD topology of two GPUs (and the CPU node)."""
    for node, version in {"0": 0, "1": 90402, "2": 90010}.items():
        (root / "sys/class/kfd/kfd/topology/nodes" / node).mkdir(parents=True)
        (root / "sys/class/kfd/kfd/topology/nodes" / node / "properties").write_text(
            f"gfx_target_version {version}\n"
        )
    if devices:
        (root / "dev/dri").mkdir(parents=True)
        (root / "dev/kfd").write_bytes(b"")
        (root / "dev/dri/renderD128").write_bytes(b"")
    return root


def test_amd_access_is_read_under_a_root(tmp_path: Path) -> None:
    assert amd_access(tmp_path, path="") == AmdAccess()  # no KFD GPU: nothing else is looked at
    root = amd_root(tmp_path / "box")
    lib = root / "opt/rocm-6.4.0/lib/libamdhip64.so.6"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    (root / "run").mkdir()
    (root / "run/.containerenv").write_text("")
    facts = amd_access(root, path="")
    assert facts.gpus == ["gfx942", "gfx90a"] and facts.kfd == "ok" and facts.render == {"renderD128": "ok"}
    assert facts.runtime == [str(lib)] and facts.container == "podman"
    assert set(facts.owners) == {"/dev/kfd", "/dev/dri/renderD128"} and facts.user and facts.groups


def test_a_bare_amd_box_lacks_the_runtime_and_the_device_nodes(tmp_path: Path) -> None:
    root = amd_root(tmp_path, devices=False)
    facts = amd_access(root, path="")
    assert (facts.kfd, facts.render, facts.runtime, facts.container) == ("missing", {}, [], "")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _tool(bin_dir, "rocminfo", "")
    assert amd_access(root, path=str(bin_dir)).runtime == [str(bin_dir / "rocminfo")]


def _script(tmp_path: Path, body: str) -> str:
    tool = tmp_path / "vendor-smi"
    tool.write_text("#!/bin/sh\n" + body)
    tool.chmod(0o755)
    return str(tool)


def test_a_vendor_tools_listing_is_read(tmp_path: Path) -> None:
    assert tool_output([_script(tmp_path, "echo 0, NVIDIA H200\n")]) == "0, NVIDIA H200\n"
    assert tool_output([_script(tmp_path, "echo partial; exit 3\n")]) == ""  # a failed tool says nothing
    assert tool_output([str(tmp_path / "absent-smi")]) == ""


def test_a_hung_vendor_tool_goes_with_the_children_it_started(tmp_path: Path) -> None:
    """A wedged driver's tool hangs with helpers of its own; cut, none of them outlives it.

    Each of them holds a FIFO's write end: the read end sees EOF only once every one is gone."""
    fifo = tmp_path / "held"
    os.mkfifo(fifo)
    read_end = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        tool = _script(tmp_path, f"exec 3>{fifo}\necho up >&3\nsleep 300 &\necho listing\nwait\n")
        assert tool_output([tool], timeout=1.0) == ""
        assert os.read(read_end, 64) == b"up\n"  # the tool and its child ran
        readable, _, _ = select.select([read_end], [], [], 30)
        assert readable and os.read(read_end, 64) == b""  # and no writer is left
    finally:
        os.close(read_end)

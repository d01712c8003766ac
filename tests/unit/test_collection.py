"""The flodl.cluster collection's Python: GPU facts parsing and the filters."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

PLUGINS = Path(__file__).parents[2] / "collections" / "ansible_collections" / "flodl" / "cluster" / "plugins"


def load(relative: str) -> ModuleType:
    pytest.importorskip("ansible")
    spec = importlib.util.spec_from_file_location(relative.replace("/", "_"), PLUGINS / relative)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_nvidia_smi_csv() -> None:
    facts = load("modules/gpu_facts.py")
    out = "0, NVIDIA A100-SXM4-80GB, 81920, 8.0\n1, NVIDIA GeForce RTX 4090, 24564, 8.9\n"
    gpus = facts.parse_nvidia(out)
    assert [(g["index"], g["arch"], g["memory_mib"]) for g in gpus] == [
        (0, "sm80", 81920),
        (1, "sm89", 24564),
    ]
    summary = facts.summarize(gpus)
    assert (summary["flodl_gpu_count"], summary["flodl_gpu_vendor"], summary["flodl_gpu_variant"]) == (
        2,
        "nvidia",
        "cu128",
    )


def test_rocm_smi_json() -> None:
    facts = load("modules/gpu_facts.py")
    out = json.dumps(
        {
            "card0": {
                "Card Series": "AMD Instinct MI300X",
                "GFX Version": "gfx942",
                "VRAM Total Memory (B)": "206141652992",
            },
            "system": {"Driver version": "6.8.5"},
        }
    )
    gpus = facts.parse_rocm(out)
    assert gpus == [
        {"index": 0, "vendor": "amd", "name": "AMD Instinct MI300X", "memory_mib": 196592, "arch": "gfx942"}
    ]
    assert facts.summarize(gpus, '{"system": {"Driver version": "6.4.1"}}')["flodl_gpu_variant"] == "rocm6.4"


def test_a_cpu_box_reports_nothing_and_no_vendor() -> None:
    facts = load("modules/gpu_facts.py")
    assert facts.parse_nvidia("") == [] and facts.parse_rocm("not json") == []
    assert facts.summarize([]) == {
        "flodl_gpus": [],
        "flodl_gpu_count": 0,
        "flodl_gpu_vendor": "",
        "flodl_gpu_variant": "cpu",
    }
    mixed = facts.summarize([{"vendor": "nvidia"}, {"vendor": "amd"}])
    assert mixed["flodl_gpu_vendor"] == "mixed" and mixed["flodl_gpu_variant"] == "cpu"


def test_cluster_workers_filter_reads_vars_then_facts() -> None:
    flt = load("filter/cluster.py")
    hostvars: dict[str, dict[str, Any]] = {
        "gpu-a": {
            "ansible_host": "10.0.0.11",
            "flodl_worker_local_devices": "all",
            "flodl_worker_libtorch": "cu128",
            "ansible_facts": {"default_ipv4": {"interface": "enp1s0"}, "flodl_gpu_count": 2},
        },
        "cpu-b": {
            "flodl_worker_local_devices": "cpu:4",
            "flodl_worker_nccl_socket_ifname": "eth1",
            "flodl_worker_data_path": "/flodl/data",
            "flodl_worker_env": {"X": "1"},
            "ansible_facts": {},
        },
    }
    workers = flt.cluster_workers(["gpu-a", "cpu-b"], hostvars)
    assert workers == [
        {
            "host": "gpu-a",
            "local_devices": [0, 1],
            "nccl_socket_ifname": "enp1s0",
            "arch": "cu128",
            "ssh": {"target": "10.0.0.11"},
        },
        {
            "host": "cpu-b",
            "local_devices": "cpu:4",
            "nccl_socket_ifname": "eth1",
            "arch": "cpu",
            "data_path": "/flodl/data",
            "env": {"X": "1"},
            "ssh": {"target": "cpu-b"},
        },
    ]
    # what the filter writes is a valid cluster file
    from flodl_agent.config import validate_data

    assert validate_data({"cluster": {"controller": {"host": "127.0.0.1"}, "workers": workers}}).cluster


@pytest.mark.skipif(shutil.which("systemd-escape") is None, reason="needs systemd-escape")
def test_mount_unit_names_match_systemd_escape() -> None:
    flt = load("filter/mount_unit.py")
    for path in ["/flodl/data", "/", "/mnt/my-data//set.v2/", "/srv/ü data", "/.hidden/x"]:
        want = subprocess.run(
            ["systemd-escape", "--path", "--suffix=mount", path], capture_output=True, text=True, check=True
        ).stdout.strip()
        assert flt.mount_unit(path) == want, path
    with pytest.raises(ValueError, match="absolute"):
        flt.mount_unit("relative/path")

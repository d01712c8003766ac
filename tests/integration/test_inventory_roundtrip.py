"""Inventory -> fdl.cluster.yml -> inventory: the collection's filter and its
inventory plugin are each other's inverse, through real ansible-inventory."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from flodl_agent.config import validate_data
from tests.support.ansible import plain

ROOT = Path(__file__).parents[2]
ANSIBLE_INVENTORY = ROOT / ".venv" / "bin" / "ansible-inventory"

pytestmark = pytest.mark.skipif(not ANSIBLE_INVENTORY.exists(), reason="ansible is not installed in .venv")


def inventory(source: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [str(ANSIBLE_INVENTORY), "-i", str(source), "--list", "--export"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return plain(json.loads(proc.stdout)), proc.stderr


def test_round_trip(tmp_path: Path) -> None:
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location(
        "flt", ROOT / "collections/ansible_collections/flodl/cluster/plugins/filter/cluster.py"
    )
    assert spec and spec.loader
    flt = module_from_spec(spec)
    spec.loader.exec_module(flt)
    hostvars = {
        "gpu-a": {
            "ansible_host": "10.0.0.11",
            "flodl_worker_local_devices": [0, 1],
            "flodl_worker_libtorch": "cu128",
            "flodl_worker_nccl_socket_ifname": "enp1s0",
            "flodl_worker_data_path": "/flodl/data",
        },
        "cpu-b": {
            "ansible_host": "10.0.0.12",
            "flodl_worker_local_devices": "cpu:4",
            "flodl_worker_nccl_socket_ifname": "eth0",
            "flodl_worker_env": {"OMP_NUM_THREADS": "4"},
        },
    }
    workers = flt.cluster_workers(list(hostvars), hostvars)
    document = {
        "cluster": {
            "controller": {"host": "10.0.0.10", "port": 7000, "join": {"start": "hybrid"}},
            "workers": workers,
        }
    }
    validate_data(document)  # the roles' template output is a valid cluster file
    (tmp_path / "fdl.cluster.yml").write_text(yaml.safe_dump(document))
    (tmp_path / "fleet.fdl_cluster.yml").write_text(
        "plugin: flodl.cluster.fdl_cluster\npath: fdl.cluster.yml\n"
    )
    back, _ = inventory(tmp_path / "fleet.fdl_cluster.yml")
    assert back["flodl_workers"]["hosts"] == ["gpu-a", "cpu-b"]  # rank order survives
    assert back["flodl_controllers"]["hosts"] == ["controller"]
    got = back["_meta"]["hostvars"]
    for host, original in hostvars.items():
        assert {k: got[host][k] for k in original} == original
    assert got["controller"]["flodl_controller_port"] == 7000
    assert got["controller"]["flodl_controller_join"] == {"start": "hybrid"}


def test_a_broken_cluster_file_is_reported_with_its_line(tmp_path: Path) -> None:
    (tmp_path / "fdl.cluster.yml").write_text(
        "cluster:\n  controller: {host: h}\n  workers:\n    - {host: a, devics: 0}\n"
    )
    (tmp_path / "x.fdl_cluster.yml").write_text("plugin: flodl.cluster.fdl_cluster\npath: fdl.cluster.yml\n")
    proc = subprocess.run(
        [str(ANSIBLE_INVENTORY), "-i", str(tmp_path / "x.fdl_cluster.yml"), "--list"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert "fdl.cluster.yml:4: error: cluster.workers[0].devics: unknown key" in proc.stderr


def test_host_key_downgrades_are_dropped_not_passed_on(tmp_path: Path) -> None:
    shutil.copy(ROOT / "tests/data/seed-000.fdl.cluster.yml", tmp_path / "fdl.cluster.yml")
    (tmp_path / "seed.fdl_cluster.yml").write_text(
        "plugin: flodl.cluster.fdl_cluster\npath: fdl.cluster.yml\n"
    )
    back, stderr = inventory(tmp_path / "seed.fdl_cluster.yml")
    node_b = back["_meta"]["hostvars"]["node-b"]
    assert node_b["ansible_ssh_common_args"] == "-o ProxyJump=bastion"
    assert "dropped `StrictHostKeyChecking=no`" in stderr


def test_arch_docker_and_tunnel_are_carried_as_worker_vars(tmp_path: Path) -> None:
    (tmp_path / "fdl.cluster.yml").write_text(
        yaml.safe_dump(
            {
                "cluster": {
                    "controller": {"host": "10.0.0.10"},
                    "workers": [
                        {"host": "gpu-a", "nccl_socket_ifname": "eth0", "arch": "cu126", "docker": "cuda"},
                        {"host": "amd-b", "nccl_socket_ifname": "eth0", "arch": "rocm6.4", "tunnel": True},
                        {"host": "odd-c", "nccl_socket_ifname": "eth0", "arch": "precompiled/cu128"},
                        {"host": "bare-d", "nccl_socket_ifname": "eth0"},
                    ],
                }
            }
        )
    )
    (tmp_path / "x.fdl_cluster.yml").write_text("plugin: flodl.cluster.fdl_cluster\npath: fdl.cluster.yml\n")
    back, stderr = inventory(tmp_path / "x.fdl_cluster.yml")
    got = back["_meta"]["hostvars"]
    carried = ("flodl_worker_libtorch", "flodl_worker_docker", "flodl_worker_tunnel")
    assert {k: got["gpu-a"].get(k) for k in carried} == dict(
        zip(carried, ["cu126", "cuda", None], strict=True)
    )
    assert {k: got["amd-b"].get(k) for k in carried} == dict(
        zip(carried, ["rocm6.4", None, True], strict=True)
    )
    # a variant sub-path has no worker-role equivalent: left out, and said so
    assert not any(k in got["odd-c"] for k in carried)
    assert "odd-c: arch `precompiled/cu128` is not a variant the worker role installs" in stderr
    assert not any(k in got["bare-d"] for k in carried)

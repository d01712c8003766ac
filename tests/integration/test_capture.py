"""`fdl probe --capture`, run for real on this box: the structure and its index, a planted
FDL_TOKEN in no file, stand-in vendor tools on PATH captured with their exit codes, a hanging
one cut with its children, and a KFD topology and /dev given as roots."""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import pytest

from flodl_agent.probing.capture import Roots, capture
from tests.support.libtorch import FDL, run_fdl

TOKEN = "0123456789abcdef" * 2


def stand_in(tools: Path, name: str, body: str) -> None:
    tools.mkdir(exist_ok=True)
    (tools / name).write_text(f"#!/bin/sh\n{body}\n")
    (tools / name).chmod(0o755)


def kfd_topology(where: Path) -> Path:
    """A KFD topology of a CPU node and an MI300 (gfx942) node, as sysfs lays it out."""
    (where / "nodes" / "0").mkdir(parents=True)
    (where / "nodes" / "0" / "properties").write_text("cpu_cores_count 64\ngfx_target_version 0\n")
    (where / "nodes" / "1").mkdir()
    (where / "nodes" / "1" / "properties").write_text("simd_count 1216\ngfx_target_version 90402\n")
    (where / "nodes" / "1" / "name").write_text("gfx942\n")
    (where / "system_properties").write_text("platform_oem 0\n")
    return where


def base_env(tools: Path) -> dict[str, str]:
    env = {"PATH": f"{tools}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")}
    if "PYTHONPATH" in os.environ:  # the interpreters the capture starts import this checkout
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


def alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def every_file(where: Path) -> dict[str, bytes]:
    return {str(p.relative_to(where)): p.read_bytes() for p in where.rglob("*") if p.is_file()}


def test_a_capture_holds_the_stack_as_each_source_answered_and_no_credential(tmp_path: Path) -> None:
    tools = tmp_path / "bin"
    stand_in(tools, "rocminfo", 'echo "ROCk module is NOT loaded, possibly no GPU devices"\nexit 3')
    children = tmp_path / "children"  # each hung rocm-smi's child: the probe's run too
    stand_in(tools, "rocm-smi", f"echo started\nsleep 600 &\necho $! >> {children}\nwait")
    stand_in(tools, "hipconfig", "env")  # what a tool runs with
    dev = tmp_path / "dev"
    (dev / "dri").mkdir(parents=True)
    (dev / "dri" / "renderD128").write_text("")
    env = base_env(tools) | {
        "FDL_TOKEN": TOKEN,
        "HIP_CLIENT_SECRET": "hunter2-" + TOKEN,
        "HSA_OVERRIDE_GFX_VERSION": "11.0.0",
        "HIP_VISIBLE_DEVICES": "0",
    }
    roots = Roots(kfd=kfd_topology(tmp_path / "kfd"), dev=dev, rocm=tmp_path / "rocm")
    where, index = capture(tmp_path / "cap", roots, env, timeout=5)
    files = every_file(where)
    entries = {e["name"]: e for e in index["files"]}

    # the index and the README name every file, and every file listed as there is there
    assert set(files) - {"index.json", "README.txt"} == {
        name for name, e in entries.items() if e["status"] in ("ok", "failed", "timeout") or e["bytes"]
    }
    assert json.loads(files["index.json"])["files"] == index["files"]
    assert all(name in files["README.txt"].decode() for name in entries)

    # no credential in any file; the GPU stack's variables are there; tools ran without the token
    assert all(TOKEN.encode() not in data for data in files.values())
    said = files["env.txt"].decode()
    assert "FDL_TOKEN=<redacted>" in said and "HIP_CLIENT_SECRET=<redacted>" in said
    assert "HSA_OVERRIDE_GFX_VERSION=11.0.0" in said and "HIP_VISIBLE_DEVICES=0" in said
    ran_with = files["tools/hipconfig.txt"].decode()
    assert "HSA_OVERRIDE_GFX_VERSION=11.0.0" in ran_with and "FDL_TOKEN" not in ran_with

    # each tool as it answered: an exit code, a hang cut at the timeout (its output kept), absent
    assert (entries["tools/rocminfo.txt"]["status"], entries["tools/rocminfo.txt"]["exit"]) == ("failed", 3)
    assert b"ROCk module is NOT loaded" in files["tools/rocminfo.txt"]
    hung = entries["tools/rocm-smi.txt"]
    assert (hung["status"], hung["exit"], hung["note"]) == ("timeout", None, "cut after 5 s")
    assert files["tools/rocm-smi.txt"] == b"started\n"
    pids = children.read_text().split()
    assert len(pids) == 3 and not [pid for pid in pids if alive(int(pid))]  # nothing left running
    assert entries["tools/nvidia-smi.txt"]["status"] == "missing"
    assert "nvidia-smi is not on PATH" in entries["tools/nvidia-smi.txt"]["note"]
    assert entries["rocm-version.txt"]["status"] == "absent"

    # the roots: the KFD topology copied node by node, the device nodes with modes and owners
    assert b"gfx_target_version 90402" in files["kfd/nodes/1/properties"]
    assert files["kfd/nodes/1/name"] == b"gfx942\n" and "kfd/nodes/0/properties" in files
    devices = files["devices.txt"].decode()
    assert f"{dev}/kfd: absent" in devices
    assert f"{dev}/dri/renderD128: -rw-r--r--" in devices and "not a device" in devices
    assert "this process's groups:" in files["user.txt"].decode()

    # this venv's torch and the probe's report, each read by an interpreter of its own
    assert json.loads(files["torch.json"])["version"].startswith("2.")
    assert "is_available False" in files["torch-runtime.txt"].decode()
    probe = json.loads(files["probe.json"])
    assert {f["check"] for f in probe["findings"]} >= {"torch"} and "facts" in probe


@pytest.mark.skipif(not FDL.exists(), reason="the fdl console script is not installed")
def test_the_command_writes_a_tarball_and_refuses_a_used_directory(tmp_path: Path) -> None:
    env = base_env(tmp_path / "bin") | {"FDL_TOKEN": TOKEN}
    run = run_fdl(tmp_path, env, "probe", "--capture", "box.tar.gz", "--json", timeout=600)
    assert run.returncode == 0, run.stderr
    index = json.loads(run.stdout)
    with tarfile.open(tmp_path / "box.tar.gz") as archive:
        members = {m.name: archive.extractfile(m).read() for m in archive.getmembers() if m.isfile()}  # type: ignore[union-attr]
    assert {"box/index.json", "box/README.txt", "box/probe.json", "box/env.txt"} <= set(members)
    assert json.loads(members["box/index.json"]) == index
    assert all(TOKEN.encode() not in data for data in members.values())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".capture.")]  # no leftovers

    used = tmp_path / "used"
    used.mkdir()
    (used / "x").write_text("")
    refused = run_fdl(tmp_path, env, "probe", "--capture", str(used), timeout=60)
    assert (
        refused.returncode == 2
        and "--capture" in refused.stderr
        and "not an empty directory" in refused.stderr
    )

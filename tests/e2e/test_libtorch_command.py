"""`fdl libtorch list|which|acquire` against real venvs, real pip and a real wheelhouse.

The venvs under the root are real (tests/support/libtorch.py): `cpu` and `cu126` see this
checkout's CPU torch, `rocm6.4` has none. Acquisitions run venv and pip offline from a
wheelhouse holding a stand-in torch of the build the test names, and flodl-fleet.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flodl_agent.errors import PERMANENT, TRANSIENT
from tests.support import free_port
from tests.support.libtorch import (
    FDL,
    fdl_env,
    fleet_wheel,
    run_fdl,
    stand_in_nvidia_smi,
    stand_in_torch,
    variant_venv,
)

pytestmark = pytest.mark.skipif(not FDL.exists(), reason="the fdl console script is not installed")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("libtorch")
    variant_venv(where, "cpu")
    variant_venv(where, "cu126")  # a CPU torch under a CUDA name
    variant_venv(where, "rocm6.4", with_torch=False)
    return where


def fdl(cwd: Path, root: Path, *args: str, tools: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = fdl_env(root, cwd, tools) | {"PIP_RETRIES": "1"}  # one retry: pip says it did not connect
    return run_fdl(cwd, env, "libtorch", *args)


def test_list_reads_each_venv_and_says_what_auto_picks_for_the_cards(root: Path, tmp_path: Path) -> None:
    tools = stand_in_nvidia_smi(tmp_path)  # an H200 (sm_90), driver CUDA 12.8
    proc = fdl(tmp_path, root, "list", "--json", tools=tools)
    assert proc.returncode == 0, proc.stderr
    listed = json.loads(proc.stdout)
    assert listed["root"] == str(root)
    assert listed["box"]["gpus"] == [{"index": 0, "vendor": "nvidia", "name": "NVIDIA H200", "arch": "sm_90"}]
    assert listed["box"]["driver_cuda"] == "12.8"
    rows = {row["path"]: row for row in listed["variants"]}
    cpu, cu126, rocm = rows[str(root / "cpu")], rows[str(root / "cu126")], rows[str(root / "rocm6.4")]
    assert cpu["torch"].startswith("2.") and cpu["variant"] == "cpu" and cpu["problem"] == ""
    assert (cpu["covers"], cpu["coverage"]) == (False, "a cpu build: no kernels for GPU 0 (sm_90)")
    assert cu126["note"] == "named cu126, holds a cpu build"
    assert "torch does not import (ModuleNotFoundError" in rocm["problem"] and rocm["covers"] is False
    running = rows[sys.prefix]  # the venv fdl runs from lives outside the root: listed, marked
    assert running["running"] and not cpu["running"]
    assert listed["auto"]["variant"] == "cu128" and listed["auto"]["acquire"] is True
    assert "the driver runs CUDA 12.8" in listed["auto"]["reason"]
    text = fdl(tmp_path, root, "list", tools=tools)
    assert text.returncode == 0, text.stderr
    assert f"libtorch root {root}" in text.stdout and "GPU 0 NVIDIA H200 (sm_90)" in text.stdout
    assert "unusable" in text.stdout and "auto: cu128, not installed" in text.stdout


def test_which_names_the_venv_join_would_run_in_or_what_it_would_acquire(root: Path, tmp_path: Path) -> None:
    named = fdl(tmp_path, root, "which", "cpu", "--json")
    assert named.returncode == 0, named.stderr
    assert json.loads(named.stdout) | {"reason": ""} == {
        "wanted": "cpu",
        "variant": "cpu",
        "venv": str(root / "cpu"),
        "acquire": False,
        "reason": "",
    }
    (tmp_path / "fdl.yml").write_text("join:\n  libtorch: cu128\n")  # the default VARIANT
    missing = fdl(tmp_path, root, "which")
    assert missing.returncode == 0 and "cu128: not installed" in missing.stdout, missing.stdout
    broken = fdl(tmp_path, root, "which", "rocm6.4")
    assert broken.returncode == PERMANENT and f"remove {root / 'rocm6.4'}" in broken.stderr


def test_acquire_auto_installs_what_the_cards_need_once(tmp_path: Path) -> None:
    """No variant installed, an H200 on a CUDA 12.8 driver, join.torch_sources naming a
    wheelhouse with a cu128 torch: auto acquires cu128; asked again, it is already there."""
    tools = stand_in_nvidia_smi(tmp_path)
    wheels = tmp_path / "wheels"
    stand_in_torch(wheels, "2.13.0+cu128", cuda="12.8", archs="sm_80 sm_90 sm_100 sm_120", nccl="2.27.3")
    fleet_wheel(wheels)
    (tmp_path / "fdl.yml").write_text(f"join:\n  torch_sources: {{cu126: {wheels}, cu128: {wheels}}}\n")
    root = tmp_path / "libtorch"
    first = fdl(tmp_path, root, "acquire", "auto", tools=tools)
    assert first.returncode == 0, first.stderr
    assert f"auto: cu128 installed at {root / 'cu128'}" in first.stdout
    assert f"pip install torch from {wheels}" in first.stderr and "pip install flodl-fleet==" in first.stderr
    assert sorted(p.name for p in root.iterdir()) == ["cu128"]  # no partial venv beside it
    assert (root / "cu128" / "bin" / "fdl").exists()
    again = fdl(tmp_path, root, "acquire", "auto", "--json", tools=tools)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) | {"reason": ""} == {
        "wanted": "auto",
        "acquired": False,
        "variant": "cu128",
        "venv": str(root / "cu128"),
        "acquire": False,
        "reason": "",
    }
    assert "pip install" not in again.stderr
    listed = json.loads(fdl(tmp_path, root, "list", "--json", tools=tools).stdout)
    (row,) = [r for r in listed["variants"] if r["name"] == "cu128"]
    assert (row["cuda"], row["nccl"], row["archs"]) == (
        "12.8",
        "2.27.3",
        ["sm_80", "sm_90", "sm_100", "sm_120"],
    )
    assert (row["covers"], row["coverage"]) == (True, "covers GPU 0 (sm_90)")
    assert listed["auto"] | {"reason": ""} == {
        "variant": "cu128",
        "venv": str(root / "cu128"),
        "acquire": False,
        "reason": "",
    }


def test_a_source_serving_another_build_is_permanent_and_leaves_nothing(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    stand_in_torch(wheels, "2.13.0+cu126", cuda="12.6", archs="sm_90")
    fleet_wheel(wheels)
    root = tmp_path / "libtorch"
    proc = fdl(tmp_path, root, "acquire", "rocm6.4", "--source", "wheels")  # relative to the working dir
    assert proc.returncode == PERMANENT, proc.stderr
    assert f"{wheels} served torch 2.13.0+cu126, a cu126 build" in proc.stderr
    assert "join.torch_sources.rocm6.4" in proc.stderr and "Traceback" not in proc.stderr
    assert list(root.iterdir()) == []


def test_an_unreachable_index_is_transient_and_leaves_nothing(tmp_path: Path) -> None:
    index = f"http://127.0.0.1:{free_port()}/simple"  # nobody listens
    where = tmp_path / "libtorch"
    proc = fdl(tmp_path, where, "acquire", "cu126", "--source", index)
    assert proc.returncode == TRANSIENT, proc.stderr
    assert f"pip could not install torch from {index}" in proc.stderr and "Connection refused" in proc.stderr
    assert list(where.iterdir()) == []


def test_usage_errors_name_the_argument_and_exit_2(root: Path, tmp_path: Path) -> None:
    bad = fdl(tmp_path, root, "acquire", "cuda12")
    assert bad.returncode == 2 and "Invalid value for VARIANT: `cuda12` is not a torch variant" in bad.stderr
    assert "cu126" in bad.stderr  # the fix names the spelling
    nowhere = fdl(tmp_path, root, "acquire", "cpu", "--source", "no/such/dir")
    assert nowhere.returncode == 2 and "--source" in nowhere.stderr and "Traceback" not in nowhere.stderr

"""join.libtorch with real venvs: each venv's torch read by its own interpreter, `fdl join
--libtorch` re-exec'd into the chosen venv (stdin intact for --spec-stdin), and an acquisition
that fails leaves nothing that looks installed.

The variant venvs (tests/support/libtorch.py) are real venvs of this interpreter that see this
checkout's site-packages (its CPU torch, its flodl-fleet): the roles' venvs without the download.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flodl_agent.agent.spec import AgentSpec, encode
from flodl_agent.errors import PERMANENT, TRANSIENT
from flodl_agent.hardware.libtorch import acquire, installed, relocate
from flodl_agent.retry import Permanent
from tests.support import free_port
from tests.support.libtorch import FDL, fdl_env, run_fdl, stand_in_nvidia_smi, variant_venv

pytestmark = pytest.mark.skipif(not FDL.exists(), reason="the fdl console script is not installed")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("libtorch")
    variant_venv(where, "cpu")
    variant_venv(where, "cu126")  # a CPU torch under a CUDA name: the facts say what it is
    variant_venv(where, "rocm6.4", with_torch=False)
    return where


def test_installed_reads_each_venvs_torch_and_reports_a_broken_one(root: Path) -> None:
    venvs = {v.name: v for v in installed(root)}
    assert sorted(venvs) == ["cpu", "cu126", "rocm6.4"]
    for name in ("cpu", "cu126"):
        assert venvs[name].torch.version.startswith("2."), venvs[name].torch
        assert venvs[name].variant == "cpu" and venvs[name].problem == ""
        assert venvs[name].path == root / name
    assert "torch does not import (ModuleNotFoundError" in venvs["rocm6.4"].problem


def join(
    root: Path, *args: str, stdin: str = "", tools: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return run_fdl(root, fdl_env(root, root, tools), "join", *args, stdin=stdin, timeout=60)


def test_join_re_execs_into_the_chosen_variant(root: Path) -> None:
    port = free_port()  # nothing listens: the child's dial is refused, a transient exit
    proc = join(root, f"127.0.0.1:{port}", "--libtorch", "cpu", "--devices", "cpu:1", "--no-persist")
    assert f"libtorch cpu: cpu as asked, installed at {root / 'cpu'}" in proc.stderr
    assert f"fdl running in {root / 'cpu'}" in proc.stderr
    assert proc.stderr.count("libtorch cpu:") == 2  # the choice and the exec, once: the child never loops
    assert proc.returncode == TRANSIENT, proc.stderr


def test_a_fan_out_agent_reads_its_spec_after_the_re_exec(root: Path) -> None:
    port = free_port()
    spec = AgentSpec(controller_host="127.0.0.1", controller_port=port, devices="cpu:1")
    proc = join(root, "--spec-stdin", "--libtorch", "cu126", "--no-persist", stdin=encode(spec).decode())
    assert f"fdl running in {root / 'cu126'}" in proc.stderr
    assert "got no spec" not in proc.stderr and str(port) in proc.stderr
    assert proc.returncode == TRANSIENT, proc.stderr


def test_a_bad_variant_and_a_broken_venv_are_refused_without_a_traceback(root: Path) -> None:
    bad = join(root, "127.0.0.1:1", "--libtorch", "cuda12")
    assert bad.returncode == 2 and "--libtorch" in bad.stderr and "Traceback" not in bad.stderr
    broken = join(root, "127.0.0.1:1", "--libtorch", "rocm6.4")
    assert broken.returncode == PERMANENT and "Traceback" not in broken.stderr
    assert f"remove {root / 'rocm6.4'}" in broken.stderr


def test_a_failed_acquisition_leaves_nothing_that_looks_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()  # no torch in it: pip finds nothing, a permanent failure
    where = tmp_path / "libtorch"
    lines: list[str] = []
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # this machine's pip.conf adds a wheelhouse
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(Permanent) as caught:
        acquire("cpu", where, str(wheelhouse), lines.append)
    assert str(wheelhouse) in caught.value.message and "join.torch_sources.cpu" in caught.value.fix
    assert caught.value.code == PERMANENT
    assert list(where.iterdir()) == []  # neither <root>/cpu nor the hidden partial venv
    assert installed(where) == []
    assert lines == [f"libtorch cpu: pip install torch from {wheelhouse}"]


def test_auto_on_an_nvidia_box_acquires_the_newest_variant_the_driver_runs(tmp_path: Path) -> None:
    """A stand-in nvidia-smi (an H200, driver CUDA 12.8), no variant installed, the sources a
    wheelhouse without torch: auto picks cu128 (cu130 is newer than the driver), tries it and
    stops permanently, leaving nothing behind."""
    tools = stand_in_nvidia_smi(tmp_path)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    root = tmp_path / "libtorch"
    sources = {variant: str(wheels) for variant in ("cu126", "cu128", "cu130")}
    (tmp_path / "fdl.yml").write_text(f"join:\n  libtorch: auto\n  torch_sources: {sources}\n")
    proc = run_fdl(
        tmp_path, fdl_env(root, tmp_path, tools), "join", "127.0.0.1:1", "--no-persist", timeout=120
    )
    assert "libtorch auto: no installed variant covers GPU 0 (sm_90)" in proc.stderr
    assert "acquiring cu128" in proc.stderr
    assert f"pip install torch from {wheels}" in proc.stderr
    assert proc.returncode == PERMANENT and "Traceback" not in proc.stderr, proc.stderr
    assert "join.torch_sources.cu128" in proc.stderr
    assert list(root.iterdir()) == []


def test_auto_on_a_gpu_box_offering_cpu_ranks_looks_at_no_card(root: Path, tmp_path: Path) -> None:
    tools = stand_in_nvidia_smi(tmp_path)
    proc = join(root, "127.0.0.1:1", "--libtorch", "auto", "--devices", "cpu:1", "--no-persist", tools=tools)
    # the stand-in H200 is not looked at: no card to cover, nothing to acquire
    assert "libtorch auto: a CPU box" in proc.stderr and "acquiring" not in proc.stderr, proc.stderr


def test_relocation_points_pips_scripts_at_the_final_place(tmp_path: Path) -> None:
    tmp, final = tmp_path / ".cu126.x.partial", tmp_path / "cu126"
    (tmp / "bin").mkdir(parents=True)
    (tmp / "bin" / "fdl").write_text(f"#!{tmp}/bin/python\nimport sys\n")
    (tmp / "bin" / "python").symlink_to(sys.executable)  # a link is left alone
    (tmp / "pyvenv.cfg").write_text(f"home = /usr/bin\ncommand = python -m venv {tmp}\n")
    relocate(tmp, tmp, final)
    assert (tmp / "bin" / "fdl").read_text().startswith(f"#!{final}/bin/python\n")
    assert (tmp / "bin" / "python").resolve() == Path(sys.executable).resolve()
    assert str(final) in (tmp / "pyvenv.cfg").read_text()

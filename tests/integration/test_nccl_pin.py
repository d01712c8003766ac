"""fdl nccl pin, as far as a CPU box allows: a real pip install of an nvidia-nccl wheel
(a stand-in built here: PyPI's is a CUDA library) into a real venv, from a wheelhouse."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from flodl_agent.cli.main import cli
from flodl_agent.probing.nccl import NcclError, package_for, pin


def stand_in_wheel(wheelhouse: Path, version: str) -> Path:
    """nvidia-nccl-cu12 as pip sees it: the package, its lib/libnccl.so.2, a valid RECORD."""
    dist = f"nvidia_nccl_cu12-{version}.dist-info"
    files = {
        "nvidia/__init__.py": b"",
        "nvidia/nccl/__init__.py": b"",
        "nvidia/nccl/lib/libnccl.so.2": b"\x7fELF stand-in",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: nvidia-nccl-cu12\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = wheelhouse / f"nvidia_nccl_cu12-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for name, data in files.items():
            whl.writestr(name, data)
    return path


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("variant") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
    return where


def test_a_pin_installs_the_wheel_and_names_the_library_for_join_env(tmp_path: Path, venv: Path) -> None:
    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    for version in ("2.21.5", "2.26.2"):
        stand_in_wheel(wheelhouse, version)
    first = pin("2.21.5", venv, cuda="12.6", find_links=wheelhouse)
    assert (first.package, first.version) == ("nvidia-nccl-cu12", "2.21.5")
    assert Path(first.lib).name == "libnccl.so.2" and Path(first.lib).is_file()
    assert first.env == {"LD_LIBRARY_PATH": str(Path(first.lib).parent)}
    # Re-pinning moves the venv to the other version (the cohort's, after a skew refusal).
    runner = CliRunner()
    moved = runner.invoke(
        cli,
        [
            "nccl",
            "pin",
            "2.26.2",
            "--venv",
            str(venv),
            "--cuda",
            "12",
            "--find-links",
            str(wheelhouse),
            "--json",
        ],
    )
    assert moved.exit_code == 0, moved.output
    assert json.loads(moved.output)["version"] == "2.26.2"
    missing = runner.invoke(
        cli, ["nccl", "pin", "2.30.1", "--venv", str(venv), "--cuda", "12", "--find-links", str(wheelhouse)]
    )
    assert missing.exit_code == 1 and "installing nvidia-nccl-cu12==2.30.1 failed" in missing.output


def test_a_cpu_build_of_torch_has_no_nccl_to_pin() -> None:
    pytest.importorskip("torch")
    with pytest.raises(NcclError) as caught:
        pin("2.21.5", Path(sys.prefix))  # this venv: torch's CPU build
    assert "CPU build" in caught.value.message and "--cuda" in caught.value.fix


@pytest.mark.parametrize(
    ("bad", "words"), [("2.21", "not an NCCL version"), ("latest", "not an NCCL version")]
)
def test_bad_versions_are_refused_by_name(bad: str, words: str) -> None:
    with pytest.raises(NcclError, match=words):
        pin(bad, Path(sys.prefix), cuda="12")


def test_the_wheel_follows_the_cuda_major() -> None:
    assert package_for("12.6") == "nvidia-nccl-cu12" and package_for("11") == "nvidia-nccl-cu11"
    with pytest.raises(NcclError):
        package_for("cpu")

"""Where `fdl publish`'s gate builds: the cluster file's controller.arch (a real variant venv on
this box) and controller.docker (a real compose service: podman-compose and the lab image)."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner, Result

from flodl_agent.cli.main import cli
from flodl_agent.sources.manifest import read_manifest
from tests.support import compose as kit

# The entry answers the model probe with a signature only its interpreter can give.
PROBE = """\
import hashlib, os, sys
inside = "container" if os.path.exists("/run/.containerenv") else "box"
where = os.environ["FLODL_PROBE_SIGNATURE"]
open(where, "w").write(hashlib.sha256(f"{inside} {sys.prefix}".encode()).hexdigest())
"""


# One xdist worker runs the podman tests, one after another: one lab image build, one engine.
pytestmark = pytest.mark.xdist_group("podman")


def source(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "probe.py").write_text(PROBE)
    return root


def cluster_file(where: Path, **controller: str) -> Path:
    path = where / "fdl.cluster.yml"
    body = {"cluster": {"controller": {"host": "127.0.0.1", **controller}, "workers": [{"host": "w"}]}}
    path.write_text(yaml.safe_dump(body))
    return path


def publish(src: Path, served: Path, cluster: Path, *flags: str) -> Result:
    argv = ["publish", f"file://{src}", "--to", str(served), "--cwd", "pkg", "--cluster", str(cluster)]
    return CliRunner().invoke(cli, [*argv, *flags, "--json"])


def test_arch_builds_and_probes_with_that_variants_venv(tmp_path: Path) -> None:
    root = tmp_path / "opt"
    venv = root / "libtorch" / "precompiled" / "cu128"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    cluster = cluster_file(tmp_path, path=str(root), arch="precompiled/cu128")
    build = (
        "python -c 'import sys; print(sys.prefix)' > prefix"
        " && echo $FDL_TORCH_VARIANT $FDL_GPU_FEATURE > variant"
    )
    flags = ("--build", build, "--bin", "probe.py", "--model-probe")
    done = publish(source(tmp_path / "src"), tmp_path / "served", cluster, *flags)
    assert done.exit_code == 0, done.output
    gate = tmp_path / "served" / "gate" / "pkg"
    assert (gate / "prefix").read_text().strip() == str(venv)  # its bin/ first on PATH
    assert (gate / "variant").read_text().strip() == "cu128 cuda"  # the variant, seed 000's feature
    manifest = read_manifest(tmp_path / "served" / "tree")
    assert manifest is not None and manifest.model_sig == hashlib.sha256(f"box {venv}".encode()).hexdigest()


def test_a_missing_variant_venv_or_both_fields_are_refused_by_name(tmp_path: Path) -> None:
    src = source(tmp_path / "src")
    missing = publish(src, tmp_path / "s", cluster_file(tmp_path, arch="cu126"), "--build", "true")
    assert missing.exit_code == 1
    error = json.loads(missing.output)["error"]
    assert error.startswith("cluster.controller.arch: no variant venv at /opt/flodl/libtorch/cu126")
    assert read_manifest(tmp_path / "s" / "tree") is None  # nothing was published
    both = publish(
        src, tmp_path / "s", cluster_file(tmp_path, arch="cu126", docker="cuda"), "--build", "true"
    )
    assert both.exit_code == 2
    assert "cluster.controller sets both docker and arch" in both.output


@pytest.fixture
def service_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    if why := kit.missing():
        pytest.skip(why)
    name = f"flodlg{secrets.token_hex(3)}"
    proj = kit.project(tmp_path / name, "cuda", "")
    monkeypatch.chdir(proj)  # `fdl publish` runs where the project's compose file is
    yield proj
    kit.remove(f"io.podman.compose.project={name}", name)  # and the network its builds used


def test_docker_builds_and_probes_in_the_compose_service(tmp_path: Path, service_project: Path) -> None:
    cluster = cluster_file(service_project, docker="cuda")
    src, served = source(tmp_path / "src"), tmp_path / "served"
    build = "test -f /run/.containerenv && id -u > built-by"
    done = publish(src, served, cluster, "--build", build, "--bin", "probe.py", "--model-probe")
    assert done.exit_code == 0, done.output
    gate = served / "gate" / "pkg"
    assert (gate / "built-by").read_text().strip() == str(os.getuid())  # in the service, as this user
    manifest = read_manifest(served / "tree")
    assert manifest is not None and manifest.built
    assert manifest.model_sig == hashlib.sha256(b"container /usr").hexdigest()  # the image's python3
    # The build's own exit code decides (podman-compose 1.0.3's run exits 0 either way).
    failed = publish(src, served, cluster, "--build", "echo broken; exit 3")
    assert failed.exit_code == 1
    said = json.loads(failed.output)
    assert "`echo broken; exit 3` exited 3" in said["error"]
    assert read_manifest(served / "tree") == manifest and said["served"].startswith(f"run {manifest.run} (")
    assert kit.containers(f"flodl.gate={gate}") == []


def test_docker_without_a_compose_tool_that_answers_is_a_clear_error(
    tmp_path: Path, service_project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pinned to `docker compose`, which has no plugin or engine on this machine: nothing answers.
    monkeypatch.setenv("FLODL_COMPOSE", "docker compose")
    cluster = cluster_file(service_project, docker="cuda")
    done = publish(source(tmp_path / "src"), tmp_path / "served", cluster, "--build", "true")
    assert done.exit_code == 1
    answer = json.loads(done.output)
    assert answer["error"].startswith("cluster.controller.docker: no compose tool answers on this box")
    assert "apt-get install podman-compose" in answer["fix"]


def test_the_gate_without_either_field_still_builds_with_this_venv(tmp_path: Path) -> None:
    cluster = cluster_file(tmp_path)
    build = "python -c 'import sys; print(sys.prefix)' > prefix"
    done = publish(source(tmp_path / "src"), tmp_path / "served", cluster, "--build", build)
    assert done.exit_code == 0, done.output
    assert (tmp_path / "served" / "gate" / "pkg" / "prefix").read_text().strip() == sys.prefix

"""fdl probe across a cluster over real OpenSSH: each worker probes itself as its cluster
entry describes it, and the set shows what no single box can.

Both reachable "workers" are this machine through a private sshd on loopback; the
agents run the repository's own fdl.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from flodl_agent.train.signature import dataset_signature
from tests.support import free_port
from tests.support.sshd import Sshd, loopback_cluster

ROOT = Path(__file__).parents[2]


def probe_lab(cwd: Path) -> subprocess.CompletedProcess[str]:
    """`fdl @lab probe --json` in ``cwd`` (its fdl.lab.yml)."""
    argv = [str(ROOT / ".venv" / "bin" / "fdl"), "@", "lab", "probe", "--json"]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "fdl").exists(), reason="needs the repository's .venv")
def test_a_cluster_probe_reaches_every_worker_and_finds_what_only_the_set_shows(
    sshd: Sshd, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "shard-0").write_bytes(b"x")
    config = yaml.safe_load(loopback_cluster(tmp_path, sshd, free_port()).read_text())
    a, b = config["cluster"]["workers"]
    a["data_path"], b["data_path"] = str(data), str(tmp_path / "not-mounted")
    lost = dict(b, host="fan-lost", ssh=dict(b["ssh"], port=free_port()))  # nothing listens there
    config["cluster"]["workers"].append(lost)
    (tmp_path / "fdl.lab.yml").write_text(yaml.safe_dump(config))
    proc = probe_lab(tmp_path)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert not report["ok"]
    assert sorted(report["hosts"]) == ["(controller)", "fan-a", "fan-b", "fan-lost"]
    # Each reachable worker probed itself as its cluster entry describes it.
    assert report["hosts"]["fan-a"]["facts"]["data"]["entries"] == 1
    assert report["hosts"]["fan-b"]["facts"]["data"]["exists"] is False
    assert "error" in report["hosts"]["fan-lost"]
    across = {f["check"]: f for f in report["cluster"]}
    assert across["reach"]["message"].startswith("fan-lost: not probed")
    assert across["data"]["level"] == "fail" and "(1 entries) on fan-a" in across["data"]["message"]


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "fdl").exists(), reason="needs the repository's .venv")
def test_a_cluster_probe_compares_data_roots_by_the_signature_admission_compares(
    sshd: Sshd, tmp_path: Path
) -> None:
    # Two roots a listing calls the same (one file each, same name and size), other bytes inside.
    roots = [tmp_path / "data-a", tmp_path / "data-b"]
    for root, content in zip(roots, (b"train-v1", b"train-v2"), strict=True):
        root.mkdir()
        (root / "shard-0").write_bytes(content)
    config = yaml.safe_load(loopback_cluster(tmp_path, sshd, free_port()).read_text())
    for worker, root in zip(config["cluster"]["workers"], roots, strict=True):
        worker["data_path"] = str(root)
    # A third entry declares no root: the convention root is checked there, and never compared.
    config["cluster"]["workers"].append(
        {k: v for k, v in worker.items() if k != "data_path"} | {"host": "fan-c"}
    )
    (tmp_path / "fdl.lab.yml").write_text(yaml.safe_dump(config))
    proc = probe_lab(tmp_path)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    signed = {h: report["hosts"][h]["facts"]["data"]["signature"] for h in ("fan-a", "fan-b")}
    # Each box reports the very signature its hello would carry.
    assert signed == {"fan-a": dataset_signature(roots[0]), "fan-b": dataset_signature(roots[1])}
    convention = report["hosts"]["fan-c"]["facts"]["data"]
    assert (convention["path"], convention["declared"]) == ("/flodl/data", False)
    (checked,) = [f for f in report["hosts"]["fan-c"]["findings"] if f["check"] == "data"]
    assert "no data_path declared; checked the convention root /flodl/data" in checked["message"]
    (data,) = [f for f in report["cluster"] if f["check"] == "data"]
    assert data["level"] == "fail" and "dataset mismatch" in data["message"]
    assert f"signature {signed['fan-a'][:12]} (1 entries) on fan-a" in data["message"]

"""`fdl probe` through the CLI: exit codes, --json, and the controller port check."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

from tests.support import free_port


def probe(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["fdl", "probe", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_a_ready_box_exits_0_and_a_broken_join_block_1_naming_what(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (tmp_path / "fdl.yml").write_text(
        f"join:\n  devices: cpu:1\n  data_path: {data}\n  nccl_socket_ifname: lo\n"
    )
    ready = probe(tmp_path, "--json", "--no-dial")
    assert ready.returncode == 0, ready.stdout
    report = json.loads(ready.stdout)
    assert report["ok"] and {f["check"] for f in report["findings"]} >= {"torch", "data", "cache", "ifname"}
    (tmp_path / "fdl.yml").write_text("join:\n  devices: [5]\n  data_path: /does/not/exist\n")
    broken = probe(tmp_path, "--no-dial")
    assert broken.returncode == 1
    assert "/does/not/exist does not exist" in broken.stdout and "not ready" in broken.stdout


def test_the_controller_port_taken_by_something_else_fails(tmp_path: Path) -> None:
    port = free_port()
    cluster = tmp_path / "fdl.cluster.yml"
    cluster.write_text(
        f"cluster:\n  controller:\n    host: 127.0.0.1\n    port: {port}\n"
        "    join: {discovery: true, min_rank_start: 1}\n"
    )
    assert probe(tmp_path, "--config", str(cluster)).returncode == 0
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        taken = probe(tmp_path, "--config", str(cluster), "--json")
    assert taken.returncode == 1
    (port_finding,) = [f for f in json.loads(taken.stdout)["findings"] if f["check"] == "port"]
    assert "not a flodl controller" in port_finding["message"]


def test_a_box_sees_the_open_window_and_the_controller_box_its_own_port(tmp_path: Path) -> None:
    port = free_port()
    cluster = tmp_path / "fdl.cluster.yml"
    cluster.write_text(
        f"cluster:\n  controller:\n    host: 127.0.0.1\n    port: {port}\n"
        "    join: {discovery: true, min_rank_start: 1, join_timeout: 60, max_join_timeout: 120}\n"
    )
    launch = subprocess.Popen(
        ["fdl", "launch", "--config", str(cluster), "--", "true"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert launch.stderr is not None
        for line in launch.stderr:  # the controller says when its window is open
            if "join window open" in line:
                break
        (tmp_path / "fdl.yml").write_text(f"join:\n  controller: 127.0.0.1:{port}\n  devices: cpu:1\n")
        box = json.loads(probe(tmp_path, "--json", "--config", "fdl.yml").stdout)
        (seen,) = [f for f in box["findings"] if f["check"] == "controller"]
        assert seen["level"] == "ok" and "window waiting" in seen["message"]
        own = json.loads(probe(tmp_path, "--json", "--config", str(cluster)).stdout)
        (port_finding,) = [f for f in own["findings"] if f["check"] == "port"]
        assert port_finding["level"] == "ok" and "already answers" in port_finding["message"]
    finally:
        launch.kill()
        launch.wait()

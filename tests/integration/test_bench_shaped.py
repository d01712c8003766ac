"""The averaging bench's shaped network, for real (root, iproute2): it is built, carries a
CPU-plane world and gloo between its namespaces, and leaves nothing behind, even on failure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import netns

ROOT = Path(__file__).parents[2]

pytestmark = [
    pytest.mark.skipif(netns.available() is not None, reason=f"a shaped network {netns.available()}"),
    # Alone with the other timing-minded test: it measures links it shapes, on 2 cores.
    pytest.mark.xdist_group("netns"),
]


def test_the_shaped_bench_builds_its_network_measures_over_it_and_removes_it() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.averaging", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    made = report["shaped_namespaces"]
    assert len(made) == 4 and all(name.startswith(netns.PREFIX) for name in made)  # switch, ctl, w0, w1
    (row,) = [r for r in report["rows"] if r["net"] == "shaped"]
    assert row["hub_s"] > 0 and row["gloo_s"] > 0  # a CPU-plane world and gloo both ran across it
    assert not set(made) & set(netns.namespaces())


def test_a_failing_run_still_removes_its_network_and_stale_ones_go_first() -> None:
    gone = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process has this id
    stale = f"{netns.PREFIX}{gone}-sw"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with pytest.raises(RuntimeError, match="mid-run"), netns.shaped(1) as t:
            present = set(netns.namespaces())
            assert set(t.namespaces) <= present and stale not in present
            # the links are up and shaped: the worker reaches the controller through the switch
            reach = subprocess.run(
                netns.in_ns(t.workers[0].ns, ["ip", "route", "get", t.controller.address]),
                capture_output=True,
                text=True,
                check=True,
            )
            assert "dev eth0" in reach.stdout
            raise RuntimeError("mid-run")
        assert not [ns for ns in netns.namespaces() if ns.startswith(t.prefix)]
    finally:
        netns.remove([stale])

"""Benchmarks keep running: each prints one JSON object as its last line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize(
    ("name", "args"),
    [("config_load", ["--quick"]), ("join_storm", ["--n", "50"]), ("join_storm", ["--n", "50", "--bound"])],
)
def test_benchmark_quick_run_reports_json(name: str, args: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["bench"] == name and report["ratio"] > 0

"""Benchmarks keep running: each prints one JSON object as its last line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("name", ["config_load"])
def test_benchmark_quick_run_reports_json(name: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["bench"] == name and report["ratio"] > 0

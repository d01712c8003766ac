"""The coverage-guided fuzzer (tests/fuzz/frames.py) for a short bounded run; `make fuzz` runs it long."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris", reason="atheris installs on x86_64 CPython only")
ROOT = Path(__file__).parents[2]


def test_the_frame_and_hello_fuzzer_finds_nothing(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests.fuzz.frames", "-runs=50000", f"-artifact_prefix={tmp_path}/"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Done 50000 runs" in done.stderr
    assert not list(tmp_path.iterdir())  # no crash input was written

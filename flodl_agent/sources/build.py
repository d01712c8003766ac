"""Building a fetched tree and running its entry: a build line with the variant's venv first
on PATH, and how a box runs an entry point."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BUILD_TAIL = 20  # lines of a failed build shown


@dataclass(frozen=True)
class Build:
    """A build line's outcome: its exit code and its output (stdout, then stderr)."""

    line: str
    returncode: int
    output: str

    def failure(self, where: str = "") -> str:
        """The failure as seed 003 words it, with the output's last lines."""
        tail = "\n".join(f"    | {line}" for line in self.output.splitlines()[-BUILD_TAIL:])
        return f"the source does not build: `{self.line}` exited {self.returncode}{where}" + (
            f"\n{tail}" if tail else ""
        )


def run_build(line: str, workdir: Path, env: dict[str, str] | None = None, path: str | None = None) -> Build:
    """Run a build line with this interpreter's venv (or ``path``) first on PATH (the variant
    that runs the ranks)."""
    full = dict(os.environ) | {"PATH": path or rank_path()} | (env or {})
    proc = subprocess.run(
        ["sh", "-c", line], cwd=workdir, env=full, capture_output=True, text=True, check=False
    )
    return Build(line, proc.returncode, (proc.stdout + proc.stderr).strip())


def entry_command(entry: str | Path, args: list[str], python: str = sys.executable) -> list[str]:
    """How a box runs an entry point: a Python script that is not executable runs under
    this interpreter (the variant's venv), or ``python``. A string stays as written
    (`./train` is not `train`, which PATH would look up)."""
    runner = [python] if Path(entry).suffix == ".py" and not os.access(entry, os.X_OK) else []
    return [*runner, str(entry), *args]


def rank_path() -> str:
    """PATH for builds, probes and ranks: this interpreter's venv first."""
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])

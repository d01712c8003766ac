"""The mutation score of each module `make mutate` mutated, from mutmut's results.

A mutant counts as caught when a test failed (killed) or hung (timeout). One that no test
runs, or that every test survives, counts against its module. Exit 1 when a module scores
under ``--min`` percent, naming it; `mutmut show NAME` shows a survivor's diff.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

CAUGHT = {"killed", "timeout"}


def tally(lines: list[str]) -> dict[str, Counter[str]]:
    """Per module, how many of its mutants ended each way (`name: status` lines)."""
    modules: dict[str, Counter[str]] = defaultdict(Counter)
    for line in lines:
        name, _, status = line.strip().rpartition(": ")
        if not name:
            continue
        module = name.split(".x", 1)[0]  # mutmut names a mutant <module>.x_<function>__mutmut_<n>
        modules[module][status] += 1
    return modules


def score(counts: Counter[str]) -> float:
    total = sum(n for status, n in counts.items() if status != "skipped")
    return 100.0 * sum(counts[s] for s in CAUGHT) / total if total else 100.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min", type=float, default=95.0, help="the lowest score a module may have")
    parser.add_argument("--mutmut", default=str(Path(sys.executable).parent / "mutmut"))
    args = parser.parse_args()
    argv = [args.mutmut, "results", "--all", "true"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    modules = tally(out.stdout.splitlines())
    if not modules:
        print("mutation_score: mutmut has no results: run `mutmut run` first", file=sys.stderr)
        return 1
    low = []
    for module, counts in sorted(modules.items()):
        pct = score(counts)
        detail = ", ".join(f"{status} {n}" for status, n in sorted(counts.items()))
        print(f"{module}: {pct:.1f}% ({detail})")
        if pct < args.min:
            low.append(module)
    if low:
        print(f"under {args.min:g}%: {', '.join(low)} (mutmut results lists the survivors)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What line tracking and located errors cost over the plainest possible load.

Ours: ``parse_yaml`` (compose + convert, recording the line of every key) and
``validate_document``. Baseline: ``yaml.safe_load`` + ``FdlConfig.model_validate``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from importlib import resources

import yaml

from flodl_agent.config import FdlConfig, parse_yaml, validate_document


def _per_call(fn: Callable[[], object], rounds: int, calls: int) -> float:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    args = parser.parse_args()
    text = resources.files("flodl_agent").joinpath("examples/reference.fdl.cluster.yml").read_text()
    rounds, calls = (3, 20) if args.quick else (9, 200)

    def ours() -> object:
        return validate_document(parse_yaml(text, "reference.yml"))

    def baseline() -> object:
        return FdlConfig.model_validate(yaml.safe_load(text))

    assert ours() == baseline()
    ours_s = _per_call(ours, rounds, calls)
    base_s = _per_call(baseline, rounds, calls)
    print(f"ours {ours_s * 1e6:.0f} us/load, baseline {base_s * 1e6:.0f} us/load")
    print(
        json.dumps(
            {
                "bench": "config_load",
                "ours_us": round(ours_s * 1e6, 1),
                "baseline_us": round(base_s * 1e6, 1),
                "ratio": round(ours_s / base_s, 3),
            }
        )
    )


if __name__ == "__main__":
    main()

"""How long `ansible-playbook site.yml` takes on the lab: from bare containers,
and again with nothing to change, for 3 and 6 hosts.

Baseline, same run: the no-change pass with Ansible's defaults (no pipelining,
5 forks) instead of the project's ansible.cfg (pipelining, 10 forks).
Needs root and podman (the lab); `--quick` measures 3 hosts only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "tests" / "lab" / "lab"


def _run(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return time.perf_counter() - start


def measure(hosts: int) -> dict[str, float | int]:
    inventory = Path(tempfile.mkdtemp()) / "inventory"
    env = {
        **os.environ,
        "LAB_NAME": "flodl-bench",
        "LAB_SUBNET": "10.89.5.0/24",
        "LAB_INVENTORY": str(inventory),
        "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}",
    }
    subprocess.run([str(LAB), "down"], env=env, capture_output=True, check=False)
    try:
        _run([str(LAB), "up", "--workers", str(hosts - 1)], env)
        env["ANSIBLE_INVENTORY"] = str(inventory / "hosts.yml")
        fresh = _run(["ansible-playbook", "site.yml"], env)
        again = _run(["ansible-playbook", "site.yml"], env)
        defaults = {**env, "ANSIBLE_PIPELINING": "False", "ANSIBLE_FORKS": "5"}
        baseline = _run(["ansible-playbook", "site.yml"], defaults)
    finally:
        subprocess.run([str(LAB), "down"], env=env, capture_output=True, check=False)
    return {
        "hosts": hosts,
        "fresh_s": round(fresh, 1),
        "no_change_s": round(again, 1),
        "no_change_per_host_s": round(again / hosts, 2),
        "baseline_no_change_s": round(baseline, 1),
        "ratio": round(again / baseline, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="3 hosts only")
    args = parser.parse_args()
    results = [measure(n) for n in ((3,) if args.quick else (3, 6))]
    for r in results:
        print(
            f"{r['hosts']} hosts: site.yml from bare {r['fresh_s']} s; no-change {r['no_change_s']} s "
            f"({r['no_change_per_host_s']} s/host); with Ansible's defaults {r['baseline_no_change_s']} s"
        )
    print("goal: a no-change run under 20 s for 3 hosts (15 s the aim), growing less than linearly")
    print(json.dumps({"bench": "fleet_converge", "results": results, "ratio": results[-1]["ratio"]}))


if __name__ == "__main__":
    main()

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
    if name == "join_storm":  # the fan-out's floor, measured beside it: one send a host
        (result,) = report["results"]
        # Both figures are rounded to a tenth, so the product of the rounded one may differ by one.
        floor = pytest.approx(50 * result["send_us"] / 1e3, abs=0.1)
        assert result["send_us"] > 0 and result["fanout_floor_ms"] == floor


def test_the_shaped_network_plan_shapes_both_ends_of_every_link() -> None:
    from bench import netns

    t = netns.topology(2, pid=4242)
    assert t.namespaces == [
        "fdl-bench-4242-sw",
        "fdl-bench-4242-ctl",
        "fdl-bench-4242-w0",
        "fdl-bench-4242-w1",
    ]
    assert [(h.name, h.rate) for h in t.hosts] == [("ctl", 10**10), ("w0", 10**9), ("w1", 10**9)]
    assert len({h.address for h in t.hosts}) == 3
    commands = [" ".join(c) for c in netns.setup_commands(t)]
    for h in t.hosts:
        shaped = [c for c in commands if "tbf" in c and f"rate {h.rate}bit" in c]
        # the host's own end, and the switch's end of its pair
        assert any(f"exec {h.ns} tc qdisc add dev eth0" in c for c in shaped)
        assert any(f"exec {t.switch} tc qdisc add dev {h.port}" in c for c in shaped)
    assert commands.index(f"ip netns add {t.switch}") < commands.index(
        f"ip -n {t.switch} link add br0 type bridge"
    )


def test_a_token_bucket_holds_at_least_a_kernel_tick_at_its_rate() -> None:
    from bench import netns

    burst = int(netns.tbf(10**10)[netns.tbf(10**10).index("burst") + 1])
    assert burst * 8 * netns.KERNEL_HZ >= 10**10 and int(netns.tbf(10**9)[4]) == 1 << 20


def test_stale_namespaces_are_the_ones_of_processes_gone() -> None:
    from bench import netns

    names = netns.parse_list(
        "fdl-bench-11-sw (id: 3)\nfdl-bench-12-w0\nnetns-1234 (id: 0)\nfdl-bench-x-ctl\n"
    )
    assert names == ["fdl-bench-11-sw", "fdl-bench-12-w0", "netns-1234", "fdl-bench-x-ctl"]
    assert netns.stale(names, alive=lambda pid: pid == 12) == ["fdl-bench-11-sw", "fdl-bench-x-ctl"]


def test_the_averaging_ratios_read_the_64_mb_rows() -> None:
    from bench import averaging

    rows = [
        averaging.row("loopback", 2, 64, {"hub": 0.1, "hub_bf16": 0.2, "hub_tcp": 0.125, "gloo": 0.05}),
        averaging.row("loopback", 4, 64, {"hub": 0.4, "hub_tcp": 0.8, "gloo": 0.2}),
        averaging.row("shaped", 2, 64, {"hub": 0.5, "hub_bf16": 0.25, "gloo": 0.55}),
        averaging.row("loopback", 2, 1, {"hub": 9.0, "gloo": 1.0}),
    ]
    got = averaging.summary(rows, 10.0, None)
    assert (got["ratio"], got["ratio_bf16"], got["ratio_4"]) == (0.5, 0.25, 0.5)
    assert (got["shaped_ratio"], got["shaped_ratio_bf16"]) == (1.1, 2.2)
    assert (got["ratio_tcp"], got["ratio_4_tcp"]) == (0.4, 0.25)  # the same box's agents over TCP
    assert averaging.summary(rows[:1], 10.0, "needs root")["shaped_ratio"] is None
    assert rows[0]["hub_gbps"] == round(64 * 2**20 / 0.1 / 1e9, 3)


def test_the_averaging_floor_counts_four_models_through_the_kernel_and_eight_tag_passes() -> None:
    from bench import averaging

    # 2 ranks, 1000 MB: 4 GB through sockets at 1 s/GB and 8 GB of tags at 4 GB/s, on 2 cores
    got = averaging.floor(1.5, socket_s=1.0, mac_gbps=4.0, cores=2, ranks=2, mb=1000)
    gb = 1000 * 1024 * 1024 / 1e9
    assert got["hub_floor_s"] == round((4 * gb + 8 * gb / 4.0) / 2, 4)
    assert got["ratio_ceiling"] == round(1.5 / got["hub_floor_s"], 3)
    assert averaging.floor(None, 1.0, 4.0, 2)["ratio_ceiling"] is None


def test_a_teardown_run_is_classed_by_how_far_its_ranks_got_and_an_outside_stop_apart(tmp_path: Path) -> None:
    from bench.teardown import outcome

    assert outcome(tmp_path, [0, 0, 0]) == "ok"
    assert outcome(tmp_path, [1, -6]) == "failed"  # no rank wrote its result
    (tmp_path / "result-0").write_text("3")
    (tmp_path / "result-1").write_text("3")
    assert outcome(tmp_path, [1, 0, -6]) == "teardown"  # both results, then the abort
    assert outcome(tmp_path, [143, 1, 1]) == "stopped"  # a SIGTERM from outside: not the run's

"""`fdl status` in a terminal: the rendering of /state.json and of a kept verdict, and where
the verdict is kept."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from flodl_agent.observe.status import RANK_ROWS, render, render_verdict
from flodl_agent.observe.verdict import keep_verdict, last_verdict, verdict_path


def shown(parts: list[Any]) -> str:
    console = Console(width=160, record=True, color_system=None, file=io.StringIO())
    for part in parts:
        console.print(part)
    return console.export_text()


TRAINING = {
    "phase": "training",
    "joined_ranks": 3,
    "joined_hosts": 2,
    "quorum": 2,
    "target": 3,
    "start": "auto",
    "now": 1000.0,
    "averaging": {"rounds": 12, "bytes": 4096, "round_s": 0.0421},
    "hosts": [
        {
            "host": "box-a",
            "ranks": [0, 2],
            "devices": ["cpu:0", "cpu:1"],
            "variant": "cpu",
            "joined_at": 990.0,
        },
        {"host": "box-b", "ranks": [2, 3], "devices": ["cpu:0"], "variant": "cpu", "joined_at": 995.0},
    ],
    "heartbeats": {"box-a": 1.5, "box-b": 42.0},
    "ranks": {
        "0": {"host": "box-a", "step": 120, "loss": 0.25, "step_rate": 19.5, "age": 1.0},
        "1": {"host": "box-a", "step": 118, "loss": None, "step_rate": None, "age": 2.0},
    },
}


def test_status_shows_ranks_as_people_count_them_and_every_ranks_progress() -> None:
    text = shown(render(TRAINING))
    assert "box-a \u2502 0\u20131 " in text and "box-b \u2502 2 " in text  # not [0..2)
    assert "..)" not in text
    row = next(line for line in text.splitlines() if line.startswith("\u2502 0 "))
    assert "120" in row and "19.50" in row and "0.25" in row and "0m01s ago" in row
    assert "0m42s ago" in text  # box-b's heartbeat age
    assert "averaging: 12 rounds, the last in 42.1 ms" in text


def test_a_fleet_sized_ranks_table_is_cut_with_a_pointer_to_the_rest() -> None:
    many = {str(r): {"host": "h", "step": r, "loss": 1.0, "step_rate": 1.0, "age": 0.0} for r in range(100)}
    text = shown(render(TRAINING | {"ranks": many}))
    assert f"... and {100 - RANK_ROWS} more ranks (fdl status --json)" in text


def test_a_kept_verdict_says_how_the_last_launch_ended(tmp_path: Path) -> None:
    report = {
        "launch": "0badc0de",
        "ok": False,
        "phase": "failed",
        "reason": "rank 1 on box-b exited with code 3",
        "world_size": 2,
        "hosts": [
            {"host": "box-a", "ranks": [0, 1], "devices": ["cpu:0"], "exits": {"0": 0}},
            {"host": "box-b", "ranks": [1, 2], "devices": ["cpu:0"], "exits": {"1": 3}},
        ],
    }
    path = keep_verdict(report, "0.0.0.0", 4242, tmp_path)
    assert path == verdict_path(4242, tmp_path) and not list(tmp_path.glob("*.tmp"))
    kept = last_verdict("127.0.0.1", 4242, tmp_path)
    assert kept is not None and kept["bind"] == "0.0.0.0" and kept["reason"] == report["reason"]
    assert last_verdict("localhost", 4242, tmp_path) == kept
    assert last_verdict("192.0.2.7", 4242, tmp_path) is None  # another box's port: not this file
    assert last_verdict("127.0.0.1", 4243, tmp_path) is None
    text = shown(render_verdict(kept, kept["ended_at"] + 75))
    assert (
        "failed  the last launch on port 4242 (launch 0badc0de) ended 1m15s ago: 2 ranks on 2 hosts" in text
    )
    assert "failure: rank 1 on box-b exited with code 3" in text and "rank 1: exit 3" in text


def test_a_verdict_that_cannot_be_kept_or_read_is_no_error(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert keep_verdict({"phase": "done"}, "127.0.0.1", 1, blocked) is None  # its directory is a file
    verdict_path(2, tmp_path).write_text("{torn")
    assert last_verdict("127.0.0.1", 2, tmp_path) is None
    verdict_path(3, tmp_path).write_text(json.dumps(["not", "a", "verdict"]))
    assert last_verdict("127.0.0.1", 3, tmp_path) is None
    stopped = shown(render_verdict({"phase": "training", "port": 5, "hosts": []}, 0.0))
    assert "the controller stopped before a verdict" in stopped


def test_a_walk_in_into_the_training_world_shows_the_step_it_joined_at() -> None:
    grown = json.loads(json.dumps(TRAINING))
    grown["hosts"].append(
        {"host": "box-c", "ranks": [3, 4], "devices": ["cpu:0"], "variant": "cpu", "joined_at": 999.0}
        | {"midrun_step": 812}
    )
    assert "elastic" not in shown(render(grown))  # a frozen world says nothing of it
    grown["elastic"] = {"max_ranks": 8}
    text = shown(render(grown))
    assert "(quorum 2, target 3, elastic to 8)" in text
    row = next(line for line in text.splitlines() if "box-c" in line)
    assert "(mid-run, step 812)" in row
    assert "mid-run" not in next(line for line in text.splitlines() if "box-b" in line)
    grown["hosts"][-1]["midrun_step"] = True  # not a step: a peer's odd JSON says nothing
    assert "mid-run" not in shown(render(grown))

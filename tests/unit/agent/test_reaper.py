"""The rank reaper's pure part (the process tree it reads from /proc) and the host's log line
for what a rank left running."""

from __future__ import annotations

import os
from pathlib import Path

from flodl_agent.agent.contained import left_note
from flodl_agent.agent.reaper import below, descendants, parse_stat, table


def test_descendants_are_every_process_below_the_root_and_nothing_beside_it() -> None:
    parents = {10: 1, 11: 10, 12: 11, 13: 12, 20: 1, 21: 20, 14: 10}
    assert descendants(parents, 10) == {11, 12, 13, 14}
    assert descendants(parents, 12) == {13}
    assert descendants(parents, 13) == set()
    assert descendants(parents, 99) == set()


def test_descendants_end_on_a_table_that_loops() -> None:
    # A table read while pids are reused can hold a loop: it must not run forever.
    assert descendants({2: 3, 3: 2, 4: 3}, 2) == {2, 3, 4}


def test_parse_stat_takes_the_name_between_the_first_paren_and_the_last() -> None:
    line = "4242 (my (odd) name) ) S 4200 4242 4242 0 -1 4194560 120 0 0 0"
    assert parse_stat(line) == ("my (odd) name) ", "S", 4200)
    assert parse_stat("7 (sleep) Z 1 7 7 0") == ("sleep", "Z", 1)


def test_table_reads_this_process_and_skips_what_is_not_a_pid(tmp_path: Path) -> None:
    assert table()[os.getpid()][2] == os.getppid()
    (tmp_path / "self").mkdir()  # not a pid: left out
    (tmp_path / "12").mkdir()
    (tmp_path / "12" / "stat").write_text("12 (x y) R 5 12 12")
    (tmp_path / "13").mkdir()  # gone mid-read: no stat file
    (tmp_path / "14").mkdir()
    (tmp_path / "14" / "stat").write_text("garbage")
    assert table(tmp_path) == {12: ("x y", "R", 5)}


def test_below_a_process_with_no_children_is_nothing() -> None:
    assert below(os.getpid()) == {}


def test_left_note_names_what_a_rank_left_and_says_it_was_stopped() -> None:
    assert left_note(0, {}) is None
    assert left_note(3, {77: "sleep"}) == "rank 3 left 1 process running (77 sleep): stopped them"
    many = {pid: f"p{pid}" for pid in range(100, 110)}
    note = left_note(1, many)
    assert note is not None
    assert note.startswith("rank 1 left 10 processes running (100 p100, 101 p101,")
    assert "107 p107 and 2 more): stopped them" in note and "108" not in note

"""A rank's word on why it ended: written atomically by the rank, read as one safe line."""

from __future__ import annotations

from pathlib import Path

import pytest

from flodl_agent.agent.rank_env import reason_file
from flodl_agent.observe import exit_reason


def test_a_rank_leaves_its_reason_where_the_agent_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    where = reason_file(tmp_path, 3)
    assert where == tmp_path / "exit-3.txt"
    monkeypatch.setenv(exit_reason.ENV, str(where))
    exit_reason.say("model mismatch at formation: rank 0 builds aa; rank 1 builds bb")
    assert exit_reason.read(where) == "model mismatch at formation: rank 0 builds aa; rank 1 builds bb"
    assert [p.name for p in tmp_path.iterdir()] == ["exit-3.txt"]  # no temporary left behind


def test_outside_a_walk_in_saying_is_a_no_op(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(exit_reason.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    exit_reason.say("why")
    assert list(tmp_path.iterdir()) == []


def test_what_a_rank_wrote_is_read_as_one_printable_line_within_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "exit-0.txt"
    path.write_bytes(b"first\nsecond\x1b[31m red" + "\u202e".encode())  # a right-to-left override
    assert exit_reason.read(path) == "first second?[31m red?"
    path.write_text("x" * 5000)
    said = exit_reason.read(path)
    assert len(said) == exit_reason.LIMIT and said.endswith("…")
    assert exit_reason.read(tmp_path / "none") == ""  # a rank that said nothing

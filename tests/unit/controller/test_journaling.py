"""The journal as the launch keeps it: what `fdl status` makes of one its controller left
unfinished, and a home the journal cannot be written in (the run goes on, said once)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flodl_agent.controller import journal as jn
from flodl_agent.controller.journaling import STOPPED, Journaler, lost_verdict, unfinished_words
from tests.unit.controller.test_journal import world


def test_an_unfinished_journal_reads_as_a_failed_launch_with_its_world_and_exits(tmp_path: Path) -> None:
    jn.write_journal(world(exits={0: 0, 3: 1}), jn.journal_path(1337, tmp_path))
    lost = lost_verdict(1337, tmp_path)
    assert lost is not None
    assert (lost["launch"], lost["phase"], lost["ok"], lost["world_size"]) == ("0a1b2c3d", "failed", False, 4)
    assert lost["reason"].startswith(f"{STOPPED}: it kept no verdict")
    assert [(h["host"], h["ranks"], h["exits"]) for h in lost["hosts"]] == [
        ("a", [0, 2], {"0": 0}),
        ("b", [2, 3], {}),
        ("c", [3, 4], {"3": 1}),
    ]
    assert lost["ended_at"] == jn.journal_path(1337, tmp_path).stat().st_mtime


def test_a_finished_missing_or_unreadable_journal_tells_nothing(tmp_path: Path) -> None:
    assert lost_verdict(1337, tmp_path) is None
    jn.write_journal(world(phase="done", reason="run complete"), jn.journal_path(1337, tmp_path))
    assert lost_verdict(1337, tmp_path) is None
    jn.journal_path(1338, tmp_path).write_text("{not json")
    jn.journal_path(1338, tmp_path).chmod(0o600)
    assert lost_verdict(1338, tmp_path) is None


def test_the_line_names_the_launch_its_world_and_the_file() -> None:
    path = Path("/h/.flodl/controller/journal-1337.json")
    assert unfinished_words(world(), path) == (
        f"launch 0a1b2c3d did not finish: {STOPPED} (ranks 0\u20133 on 3 hosts; journal {path})"
    )


class _Unformed:
    """A controller whose window has not formed: the journaler has nothing to write yet."""

    settings: Any = None
    salt = b"\0" * 16
    run_id = reason = ""
    port = 1337
    window: Any = None
    supervisor = None


def test_a_home_the_journal_cannot_be_written_in_is_said_once_and_nothing_else_fails(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the journal's directory should be
    said: list[str] = []
    keeper = Journaler.open(_Unformed(), said.append, blocked / "controller")
    keeper.on_note("formed", "world formed")  # nothing formed: nothing to write, nothing raised
    keeper.close()
    assert len(said) == 1
    assert said[0].startswith(f"journal: cannot write {blocked}/controller/journal-1337.json")
    assert said[0].endswith("a restarted controller could not tell this launch's world; the run goes on")

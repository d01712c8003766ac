"""The journal as the launch keeps it: what `fdl status` makes of one its controller left
unfinished, and a home the journal cannot be written in (the run goes on, said once)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flodl_agent.controller import journal as jn
from flodl_agent.controller.journal import JournalError
from flodl_agent.controller.journaling import STOPPED, Journaler, lost_verdict, restored, unfinished_words
from flodl_agent.controller.reformation import Reformation
from flodl_agent.controller.settings import Settings
from flodl_agent.controller.supervision import Evict, Limits, Supervisor
from flodl_agent.controller.window import Member, Window, WindowClosed, WindowConfig
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


def test_a_journal_it_cannot_trust_stops_a_launch_unless_fresh_and_lets_the_lock_go(tmp_path: Path) -> None:
    home = tmp_path / "controller"
    home.mkdir()
    (home / "journal-1337.json").write_text("not json")
    (home / "journal-1337.json").chmod(0o600)
    with pytest.raises(JournalError, match="not a journal this fdl reads"):
        Journaler.take(1337, print, home, strict=True)
    said: list[str] = []
    keeper, left = Journaler.take(1337, said.append, home)  # --fresh: said, and replaced later
    assert left is None and said[0].endswith("it is replaced when this launch's world forms")
    keeper.close()  # its lock was free again: the strict take let it go


# --- what a restarted controller rebuilds from the journal ----------------------------


class _Formed:
    """A controller whose world formed: a real Supervisor with exits and a lost rank."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.settings = Settings(command=["train"], window=CONFIG, launch="0a1b2c3d", plane="nccl")
        self.salt = b"\x05" * 16
        self.run_id = self.reason = ""
        self.port = 1337
        self.window = Window.resumed(CONFIG, [("a", 2), ("b", 1), ("c", 1)], 0.0)
        self.supervisor = supervisor
        self.reformation: Reformation | None = None


CONFIG = WindowConfig(quorum=1, target=None, join_timeout=1.0, max_join_timeout=2.0, start="auto")
LIMITS = Limits(max_failure="1")


def test_a_journaled_world_restores_its_supervision_as_it_stood() -> None:
    before = Supervisor({"a": range(0, 2), "b": range(2, 3), "c": range(3, 4)}, LIMITS, 0.0)
    before.exited("a", 0, 0)
    before.exited("c", 3, 1)
    assert isinstance(before.rank_failed("rank 3 on c exited 1", {3}, averaging=True, now=1.0), Evict)
    before.rendezvous = True
    journal = Journaler(_Formed(before), Path("unused"), print).snapshot()
    assert journal is not None
    assert (journal.exits, journal.failed, journal.evicted, journal.rendezvous, journal.reforming) == (
        {0: 0, 3: 1},
        (3,),
        ("c",),
        True,
        False,
    )

    after = restored(journal, LIMITS, 50.0)
    assert after.world == before.world and after.exits == before.exits and after.failed == {3}
    assert after.rendezvous and after.running("a") == {1}
    # The budget spent before the restart stays spent: one more lost rank is past max_failure 1.
    assert not isinstance(after.rank_failed("rank 2 on b exited 1", {2}, averaging=True, now=51.0), Evict)


def test_a_resumed_window_trains_admits_nobody_new_and_ends_when_every_link_closed() -> None:
    window = Window.resumed(CONFIG, [("a", 2), ("b", 1)], 10.0)
    assert (window.phase, window.joined_ranks, window.can_admit(), window.next_deadline()) == (
        "training", 3, False, None,
    )  # fmt: skip
    assert window.members == (Member("a", 2, 10.0), Member("b", 1, 10.0))
    with pytest.raises(WindowClosed):
        window.join("d", 1, 11.0)
    window.leave("a", 12.0)
    assert window.phase == "training"
    window.leave("b", 13.0)
    assert window.phase == "done"


def test_a_world_stopped_for_a_re_formation_is_journaled_so_until_it_forms_again() -> None:
    formed = _Formed(Supervisor({"a": range(0, 2), "b": range(2, 3)}, LIMITS, 0.0))
    keeper = Journaler(formed, Path("unused"), print)
    formed.reformation = reformation = Reformation(interval=0.0, formed_at=0.0)
    reformation.begin({"a": {0, 1}, "b": {2}}, now=1.0, grace=5.0)
    snapshot = keeper.snapshot()
    assert snapshot is not None and snapshot.reforming  # a restart must not resume stopped ranks
    reformation.formed(2.0)
    snapshot = keeper.snapshot()
    assert snapshot is not None and not snapshot.reforming

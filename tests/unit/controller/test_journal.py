"""The formed world's journal (issue 37): what a restart does with it, whom it lets back in,
and a file that only its user reads, written whole or not at all."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from flodl_agent.controller import journal as jn
from flodl_agent.controller.journal import Journal, JournalError, NewWindow, Resume, Span
from flodl_agent.controller.settings import Settings
from flodl_agent.controller.window import WindowConfig

DIGEST = "d" * 64
RESUMED = "this controller resumed launch 0a1b2c3d"
GIVES = "launch 0a1b2c3d's journal gives it"


def world(**changes: object) -> Journal:
    fields: dict[str, object] = {
        "launch": "0a1b2c3d",
        "port": 1337,
        "settings": DIGEST,
        "plane": "cpu",
        "salt": "5" * 32,
        "world": (
            Span(host="a", first=0, stop=2),
            Span(host="b", first=2, stop=3),
            Span(host="c", first=3, stop=4),
        ),
    }
    return Journal.model_validate(fields | changes)


# --- on start -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("found", "fresh", "then"),
    [
        (None, False, NewWindow("")),
        (world(), False, Resume(world())),
        (world(), True, NewWindow("launch 0a1b2c3d's journal discarded (--fresh)")),
        (world(phase="done"), False, NewWindow("")),  # a finished launch is never resumed
        (world(phase="failed", reason="rank 1 exited 3"), False, NewWindow("")),
        (world(settings="e" * 64, phase="done"), False, NewWindow("")),
        (  # its ranks were stopped for a re-formation, and its hosts gave up with its controller
            world(reforming=True),
            False,
            NewWindow(
                "launch 0a1b2c3d's controller went away while its world re-formed, its ranks "
                "stopped: nothing trains to resume"
            ),
        ),
    ],
)
def test_what_a_launch_does_with_the_journal_on_its_port(
    found: Journal | None, fresh: bool, then: Resume | NewWindow
) -> None:
    assert jn.on_start(found, DIGEST, fresh=fresh, path=Path("j.json")) == then


def test_an_unfinished_launch_of_other_settings_is_neither_resumed_nor_dropped() -> None:
    with pytest.raises(JournalError, match=r"j.json: launch 0a1b2c3d did not finish") as raised:
        jn.on_start(world(settings="e" * 64), DIGEST, fresh=False, path=Path("j.json"))
    assert "--fresh" in raised.value.fix and "settings it ran" in raised.value.fix


def test_the_settings_digest_ignores_the_token_and_the_label_and_nothing_else() -> None:
    window = WindowConfig(quorum=2, target=2, join_timeout=60, max_join_timeout=120, start="auto")
    base = Settings(window=window, command=["python", "train.py"], token="ab" * 16, launch="0a1b2c3d")
    digest = jn.settings_digest(base)
    same = Settings(window=window, command=["python", "train.py"], token="cd" * 16, launch="ffffffff")
    assert jn.settings_digest(same) == digest
    for other in (
        Settings(window=window, command=["python", "other.py"]),
        Settings(window=window, command=["python", "train.py"], port=7000),
        Settings(window=window, command=["python", "train.py"], plane="nccl"),
    ):
        assert jn.settings_digest(other) != digest
    assert "ab" * 16 not in digest


# --- who may come back --------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "launch", "ranks", "back", "refused"),
    [
        ("a", "0a1b2c3d", range(0, 2), set(), None),
        ("b", "0a1b2c3d", range(2, 3), {"a"}, None),
        ("a", "0a1b2c3d", range(0, 2), {"a"}, "host a is back already (a second resume for one host)"),
        ("a", "99999999", range(0, 2), set(), f"it resumes launch 99999999; {RESUMED}"),
        ("a", "", range(0, 2), set(), f"it resumes launch (none); {RESUMED}"),
        ("z", "0a1b2c3d", range(4, 5), set(), "host z was not in launch 0a1b2c3d's world"),
        ("a", "0a1b2c3d", range(0, 1), set(), f"host a says it holds rank 0; {GIVES} ranks 0\u20131"),
        ("b", "0a1b2c3d", range(0, 2), set(), f"host b says it holds ranks 0\u20131; {GIVES} rank 2"),
    ],
)  # fmt: skip
def test_a_resume_hello_is_let_back_only_as_the_journal_has_it(
    host: str, launch: str, ranks: range, back: set[str], refused: str | None
) -> None:
    assert jn.judge_resume(world(), back, host, launch, ranks) == refused


def test_an_evicted_host_stays_out_and_is_not_waited_for() -> None:
    journal = world(evicted=("b",), failed=(2,))
    said = jn.judge_resume(journal, set(), "b", "0a1b2c3d", range(2, 3))
    assert said == "host b was evicted from launch 0a1b2c3d: it may not come back"
    assert jn.missing(journal, {"a"}) == ["c"]
    assert jn.missing(journal, {"a", "c"}) == []
    assert jn.resumed_words(journal, {"a", "c"}, 1.234) == "controller resumed: 2 of 2 hosts back in 1.2 s"
    assert jn.resumed_words(world(), {"a"}, 120) == "controller resumed: 1 of 3 hosts back in 120.0 s"


@pytest.mark.parametrize(
    "bad",
    [
        {"launch": "XYZ"},
        {"salt": "00"},
        {"world": ()},
        {"run_id": "short"},
        {"plane": "carrier-pigeon"},
        {"token": "ab" * 16},  # no field for a credential: the file never holds one
    ],
)
def test_a_journal_holds_only_what_it_declares(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        world(**bad)


# --- the file ------------------------------------------------------------------


def test_written_whole_for_its_user_alone_and_read_back(tmp_path: Path) -> None:
    path = jn.journal_path(1337, tmp_path / "controller")
    assert jn.read_journal(path) is None
    journal = world(exits={0: 0}, failed=(3,), evicted=("c",), run_id="f" * 32)
    jn.write_journal(journal, path)
    assert (path.stat().st_mode & 0o777, path.parent.stat().st_mode & 0o777) == (0o600, 0o700)
    assert jn.read_journal(path) == journal
    jn.write_journal(journal.model_copy(update={"phase": "done"}), path)  # replaced whole
    assert jn.read_journal(path).phase == "done"  # type: ignore[union-attr]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left behind


@pytest.mark.parametrize(
    ("spoil", "said", "fix"),
    [
        (lambda p: p.chmod(0o644), "mode 0644 lets other users read the run's salt", "chmod 600"),
        (lambda p: p.write_text("{not json"), "not a journal this fdl reads", "--fresh"),
        (lambda p: p.write_text('{"format": 2}'), "not a journal this fdl reads (format:", "--fresh"),
        (lambda p: (p.unlink(), p.mkdir()), "not a regular file", "--fresh"),
        (lambda p: (p.unlink(), p.symlink_to("/etc/passwd")), "cannot be read", "--fresh"),
    ],
)
def test_a_journal_that_cannot_be_trusted_is_refused_by_name(
    spoil: Callable[[Path], object], said: str, fix: str, tmp_path: Path
) -> None:
    path = tmp_path / "journal-1337.json"
    jn.write_journal(world(), path)
    spoil(path)
    with pytest.raises(JournalError, match=said.replace("(", r"\(")) as raised:
        jn.read_journal(path)
    assert str(path) in str(raised.value) and fix in raised.value.fix


def test_another_users_journal_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give the file away")
    path = tmp_path / "journal-1337.json"
    jn.write_journal(world(), path)
    os.chown(path, 65534, 65534)
    with pytest.raises(JournalError, match="belongs to uid 65534"):
        jn.read_journal(path)


def test_one_port_one_controller_holds_the_journal(tmp_path: Path) -> None:
    path = tmp_path / "journal-1337.json"
    fd = jn.hold(path)
    holder = (
        "import sys\nfrom pathlib import Path\nfrom flodl_agent.controller import journal as jn\n"
        "try:\n    jn.hold(Path(sys.argv[1]))\nexcept jn.JournalError as exc:\n    print(exc, exc.fix)\n"
    )
    other = subprocess.run(
        [sys.executable, "-c", holder, str(path)], capture_output=True, text=True, check=True
    )
    assert f"another controller (pid {os.getpid()}) holds this port's journal" in other.stdout
    os.close(fd)  # the holder is gone: the next controller takes it
    again = subprocess.run(
        [sys.executable, "-c", holder, str(path)], capture_output=True, text=True, check=True
    )
    assert again.stdout == ""

"""The launch's journal kept in step with its formed world (the file's rules: ``journal``).

The controller's timeline already names every change a restart needs to know of: the
formation, a rank's exit, a host lost or leaving, ShutdownWithSave. The journaler listens
to it and rewrites the journal: at once when the world has formed, coalesced for the rest
(a world of thousands of ranks ends with thousands of exits: one write covers all that
arrive within ``SETTLE`` seconds), and a last time when the launch ends (``close``).

A journal that cannot be written is said once and the run goes on: it only costs a
restart the chance to resume.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ..config.ranks import rank_span
from . import journal as journals
from .journal import Journal, JournalError, Span, journal_path, settings_digest
from .reformation import Reformation
from .settings import Settings
from .supervision import Limits, Supervisor
from .window import Window

SETTLE = 0.5  # seconds: changes after the formation are written at most this often
CHANGES = frozenset({"exit", "eviction", "leave", "save", "cut", "resume", "lost", "grow", "reform", "stop"})


class Journaled(Protocol):
    """What the journaler reads of the controller."""

    settings: Settings
    salt: bytes
    run_id: str
    reason: str
    port: int
    window: Window
    supervisor: Supervisor | None
    reformation: Reformation | None


class Journaler:
    def __init__(self, ctl: Journaled | None, path: Path, log: Callable[[str], None]) -> None:
        self.ctl, self.path, self.log = ctl, path, log  # ctl: attached once the controller exists
        self._lock: int | None = None
        self._soon: asyncio.TimerHandle | None = None
        self._broken = False
        self._closed = False

    @classmethod
    def take(
        cls, port: int, log: Callable[[str], None], directory: Path | None = None, *, strict: bool = False
    ) -> tuple[Journaler, Journal | None]:
        """The journal of ``port``, held for this controller's life, and the journal left on it
        (None: none, or one that cannot be read, said). Raises JournalError while another
        controller holds it: two controllers resuming one world would split it; and, when
        ``strict``, for a journal it cannot trust (another owner, readable by others, not a
        journal): a world that may still train is not dropped without ``--fresh``."""
        path = journal_path(port) if directory is None else journal_path(port, directory)
        keeper = cls(None, path, log)
        try:
            keeper._lock = journals.hold(path)
        except OSError as exc:  # a home it cannot write: the run needs no journal to train
            keeper._say(exc)
            return keeper, None
        try:
            return keeper, journals.read_journal(path)
        except JournalError as exc:
            if strict:
                os.close(keeper._lock)
                raise
            log(f"journal: {exc}; it is replaced when this launch's world forms")
            return keeper, None

    @classmethod
    def open(cls, ctl: Journaled, log: Callable[[str], None], directory: Path | None = None) -> Journaler:
        """``take`` for a controller that opens a new window: a journal its controller left
        unfinished is said and closed, its world did not outlive that controller."""
        keeper, left = cls.take(ctl.port, log, directory)
        keeper.ctl = ctl
        keeper.discard(left)
        return keeper

    def discard(self, left: Journal | None) -> None:
        """A new window opens over ``left``: an unfinished launch's journal is closed, failed."""
        if left is not None and left.phase == "training":
            self.log(unfinished_words(left, self.path))
            self._write(left.model_copy(update={"phase": "failed", "reason": STOPPED}))

    def on_note(self, kind: str, line: str) -> None:
        if self._closed:
            return  # the links closing after the launch's end change nothing it journals
        if kind == "formed":
            self.write()
        elif (
            kind in CHANGES
            and self._soon is None
            and self.ctl is not None
            and self.ctl.supervisor is not None
        ):
            self._soon = asyncio.get_running_loop().call_later(SETTLE, self.write)

    def write(self) -> None:
        self._soon = None
        try:
            journal = self.snapshot()
        except ValueError as exc:  # a peer's field the journal cannot hold (a run_id of another form)
            if not self._broken:
                self._broken = True
                self.log(f"journal: cannot journal this world ({type(exc).__name__}); the run goes on")
            return
        if journal is not None:
            self._write(journal)

    def close(self) -> None:
        """The launch is over: its journal says how (a formed world's; one handed to the next
        controller stays at training), and the lock goes."""
        if self._soon is not None:
            self._soon.cancel()
        self.write()
        self._closed = True
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def snapshot(self) -> Journal | None:
        """The formed world as the controller holds it now; None before it formed."""
        ctl = self.ctl
        supervisor = ctl.supervisor if ctl is not None else None
        if ctl is None or supervisor is None or not supervisor.world:
            return None
        phase = ctl.window.phase
        ended = phase in ("done", "failed")
        exits = {rank: code for codes in supervisor.exits.values() for rank, code in codes.items()}
        lost = supervisor.failed
        evicted = [host for host, ranks in supervisor.world.items() if ranks and set(ranks) <= lost]
        return Journal(
            launch=ctl.settings.launch,
            port=ctl.port,
            settings=settings_digest(ctl.settings),
            plane=ctl.settings.plane,
            salt=ctl.salt.hex(),
            run_id=ctl.run_id,
            world=tuple(Span(host=h, first=r.start, stop=r.stop) for h, r in supervisor.world.items()),
            exits=exits,
            failed=tuple(sorted(supervisor.failed)),
            evicted=tuple(evicted),
            rendezvous=supervisor.rendezvous,
            reforming=ctl.reformation is not None and ctl.reformation.stopping is not None,
            phase=phase if ended else "training",
            reason=(ctl.reason or "run complete: every host link closed") if ended else "",
        )

    def _write(self, journal: Journal) -> None:
        if self._broken:
            return
        try:
            journals.write_journal(journal, self.path)
        except OSError as exc:
            self._say(exc)

    def _say(self, exc: OSError) -> None:
        self._broken = True  # said once; the run goes on without
        self.log(
            f"journal: cannot write {self.path} ({exc.strerror or exc}): a restarted controller "
            "could not tell this launch's world; the run goes on"
        )


def restored(journal: Journal, limits: Limits, now: float) -> Supervisor:
    """The supervision of a journaled world as it stood: its ranks' exits, the failure budget
    spent, whether it rendezvouses (what the journal's snapshot took from a Supervisor)."""
    world = {span.host: span.ranks for span in journal.world}
    supervisor = Supervisor(world, limits, now, rendezvous=journal.rendezvous)
    for host, ranks in world.items():
        if codes := {r: journal.exits[r] for r in ranks if r in journal.exits}:
            supervisor.exits[host] = codes
    supervisor.failed = set(journal.failed)
    return supervisor


STOPPED = "its controller stopped while the world trained"


def unfinished_words(journal: Journal, path: Path) -> str:
    """One line for a journal whose controller stopped mid-run (launch's log, ``fdl status``)."""
    hosts = len(journal.world)
    ranks = rank_span(range(journal.size), noun=True)
    return (
        f"launch {journal.launch} did not finish: {STOPPED} ({ranks} on {hosts} "
        f"host{'s' if hosts != 1 else ''}; journal {path})"
    )


def lost_verdict(port: int, directory: Path | None = None) -> dict[str, Any] | None:
    """What ``fdl status`` shows for a launch whose controller stopped mid-run: its journal as
    a kept verdict would read (failed, the world as journaled, when it was last written);
    None when the port's journal is missing, finished or unreadable."""
    path = journal_path(port) if directory is None else journal_path(port, directory)
    try:
        journal = journals.read_journal(path)
        written = path.stat().st_mtime
    except (JournalError, OSError):
        return None
    if journal is None or journal.phase != "training":
        return None
    hosts = [
        {
            "host": span.host,
            "ranks": [span.first, span.stop],
            "devices": [],
            "exits": {str(r): journal.exits[r] for r in span.ranks if r in journal.exits},
        }
        for span in journal.world
    ]
    return {
        "launch": journal.launch,
        "run_id": journal.run_id,
        "port": port,
        "ok": False,
        "phase": "failed",
        "reason": f"{STOPPED}: it kept no verdict (its journal, {path}, was last written then)",
        "world_size": journal.size,
        "hosts": hosts,
        "ended_at": written,
    }

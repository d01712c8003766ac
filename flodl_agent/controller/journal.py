"""The formed world's journal: what a restarted controller needs to re-adopt its launch.

The controller writes it when the world forms and whenever the world changes (a rank's
exit, a host lost within the failure budget, the run's end), to
``~/.flodl/controller/journal-PORT.json`` of its own user: atomically (a temporary file
in the same directory, fsynced, renamed over the old one, the directory fsynced), mode
0600. ``fdl launch`` started again on that port with the same settings finds an unfinished
journal and resumes its launch instead of opening a new window; ``--fresh`` discards it,
and a finished launch's journal is closed (its ``phase`` done or failed) and never resumed.

It holds no token: with one configured, the run key is the token the restarted controller
is given again; without, it is the salt, which is why the file is its user's alone and its
mode is checked on load. The rules here are pure (what to do with a journal, whom to let
back in); reading and writing are the thin shell around them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..config.ranks import rank_span

DIRECTORY = Path("~/.flodl/controller")
MAX_BYTES = 16 << 20  # 10,000 hosts take well under 1 MiB
FRESH = "run fdl launch --fresh to discard it and open a new window"

Phase = Literal["training", "done", "failed"]


class JournalError(Exception):
    """A journal that cannot be used as it is: the message names the file, ``fix`` the way out."""

    def __init__(self, message: str, fix: str = FRESH) -> None:
        super().__init__(message)
        self.fix = fix


class Span(BaseModel):
    """One host of the formed world and the ranks it holds, [first, stop)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    host: str = Field(min_length=1, max_length=253)
    first: int = Field(ge=0)
    stop: int = Field(ge=1)

    @property
    def ranks(self) -> range:
        return range(self.first, self.stop)


class Journal(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    format: Literal[1] = 1
    launch: str = Field(pattern=r"^[0-9a-f]{8}$")
    port: int = Field(ge=1, le=65535)
    settings: str = Field(pattern=r"^[0-9a-f]{64}$")  # settings_digest of the launch it records
    plane: Literal["cpu", "nccl"]
    salt: str = Field(pattern=r"^[0-9a-f]{32}$")
    run_id: str = Field(default="", pattern=r"^([0-9a-f]{32})?$")
    world: tuple[Span, ...] = Field(min_length=1)
    exits: dict[int, int] = Field(default_factory=dict)  # ranks that ended, and their codes
    failed: tuple[int, ...] = ()  # ranks lost within max_failure: the budget spent
    evicted: tuple[str, ...] = ()  # hosts lost so: they may not come back
    rendezvous: bool = False  # the world was seen to rendezvous through torch's store
    reforming: bool = False  # its ranks were stopped for a re-formation: nothing trains to resume
    phase: Phase = "training"
    reason: str = ""  # a finished launch's verdict

    @property
    def size(self) -> int:
        return sum(len(span.ranks) for span in self.world)

    def span(self, host: str) -> Span | None:
        return next((s for s in self.world if s.host == host), None)


def journal_path(port: int, directory: Path = DIRECTORY) -> Path:
    return directory.expanduser() / f"journal-{port}.json"


def settings_digest(settings: Any) -> str:
    """What makes a restart the same launch: the controller's settings, less the token (a
    journal holds no credential, not even a hash of one) and the label it is about to learn."""
    fields = dataclasses.asdict(settings)
    fields.pop("token", None)
    fields.pop("launch", None)
    body = json.dumps(fields, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


# --- what to do with a journal (pure) ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class Resume:
    journal: Journal


@dataclasses.dataclass(frozen=True)
class NewWindow:
    why: str  # "" when there was no journal


def on_start(journal: Journal | None, digest: str, *, fresh: bool, path: Path) -> Resume | NewWindow:
    """What ``fdl launch`` does with the journal it found on its port. Raises JournalError for
    an unfinished launch of other settings: resuming it would run another world's command,
    and opening a window over it would drop a world that may still be training."""
    if journal is None:
        return NewWindow("")
    if fresh:
        return NewWindow(f"launch {journal.launch}'s journal discarded (--fresh)")
    if journal.phase != "training":
        return NewWindow("")
    if journal.reforming:  # its hosts gave up when their controller went away (regrowth.next_world)
        return NewWindow(
            f"launch {journal.launch}'s controller went away while its world re-formed, its ranks "
            "stopped: nothing trains to resume"
        )
    if journal.settings != digest:
        raise JournalError(
            f"{path}: launch {journal.launch} did not finish, and it ran other settings than "
            "this launch's (cluster file, command or flags)",
            f"start it with the settings it ran to resume it, or {FRESH.removeprefix('run ')}",
        )
    return Resume(journal)


def judge_resume(journal: Journal, back: set[str], host: str, launch: str, ranks: range) -> str | None:
    """Why a resume hello is refused, or None to let the host back into the world. The hello
    is already authenticated (the host key the journal's salt or the token derives)."""
    if launch != journal.launch:
        return f"it resumes launch {launch or '(none)'}; this controller resumed launch {journal.launch}"
    if host in journal.evicted:
        return f"host {host} was evicted from launch {journal.launch}: it may not come back"
    span = journal.span(host)
    if span is None:
        return f"host {host} was not in launch {journal.launch}'s world"
    if ranks != span.ranks:
        held, kept = rank_span(ranks, noun=True), rank_span(span.ranks, noun=True)
        return f"host {host} says it holds {held}; launch {journal.launch}'s journal gives it {kept}"
    if host in back:
        return f"host {host} is back already (a second resume for one host)"
    return None


def missing(journal: Journal, back: set[str]) -> list[str]:
    """The journal's hosts not back yet, evicted ones left out, in rank order."""
    return [s.host for s in journal.world if s.host not in back and s.host not in journal.evicted]


def resumed_words(journal: Journal, back: set[str], seconds: float) -> str:
    """The timeline's entry once every host is back or the grace ran out."""
    expected = len(journal.world) - len(journal.evicted)
    return f"controller resumed: {len(back)} of {expected} hosts back in {seconds:.1f} s"


# --- the file (the thin shell) ----------------------------------------------------


def write_journal(journal: Journal, path: Path) -> None:
    """Atomically, readable by its user only. Raises OSError: the caller says that a restart
    could not resume this launch, and the run goes on."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(journal.model_dump_json())
            out.flush()
            os.fsync(out.fileno())
        tmp.replace(path)  # a reader sees the whole journal or the one before
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)  # the rename itself survives a power cut
    finally:
        os.close(directory)


def hold(path: Path) -> int:
    """Take the journal's lock for this controller's life (the returned descriptor holds it;
    the kernel lets go when the process ends, however it ends). Raises JournalError while
    another controller holds it: two controllers resuming one world would split it."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = path.with_name(f"{path.name}.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise JournalError(
            f"{path}: another controller (pid {holder}) holds this port's journal",
            "stop that controller first; one world has one controller",
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def read_journal(path: Path) -> Journal | None:
    """The journal on ``path``, None when there is none. Raises JournalError for one that is
    not a regular file, belongs to another user, is readable by others or does not parse."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise JournalError(f"{path}: cannot be read ({exc.strerror})") from exc
    try:
        _check_file(path, os.fstat(fd))
        body = b""
        while len(body) <= MAX_BYTES and (chunk := os.read(fd, 1 << 20)):
            body += chunk
    finally:
        os.close(fd)
    if len(body) > MAX_BYTES:
        raise JournalError(f"{path}: over {MAX_BYTES >> 20} MiB, no journal of a world")
    try:
        return Journal.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the file"
        raise JournalError(f"{path}: not a journal this fdl reads ({where}: {first['msg']})") from exc


def _check_file(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise JournalError(f"{path}: not a regular file")
    if st.st_uid != os.geteuid():
        raise JournalError(
            f"{path}: belongs to uid {st.st_uid}, not to the controller's user ({os.geteuid()})",
            f"run the controller as its owner, or {FRESH.removeprefix('run ')}",
        )
    if st.st_mode & 0o077:
        raise JournalError(
            f"{path}: mode {stat.S_IMODE(st.st_mode):04o} lets other users read the run's salt",
            f"chmod 600 {path} if nobody else could have read it, else {FRESH.removeprefix('run ')}",
        )

"""Each rank's own parent: a child subreaper, so that nothing the rank starts outlives it.

The agent starts every rank as ``python -I .../reaper.py REPORT -- COMMAND`` in a session
of its own. This process makes itself the child subreaper of everything below it (prctl
PR_SET_CHILD_SUBREAPER): a child the rank left behind, one that called ``setsid``, one
that forked twice so that its parent is gone, all become its children when their parents
end, never init's. It starts the rank, says on fd REPORT whether the kernel started it
(the agent raises the same error as if it had started the rank itself), and waits. When
the rank ends, whatever is still below it gets SIGTERM, GRACE seconds, then SIGKILL, and
is reaped; the names of those it stopped go on REPORT; then it exits with the rank's own
status. A SIGTERM, SIGHUP or SIGINT for it (the agent's abort or stop, sent to the
session's group), or the agent's death, is passed on to everything below it at once, so
a daemon out of the rank's group ends too; what has not ended GRACE seconds later is
killed.

Run by path with ``-I`` and only the standard library: the rank's environment
(PYTHONPATH, PYTHONSTARTUP, a ``site`` of its own) reaches the rank, never this process.
:func:`descendants` and :func:`parse_stat` are the pure part.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

GRACE = 3.0  # seconds from SIGTERM to SIGKILL: inside the agent's own grace (agent.KILL_GRACE)
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
PROC = Path("/proc")
GONE = frozenset("ZX")  # /proc states of a process that has ended: nothing to stop


def descendants(parents: Mapping[int, int], root: int) -> set[int]:
    """Every process below ``root`` in a table of pid -> parent pid."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def parse_stat(text: str) -> tuple[str, str, int]:
    """(name, state, parent pid) of a /proc/<pid>/stat line; the name may hold spaces and ')'."""
    name = text[text.index("(") + 1 : text.rindex(")")]
    state, ppid = text[text.rindex(")") + 2 :].split()[:2]
    return name, state, int(ppid)


def table(proc: Path = PROC) -> dict[int, tuple[str, str, int]]:
    """pid -> (name, state, parent pid) of every process /proc shows now (one gone mid-read
    is left out)."""
    found: dict[int, tuple[str, str, int]] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                found[int(entry.name)] = parse_stat((entry / "stat").read_text())
    return found


def below(root: int | None = None) -> dict[int, str]:
    """pid -> name of every live process below ``root`` (this one) now."""
    now = table()
    under = descendants({pid: row[2] for pid, row in now.items()}, os.getpid() if root is None else root)
    return {pid: now[pid][0] for pid in under if now[pid][1] not in GONE}


def _prctl(option: int, value: int) -> bool:
    # ctypes here: where it cannot load, only what stays in the rank's group is stopped (the
    # agent's killpg), as before this module.
    try:
        import ctypes

        return bool(ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0)
    except (ImportError, MemoryError, OSError, AttributeError):
        return False


def _signal(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def reap(until: float) -> bool:
    """Collect ended children until none is left (True) or ``until`` passes (False)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:  # children left, none ended yet
            if time.monotonic() >= until:
                return False
            signal.sigtimedwait([signal.SIGCHLD], min(0.2, max(0.0, until - time.monotonic())))


def clear_below(grace: float = GRACE) -> dict[int, str]:
    """Stop everything below this process: SIGTERM, ``grace``, SIGKILL, reaped. What it stopped."""
    reap(time.monotonic())  # the ended ones first: they left nothing running
    left = below()
    stopped = dict(left)
    for _ in range(3):  # what they forked between the listing and the signal is listed next time
        if not left:
            break
        _signal(left, signal.SIGTERM)
        if not reap(time.monotonic() + grace):
            left = below()  # with what was forked or reparented to us meanwhile: named too
            stopped.update(left)
            _signal(left, signal.SIGKILL)
            reap(time.monotonic() + GRACE)
        left = below()
        stopped.update(left)
    return stopped


def _start(command: list[str], report: int) -> subprocess.Popen[bytes]:
    try:
        rank = subprocess.Popen(command)  # its environment and cwd: this process's, the agent's for it
    except OSError as exc:
        said = {"errno": exc.errno, "strerror": exc.strerror, "filename": exc.filename}
        with contextlib.suppress(OSError):
            os.write(report, json.dumps({"start": said}).encode() + b"\n")
        raise SystemExit(127 if isinstance(exc, FileNotFoundError) else 126) from None
    return rank


def _wait_rank(pid: int) -> int:
    """The rank's wait status; the other children that end meanwhile are reaped."""
    while True:
        done, status = os.waitpid(-1, 0)
        if done == pid:
            return status


def main(argv: list[str]) -> int:
    report, command = int(argv[0]), argv[2:]  # REPORT -- COMMAND...
    stopping: float | None = None  # when a stop came: its GRACE runs from then

    def stop(_sig: int = 0, _frame: object = None) -> None:
        nonlocal stopping
        if stopping is None:
            stopping = time.monotonic()
            signal.setitimer(signal.ITIMER_REAL, GRACE)
        _signal(below(), signal.SIGTERM)  # the rank and what left its group: all at once

    def kill(_sig: int, _frame: object) -> None:
        _signal(below(), signal.SIGKILL)

    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # the agent killed: its ranks go with it
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, stop)
    signal.signal(signal.SIGALRM, kill)
    rank = _start(command, report)
    # After the rank's fork (it must not inherit the mask): SIGCHLD is taken by sigtimedwait.
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
    try:
        os.write(report, json.dumps({"started": rank.pid}).encode() + b"\n")
    except OSError:  # nobody reads: the agent ended before the rank started
        stop()
    if stopping is not None:  # told to stop before the rank was there to hear it
        stop()
    status = _wait_rank(rank.pid)
    grace = GRACE if stopping is None else max(0.0, stopping + GRACE - time.monotonic())
    stopped = clear_below(grace)
    with contextlib.suppress(OSError):
        left = {str(pid): name for pid, name in sorted(stopped.items())}
        os.write(report, json.dumps({"left": left}).encode() + b"\n")
        os.close(report)
    return _end_as(status)


def _end_as(status: int) -> int:
    """The rank's exit code; ended by a signal, this process ends by the same one."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the rank's crash, not a core of ours
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        return 128 + sig  # a signal that does not end a process by default (the rank stopped by one)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

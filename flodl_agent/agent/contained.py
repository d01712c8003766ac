"""A rank contained: started under its own reaper (:mod:`.reaper`), its end its process's
exit, and what it left running stopped and named.

The agent waits on the reaper, the rank's parent: the reaper exits with the rank's status
once nothing the rank started is left below it, so the rank's output ends with it. Where
something escaped all the same (no prctl), the output is read a bounded while after the
exit, never until a pipe some stray process holds is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from . import reaper
from .rank_io import output_lines

DRAIN = 2.0  # seconds the output is read after the rank's exit (what it printed last)
REPORT_LINE = 65536  # one report line's ceiling: the names of what a rank left behind


@dataclass
class Contained:
    """A rank's reaper (the process the agent waits on) and its report pipe."""

    proc: asyncio.subprocess.Process
    report: asyncio.StreamReader
    left: dict[int, str] = field(default_factory=dict)  # what the rank left running: stopped


async def start(command: list[str], env: dict[str, str], cwd: Path | None) -> Contained:
    """The rank under its reaper, in a session of its own; raises the OSError the kernel
    gave for the rank's command, as if the agent had started it itself."""
    read_end, write_end = os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", reaper.__file__, str(write_end), "--", *command,
            env=env, cwd=cwd, pass_fds=(write_end,), start_new_session=True,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    report = asyncio.StreamReader(limit=REPORT_LINE)
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(report), os.fdopen(read_end, "rb", 0))
    first = await _record(report)
    if "start" in first:  # the kernel refused the rank's command
        await proc.wait()
        said = first["start"]
        raise OSError(said.get("errno"), said.get("strerror"), said.get("filename"))
    return Contained(proc, report)


async def _record(report: asyncio.StreamReader) -> dict[str, dict[str, object]]:
    """The reaper's next report line ({} at its end, or for a line it could not have written)."""
    with contextlib.suppress(ValueError, asyncio.LimitOverrunError):
        said = json.loads(await report.readline() or b"{}")
        if isinstance(said, dict) and all(isinstance(v, dict | int) for v in said.values()):
            return said
    return {}


async def lines_until_exit(proc: asyncio.subprocess.Process, held: Contained | None) -> AsyncIterator[str]:
    """A rank's output as lines until it has ended: a contained rank's when its reaper says
    what it stopped (``held.left``) and its output ends, or DRAIN seconds later, whichever
    is first; a compose service's client's (``held`` None) when its output ends."""
    assert proc.stdout is not None
    lines = aiter(output_lines(proc.stdout))
    if held is None:  # its container's end closes it
        async for text in lines:
            yield text
        return
    loop = asyncio.get_running_loop()
    ended = asyncio.ensure_future(stopped(held))
    line = asyncio.ensure_future(anext(lines))
    deadline: float | None = None
    try:
        while True:
            if ended.done() and deadline is None:
                deadline = loop.time() + DRAIN
            waiting = {line} if ended.done() else {line, ended}
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            done, _ = await asyncio.wait(waiting, timeout=timeout)
            if not done:  # a stray process outside the reaper holds the pipe: the rank has ended
                _close_output(proc)
                return
            if line in done:
                try:
                    text = line.result()
                except StopAsyncIteration:  # the reaper has exited: its last report is there
                    await ended
                    return
                yield text
                line = asyncio.ensure_future(anext(lines))
    finally:
        line.cancel()
        ended.cancel()


def _close_output(proc: asyncio.subprocess.Process) -> None:
    # Without this a wait() that also waits for the pipes (Python 3.12+) would wait for the stray.
    transport = getattr(proc, "_transport", None)
    pipe = transport.get_pipe_transport(1) if transport is not None else None
    if pipe is not None:
        pipe.close()


async def stopped(contained: Contained) -> dict[int, str]:
    """What the reaper stopped after the rank ended: pid -> name (its last report line)."""
    said = await _record(contained.report)
    left = said.get("left", {})
    contained.left = {int(pid): str(name) for pid, name in left.items() if str(pid).isdigit()}
    return contained.left


def left_note(rank: int, left: dict[int, str]) -> str | None:
    """The host's log line for what a rank left running, or None when it left nothing."""
    if not left:
        return None
    shown = ", ".join(f"{pid} {name}" for pid, name in sorted(left.items())[:8])
    more = f" and {len(left) - 8} more" if len(left) > 8 else ""
    noun = "process" if len(left) == 1 else "processes"
    return f"rank {rank} left {len(left)} {noun} running ({shown}{more}): stopped them"

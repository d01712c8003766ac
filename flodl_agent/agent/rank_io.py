"""The IO pieces of a host's ranks and its link that the agent's attempt drives: a rank's
output as lines, why a rank could not start (as a shell says it), the heartbeat that
carries the ranks' reports, and the hang-up that lets the last reports cross.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path

from ..observe.metrics import read_reports
from ..protocol import wire
from ..retry import AgentFailure, Transient
from .uplink import Uplink

FIRST_BEAT = 1.0  # seconds from the ranks' start to the first beat
CLOSE_TIMEOUT = 10.0
# A shell's codes for a command it could not run: not found, found but not executable.
NOT_FOUND, CANNOT_EXECUTE = 127, 126


def start_failure(command: list[str], exc: OSError | ValueError) -> tuple[AgentFailure, int, str]:
    """A rank's command that the kernel would not start (or Python would not hand it: a NUL
    byte in its argv, env or cwd is a ValueError): the attempt's failure (transient: the run's
    command is wrong, not the box), the code a shell would exit with, and why."""
    entry = command[0] if command else "?"
    filename = getattr(exc, "filename", None)
    where = f" ({filename})" if filename and str(filename) != entry else ""  # a missing cwd
    why = f"{entry}: {getattr(exc, 'strerror', None) or exc}{where}"
    code = NOT_FOUND if isinstance(exc, FileNotFoundError) else CANNOT_EXECUTE
    failure = Transient(
        f"cannot start the entry point {why}",
        "the run's command (the launch's, a published manifest's, or --bin / join.bin) is not there "
        "or not executable on this box: fix it and launch again; --persist re-dials for that launch",
    )
    return failure, code, why


async def heartbeat(uplink: Uplink, reports: dict[int, Path], every: float) -> None:
    """Tell the controller this host is alive while its ranks train (its watchdog's input),
    with the ranks' latest progress reports (the status page's and /metrics' input).

    The first beat comes after a second, not a period (the page shows progress as soon
    as there is some), and a last one when the ranks end (their final step and loss)."""

    def beat() -> None:
        # msgpack maps take string keys only: the controller reads the ranks back as ints.
        ranks = {str(rank): body for rank, body in read_reports(reports).items()}
        uplink.send(wire.Kind.HEARTBEAT, {"ranks": ranks})

    try:
        await asyncio.sleep(min(every, FIRST_BEAT))
        while True:
            beat()
            await asyncio.sleep(every)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):  # a link already gone takes no last beat
            if not uplink.closing:
                beat()
        raise


async def output_lines(stream: asyncio.StreamReader, longest: int = 16384) -> AsyncIterator[str]:
    """A child's output as lines, whatever it writes: progress bars end lines with
    \r, and a line longer than ``longest`` is cut rather than fatal."""
    pending = b""
    while chunk := await stream.read(65536):
        pending += chunk
        *complete, pending = re.split(rb"\r\n|\r|\n", pending)
        for line in complete:
            yield line.decode(errors="replace")
        while len(pending) > longest:
            yield pending[:longest].decode(errors="replace")
            pending = pending[longest:]
    if pending:
        yield pending.decode(errors="replace")


async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Half-close and wait for the controller to close in turn: only then are the exit
    reports known to have crossed every hop (a tunnel torn down early loses them)."""
    await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()
    with contextlib.suppress(TimeoutError, ConnectionError):
        await asyncio.wait_for(_until_eof(reader), CLOSE_TIMEOUT)


async def _until_eof(reader: asyncio.StreamReader) -> None:
    while await reader.read(65536):
        pass

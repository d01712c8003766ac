"""A rank's own word on why it ended, carried to the controller's log and the run's verdict.

An exit code says that a rank failed, not why. A rank that knows (the Trainer, on a
model mismatch at formation; a script of one's own through :func:`say`) writes one
line to the file ``FLODL_EXIT_REASON`` names, in the agent's private per-run
directory beside its metrics file; the agent reads it when the rank ends and sends
it with the rank's exit, so the controller says "rank 1 on b exited with code 2:
model mismatch at formation: …" instead of the code alone.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ..protocol.messages import shown

ENV = "FLODL_EXIT_REASON"
LIMIT = 256  # what the rank's exit message carries (protocol.messages.Short)


def say(reason: str) -> None:
    """Leave ``reason`` for the agent (atomic; a no-op outside a walk-in)."""
    target = os.environ.get(ENV)
    if not target:
        return
    with contextlib.suppress(OSError):  # the reason is a courtesy: the exit code still tells
        tmp = Path(f"{target}.{os.getpid()}.tmp")
        tmp.write_text(reason)
        tmp.replace(target)


def read(path: Path) -> str:
    """The reason a rank left at ``path``: one printable line of at most LIMIT characters, or ""."""
    try:
        with path.open("rb") as f:
            raw = f.read(4 * LIMIT)
    except OSError:
        return ""
    return shown(" ".join(raw.decode(errors="replace").split()), LIMIT)  # one line, whatever it wrote

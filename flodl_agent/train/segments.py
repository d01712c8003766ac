"""What a CPU-plane rank and its agent share outside the loopback frames: the environment the
agent hands the rank, and the shared-memory files the parameters and the average live in.

Pure (no sockets, no torch): the agent's rank environment imports the names from here.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path

import numpy as np

ENV_PORT, ENV_KEY, ENV_DIR = "FLODL_AVERAGE_PORT", "FLODL_AVERAGE_KEY", "FLODL_AVERAGE_DIR"
# An elastic world's ceiling of ranks: every rank sizes its timing slots by it, so that the
# parameter count each rank pushes stays the same however the world grows.
MAX_WORLD_ENV = "FLODL_MAX_WORLD_SIZE"
MIDRUN_ENV = "FLODL_MIDRUN"  # "1": the rank walked into a training world and syncs before a step
AVERAGE_FILE = "average"


def segment_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank-{rank}"


class Mapped:
    """A file mapped whole, remapped when the size asked for changes.

    ``grow``: this side sizes the file, and never makes it smaller (a view handed out earlier
    may still map its end: a shrunk file faults on access there). The other side maps the
    first ``nbytes`` of a file at least that long."""

    def __init__(self, path: Path, writable: bool, grow: bool = False) -> None:
        self.path, self.writable, self.grow = path, writable, grow
        self.map: mmap.mmap | None = None
        self.array: np.ndarray = np.empty(0, np.float32)

    def view(self, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` as float32."""
        if self.map is None or len(self.map) != nbytes:
            self.close()
            flags = (os.O_RDWR if self.writable else os.O_RDONLY) | (os.O_CREAT if self.grow else 0)
            fd = os.open(self.path, flags, 0o600)
            try:
                have = os.fstat(fd).st_size
                if self.grow and have < nbytes:
                    os.ftruncate(fd, nbytes)
                    have = nbytes
                if have < nbytes:
                    # Mapping past the end of a file faults on access: check before touching it.
                    raise ValueError(f"{self.path.name} holds {have} bytes, not {nbytes}")
                if nbytes:
                    access = mmap.ACCESS_WRITE if self.writable else mmap.ACCESS_READ
                    self.map = mmap.mmap(fd, nbytes, access=access)
                    self.array = np.frombuffer(self.map, dtype=np.float32)
            finally:
                os.close(fd)
        return self.array

    def close(self) -> None:
        self.array = np.empty(0, np.float32)
        if self.map is not None:
            with contextlib.suppress(BufferError):  # a view still exported: the map goes with it
                self.map.close()
            self.map = None

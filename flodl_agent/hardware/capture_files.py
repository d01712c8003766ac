"""A capture directory: its files, each with how it came to be, and the index that lists them.

The machinery under :mod:`flodl_agent.probing.capture`: a file is put (capped in size), copied
from a path (absent or unreadable is written down, not raised), or is a tool's output
(missing from PATH, a non-zero exit and a timeout written down; a run is cut with its
whole process group). The environment enters only as an allow-list of the GPU stack's
variables with credential-like names redacted, and tools run without those names at all.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

TIMEOUT = 10.0  # a vendor tool's run
MAX_BYTES = 1 << 20  # per file

# What a GPU stack's environment is made of; anything else is not captured.
ENV_PREFIXES = (
    "HIP_", "ROCR_", "HSA_", "ROCM_", "AMD_", "HCC_", "GPU_", "CUDA_", "NVIDIA_", "NCCL_",
    "RCCL_", "GLOO_", "TORCH_", "PYTORCH_", "FLODL_", "FDL_", "OMP_",
)  # fmt: skip
ENV_NAMES = ("PATH", "LD_LIBRARY_PATH", "LD_PRELOAD", "VIRTUAL_ENV", "PYTHONPATH")
_CREDENTIAL = re.compile(r"TOKEN|SECRET|PASS|KEY|CRED|AUTH|COOKIE|SESSION|PRIVATE", re.IGNORECASE)
_URL_USER = re.compile(r"://[^/@\s]+@")  # user:password@ in a URL
REDACTED = "<redacted>"


@dataclass
class Entry:
    """One file of the capture and how it came to be."""

    name: str
    what: str
    source: str  # the command line run, or the path read
    status: str = "ok"  # ok | failed (exit != 0) | timeout | missing (no such tool) | absent | unreadable
    exit: int | None = None
    seconds: float | None = None
    bytes: int = 0
    truncated: bool = False
    note: str = ""


@dataclass
class Capture:
    """A capture being written into ``where``."""

    where: Path
    env: dict[str, str]  # what the tools run with: credential-like names removed
    timeout: float = TIMEOUT
    max_bytes: int = MAX_BYTES
    entries: list[Entry] = field(default_factory=list)

    def put(self, entry: Entry, data: bytes) -> Entry:
        entry.truncated = entry.truncated or len(data) > self.max_bytes
        data = data[: self.max_bytes]
        if data or entry.status in ("ok", "failed", "timeout"):  # what was not there leaves no file
            target = self.where / entry.name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        entry.bytes = len(data)
        self.entries.append(entry)
        return entry

    def text(self, name: str, what: str, source: str, text: str) -> Entry:
        return self.put(Entry(name, what, source), text.encode())

    def copy(self, name: str, what: str, path: Path) -> Entry:
        try:
            data = path.read_bytes()[: self.max_bytes + 1]
        except FileNotFoundError:
            return self.put(Entry(name, what, str(path), "absent", note=f"{path} does not exist"), b"")
        except OSError as exc:
            return self.put(Entry(name, what, str(path), "unreadable", note=exc.strerror or str(exc)), b"")
        return self.put(Entry(name, what, str(path)), data)

    def run(
        self,
        name: str,
        what: str,
        argv: Sequence[str],
        timeout: float | None = None,
        keep: str = "",
        apart: bool = False,
        shown: str = "",
    ) -> Entry:
        """A tool's output; ``keep``: only the lines this pattern finds; ``apart``: stderr in a
        file of its own (``name``'s stem + .stderr.txt, when it printed any), as for JSON;
        ``shown``: how the index names the command (default: its argv)."""
        shown = shown or " ".join(argv)
        tool = argv[0] if "/" in argv[0] else shutil.which(argv[0], path=self.env.get("PATH", ""))
        if tool is None:
            return self.put(Entry(name, what, shown, "missing", note=f"{argv[0]} is not on PATH"), b"")
        limit = self.max_bytes * (16 if keep else 1)
        wait = timeout or self.timeout
        ran = bounded_run([tool, *argv[1:]], self.env, wait, limit, apart)
        entry = Entry(name, what, shown, exit=ran.code, seconds=round(ran.seconds, 2), truncated=ran.cut)
        if ran.code is None:
            entry.status, entry.note = "timeout", f"cut after {wait:g} s"
        elif ran.code != 0:
            entry.status = "failed"
        data = ran.out
        if keep and ran.code == 0:
            pattern = re.compile(keep)
            lines = data.decode(errors="replace").splitlines(True)
            data = "".join(line for line in lines if pattern.search(line)).encode()
            entry.note = "" if data else f"no line matched {keep}"
        if ran.err:
            stem = name.rsplit(".", 1)[0]
            self.put(Entry(f"{stem}.stderr.txt", f"what {name}'s command printed on stderr", shown), ran.err)
        return self.put(entry, data)


@dataclass
class Ran:
    """A bounded run: its exit code (None: cut at the timeout), the first bytes of its output."""

    code: int | None
    out: bytes
    err: bytes  # empty when stderr went with stdout
    seconds: float
    cut: bool  # more came than was kept


def bounded_run(
    argv: Sequence[str], env: Mapping[str, str], timeout: float, limit: int, apart: bool = False
) -> Ran:
    """Run a tool for at most ``timeout`` seconds, keeping ``limit`` bytes of what it prints
    (stderr with stdout, or ``apart``). It runs in a session of its own so that, cut, its
    whole process group goes and no child of it keeps the pipes open."""
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if apart else subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
        )
    except OSError as exc:
        return Ran(127, b"", f"{argv[0]}: {exc.strerror or exc}\n".encode(), 0.0, False)
    kept = [bytearray(), bytearray()]
    more = threading.Event()
    pipes = [p for p in (proc.stdout, proc.stderr) if p is not None]
    readers = [
        threading.Thread(target=_drain, args=(p.fileno(), kept[i], limit, more), daemon=True)
        for i, p in enumerate(pipes)
    ]
    for reader in readers:
        reader.start()
    code = _wait(proc, timeout)
    _reap(proc, readers, pipes, cut=code is None)
    return Ran(code, bytes(kept[0]), bytes(kept[1]), time.monotonic() - start, more.is_set())


def _drain(fd: int, into: bytearray, limit: int, more: threading.Event) -> None:
    """Read a pipe to its end, keeping ``limit`` bytes; ``more`` set when some were dropped."""
    while block := os.read(fd, 65536):
        room = limit - len(into)
        into.extend(block[: max(room, 0)])
        if len(block) > room:
            more.set()


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """Its exit code, or None when it is still running after ``timeout`` seconds."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def _reap(
    proc: subprocess.Popen[bytes], readers: Sequence[threading.Thread], pipes: Sequence[IO[bytes]], cut: bool
) -> None:
    """Join the readers (at once when cut), end what is left of its session, and close the
    pipes unless an escaped child still holds one."""
    for reader in readers:
        reader.join(0 if cut else 2.0)
    # Cut, or done: what is left of its session goes too (a child holding the pipes, or one
    # it gave up on: the probe's own rocm-smi that hung).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for reader in readers:
        reader.join(5.0)
    if not any(r.is_alive() for r in readers):  # one that escaped the group keeps its pipe
        for pipe in pipes:
            pipe.close()


# --- the environment -------------------------------------------------------------------


def credential_like(name: str) -> bool:
    return bool(_CREDENTIAL.search(name))


def gpu_env(env: Mapping[str, str]) -> str:
    """The GPU stack's variables, one a line; a credential-like one only named."""
    lines = []
    for name in sorted(env):
        if not (name in ENV_NAMES or name.startswith(ENV_PREFIXES)):
            continue
        value = REDACTED if credential_like(name) else _URL_USER.sub(f"://{REDACTED}@", env[name])
        lines.append(f"{name}={value}")
    return "\n".join(lines) + "\n" if lines else "(none of the GPU stack's variables is set)\n"


def redact_words(text: str) -> str:
    """``name=value`` words whose name is credential-like, value redacted (a kernel command line)."""
    return re.sub(r"(\S+)=(\S+)", lambda m: f"{m[1]}={REDACTED}" if credential_like(m[1]) else m[0], text)


def tool_env(env: Mapping[str, str]) -> dict[str, str]:
    """What tools run with: the caller's environment without anything credential-like."""
    return {k: v for k, v in env.items() if not credential_like(k)} | {"LC_ALL": "C"}


def readme(index: Mapping[str, object], entries: Sequence[Entry]) -> str:
    head = (
        f"flodl fleet capture of {index['host']} at {index['created']} (fdl {index['fdl']})\n"
        "What a GPU bug report needs; index.json says the same for machines. No token or credential\n"
        "is in it (credential-like variables are redacted, tools ran without them): look it over\n"
        "before you attach it.\n\n"
    )
    width = max(len(e.name) for e in entries)
    rows = []
    for e in entries:
        how = e.status + (f", exit {e.exit}" if e.exit not in (None, 0) else "")
        how += ", truncated" if e.truncated else ""
        rows.append(f"{e.name:<{width}}  {how:<14} {e.what}" + (f" ({e.note})" if e.note else ""))
        rows.append(f"{'':<{width}}  {'':<14} from: {e.source}")
    return head + "\n".join(rows) + "\n"

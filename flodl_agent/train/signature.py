"""Signatures that keep a cohort coherent: the model each rank builds and the data root each box reads.

The dataset signature is computed by the agent before it dials (names, sizes
and a sampled content hash of the data root, cached between dials) and rides
the hello; admission refuses a box whose signature differs from the cohort's
("dataset mismatch"). The model signature is SHA-256 over the sorted names,
shapes and dtypes of a model's parameters and buffers; the Trainer compares
every rank's at formation through the rendezvous store ("model mismatch at
formation" names the ranks).

The model probe moves that check to the join window: when a published run
says its entry answers it (``fdl publish --model-probe``), each box runs the
entry once with ``FLODL_PROBE_SIGNATURE`` set before it dials; the Trainer
(or :func:`answer_probe` in a script of one's own) writes the signature of
the model it builds and exits before anything trains. The answer is cached
on the command, its working directory and the entry's mtime, so a re-dial
costs nothing.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import signal
import stat
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

SAMPLE_BYTES = 64 * 1024  # read from the head and the tail of a sampled file
SAMPLED_FILES = 256  # at most this many files are read; every file is listed
PROBE_ENV = "FLODL_PROBE_SIGNATURE"  # set: build the model, write its signature here, exit
PROBE_TIMEOUT = 300.0  # seconds an entry gets to build its model and answer
# A probe is not a rank: none of the distributed plumbing reaches it.
_NOT_FOR_PROBES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "FLODL_AVERAGE_PORT",
    "FLODL_AVERAGE_DIR",
)


class ModelMismatch(RuntimeError):
    pass


def model_signature(model: Any) -> str:
    """SHA-256 over the sorted (name, shape, dtype) of a torch module's parameters and buffers."""
    entries = sorted((name, tuple(t.shape), str(t.dtype)) for name, t in model.state_dict().items())
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def answer_probe(model: Any) -> None:
    """Under a model probe, write ``model``'s signature where the prober asked and exit;
    otherwise return at once. The Trainer calls it as soon as it has built the model."""
    target = os.environ.get(PROBE_ENV)
    if not target:
        return
    tmp = Path(f"{target}.{os.getpid()}.tmp")
    tmp.write_text(model_signature(model))
    tmp.replace(target)  # the prober reads a whole signature or none
    raise SystemExit(0)


class ProbeFailed(RuntimeError):
    pass


def probe_key(command: list[str], cwd: Path) -> str:
    """The probe's cache key: the command, where it runs, and the mtime of each file it names."""
    stamps = []
    for word in command:
        with contextlib.suppress(OSError, ValueError):
            path = Path(word) if Path(word).is_absolute() else cwd / word
            if path.is_file():
                stamps.append((word, path.stat().st_mtime_ns))
    return hashlib.sha256(json.dumps([command, str(cwd), stamps]).encode()).hexdigest()


Runner = Callable[[list[str], Path, dict[str, str], float], tuple[int, str]]


def run_here(command: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run a probe on this box: its exit code and output (raises ProbeFailed when it cannot
    start or does not end in time)."""
    try:
        proc = subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the whole group goes if it hangs
        )
    except OSError as exc:
        raise ProbeFailed(f"cannot run {command[0]}: {exc.strerror}") from None
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise ProbeFailed(f"the entry did not answer the model probe within {timeout:.0f}s") from None
    return proc.returncode, output.decode(errors="replace")


def probe_model(
    command: list[str],
    cwd: Path,
    env: dict[str, str],
    cache: Path | None = None,
    timeout: float = PROBE_TIMEOUT,
    run: Runner = run_here,
    scratch: Path | None = None,
) -> str:
    """The signature of the model ``command`` builds, by running it as a probe (cached).

    The model is built on the CPU (``CUDA_VISIBLE_DEVICES`` empty): a probe claims no
    GPU, and the signature holds names, shapes and dtypes, never the device.
    Raises ProbeFailed when the entry exits, fails or hangs without answering.
    ``run`` runs it (elsewhere: a compose service, which must see ``scratch``, where the
    answer is written).
    """
    key = probe_key(command, cwd)
    cached = _read_cache(cache).get(key)
    if isinstance(cached, str):
        return cached
    if isinstance(cached, dict) and isinstance(cached.get("failed"), str):
        raise ProbeFailed(f"{cached['failed']} (remembered until the entry changes)")
    try:
        sig = _ask(command, cwd, env, timeout, run, scratch)
    except ProbeFailed as exc:
        if cache is not None:  # an entry that does not answer is not run again for every dial
            _write_cache(cache, {key: {"failed": str(exc)}})
        raise
    if cache is not None:
        _write_cache(cache, {key: sig})  # only the latest: a box runs one run at a time
    return sig


def _ask(
    command: list[str], cwd: Path, env: dict[str, str], timeout: float, run: Runner, scratch: Path | None
) -> str:
    with tempfile.TemporaryDirectory(prefix="flodl-probe-", dir=scratch) as where:
        answer = Path(where) / "signature"
        child_env = {k: v for k, v in env.items() if k not in _NOT_FOR_PROBES}
        child_env.update({PROBE_ENV: str(answer), "CUDA_VISIBLE_DEVICES": "", "FLODL_DEVICE": "cpu"})
        code, output = run(command, cwd, child_env, timeout)
        if not answer.is_file():
            tail = " / ".join(output.strip().splitlines()[-3:])
            raise ProbeFailed(
                f"the entry exited {code} without answering the model probe" + (f" ({tail})" if tail else "")
            )
        return answer.read_text().strip()


def check_formation(signatures: dict[int, str]) -> None:
    """Every rank must build the same model; otherwise name who builds what."""
    by_sig: dict[str, list[int]] = {}
    for rank, sig in sorted(signatures.items()):
        by_sig.setdefault(sig, []).append(rank)
    if len(by_sig) <= 1:
        return
    parts = []
    for sig, ranks in sorted(by_sig.items(), key=lambda kv: kv[1]):
        many = len(ranks) > 1
        parts.append(
            f"rank{'s' if many else ''} {', '.join(map(str, ranks))} build{'' if many else 's'} {sig[:12]}"
        )
    raise ModelMismatch(
        "model mismatch at formation: "
        + "; ".join(parts)
        + " (parameter names, shapes or dtypes differ: a stale source tree, a wrong bin, or different "
        "arguments reaching the model factory)"
    )


def _listing(root: Path) -> list[tuple[str, int, int]]:
    """Every regular file under ``root``: (relative path, size, mtime in ns), sorted."""
    if not stat.S_ISDIR(root.stat().st_mode):  # raises for a missing root or a dead mount
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(root))
    files = []

    def fail(exc: OSError) -> None:
        raise exc  # os.walk would skip an unreadable directory: a signature must not

    for dirpath, dirnames, filenames in os.walk(root, onerror=fail):
        dirnames.sort()
        for name in filenames:
            path = Path(dirpath) / name
            st = path.stat()
            files.append((str(path.relative_to(root)), st.st_size, st.st_mtime_ns))
    return sorted(files)


def dataset_signature(root: str | Path, cache: Path | None = None) -> str:
    """Names, sizes and a sampled content hash of the data root (cached by its listing)."""
    root = Path(root)
    listing = _listing(root)
    key = hashlib.sha256(json.dumps([str(root), listing]).encode()).hexdigest()
    cached = _read_cache(cache)
    if cached.get(str(root), {}).get("key") == key:
        return str(cached[str(root)]["sig"])
    digest = hashlib.sha256()
    step = max(1, len(listing) // SAMPLED_FILES)
    for i, (rel, size, _) in enumerate(listing):
        digest.update(f"{rel}\0{size}\n".encode())  # names and sizes: every file
        if i % step == 0:  # content: a deterministic sample (the same files on every box)
            with (root / rel).open("rb") as f:
                digest.update(f.read(SAMPLE_BYTES))
                if size > 2 * SAMPLE_BYTES:
                    f.seek(size - SAMPLE_BYTES)
                    digest.update(f.read(SAMPLE_BYTES))
    sig = digest.hexdigest()
    if cache is not None:
        cached[str(root)] = {"key": key, "sig": sig}
        _write_cache(cache, cached)
    return sig


def _read_cache(cache: Path | None) -> dict[str, Any]:
    if cache is None:
        return {}
    try:
        data = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(cache: Path, data: dict[str, Any]) -> None:
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(cache)  # atomic: a concurrent reader sees the old file or the new one
    except OSError:
        pass  # a cache that cannot be written only costs a recomputation

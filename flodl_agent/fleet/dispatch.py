"""`local_devices: all` at dispatch: each such worker's GPUs counted over its ssh block.

Before a fan-out launch fixes its window, every worker that offers ``all`` is
asked over ssh what its vendor tools and sysfs list: ``nvidia-smi`` and the KFD
topology (AMD GPUs, readable with no ROCm runtime), the same sources ``fdl
probe`` reads (:mod:`.gpus` parses both). The counts become those workers'
capacity, so quorum and target default to what the fleet actually holds. No
fdl or torch is needed on the box for this; a box that cannot be asked fails
the launch naming the host, the ssh client's words and the fixes.
"""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..config.models import Cluster, Worker
from ..errors import Failure
from ..hardware.gpus import KFD_NODES, NVIDIA_SMI, Gpu, parse_kfd, parse_nvidia
from .fanout import ask, worker_ssh

COUNT_TIMEOUT = 30.0  # seconds one box gets to answer (the tools, not torch, run there)
MARK = "@@flodl-count"  # section lines in the answer; no tool prints them
FIX = (
    "check the worker's ssh: block (fdl @NAME probe reaches every box the same way), or list its "
    "devices (local_devices: [0, 1], or cpu:N), or set cluster.controller.join.min_rank_start"
)


class DispatchError(Failure):
    """A worker offering ``all`` whose devices could not be counted."""


@dataclass(frozen=True)
class Found:
    """What one box's tools list: its NVIDIA GPUs, and its AMD GPUs' gfx targets."""

    nvidia: list[Gpu] = field(default_factory=list)
    amd: list[str] = field(default_factory=list)

    def describe(self) -> str:
        names = [g.name for g in self.nvidia] or [f"AMD {arch}" for arch in self.amd]
        distinct = sorted(set(names))
        return ", ".join(f"{names.count(n)}x {n}" if names.count(n) > 1 else n for n in distinct)


# --- the pure part --------------------------------------------------------------


def count_command(kfd: str = str(KFD_NODES)) -> str:
    """The shell line a worker runs: nvidia-smi's CSV, then each KFD node's properties."""
    nodes = shlex.quote(kfd)
    return "; ".join(
        [
            f"echo {MARK} nvidia",
            f"command -v nvidia-smi >/dev/null 2>&1 && {shlex.join(NVIDIA_SMI)} 2>/dev/null",
            f'for n in {nodes}/*; do [ -r "$n/properties" ] && echo "{MARK} kfd ${{n##*/}}" '
            '&& cat "$n/properties"; done',
            "exit 0",  # the tools' own failures are a count of zero; non-zero is ssh's
        ]
    )


def parse_count(text: str) -> Found:
    """The answer to :func:`count_command`, section by section."""
    nvidia: list[str] = []
    nodes: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith(MARK):
            words = line.split()
            if words[1:2] == ["nvidia"]:
                current = nvidia
            elif words[1:2] == ["kfd"] and len(words) == 3:
                current = nodes.setdefault(words[2], [])
            else:
                current = None
        elif current is not None:
            current.append(line)
    kfd = parse_kfd({node: "\n".join(lines) for node, lines in nodes.items()})
    return Found(parse_nvidia("\n".join(nvidia)), kfd)


def capacity(host: str, found: Found) -> int:
    """The ranks a worker offering ``all`` carries: one per GPU of the one vendor it has."""
    if found.nvidia and found.amd:
        raise DispatchError(
            f"{host} offers `local_devices: all` and lists {len(found.nvidia)} NVIDIA and "
            f"{len(found.amd)} AMD GPU(s): one torch build drives one vendor",
            "list the devices its torch variant drives (local_devices: [0, 1])",
        )
    count = len(found.nvidia) or len(found.amd)
    if count == 0:
        raise DispatchError(
            f"{host} offers `local_devices: all`, but nvidia-smi and the KFD topology list no GPU there",
            "offer CPU ranks (local_devices: cpu:N), list its devices, or set "
            "cluster.controller.join.min_rank_start",
        )
    return count


# --- the IO shell ---------------------------------------------------------------


async def count_worker(worker: Worker, kfd: str = str(KFD_NODES), timeout: float = COUNT_TIMEOUT) -> Found:
    """Ask one worker over its ssh block what its tools list."""
    argv = [*worker_ssh(worker), count_command(kfd)]
    try:
        code, out, errout = await ask(argv, None, timeout)
    except OSError as exc:
        raise DispatchError(
            f"cannot run ssh to count the devices of {worker.host}: {exc.strerror}", FIX
        ) from None
    except TimeoutError:
        raise DispatchError(
            f"{worker.host} did not answer the device count over ssh within {timeout:.0f}s", FIX
        ) from None
    if code != 0:
        said = errout.decode(errors="replace").strip().splitlines()
        raise DispatchError(
            f"cannot count the devices of {worker.host} (local_devices: all) over ssh: exit "
            f"{code}: {said[-1] if said else 'no output'}",
            FIX,
        )
    return parse_count(out.decode(errors="replace"))


async def count_devices(
    cluster: Cluster,
    log: Callable[[str], None],
    kfd: str = str(KFD_NODES),
    timeout: float = COUNT_TIMEOUT,
) -> Mapping[str, int]:
    """Every ``all`` worker counted at once: host -> ranks. Every box that fails is named in one error."""
    workers = [w for w in cluster.workers if w.capacity is None]
    if not workers:
        return {}
    log(f"counting the devices of {len(workers)} worker(s) offering `local_devices: all` over ssh")
    answers = await asyncio.gather(*(count_worker(w, kfd, timeout) for w in workers), return_exceptions=True)
    counts: dict[str, int] = {}
    failed: list[DispatchError] = []
    for worker, answer in zip(workers, answers, strict=True):
        if isinstance(answer, DispatchError):
            failed.append(answer)
            continue
        if isinstance(answer, BaseException):
            raise answer
        try:
            counts[worker.host] = capacity(worker.host, answer)
        except DispatchError as exc:
            failed.append(exc)
            continue
        log(f"{worker.host}: {answer.describe()}: {counts[worker.host]} rank(s)")
    if failed:
        raise DispatchError(
            "; ".join(e.message for e in failed), "; ".join(dict.fromkeys(e.fix for e in failed))
        )
    return counts

"""A Trainer for the ElChe modes: data-parallel training that averages parameters
every round, on the NCCL plane (torch.distributed collectives; gloo on CPU
boxes) or the CPU plane (through the controller: works through tunnels and
across GPU vendors).

Sync modes take one batch per rank per round. Cadence modes anchor on the
slowest device: it takes ``anchor`` batches per round and every faster rank
proportionally more, measured from the previous round's time per batch (so a
smaller or slower GPU gets less work, never a wait). Averages are weighted by
the batches each rank actually took. ``cpu_async`` blends each rank toward
the average with elasticity ``alpha`` (EASGD) instead of replacing its
parameters; its rounds are still in step (the hub answers once per round).

Every rank runs the same ``Trainer(...).fit(rounds)`` (or ``fit(batches=N)``:
until the world has taken N batches, a stop every rank agrees on because it
reads the round's averaged weight); the walk-in's
environment (RANK, WORLD_SIZE, the store, the averaging port) does the rest.

A rank's shard goes resident on its GPU when it fits the device's budget
(:mod:`.device_memory`: an APU's is its ``gpu_ram_share`` of the host's RAM),
and streams batch by batch otherwise; the batches are the same either way.

An elastic world (``FLODL_MAX_WORLD_SIZE``: the CPU plane) grows as it trains: a walk-in
(``FLODL_MIDRUN``) first takes the world's average, round number and batches so far; once a
round shows another set of ranks stepping, every rank re-cuts its shard among them.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import Any, Literal, Protocol

from ..observe import exit_reason
from ..observe.metrics import report as report_progress
from .device_memory import Budget, Device, device_budget, resolve_share
from .segments import MAX_WORLD_ENV, MIDRUN_ENV
from .signature import ModelMismatch, answer_probe, check_formation, model_signature

FORMATION_TIMEOUT = 300.0  # seconds a rank waits for the others' model signatures
Plane = Literal["nccl", "cpu"]
Cadence = Literal["sync", "cadence", "async"]


@dataclass(frozen=True)
class ElCheConfig:
    plane: Plane = "nccl"
    cadence: Cadence = "cadence"
    anchor: int = 8  # batches the slowest rank takes per round (cadence modes)
    max_anchor: int = 256
    overhead_target: float = 0.05  # averaging time / compute time the anchor adapts toward
    alpha: float = 0.5  # EASGD elasticity (cpu_async)
    bf16_wire: bool = False  # cpu plane: parameters cross the link as bfloat16 (half the bytes)

    def __post_init__(self) -> None:
        if not 1 <= self.anchor <= self.max_anchor:
            raise ValueError(f"anchor must be 1..max_anchor ({self.max_anchor}), not {self.anchor}")
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], not {self.alpha}")
        if self.cadence == "async" and self.plane != "cpu":
            raise ValueError("async blending runs on the cpu plane (cpu_async)")
        if self.bf16_wire and self.plane != "cpu":
            raise ValueError("bf16_wire is the cpu plane's wire format; the nccl plane reduces in place")

    @classmethod
    def nccl_sync(cls, **knobs: Any) -> ElCheConfig:
        return cls("nccl", "sync", **knobs)

    @classmethod
    def nccl_cadence(cls, **knobs: Any) -> ElCheConfig:
        return cls("nccl", "cadence", **knobs)

    @classmethod
    def cpu_sync(cls, **knobs: Any) -> ElCheConfig:
        return cls("cpu", "sync", **knobs)

    @classmethod
    def cpu_cadence(cls, **knobs: Any) -> ElCheConfig:
        return cls("cpu", "cadence", **knobs)

    @classmethod
    def cpu_async(cls, **knobs: Any) -> ElCheConfig:
        return cls("cpu", "async", **knobs)


def batches_for(config: ElCheConfig, anchor: int, mine: float | None, slowest: float | None) -> int:
    """This rank's batches for the next round, from last round's seconds per batch."""
    if config.cadence == "sync":
        return 1
    if not mine or not slowest:
        return anchor  # first round: nothing measured yet
    return max(1, min(config.max_anchor, round(anchor * slowest / mine)))


def adapt_anchor(config: ElCheConfig, anchor: int, compute: float, averaging: float) -> int:
    """Averaging should cost about ``overhead_target`` of the compute: double or halve the anchor."""
    if config.cadence == "sync" or compute <= 0:
        return anchor
    ratio = averaging / compute
    if ratio > config.overhead_target:
        return min(config.max_anchor, anchor * 2)
    if ratio < config.overhead_target / 4:
        return max(config.anchor, anchor // 2)
    return anchor


def world_round(
    config: ElCheConfig, anchor: int, slots: list[float], world: int
) -> tuple[int, dict[int, float]]:
    """A round's averaged timing slots -> (next anchor, every rank's seconds per batch).

    ``slots`` holds, per rank, its seconds per batch (first ``world``) and how long its
    previous averaging call took (next ``world``), as the average hands them back
    (multiplied by the total weight). The least of the averaging times is the
    averaging's own cost — a faster rank's call also holds its wait for the slowest —
    and every rank reads the same slots, so every rank picks the same anchor.
    """
    times = {r: slots[r] for r in range(world) if slots[r] > 0}
    if times:
        averaging = min(slots[world + r] for r in times)
        anchor = adapt_anchor(config, anchor, anchor * max(times.values()), averaging)
    return anchor, times


class ShutdownWithSave(RuntimeError):
    """The run is ending because too many ranks were lost; ``path`` is the checkpoint this rank wrote."""

    def __init__(self, reason: str, path: Path | None) -> None:
        saved = f"; checkpoint saved to {path}" if path is not None else "; another rank saves the checkpoint"
        super().__init__(reason + saved)
        self.path = path


@dataclass
class RoundReport:
    round: int
    batches: int
    loss: float
    weight: float  # the round's accepted weight across the world
    seconds_per_batch: dict[int, float]  # every rank that stepped


@dataclass
class _Progress:
    """Where a rank's ``fit`` stands, round to round."""

    anchor: int
    round: int = 0
    taken: float = 0.0  # the world's batches so far
    steps: int = 0  # this rank's batches so far
    averaging: float = 0.0  # this rank's last averaging call, in seconds
    times: dict[int, float] = field(default_factory=dict)  # last round: every rank's seconds per batch


class Averaging(Protocol):
    """A rank's plane: one call per round, in step with the other ranks."""

    round: int  # the round it takes part in next (a join's: as the world counts them)
    taken: float  # the world's accepted weight through the last round, as the plane told it

    def average(self, tensors: list[Any], weight: float, join: bool = False) -> float: ...


class _Collective:
    """The NCCL plane (gloo on CPU boxes): one all-reduce of weight * params beside the weight."""

    def __init__(self, device: Any) -> None:
        self.device, self.round, self.taken = device, 0, 0.0

    def average(self, tensors: list[Any], weight: float, join: bool = False) -> float:
        import torch
        import torch.distributed as dist

        flat = torch.cat([t.detach().reshape(-1).to(self.device, torch.float32) for t in tensors])
        both = torch.cat([flat * weight, torch.tensor([weight], device=self.device)])
        dist.all_reduce(both)
        total = float(both[-1])
        if total > 0:
            averaged, offset = both[:-1] / total, 0
            with torch.no_grad():
                for t in tensors:
                    t.copy_(averaged[offset : offset + t.numel()].view_as(t).to(t.dtype))
                    offset += t.numel()
        self.round += 1
        return total


def read_device(torch: Any, device: Any) -> Device:
    """The device's memory facts: torch's figure, whether it is an APU, the host's RAM."""
    if device.type != "cuda":
        return Device("cpu")
    props = torch.cuda.get_device_properties(device)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Device("cuda", int(props.total_memory), bool(getattr(props, "is_integrated", False)), ram)


def nbytes(item: Any) -> int:
    """The bytes one dataset item holds in its tensors (arrays, numbers: 8 bytes each)."""
    if hasattr(item, "nbytes"):
        return int(item.nbytes)
    if isinstance(item, Mapping):
        return sum(nbytes(v) for v in item.values())
    if isinstance(item, (list, tuple)):
        return sum(nbytes(v) for v in item)
    return 8


def _map(tree: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` over every tensor of a collated batch (tensors, mappings, sequences of them)."""
    import torch

    if torch.is_tensor(tree):
        return fn(tree)
    if isinstance(tree, Mapping):
        return {k: _map(v, fn) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a namedtuple
        return type(tree)(*(_map(v, fn) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(v, fn) for v in tree)
    return tree


def stream_batches(dataset: Any, indices: list[int], batch_size: int) -> Iterator[Any]:
    """A shard, cycled, collated batch by batch as it is drawn: faster ranks draw more of it."""
    from torch.utils.data import default_collate

    while True:
        for start in range(0, len(indices), batch_size):
            yield default_collate([dataset[i] for i in indices[start : start + batch_size]])


def resident_batches(dataset: Any, indices: list[int], batch_size: int, device: Any) -> Iterator[Any]:
    """The same batches as :func:`stream_batches`, cut from the whole shard collated once on ``device``."""
    from torch.utils.data import default_collate

    whole = _map(default_collate([dataset[i] for i in indices]), lambda t: t.to(device))
    while True:
        for start in range(0, len(indices), batch_size):
            yield _map(whole, itemgetter(slice(start, start + batch_size)))


class Trainer:
    def __init__(
        self,
        model: Callable[[], Any],
        dataset: Any,
        optimizer: Callable[[Iterable[Any]], Any],
        loss: Callable[[Any, Any], Any],
        config: ElCheConfig | None = None,
        batch_size: int = 32,
        checkpoint: str | os.PathLike[str] | None = None,
        gpu_ram_share: float | None = None,
    ) -> None:
        """``gpu_ram_share``: an APU's share of the host's RAM (set here, it beats the
        FLODL_GPU_RAM_SHARE the agent hands the rank); discrete GPUs and CPU ranks ignore it."""
        import torch

        self.config = config or ElCheConfig.nccl_cadence()
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        # An elastic world's ceiling sizes the timing slots: the same parameter count however it grows.
        ceiling = int(os.environ.get(MAX_WORLD_ENV) or 0)
        self.elastic, self.slots = ceiling > 0, ceiling or self.world
        if not 0 <= self.rank < self.slots:
            raise ValueError(f"rank {self.rank} is outside the world's {self.slots} timing slots")
        self.midrun = self.config.plane == "cpu" and os.environ.get(MIDRUN_ENV) == "1"
        self._live = frozenset(range(self.world))  # the ranks that stepped in the last round
        torch.manual_seed(0)  # every rank starts from the same parameters
        # The agent masks the rank to its one device (CUDA_VISIBLE_DEVICES): it is cuda:0 here.
        on_gpu = os.environ.get("FLODL_DEVICE", "").startswith("cuda") and torch.cuda.is_available()
        self.device = torch.device("cuda" if on_gpu else "cpu")
        self.gpu_ram_share = resolve_share(gpu_ram_share, os.environ)
        self.memory: Budget = device_budget(read_device(torch, self.device), self.gpu_ram_share)
        built = model()
        answer_probe(built)  # under a join's model probe: answer and exit before anything trains
        self.model = built.to(self.device)
        self._check_formation()
        self.optimizer = optimizer(self.model.parameters())
        self.loss_fn = loss
        self.batch_size = batch_size
        self.dataset = dataset
        self.checkpoint = Path(checkpoint or os.environ.get("FLODL_CHECKPOINT", "checkpoint.pt"))
        self.reports: list[RoundReport] = []
        self._owns_group = False  # a process group this Trainer created, and so tears down
        self._cut(self.rank, self.world)
        self._averager = self._plane()

    def _cut(self, position: int, world: int) -> None:
        """This rank's shard: every ``world``-th item from ``position`` (resident or streamed)."""
        indices = list(range(position, len(self.dataset), world))
        if not indices:
            raise ValueError(f"rank {self.rank}: the dataset ({len(self.dataset)} items) has nothing for it")
        self.shard = indices
        self.data_bytes = nbytes(self.dataset[indices[0]]) * len(indices)  # this rank's shard, estimated
        self.resident = self.memory.fits(self.data_bytes)
        if self.resident:
            self._batches = resident_batches(self.dataset, indices, self.batch_size, self.device)
        else:
            self._batches = stream_batches(self.dataset, indices, self.batch_size)

    def _follow(self, times: Mapping[int, float]) -> None:
        """An elastic world follows its growth: once another set of ranks (this one among them)
        stepped, every rank re-cuts its shard by its place among them (they read the same slots)."""
        live = frozenset(times)
        if not self.elastic or self.rank not in live or live == self._live:
            return
        self._live, self.world = live, len(live)
        self._cut(sorted(live).index(self.rank), self.world)

    def _shutdown(self, exc: Exception, round_no: int) -> None:
        """ShutdownWithSave: the plane says too many ranks were lost (the CPU plane names
        the saver), or a collective broke under us (NCCL plane: every survivor saves, to
        the same path, atomically). Raises ShutdownWithSave; returns for other errors."""
        from .averaging import AveragingError

        if isinstance(exc, AveragingError):
            if exc.saver is None:
                return
            saved = self.save(round_no) if exc.saver == self.rank else None
            raise ShutdownWithSave(str(exc), saved) from None
        if self.config.plane == "nccl" and isinstance(exc, RuntimeError):
            raise ShutdownWithSave(f"a collective failed: {exc}", self.save(round_no)) from None

    def save(self, round_no: int) -> Path:
        """An atomic checkpoint: a temp file beside it, then a rename (readers never see half)."""
        import torch

        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.checkpoint.with_name(f".{self.checkpoint.name}.{os.getpid()}.tmp")
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "round": round_no,
            "rank": self.rank,
            "world_size": self.world,
        }
        torch.save(state, tmp)
        tmp.replace(self.checkpoint)
        return self.checkpoint

    def _check_formation(self) -> None:
        """Every rank must build the same model: compare signatures through the rendezvous store
        (a walk-in's is checked by its join round instead: the store may have left with rank 0)."""
        if self.world == 1 or "MASTER_PORT" not in os.environ or self.midrun:
            return
        from datetime import timedelta

        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        store = TCPStore(
            os.environ.get("MASTER_ADDR", "127.0.0.1"),
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=FORMATION_TIMEOUT),
        )
        prefix = f"flodl/{os.environ.get('FLODL_LAUNCH', '')}/model_sig"
        store.set(f"{prefix}/{self.rank}", model_signature(self.model))
        try:
            check_formation({r: store.get(f"{prefix}/{r}").decode() for r in range(self.world)})
        except ModelMismatch as exc:  # the user's to fix, not a bug: one line, not a traceback
            exit_reason.say(str(exc))
            print(f"flodl: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    def _plane(self) -> Averaging:
        if self.config.plane == "cpu":
            from .averaging import Averager

            averager = Averager(bf16_wire=self.config.bf16_wire)
            # The parameters live in the rank's segment: each round reads them where they are.
            averager.adopt(list(self.model.parameters()))
            return averager
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
            self._owns_group = True
        return _Collective(self.device)

    def fit(self, rounds: int | None = None, batches: int | None = None) -> Any:
        """Train for ``rounds`` rounds, or until the world has taken ``batches`` batches
        (whichever comes first); returns the model.

        The batch count is the sum of every round's accepted weight, which every rank
        receives identically, so every rank stops after the same round.
        """
        if rounds is None and batches is None:
            raise ValueError("fit needs rounds=, batches= or both")
        if (rounds is not None and rounds < 0) or (batches is not None and batches < 1):
            raise ValueError(f"rounds must be >= 0 and batches >= 1, not rounds={rounds} batches={batches}")

        params = [p.data for p in self.model.parameters()]
        buffers = [b for b in self.model.buffers() if b.is_floating_point()]
        at = _Progress(self.config.anchor)
        if self.midrun:
            self._sync(params, buffers, at)
        while (rounds is None or at.round < rounds) and (batches is None or at.taken < batches):
            slowest = max(at.times.values(), default=None)
            n = batches_for(self.config, at.anchor, at.times.get(self.rank), slowest)
            started = time.perf_counter()
            total_loss = self._steps(n)
            total = self._round(params, buffers, n, time.perf_counter() - started, at)
            self.reports.append(RoundReport(at.round, n, total_loss / n, total, at.times))
            at.steps += n
            report_progress(at.steps, total_loss / n)  # the status page's and /metrics' step rate and loss
            at.taken += total
            at.round += 1
        self.close()
        return self.model

    def _steps(self, n: int) -> float:
        """``n`` batches of this rank's shard; their summed loss."""
        total_loss = 0.0
        for _ in range(n):
            x, y = (t.to(self.device) for t in next(self._batches))
            self.optimizer.zero_grad()
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
            self.optimizer.step()
            total_loss += float(loss.detach())
        return total_loss

    def _round(self, params: list[Any], buffers: list[Any], n: int, compute: float, at: _Progress) -> float:
        """Average this rank's ``n`` batches' worth with the world's; the round's total weight."""
        import torch

        # Each rank's seconds per batch (and its last averaging time) ride the round in
        # its own slots, divided by its weight: after the weighted average, slot * total
        # weight is that rank's figure, the same on every rank.
        timing = torch.zeros(2 * self.slots, device=self.device)
        timing[self.rank] = compute / n / n
        timing[self.slots + self.rank] = at.averaging / n
        # Float buffers (running statistics) are averaged equally among the ranks that
        # stepped: sent divided by the weight beside a 1/weight count slot, the average
        # of the buffers over the average of the counts is their plain mean.
        shared = [b / n for b in buffers]
        count = torch.full((1,), 1.0 / n, device=self.device)
        state = params + buffers
        before = [t.detach().clone() for t in state] if self.config.cadence == "async" else []
        total = self._exchange([*params, *shared, count, timing], float(n), at)
        self._averaged(buffers, shared, count, timing, total, at)
        if before:  # EASGD: move alpha of the way toward the average, keep the rest local
            with torch.no_grad():
                for t, own in zip(state, before, strict=True):
                    t.copy_(own + self.config.alpha * (t - own))
        return total

    def _sync(self, params: list[Any], buffers: list[Any], at: _Progress) -> None:
        """A walk-in's first round, before any step (no report): weight 0, marked join, as many
        parameters as any round. The world's average comes back (parameters, buffers, timing
        slots) with its round number and batches so far: every rank stops on the same round."""
        import torch

        shared = [torch.zeros_like(b) for b in buffers]
        count = torch.zeros(1, device=self.device)
        timing = torch.zeros(2 * self.slots, device=self.device)
        total = self._exchange([*params, *shared, count, timing], 0.0, at, join=True)
        self._averaged(buffers, shared, count, timing, total, at)
        at.round, at.taken = self._averager.round, self._averager.taken

    def _exchange(self, tensors: list[Any], weight: float, at: _Progress, join: bool = False) -> float:
        """One averaging call, timed; a shutdown the plane calls ends the run (ShutdownWithSave)."""
        started = time.perf_counter()
        try:
            total = self._averager.average(tensors, weight, join)
        except Exception as exc:
            self._shutdown(exc, at.round)
            raise
        at.averaging = time.perf_counter() - started
        return total

    def _averaged(
        self, buffers: list[Any], shared: list[Any], count: Any, timing: Any, total: float, at: _Progress
    ) -> None:
        """The buffers' mean over the ranks that stepped; the next anchor, their paces, who stepped."""
        import torch

        if total > 0:
            with torch.no_grad():
                for buffer, mean in zip(buffers, shared, strict=True):
                    buffer.copy_(mean / count)
        slots = [float(v) * total for v in timing]
        at.anchor, at.times = world_round(self.config, at.anchor, slots, self.slots)
        self._follow(at.times)

    def close(self) -> None:
        """Tear down a process group this Trainer created: every rank past its last collective
        first (a rank destroying gloo while a peer still sends aborts, torch 2.13)."""
        if self._owns_group:
            import torch.distributed as dist

            dist.barrier()
            dist.destroy_process_group()
            self._owns_group = False

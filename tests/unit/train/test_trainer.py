"""The ElChe modes' pure parts: presets, per-round budgets, the adaptive anchor; and a Trainer on
a stand-in plane: an elastic world's slots, a walk-in's sync round, the shards following growth."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from flodl_agent.train.trainer import ElCheConfig, adapt_anchor, batches_for, world_round


def test_presets_name_their_plane_and_cadence_and_refuse_nonsense() -> None:
    assert (ElCheConfig.nccl_cadence().plane, ElCheConfig.nccl_cadence().cadence) == ("nccl", "cadence")
    assert ElCheConfig().cadence == "cadence"  # nccl_cadence is the default
    assert ElCheConfig.cpu_async(alpha=0.25).alpha == 0.25
    with pytest.raises(ValueError, match="anchor"):
        ElCheConfig.cpu_cadence(anchor=0)
    with pytest.raises(ValueError, match="alpha"):
        ElCheConfig.cpu_async(alpha=1.5)
    with pytest.raises(ValueError, match="cpu_async"):
        ElCheConfig("nccl", "async")
    with pytest.raises(ValueError, match="bf16_wire"):
        ElCheConfig.nccl_sync(bf16_wire=True)


def test_the_slowest_rank_anchors_and_faster_ranks_take_proportionally_more() -> None:
    cadence = ElCheConfig.cpu_cadence(anchor=4, max_anchor=64)
    assert batches_for(cadence, 4, None, None) == 4  # nothing measured yet
    assert batches_for(cadence, 4, 0.5, 0.5) == 4  # the slowest takes the anchor
    assert batches_for(cadence, 4, 0.1, 0.5) == 20  # five times faster, five times the batches
    assert batches_for(cadence, 4, 0.001, 0.5) == 64  # capped by max_anchor
    assert batches_for(ElCheConfig.cpu_sync(), 4, 0.1, 0.5) == 1


def test_the_anchor_adapts_to_the_averaging_overhead() -> None:
    config = ElCheConfig.cpu_cadence(anchor=4, max_anchor=16, overhead_target=0.1)
    assert adapt_anchor(config, 4, compute=1.0, averaging=0.5) == 8  # averaging too costly: rounds grow
    assert adapt_anchor(config, 16, compute=1.0, averaging=0.5) == 16
    assert adapt_anchor(config, 8, compute=1.0, averaging=0.001) == 4  # cheap: rounds shrink back
    assert adapt_anchor(config, 4, compute=1.0, averaging=0.001) == 4  # never below the configured anchor
    assert adapt_anchor(config, 8, compute=1.0, averaging=0.05) == 8


def test_every_rank_picks_the_same_anchor_from_the_rounds_slots() -> None:
    config = ElCheConfig.cpu_cadence(anchor=4, max_anchor=64, overhead_target=0.1)
    # rank 0: 0.3 s a batch, averaged in 0.01 s; rank 1: 0.1 s a batch, but its averaging
    # call held its 0.9 s wait for rank 0 — that wait is not the averaging's cost.
    slots = [0.3, 0.1, 0.01, 0.9]
    assert world_round(config, 4, slots, 2) == (4, {0: 0.3, 1: 0.1})
    # Averaging that costs more than the target share of the slowest rank's compute grows rounds.
    assert world_round(config, 4, [0.3, 0.1, 0.5, 0.9], 2)[0] == 8
    # A rank that took no step (zero slots) is not timed.
    assert world_round(config, 4, [0.0, 0.1, 0.0, 0.0], 2) == (4, {1: 0.1})


# -- a Trainer on a stand-in plane -----------------------------------------


class World:
    """A stand-in for the CPU plane's Averager: records each call, and answers as a world whose
    other ranks (``others[i]``, rank -> weight, for the i-th call; the last repeats) stepped
    at 0.1 s a batch. A join is answered with round ``at``, parameters 5.0, ``taken`` 40."""

    def __init__(self, others: list[dict[int, float]], at: int = 0) -> None:
        self.others, self.at = others, at
        self.calls: list[tuple[int, float, bool, list[float]]] = []  # numel, weight, join, params
        self.round, self.taken = 0, 0.0

    def average(self, tensors: list[Any], weight: float, join: bool = False) -> float:
        torch = pytest.importorskip("torch")
        listed = self.others[min(len(self.calls), len(self.others) - 1)]
        others = {rank: w for rank, w in listed.items() if w > 0}  # a rank of weight 0 has no slots
        first = tensors[0].detach().reshape(-1).tolist()
        self.calls.append((sum(t.numel() for t in tensors), weight, join, first))
        total = weight + sum(others.values())
        count, timing = tensors[-2], tensors[-1]
        slots = len(timing) // 2
        with torch.no_grad():  # this rank's slots weighed in, the others' beside them
            count.mul_(weight / total).add_(len(others) / total)
            timing.mul_(weight / total)
            for rank in others:
                timing[rank], timing[slots + rank] = 0.1 / total, 0.01 / total
            if join:
                tensors[0].fill_(5.0)
        self.round = self.at + 1 if join else self.round + 1
        self.taken = 40.0 if join else self.taken + total
        return total


class Still:
    """An optimizer that leaves the parameters alone. Not torch.optim's: building one imports
    torch._dynamo, which fails in a test process where ansible has patched sys.intern."""

    def __init__(self, params: Any) -> None:
        self.params = list(params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}


@pytest.fixture
def trainer(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """A Trainer of rank ``rank`` among ``world`` (env names as the agent hands them), on ``plane``."""
    torch = pytest.importorskip("torch")
    from flodl_agent.train.trainer import Trainer

    for name in ("MASTER_PORT", "FLODL_MAX_WORLD_SIZE", "FLODL_MIDRUN", "FLODL_METRICS_FILE"):
        monkeypatch.delenv(name, raising=False)

    def make(plane: World, rank: int, world: int, **env: str) -> Any:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(Trainer, "_plane", lambda self: plane)
        data = [(torch.full((2,), float(i)), torch.zeros(1)) for i in range(12)]
        return Trainer(
            lambda: torch.nn.Linear(2, 1),
            data,
            Still,  # parameters stay as the plane left them
            torch.nn.functional.mse_loss,
            ElCheConfig.cpu_sync(),
            batch_size=2,
        )

    return make


def test_the_timing_slots_are_sized_by_an_elastic_worlds_ceiling(trainer: Callable[..., Any]) -> None:
    frozen, elastic = World([{0: 1.0}]), World([{0: 1.0}])
    trainer(frozen, 1, 2).fit(rounds=1)
    trainer(elastic, 1, 2, FLODL_MAX_WORLD_SIZE="8").fit(rounds=1)
    params = 2 + 1  # Linear(2, 1): its weight and bias
    assert [c[0] for c in frozen.calls] == [params + 1 + 2 * 2]  # and the count slot
    assert [c[0] for c in elastic.calls] == [params + 1 + 2 * 8]


@pytest.mark.parametrize(("stop", "rounds"), [({"rounds": 10}, [7, 8, 9]), ({"batches": 46}, [7, 8])])
def test_a_walk_in_syncs_with_a_join_of_weight_0_and_counts_on_from_the_worlds_round(
    trainer: Callable[..., Any], stop: dict[str, int], rounds: list[int]
) -> None:
    """The world answered the join with its round 6 (taken 40 batches): the walk-in stops on the
    round every other rank stops on. Its first step starts from the world's parameters."""
    plane = World([{0: 1.0, 1: 1.0}, {0: 1.0, 1: 1.0}], at=6)
    walk_in = trainer(plane, 2, 3, FLODL_MAX_WORLD_SIZE="4", FLODL_MIDRUN="1")
    walk_in.fit(**stop)
    numel, weight, join, _ = plane.calls[0]
    assert (numel, weight, join) == (3 + 1 + 2 * 4, 0.0, True)  # as many parameters as any round
    assert [(c[0], c[1], c[2]) for c in plane.calls[1:]] == [(numel, 1.0, False)] * len(rounds)
    assert plane.calls[1][3] == [5.0, 5.0]  # the world's average, not its own start
    assert [r.round for r in walk_in.reports] == rounds  # no report for the sync
    assert walk_in.reports[0].seconds_per_batch.keys() == {0, 1, 2}


def test_an_elastic_world_re_cuts_the_shards_once_a_walk_in_steps(trainer: Callable[..., Any]) -> None:
    plane = World([{0: 1.0}, {0: 1.0, 2: 0.0}, {0: 1.0, 2: 1.0}])  # rank 2 syncs, then steps
    rank = trainer(plane, 1, 2, FLODL_MAX_WORLD_SIZE="4")
    assert rank.shard == [1, 3, 5, 7, 9, 11]
    rank.fit(rounds=2)
    assert rank.shard == [1, 3, 5, 7, 9, 11] and rank.world == 2  # a join of weight 0 took no step
    rank.fit(rounds=1)
    assert rank.shard == [1, 4, 7, 10] and rank.world == 3


def test_only_an_elastic_world_re_cuts_the_shards_after_an_eviction(trainer: Callable[..., Any]) -> None:
    frozen = trainer(World([{0: 1.0}, {}]), 1, 2)  # rank 0 is gone after the first round
    frozen.fit(rounds=2)
    assert frozen.shard == [1, 3, 5, 7, 9, 11] and frozen.world == 2  # as before worlds grew
    elastic = trainer(World([{0: 1.0}, {}]), 1, 2, FLODL_MAX_WORLD_SIZE="2")
    elastic.fit(rounds=2)
    assert elastic.shard == list(range(12)) and elastic.world == 1

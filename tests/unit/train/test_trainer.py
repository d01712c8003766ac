"""The ElChe modes' pure parts: presets, per-round budgets, the adaptive anchor."""

from __future__ import annotations

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

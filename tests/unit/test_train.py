"""The ElChe modes' pure parts: presets, per-round budgets, the adaptive anchor."""

from __future__ import annotations

import pytest

from flodl_agent.train import ElCheConfig, adapt_anchor, batches_for


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

"""bench.gpu_check's mixed world, run as two CPU walk-ins (where CUDA is, one offers GPU 0):
`fdl launch` and two `fdl join --devices cpu:1` processes on loopback, one model trained
through the controller in cpu_cadence, every rank ending with the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import gpu_ranks, gpu_report

pytest.importorskip("torch")


def test_two_walk_ins_train_one_model_through_the_controller_to_the_same_weights(tmp_path: Path) -> None:
    ranks = gpu_ranks.trained(tmp_path, "cpu_cadence", 24, 16, ["cpu:1", "cpu:1"], timeout=90)
    assert [r["rank"] for r in ranks] == [0, 1] and {r["device"] for r in ranks} == {"cpu"}
    figures, problems = gpu_report.world_verdict(ranks, cadence=True)
    assert problems == []
    assert len({r["digest"] for r in ranks}) == 1 and ranks[0]["rounds"] == ranks[1]["rounds"] >= 2
    assert sum(r["batches"] for r in ranks) >= 24 and sum(figures["share"].values()) == pytest.approx(
        1, abs=0.01
    )
    assert (tmp_path / "launch.log").read_text().count("admitted h") == 2  # two hosts, not one with two ranks

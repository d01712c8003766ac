"""What a launch hands its controller: the elastic knob from the cluster file and ``--elastic``."""

from __future__ import annotations

import pytest

from flodl_agent.config import Cluster, ClusterBuilder
from flodl_agent.controller.elastic import Elastic
from flodl_agent.fleet.launcher import LaunchError, LaunchOptions, settings_for


def _cluster(elastic: tuple[int, tuple[str, ...]] | None = None, **join: object) -> Cluster:
    builder = ClusterBuilder().controller("127.0.0.1").join(**join).worker("a", local_devices="cpu:2")
    if elastic is not None:
        builder.elastic(*elastic)
    return builder.build()


def _elastic(cluster: Cluster, flag: int | None = None) -> Elastic | None:
    return settings_for(cluster, LaunchOptions(["true"], port=0, elastic=flag), print).elastic


def test_a_launch_without_either_keeps_the_world_frozen() -> None:
    assert _elastic(_cluster()) is None


def test_the_file_s_block_reaches_the_controller() -> None:
    assert _elastic(_cluster((8, ("cpu", "nccl")))) == Elastic(8, ("cpu", "nccl"))
    assert _elastic(_cluster((3, ("cpu",)))) == Elastic(3, ("cpu",))


def test_the_flag_beats_the_file_s_ceiling_and_keeps_its_planes() -> None:
    assert _elastic(_cluster((8, ("nccl",))), 12) == Elastic(12, ("nccl",))
    assert _elastic(_cluster(), 5) == Elastic(5, ("cpu",))  # no block: cpu grows


def test_a_flag_below_the_world_the_window_forms_is_refused_naming_both() -> None:
    with pytest.raises(LaunchError) as caught:
        _elastic(_cluster(target_ranks=2, min_rank_start=1), 1)
    assert "--elastic 1 is below cluster.controller.join.target_ranks (2)" in str(caught.value)
    assert "--elastic 2 or more" in caught.value.fix
    assert _elastic(_cluster(target_ranks=2), 2) == Elastic(2, ("cpu",))

"""A declared ParallelismSpec gates formation: the controller refuses to form a world that
cannot satisfy it, with the arithmetic, before any rank starts."""

from __future__ import annotations

import pytest

from flodl_agent.controller.controller import Controller
from flodl_agent.placement import PlacementError
from flodl_agent.placement.parallel import check_world, parse_parallelism
from tests.support.control_plane import run, settings, walk_ins


@pytest.mark.parametrize(
    ("sizes", "ok", "reason"),
    [
        ({"pipeline": 2}, True, ""),
        ({"tensor": 2}, False, "tensor-parallel size 2 exceeds a node's 1 GPUs"),
        ({"tensor": 1, "data": 3}, False, "1 x 1 x 3 = 3 GPUs, but the fleet has 2 nodes x 1 GPUs = 2"),
    ],
)
def test_formation_checks_the_world_against_the_request(sizes: dict[str, int], ok: bool, reason: str) -> None:
    async def scenario() -> None:
        ctl = Controller(settings(parallelism=sizes))
        await ctl.start()
        await walk_ins(ctl, ("box-a", 1), ("box-b", 1))
        await ctl.finished.wait()
        assert (ctl.exit_code == 0) is ok, ctl.reason
        if not ok:
            assert ctl.reason.startswith("the formed world cannot satisfy the parallelism request: ")
            assert reason in ctl.reason
            assert ctl.formed == []  # no rank was started
        await ctl.close()

    run(scenario)


def test_the_request_parses_and_uneven_hosts_are_named() -> None:
    assert parse_parallelism("tensor=2, pipeline=4") == {"tensor": 2, "pipeline": 4}
    with pytest.raises(PlacementError, match="`tensr=2` is not a parallel size"):
        parse_parallelism("tensr=2")
    with pytest.raises(PlacementError, match="sizes are whole numbers"):
        parse_parallelism("tensor=0")
    with pytest.raises(PlacementError, match="the hosts carry 1, 2 ranks"):
        check_world({"tensor": 1}, [2, 1])
    assert check_world({"tensor": 2}, [2, 2]).replicas == 2  # data fills the world


def test_fdl_launch_refuses_a_malformed_request_before_opening_anything() -> None:
    from click.testing import CliRunner

    from flodl_agent.cli.main import cli

    result = CliRunner().invoke(cli, ["launch", "--parallelism", "tensor=two", "--", "true"])
    assert result.exit_code == 2 and "--parallelism" in result.output and "whole numbers" in result.output

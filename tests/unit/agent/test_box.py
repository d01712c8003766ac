"""What a box probes before its dial: its own entry point, unless told not to."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flodl_agent.agent.box import own_entry
from flodl_agent.agent.options import AgentOptions
from flodl_agent.agent.prepare import Prepared

BUILT = Prepared(["./train", "--lr", "0.1"], Path("/stage/build/pkg"), "run-1", False)
PUBLISHED_PROBE = Prepared(["./train"], Path("/stage/build"), "run-2", True)


def test_a_box_probes_the_entry_it_runs_of_its_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    command, cwd = own_entry(AgentOptions(bin="train.py", args=["--x"]), None) or ([], None)
    assert command == [sys.executable, "train.py", "--x"] and cwd == tmp_path  # a .py: this python
    assert own_entry(AgentOptions(), BUILT) == (BUILT.command, BUILT.cwd)  # a built source's entry


@pytest.mark.parametrize(
    "options",
    [
        AgentOptions(),  # the launch's command: the launch is the one place it is defined
        AgentOptions(bin="train.py", model_probe=False),  # --no-model-probe, join.model_probe: false
        AgentOptions(bin="train.py", docker="trainer"),  # its ranks run in a compose service
        AgentOptions(bin="train.py", model_sig="ab" * 32),  # already known (a launcher's spec)
    ],
)
def test_no_probe_without_an_entry_of_its_own_or_when_told_not_to(options: AgentOptions) -> None:
    assert own_entry(options, None) is None


def test_a_published_run_that_asks_every_box_to_probe_is_probed_whatever_the_box_says() -> None:
    told_not_to = AgentOptions(model_probe=False)
    assert own_entry(told_not_to, PUBLISHED_PROBE) == (PUBLISHED_PROBE.command, PUBLISHED_PROBE.cwd)
    assert own_entry(told_not_to, BUILT) is None

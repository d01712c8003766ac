"""The data root a probe checks, on real directories: the declared data_path or the convention
root, signed with the agent's own dataset signature."""

from __future__ import annotations

from pathlib import Path

from flodl_agent.config.models import Join
from flodl_agent.probing.data_root import data_facts
from flodl_agent.probing.probe import gather
from flodl_agent.train.signature import dataset_signature


def test_with_no_data_path_the_convention_root_is_checked_and_its_absence_is_fine(tmp_path: Path) -> None:
    convention = tmp_path / "flodl-data"
    facts = data_facts(None, convention)
    assert (facts["path"], facts["declared"], facts["exists"]) == (str(convention), False, False)
    convention.mkdir()
    (convention / "train.bin").write_bytes(b"x" * 10)
    there = data_facts(None, convention)
    assert (there["declared"], there["entries"]) == (False, 1)
    assert there["signature"] == dataset_signature(convention)  # what a declared root's hello would carry


def test_roots_a_listing_calls_the_same_sign_differently(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for root, content in ((a, b"0123"), (b, b"3210")):  # same names, same sizes, other bytes
        root.mkdir()
        (root / "shard-0").write_bytes(content)
    fa, fb = data_facts(str(a)), data_facts(str(b))
    assert (fa["entries"], fa["declared"]) == (fb["entries"], fb["declared"]) == (1, True)
    assert fa["signature"] == dataset_signature(a) != fb["signature"]


def test_gather_checks_the_declared_root_or_else_the_convention_root(tmp_path: Path) -> None:
    convention = tmp_path / "convention"
    assert gather(Join(), None, dial=False, convention=convention).data["path"] == str(convention)
    assert gather(None, None, dial=False, convention=convention).data["declared"] is False  # the box alone
    declared = gather(Join(data_path=str(tmp_path)), None, dial=False, convention=convention).data
    assert (declared["path"], declared["declared"], declared["exists"]) == (str(tmp_path), True, True)

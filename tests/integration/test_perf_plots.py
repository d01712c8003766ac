"""docs/performance.md's plots are what bench/plots.py draws from bench/results/: a changed
result without new plots (or a hand-edited plot) fails here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
from bench import plots

DOC = Path(plots.ROOT / "docs" / "performance.md").read_text()


def test_the_committed_plots_are_the_scripts_output_of_the_committed_results() -> None:
    assert plots.main(["--check"]) == 0


def test_a_changed_result_makes_its_plot_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "results"
    shutil.copytree(plots.RESULTS, results)
    storm = json.loads((results / "join_storm.json").read_text())
    storm["results"][-1]["formation_ms"] *= 2
    (results / "join_storm.json").write_text(json.dumps(storm))
    monkeypatch.setattr(plots, "RESULTS", results)
    assert plots.main(["--check"]) == 1
    assert "out of date with bench/results/: formation.svg;" in capsys.readouterr().err


def test_the_page_shows_every_plot() -> None:
    for name in plots.PLOTS:
        assert f"](img/{name})" in DOC


def test_a_broken_result_is_named_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "results"
    shutil.copytree(plots.RESULTS, results)
    (results / "fleet_converge.json").write_text('{"results": [{"hosts": 3}]}')
    monkeypatch.setattr(plots, "RESULTS", results)
    assert plots.main(["--check"]) == 1
    assert "converge.svg: cannot draw it from" in capsys.readouterr().err

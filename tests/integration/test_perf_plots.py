"""docs/performance.md's plots are what bench/plots.py draws from bench/results/: a changed
result without new plots (or a hand-edited plot) fails here."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def _broken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, edit: Callable[[dict[str, Any]], None]
) -> Path:
    """A copy of the results with ``name``'s JSON edited, where the script reads them."""
    results = tmp_path / "results"
    shutil.copytree(plots.RESULTS, results)
    data = json.loads((results / name).read_text())
    edit(data)
    (results / name).write_text(json.dumps(data))
    monkeypatch.setattr(plots, "RESULTS", results)
    return results / name


def test_a_series_with_no_point_is_named_not_drawn_as_its_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No row has the column: an empty zip would leave matplotlib the format string alone as
    the line's data, a legend entry with no line (and only "out of date" said)."""

    def untimed(data: dict[str, Any]) -> None:
        for row in data["results"]:
            row.pop("fanout_floor_ms", None)

    source = _broken(tmp_path, monkeypatch, "join_storm.json", untimed)
    assert plots.main(["--check"]) == 1
    assert capsys.readouterr().err == (
        f"formation.svg: cannot draw it from {source}: ValueError('no point for fanout_floor_ms'); "
        "rerun `python -m bench.join_storm`\n"
    )


def test_a_zero_time_is_named_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def zero(data: dict[str, Any]) -> None:
        data["rows"][0]["hub_s"] = 0

    source = _broken(tmp_path, monkeypatch, "averaging.json", zero)
    assert plots.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"averaging.svg: cannot draw it from {source}: ZeroDivisionError(")
    assert err.endswith("; rerun `python -m bench.averaging`\n") and err.count("\n") == 1

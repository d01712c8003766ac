"""docs/performance.md's plots, drawn from the benches' JSON in bench/results/.

    python -m bench.plots            # (re)write docs/img/*.svg from bench/results/*.json
    python -m bench.plots --check    # exit 1 naming each SVG that differs from what it would write

Each bench's last line of JSON is what it keeps in bench/results/ (bench/README.md). The SVGs
are byte for byte reproducible (fixed hash salt, no date), so the committed ones can be
checked against the data they claim to show.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("svg")
import matplotlib.pyplot as plt  # after the backend is chosen
from matplotlib.axes import Axes
from matplotlib.typing import LegendLocType, RcKeyType

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "docs" / "img"
STYLE: dict[RcKeyType, Any] = {
    "svg.hashsalt": "flodl",  # the ids matplotlib writes, fixed
    "svg.fonttype": "path",  # glyphs as paths: no font needed where the page is read
    "font.size": 9,
    "axes.grid": True,
    "grid.alpha": 0.35,
    "axes.spines.top": False,
    "axes.spines.right": False,
}


def _load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _series(points: list[tuple[Any, Any]], what: str) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """A line's x and y. No point at all is a result that lost a column: as an empty zip,
    matplotlib would take the line's format for its data and draw nothing under the label."""
    if not points:
        raise ValueError(f"no point for {what}")
    xs, ys = zip(*points, strict=True)
    return xs, ys


def _when(data: dict[str, Any]) -> str:
    measured = data.get("measured") or {}
    return str(measured.get("date", "date not recorded"))


def _words(ax: Axes, data: dict[str, Any], title: str, x: str, y: str, legend: LegendLocType) -> None:
    """The axes' labels, the title with the run's date, and the legend where the lines are not."""
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(f"{title} ({_when(data)})")
    ax.legend(fontsize=7, loc=legend)


def averaging(ax: Axes, data: dict[str, Any]) -> None:
    loop = [r for r in data["rows"] if r["net"] == "loopback"]
    for ranks, colour in ((2, "tab:blue"), (4, "tab:orange")):
        rows = sorted((r for r in loop if r["ranks"] == ranks), key=lambda r: r["model_mb"])
        local = _series(
            [(r["model_mb"], r["gloo_s"] / r["hub_s"]) for r in rows], f"hub_s, loopback, {ranks} ranks"
        )
        ax.plot(*local, "o-", color=colour, label=f"{ranks} ranks, local socket")
        tcp = [(r["model_mb"], r["gloo_s"] / r["hub_tcp_s"]) for r in rows if r.get("hub_tcp_s")]
        ax.plot(*_series(tcp, f"hub_tcp_s, loopback, {ranks} ranks"), "o--", color=colour,
                label=f"{ranks} ranks, TCP loopback")  # fmt: skip
    for r in (r for r in data["rows"] if r["net"] == "shaped"):
        colour = "tab:blue" if r["ranks"] == 2 else "tab:orange"
        ax.plot(r["model_mb"], r["gloo_s"] / r["hub_s"], "s", color=colour, mfc="none")
        ax.plot(r["model_mb"], r["gloo_s"] / r["hub_bf16_s"], "^", color=colour)
    ax.plot([], [], "s", color="grey", mfc="none", label="shaped links, fp32")
    ax.plot([], [], "^", color="grey", label="shaped links, bf16 on the wire")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 64, 512], ["1 MB", "64 MB", "512 MB"])
    _words(ax, data, "The CPU plane against gloo, same run", "parameters averaged a round",
           "speed against gloo all_reduce (1 = parity)", "upper right")  # fmt: skip


def formation(ax: Axes, data: dict[str, Any]) -> None:
    rows = sorted(data["results"], key=lambda r: r["n"])
    sizes = [r["n"] for r in rows]
    series = (
        ("formation_ms", "formed after the last hello", "o-"),
        ("baseline_poll_formation_ms", "the same, a 20 ms polling window", "x:"),
        ("fanout_ms", "of it, the fan-out", "o--"),
        ("fanout_floor_ms", "one send a host alone (the floor)", "s-."),
        ("status_p99_ms", "/state.json p99 during the storm", "d-"),
    )
    for key, label, fmt in series:
        points = [(r["n"], r[key]) for r in rows if r.get(key)]
        ax.plot(*_series(points, key), fmt, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(sizes, [f"{n:,}" for n in sizes])
    _words(ax, data, "Formation against fleet size", "walk-ins in one storm", "milliseconds", "lower right")


def converge(ax: Axes, data: dict[str, Any]) -> None:
    rows = sorted(data["results"], key=lambda r: r["hosts"])
    hosts = [r["hosts"] for r in rows]
    ax.plot(hosts, [r["fresh_s"] for r in rows], "o-", label="site.yml from bare containers")
    ax.plot(hosts, [r["baseline_no_change_s"] for r in rows], "x:", label="no change, Ansible's defaults")
    ax.plot(hosts, [r["no_change_s"] for r in rows], "o--", label="no change, the project's settings")
    ax.set_xticks(hosts)
    ax.set_ylim(bottom=0)
    _words(ax, data, "site.yml converge against hosts", "hosts in the lab fleet", "seconds", "upper left")


# What a missing or hand-broken result raises (a zero time: ZeroDivisionError), named in one line.
BROKEN = (OSError, ValueError, KeyError, TypeError, ZeroDivisionError)
Draw = Callable[[Axes, dict[str, Any]], None]
# Each plot, the bench whose result it draws (bench/results/<bench>.json), and how.
PLOTS: dict[str, tuple[str, Draw]] = {
    "averaging.svg": ("averaging", averaging),
    "formation.svg": ("join_storm", formation),
    "converge.svg": ("fleet_converge", converge),
}


def render(draw: Draw, data: dict[str, Any]) -> bytes:
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        try:
            draw(ax, data)
            fig.tight_layout()
            out = io.BytesIO()
            fig.savefig(out, format="svg", metadata={"Date": None})
        finally:
            plt.close(fig)  # a broken result's half-drawn figure too
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.plots", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with docs/img/ instead of writing")
    parser.add_argument("--out", type=Path, default=OUT, help="where the SVGs go (default: docs/img)")
    args = parser.parse_args(argv)
    stale = []
    for name, (bench, draw) in PLOTS.items():
        source, path = RESULTS / f"{bench}.json", args.out / name
        try:
            svg = render(draw, _load(source))
        except BROKEN as exc:
            print(
                f"{name}: cannot draw it from {source}: {exc!r}; rerun `python -m bench.{bench}`",
                file=sys.stderr,
            )
            return 1
        if args.check:
            if not path.is_file() or path.read_bytes() != svg:
                stale.append(name)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(svg)
        print(f"wrote {path}")
    if stale:
        names = ", ".join(stale)
        print(f"out of date with bench/results/: {names}; run `python -m bench.plots`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

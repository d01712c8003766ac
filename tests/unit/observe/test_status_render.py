"""`fdl status` renders a controller's state: peers' words escaped, odd shapes shown as `-`."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from flodl_agent.observe.status import one_line, render

EVIL = "ev\u202eil\x9b2J"  # a bidi override, then a C1 CSI: "erase the screen"


def shown(state: dict[str, Any]) -> str:
    sink = io.StringIO()
    console = Console(file=sink, width=200, color_system=None, force_terminal=False)
    for part in render(state):
        console.print(part)
    return sink.getvalue()


def test_peer_text_is_escaped_in_every_place_it_shows() -> None:
    state = {
        "phase": "failed",
        "failure": f"fan-out to box failed (ssh exit 255: {EVIL})",
        "hosts": [
            {
                "host": EVIL,
                "ranks": [0, 1],
                "device_labels": [f"[red]{EVIL}[/red]"],
                "variant": EVIL,
                "joined_at": 1.0,
            }
        ],
        "now": 3.0,
    }
    text = shown(state)
    assert "\u202e" not in text and "\x9b" not in text
    assert text.count("ev\\u202eil\\x9b2J") == 4  # failure, host, label, variant
    assert "[red]" in text  # a label is text, not markup
    assert all(line.isprintable() for line in one_line(state).splitlines())
    assert "ev\\u202eil" in one_line(state)


def test_a_state_of_the_wrong_shape_renders_without_a_crash() -> None:
    for state in [
        {"hosts": "x", "window_left_s": "soon", "cap_left_s": float("inf")},
        {"hosts": [5, {"ranks": 5, "device_labels": [[1]], "joined_at": "x"}], "now": float("nan")},
        {"phase": ["x"], "quorum": {"a": 1}},
    ]:
        assert shown(state)
        assert one_line(state)

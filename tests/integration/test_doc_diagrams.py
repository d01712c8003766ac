"""The docs' Mermaid diagrams parse with Mermaid's own parser (tests/support/mermaid, run in
Node), and the window's state diagram draws the states the window has: the same ones the
status page's phase line marks, in the same order."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from typing import get_args

import pytest

from flodl_agent.controller.window import Phase
from tests.support.doc_blocks import ROOT, Block, all_blocks

MERMAID = ROOT / "tests" / "support" / "mermaid"
PAGE = ROOT / "flodl_agent" / "observe" / "static" / "status.html"
pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js (the machine's own)")


def parse(diagrams: list[tuple[str, str]]) -> dict[str, dict[str, str]]:
    """Each diagram's verdict by where it is: {"type": ...} or {"error": ...}."""
    if not (MERMAID / "node_modules" / "mermaid").is_dir():
        pytest.fail(
            f"Mermaid is not installed in {MERMAID.relative_to(ROOT)}: run `make setup` (npm ci there)"
        )
    given = json.dumps([{"where": where, "text": text} for where, text in diagrams])
    done = subprocess.run(
        ["node", "parse.mjs"],
        cwd=MERMAID,
        input=given,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return {r["where"]: {k: v for k, v in r.items() if k != "where"} for r in json.loads(done.stdout)}


def diagrams() -> list[Block]:
    return [b for b in all_blocks() if b.lang == "mermaid"]


def test_every_diagram_in_the_docs_parses() -> None:
    found = diagrams()
    verdicts = parse([(b.where, b.text) for b in found])
    assert {where: v["error"] for where, v in verdicts.items() if "error" in v} == {}
    kinds = {(b.page, verdicts[b.where]["type"]) for b in found}
    # The run's sequence and the window's states, where the docs promise them.
    assert ("docs/control-plane.md", "sequence") in kinds
    assert ("docs/cluster-guide.md", "stateDiagram") in kinds


def test_the_parser_refuses_a_broken_diagram() -> None:
    # Without this the test above could pass on a checker that accepts anything.
    verdicts = parse(
        [("broken", "sequenceDiagram\n    A->>\n"), ("fine", "sequenceDiagram\n    A->>B: hi\n")]
    )
    assert "Parse error" in verdicts["broken"]["error"]
    assert verdicts["fine"] == {"type": "sequence"}


class _Steps(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.phases: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        phase = dict(attrs).get("data-phase")
        if tag == "li" and phase:
            self.phases.append(phase)


def test_the_state_diagram_and_the_phase_line_name_the_windows_states() -> None:
    (states,) = [b.text for b in diagrams() if b.page == "docs/cluster-guide.md" and "stateDiagram" in b.text]
    drawn = set(re.findall(r"^\s*(\w+|\[\*\])\s*-->\s*(\w+|\[\*\])", states, re.M))
    named = {s for edge in drawn for s in edge} - {"[*]"}
    assert named == set(get_args(Phase))
    assert ("[*]", "waiting") in drawn  # the window opens waiting
    assert {a for a, b in drawn if b == "[*]"} == {"done", "failed"}  # and ends in one of two verdicts
    page = _Steps()
    page.feed(PAGE.read_text())
    assert page.phases == list(get_args(Phase))  # the page's line, in the diagram's order

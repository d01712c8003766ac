"""How the docs test reads a page's blocks (tests/support/doc_blocks.py)."""

from __future__ import annotations

import re

import pytest

from tests.support import doc_blocks
from tests.support.doc_blocks import DocBlockError, Exchange


def test_markers_say_what_each_block_is_and_other_languages_are_prose() -> None:
    page = "\n".join(
        [
            "```sh",
            "fdl --version",
            "```",
            "<!-- doc-test: skip: needs the lab fleet (tests/lab) -->",
            "```sh",
            "make demo",
            "```",
            "<!--doc-test: terminals; ready: fdl status-->",
            "```sh",
            "fdl join a   # one",
            "",
            "# a comment is no terminal",
            "fdl join b",
            "```",
            "```yaml",
            "a: 1",
            "```",
            "- item:",
            "  ```console",
            "  $ echo hi",
            "  hi",
            "  ```",
        ]
    )
    run, skip, terminals, prose, console = doc_blocks.blocks_of(page, "p.md")
    assert (run.action, run.line, run.text) == ("run", 1, "fdl --version\n")
    assert (skip.action, skip.arg) == ("skip", "needs the lab fleet (tests/lab)")
    assert (terminals.action, terminals.arg) == ("terminals", "fdl status")
    assert terminals.terminals() == ["fdl join a   # one", "fdl join b"]
    assert run.terminals() == ["fdl --version\n"]
    assert prose.action == "prose"
    assert doc_blocks.exchanges(console) == [Exchange("echo hi", "hi\n")]  # indent left off


def test_a_console_block_is_commands_with_what_each_prints() -> None:
    text = "$ a \\\n    --flag\nout 1  \n\n$ b\n\n$ c\nline\n\n"
    block = doc_blocks.Block("p.md", 3, "console", text, "console")
    assert doc_blocks.exchanges(block) == [
        Exchange("a \\\n    --flag", "out 1\n"),  # a continued command, trailing blanks off
        Exchange("b", ""),
        Exchange("c", "line\n"),
    ]


@pytest.mark.parametrize(
    ("marker", "said"),
    [
        ("<!-- doc-test: skip -->", "p.md:2: doc-test marker 'skip' is not one of"),
        ("<!-- doc-test: background -->", "'background; ready: CMD'"),
        ("<!-- doc-test: run me -->", "'skip: REASON', 'file NAME'"),
    ],
)
def test_a_marker_the_test_cannot_read_names_its_line(marker: str, said: str) -> None:
    with pytest.raises(DocBlockError, match=re.escape(said)):
        doc_blocks.blocks_of(f"{marker}\n```sh\ntrue\n```\n", "p.md")
    with pytest.raises(DocBlockError, match=re.escape("p.md:1: a console block starts with")):
        doc_blocks.exchanges(doc_blocks.Block("p.md", 1, "console", "hi\n$ x\n", "console"))


def test_every_page_of_the_checkout_reads() -> None:
    blocks = doc_blocks.all_blocks()
    assert {b.page for b in blocks} >= {"README.md", "docs/quickstart.md"}

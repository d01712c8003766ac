"""Every glossary term is linked at its first use on each page, and every link between the
pages lands on a heading that exists (scripts/doc_links.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from tests.support.doc_blocks import ROOT


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("doc_links", ROOT / "scripts" / "doc_links.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


doc_links = _script()


def test_the_docs_link_every_terms_first_use_and_every_link_lands() -> None:
    assert [str(f) for f in doc_links.check()] == []


def test_the_glossary_names_the_seeds_vocabulary() -> None:
    names = {t.name for t in doc_links.terms()}
    # The words the docs issue found a newcomer meeting unexplained, and the seeds' own.
    seed = {"walk-in", "door", "fan-out", "plane", "ElChe", "staging", "provisional ranks", "salt"}
    seed |= {"envelope", "join window", "hello", "admission", "relay", "rank", "controller", "agent"}
    assert seed <= names


GLOSSARY = """# Glossary

### walk-in

A box that dials in.

### CPU plane

Averaging through the controller.

### plane

How ranks exchange.
"""


def _pages(root: Path, page: str) -> Path:
    (root / "docs").mkdir()
    (root / "docs" / "glossary.md").write_text(GLOSSARY)
    (root / "README.md").write_text("# Readme\n\nNothing here.\n")
    (root / "docs" / "a.md").write_text(page)
    return root / "docs" / "a.md"


def test_a_first_use_outside_prose_does_not_count_and_fix_links_the_first_in_prose(tmp_path: Path) -> None:
    page = _pages(
        tmp_path,
        "# A walk-in heading\n\n"
        "<!-- a walk-in in a comment -->\n"
        "```sh\nfdl join  # a walk-in in code\n```\n\n"
        "Run `walk-in` here; [the walk-in page](other.md) is elsewhere.\n"
        "Walk-ins come in over the CPU\nplane, and any plane will do.\n",
    )
    found = [str(f) for f in doc_links.check(tmp_path)]
    assert found == [
        "docs/a.md:8: link to other.md: no such file",
        "docs/a.md:9: first use of 'CPU plane' is not linked to the glossary",
        "docs/a.md:9: first use of 'walk-in' is not linked to the glossary",
        "docs/a.md:10: first use of 'plane' is not linked to the glossary",  # not the one in "CPU plane"
    ]
    assert doc_links.fix(tmp_path) == 3
    assert page.read_text().endswith(
        "[Walk-ins](glossary.md#walk-in) come in over the [CPU\nplane](glossary.md#cpu-plane), "
        "and any [plane](glossary.md#plane) will do.\n"
    )
    assert [str(f) for f in doc_links.check(tmp_path)] == ["docs/a.md:8: link to other.md: no such file"]


def test_a_link_to_a_heading_that_is_not_there_is_named(tmp_path: Path) -> None:
    _pages(tmp_path, "# A\n\n## Two words\n\nSee [it](#two-words), [that](glossary.md#walk-out).\n")
    assert [str(f) for f in doc_links.check(tmp_path)] == [
        "docs/a.md:5: link to glossary.md#walk-out: no heading #walk-out there"
    ]


def test_an_external_links_text_is_not_prose_and_fix_leaves_it_alone(tmp_path: Path) -> None:
    """The bare-URL rule would take the link's ")" with its URL: the link would go unmatched,
    its text would count as prose, and --fix would nest a glossary link inside it."""
    links = (
        "See [the walk-in guide](https://example.com/guide) and\n"
        '[a plane\'s notes](https://example.com/notes "Notes"), or <https://example.com/>.\n'
    )
    page = _pages(tmp_path, "# A\n\n" + links)
    assert [str(f) for f in doc_links.check(tmp_path)] == []
    assert doc_links.fix(tmp_path) == 0 and page.read_text() == "# A\n\n" + links
    # A use in the prose after it is the first use, and the one --fix links.
    page.write_text("# A\n\n" + links + "A walk-in dials in.\n")
    assert [str(f) for f in doc_links.check(tmp_path)] == [
        "docs/a.md:5: first use of 'walk-in' is not linked to the glossary"
    ]
    assert doc_links.fix(tmp_path) == 1
    assert page.read_text() == "# A\n\n" + links + "A [walk-in](glossary.md#walk-in) dials in.\n"


def test_a_broken_links_line_is_its_own_with_code_around_or_inside_it(tmp_path: Path) -> None:
    """The same link shown as code earlier on the page, a link whose text is code, a link with
    a title: each finding names the line the link is on."""
    _pages(
        tmp_path,
        "# A\n\n"
        "```md\nSee [it](gone.md).\n```\n\n"  # lines 3-5: in a fence, not checked
        "Write `[it](gone.md)` for a link.\n"  # 7: in a code span, not checked
        "See [it](gone.md) here,\n"  # 8
        'and [`fdl join`](joined.md), [that](titled.md "Title").\n'  # 9
        "\nThe end.\n",
    )
    assert [str(f) for f in doc_links.check(tmp_path)] == [
        "docs/a.md:8: link to gone.md: no such file",
        "docs/a.md:9: link to joined.md: no such file",
        "docs/a.md:9: link to titled.md: no such file",
    ]

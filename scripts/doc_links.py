"""The docs' links: every glossary term linked at its first use on a page, every link between
pages pointing at a heading that exists.

    python scripts/doc_links.py --check   # list what is missing or broken; exit 1 if anything is
    python scripts/doc_links.py --fix     # link each term's first unlinked use to docs/glossary.md

A term is a ``### heading`` of docs/glossary.md; its first use is its first appearance in a
page's prose (not in code, a heading, a comment or another link), matched with either case of
its first letter and an optional plural ending. The pages are README.md and docs/*.md.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = ROOT / "docs" / "glossary.md"
_HIDDEN = "\0"
_FENCE = re.compile(r"^ *```.*?^ *```[^\n]*$", re.M | re.S)
_HEADING = re.compile(r"^#{1,6} .*$", re.M)
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_CODE = re.compile(r"``[^\n]*?``|`[^`]*`")  # code spans, double-backticked ones first
_URL = re.compile(r"<https?://[^>]*>|https?://\S+")
# A link, with an optional title: [text](url "title").
_LINK = re.compile(r"""(!?)\[(?P<text>[^\]]*)\]\((?P<url>[^)\s]*)(?:\s+(?:"[^"]*"|'[^']*'))?\)""")


@dataclass(frozen=True)
class Term:
    name: str
    anchor: str

    def pattern(self) -> re.Pattern[str]:
        first, rest = self.name[0], r"\s+".join(map(re.escape, self.name[1:].split(" ")))  # a term may wrap
        # Not inside a word or a name (walk-in/-out), and not a command's name ("fdl launch").
        return re.compile(rf"(?<![\w-])(?<!fdl )[{first.lower()}{first.upper()}]{rest}(?:e?s)?(?![\w-])")


@dataclass(frozen=True)
class Finding:
    page: str
    line: int
    say: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.say}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def headings(text: str) -> set[str]:
    masked = _mask(text, _FENCE)
    return {slug(m[1]) for m in re.finditer(r"^#{1,6} (.*)$", masked, re.M)}


def terms(glossary: Path = GLOSSARY) -> list[Term]:
    found = [Term(m[1].strip(), slug(m[1])) for m in re.finditer(r"^### (.+)$", glossary.read_text(), re.M)]
    return sorted(found, key=lambda t: -len(t.name))  # longest first: "CPU plane" before "plane"


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _to_glossary(page: Path, root: Path) -> str:
    return "glossary.md" if page.parent == root / "docs" else "docs/glossary.md"


def _hide(chars: list[str], start: int, end: int) -> None:
    chars[start:end] = [c if c == "\n" else _HIDDEN for c in chars[start:end]]


def _mask(text: str, *rules: re.Pattern[str]) -> str:
    """``text`` with what each rule matches hidden, in turn. Same length, newlines kept: an
    offset into it is an offset into ``text``, its line the same."""
    chars = list(text)
    for rule in rules:
        for m in rule.finditer("".join(chars)):
            _hide(chars, *m.span())
    return "".join(chars)


def _prose(text: str) -> tuple[str, list[tuple[int, int, str]]]:
    """The page with everything but prose hidden (same length), and its glossary links' spans."""
    masked = _mask(text, _FENCE, _HEADING, _COMMENT, _CODE)
    chars = list(masked)
    glossary: list[tuple[int, int, str]] = []
    for m in _LINK.finditer(masked):
        url = m["url"]
        if not m[1] and url.split("#")[0].endswith("glossary.md") and "#" in url:
            glossary.append((m.start("text"), m.end("text"), url.split("#", 1)[1]))
            _hide(chars, m.end("text"), m.end())
        else:
            _hide(chars, *m.span())
    # Bare URLs only after the links: the URL rule would take a link's ")" with its URL, and
    # the link, unmatched, would leave its text as prose.
    return _mask("".join(chars), _URL), glossary


def first_uses(text: str, vocabulary: list[Term]) -> dict[Term, tuple[int, int, bool]]:
    """Each term's first use on a page: (start, end, linked)."""
    prose, links = _prose(text)
    found: dict[Term, tuple[int, int, bool]] = {}
    for term in vocabulary:
        # "plane" inside "CPU plane" is a use of the longer term, linked or not
        name = term.name.lower()
        longer = [u for u in vocabulary if len(u.name) > len(name) and name in u.name.lower()]
        covered = [m.span() for u in longer for m in u.pattern().finditer(prose)]
        for m in term.pattern().finditer(prose):
            if any(start <= m.start() and m.end() <= end for start, end in covered):
                continue
            inside = [anchor for start, end, anchor in links if start <= m.start() and m.end() <= end]
            if inside and inside[0] != term.anchor:
                continue  # inside another term's link
            found[term] = (m.start(), m.end(), bool(inside))
            break
    return found


def broken_links(page: Path, root: Path) -> list[Finding]:
    prose = _mask(page.read_text(), _FENCE, _CODE)  # same length: a link's line is its own
    out = []
    for m in _LINK.finditer(prose):
        target, _, anchor = m["url"].partition("#")
        if re.match(r"[a-z]+:", target):
            continue
        path = (page.parent / target).resolve() if target else page
        line = prose.count("\n", 0, m.start()) + 1
        if not path.exists():
            out.append(Finding(page.name, line, f"link to {m['url']}: no such file"))
        elif anchor and path.suffix == ".md" and anchor not in headings(path.read_text()):
            out.append(Finding(page.name, line, f"link to {m['url']}: no heading #{anchor} there"))
    return out


def check(root: Path = ROOT) -> list[Finding]:
    vocabulary = terms(root / "docs" / "glossary.md")
    findings: list[Finding] = []
    for page in pages(root):
        name = str(page.relative_to(root))
        findings += [Finding(name, f.line, f.say) for f in broken_links(page, root)]
        if page.name == "glossary.md":
            continue
        text = page.read_text()
        for term, (start, _, linked) in first_uses(text, vocabulary).items():
            if not linked:
                line = text.count("\n", 0, start) + 1
                say = f"first use of {term.name!r} is not linked to the glossary"
                findings.append(Finding(name, line, say))
    return sorted(findings, key=lambda f: (f.page, f.line))


def fix(root: Path = ROOT) -> int:
    """Link each term's first unlinked use; returns how many links were added."""
    added = 0
    for page in pages(root):
        if page.name == "glossary.md":
            continue
        vocabulary = terms(root / "docs" / "glossary.md")
        while True:  # one link at a time: each one moves the text after it
            text = page.read_text()
            todo = [(s, e, t) for t, (s, e, linked) in first_uses(text, vocabulary).items() if not linked]
            if not todo:
                break
            start, end, term = min(todo, key=lambda x: x[0])
            link = f"[{text[start:end]}]({_to_glossary(page, root)}#{term.anchor})"
            page.write_text(text[:start] + link + text[end:])
            added += 1
    return added


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/doc_links.py", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="list unlinked terms and broken links")
    mode.add_argument("--fix", action="store_true", help="link every term's first use to the glossary")
    args = parser.parse_args(argv)
    if args.fix:
        print(f"added {fix()} glossary links")
    findings = check()
    for finding in findings:
        print(finding, file=sys.stderr)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())

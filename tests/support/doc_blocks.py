"""The shell blocks of README.md and docs/*.md, read as the docs test runs them.

A fenced ``sh`` block is a script; a ``console`` block is ``$ command`` lines, each followed
by what it prints. An HTML comment on the line above a fence says how the test treats it:

    <!-- doc-test: skip: REASON -->        not run here: REASON says why and where it runs
    <!-- doc-test: file NAME -->           (any language) written to NAME before what follows
    <!-- doc-test: background; ready: CMD -->   started and left running to the page's end;
                                           the next block waits until CMD exits 0
    <!-- doc-test: terminals; ready: CMD -->    the same, each line in a terminal of its own

Unmarked ``sh`` and ``console`` blocks run; other languages are prose. ``python -m
tests.support.doc_blocks`` lists every block and what the test does with it.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHELL = ("sh", "bash", "shell")
_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*$")
_MARK = re.compile(r"^<!--\s*doc-test:\s*(?P<say>.*?)\s*-->$")


class DocBlockError(ValueError):
    """A marker the test cannot read: the page and line say where."""


@dataclass(frozen=True)
class Block:
    page: str  # relative to the checkout: README.md, docs/quickstart.md
    line: int  # the fence's line, 1-based
    lang: str
    text: str
    action: str  # run | console | skip | file | background | terminals | prose
    arg: str = ""  # the skip's reason, the file's name, the readiness command

    def terminals(self) -> list[str]:
        """What runs in each terminal: the whole block, or each command line of it."""
        if self.action != "terminals":
            return [self.text]
        return [line for line in self.text.splitlines() if line.strip() and not line.lstrip().startswith("#")]

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass(frozen=True)
class Exchange:
    """One ``$ command`` of a console block and what it prints."""

    command: str
    expected: str


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _action(mark: str, lang: str, where: str) -> tuple[str, str]:
    if not mark:
        if lang in SHELL:
            return "run", ""
        return ("console", "") if lang == "console" else ("prose", "")
    head, _, rest = mark.partition(" ")
    if head == "skip:" and rest.strip():
        return "skip", rest.strip()
    if head == "file" and rest.strip():
        return "file", rest.strip()
    if head in ("background;", "terminals;") and rest.startswith("ready: ") and rest[7:].strip():
        return head[:-1], rest[7:].strip()
    raise DocBlockError(
        f"{where}: doc-test marker {mark!r} is not one of "
        "'skip: REASON', 'file NAME', 'background; ready: CMD', 'terminals; ready: CMD'"
    )


def blocks_of(text: str, page: str) -> list[Block]:
    """Every fenced block of one page, in order, with what its marker says."""
    lines = text.splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        start, lang, indent = i, fence["lang"], fence["indent"]
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        body = "\n".join(line.removeprefix(indent) for line in lines[start + 1 : i])
        above = _MARK.match(lines[start - 1].strip()) if start else None
        where = f"{page}:{start + 1}"
        action, arg = _action(above["say"] if above else "", lang, where)
        found.append(Block(page, start + 1, lang, body + "\n", action, arg))
        i += 1
    return found


def all_blocks(root: Path = ROOT) -> list[Block]:
    return [b for p in pages(root) for b in blocks_of(p.read_text(), str(p.relative_to(root)))]


def exchanges(block: Block) -> list[Exchange]:
    """A console block's ``$ command`` lines (a trailing backslash continues one) and the
    lines each prints, blank lines at the end left off."""
    found: list[Exchange] = []
    command: list[str] = []
    printed: list[str] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            if command:
                found.append(Exchange("\n".join(command), _tidy(printed)))
            command, printed = [line.removeprefix("$ ")], []
        elif command and command[-1].endswith("\\") and not printed:
            command.append(line)
        elif not command:
            raise DocBlockError(f"{block.where}: a console block starts with '$ COMMAND'")
        else:
            printed.append(line)
    if command:
        found.append(Exchange("\n".join(command), _tidy(printed)))
    return found


def _tidy(lines: list[str]) -> str:
    text = "\n".join(line.rstrip() for line in lines).strip("\n")
    return text + "\n" if text else ""


def main() -> int:
    for block in all_blocks():
        if block.action != "prose":
            print(f"{block.where:32} {block.action:10} {block.arg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Problems found in a configuration: where, what, and how to fix it.

Every validation failure in the project ends up as a :class:`Problem` so that
the CLI, the Ansible role and the tests all see the same wording: the dotted
field path (``cluster.workers[1].nccl_socket_ifname``), the file and line when
the value came from YAML, a message, and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from pydantic_core import PydanticCustomError

from ..names import printable, shown

Loc = tuple[str | int, ...]
Severity = Literal["error", "warning"]


def format_path(loc: Loc) -> str:
    """``("cluster", "workers", 1, "host")`` -> ``cluster.workers[1].host``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            # A key is the file's text: escaped, a huge one cut, an empty one quoted (`env.""`).
            key = shown(part) if part else '""'
            out += f".{key}" if out else key
    return out or "<document>"


Rule = tuple[Loc, str, str]  # (path relative to the failing value, message, fix)


def fail(*rules: Rule) -> PydanticCustomError:
    """The one error type the schema raises; :mod:`.validate` expands its rules."""
    return PydanticCustomError(
        "flodl", "{message}", {"message": rules[0][1], "hint": rules[0][2], "rules": list(rules)}
    )


@dataclass(frozen=True)
class Problem:
    loc: Loc
    message: str
    hint: str | None = None
    severity: Severity = "error"
    file: str | None = None
    line: int | None = None

    @property
    def path(self) -> str:
        return format_path(self.loc)

    def located(self, file: str | None, line: int | None) -> Problem:
        return replace(self, file=file, line=line)

    def render(self) -> str:
        where = ""
        if self.file is not None:
            where = f"{self.file}:{self.line}: " if self.line is not None else f"{self.file}: "
        subject = f"{self.path}: " if self.loc else ""
        # Messages quote the file's text: nothing in it may act on the terminal.
        text = printable(f"{where}{self.severity}: {subject}{self.message}")
        if self.hint:
            text += f"\n    fix: {printable(self.hint)}"
        return text

    def as_dict(self) -> dict[str, object]:
        return {
            "severity": self.severity,
            "path": self.path,
            "message": self.message,
            "hint": self.hint,
            "file": self.file,
            "line": self.line,
        }


class ConfigError(Exception):
    """A configuration that does not validate; carries every problem found."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems: tuple[Problem, ...] = tuple(problems)
        super().__init__(self.render())

    def render(self) -> str:
        return "\n".join(p.render() for p in self.problems)

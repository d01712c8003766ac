"""A probe's finding: one check's verdict, ``ok``, ``warn`` or ``fail``, with the fix (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Level = Literal["ok", "warn", "fail"]


@dataclass(frozen=True)
class Finding:
    check: str
    level: Level
    message: str
    fix: str = ""

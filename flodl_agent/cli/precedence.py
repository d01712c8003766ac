"""Precedence as data: per setting, which sources it is read from and in which order (pure).

The option resolvers (``options``) declare a table of these per command, so that
`flags > env > the fdl.yml block > defaults` is stated once per field, not
re-spelled as an `or` chain in each resolver.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


def unset(value: object) -> bool:
    """What `flag or block or default` skips: nothing given, an empty string or list."""
    return value is None or value == "" or (isinstance(value, (list, tuple, dict)) and not value)


def none(value: object) -> bool:
    """For fields where an empty or false value is a choice (``--no-persist``, an empty tail)."""
    return value is None


@dataclass(frozen=True)
class Precedence:
    """Where one setting comes from: ``sources`` as ``place.attribute``, the first that is set
    wins. Places are read lazily, so a source after the winner is never validated."""

    sources: tuple[str, ...]
    is_unset: Callable[[object], bool] = unset

    def pick(self, places: Mapping[str, object]) -> tuple[Any, str | None]:
        """The winning value and the source it came from; (None, None) when none is set."""
        for source in self.sources:
            place, _, attribute = source.partition(".")
            value = getattr(places[place], attribute)
            if not self.is_unset(value):
                return value, source
        return None, None

"""One log line per peer and reason an interval, however often it happens (pure).

A flood of refused or bad dials must not fill the disk, nor the status page's
timeline, and the operator must still learn of every kind of refusal from every
peer. The first line for a key (a peer and a reason) is said at once; the rest of
that interval's are held back, counted, and their number rides the key's next line.
At most ``per_interval`` lines go out per interval across all keys (a flood from
many addresses), and at most ``max_keys`` keys are remembered; what either bound
holds back is said with the next line that goes out. The controller's counters
(``refused``, ``dropped``) stay exact: only the log is thinned.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Say:
    """Say this line now: ``same`` lines like it and ``others`` of any kind were held back before it."""

    same: int = 0
    others: int = 0

    def suffix(self, interval: float) -> str:
        parts = []
        if self.same:
            parts.append(f"{self.same} more like it in the last {interval:g}s")
        if self.others:
            parts.append(f"{self.others} other line(s) held back while too many came at once")
        return f" ({'; '.join(parts)})" if parts else ""


@dataclass
class LogLimit:
    interval: float = 60.0
    per_interval: int = 30
    max_keys: int = 4096
    held: int = 0  # lines held back by the overall cap or a forgotten key, not yet said
    _keys: dict[Hashable, tuple[float, int]] = field(default_factory=dict)  # key -> (said at, held since)
    _window: tuple[float, int] | None = None  # (start of the current interval, lines said in it)

    def admit(self, key: Hashable, now: float) -> Say | None:
        """``None``: hold this line back (it is counted); otherwise say it, with what was held back."""
        last = self._keys.get(key)
        if last is not None and now - last[0] < self.interval:
            self._keys[key] = (last[0], last[1] + 1)
            return None
        start, said = self._window if self._window is not None else (now, 0)
        if now - start >= self.interval:
            start, said = now, 0
        if said >= self.per_interval:
            self._window = (start, said)
            self.held += 1
            return None
        self._window = (start, said + 1)
        self._keys.pop(key, None)
        self._keys[key] = (now, 0)  # most recent last: the dict is the LRU order
        while len(self._keys) > self.max_keys:
            oldest = next(iter(self._keys))
            self.held += self._keys.pop(oldest)[1]  # its held-back lines would never be said
        others, self.held = self.held, 0
        return Say(last[1] if last is not None else 0, others)

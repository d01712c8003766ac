"""A restarted controller taking its journaled world back (pure).

The controller came back on its port and found an unfinished journal (``journal.on_start``
said Resume): the world still trains, its agents re-dial with resume hellos. This core says
whom to let back in, who is still missing, and what the timeline says once every host is
back or the grace ran out. The controller moves the bytes and arms the grace's one timer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from ..protocol.messages import Hello
from .admission import Refusal
from .journal import Journal, judge_resume


@dataclass
class Readoption:
    journal: Journal
    started: float  # when the restarted controller opened its port
    grace: float  # seconds a journaled host has to come back
    back: set[str] = field(default_factory=set)
    said: bool = False  # the timeline's "controller resumed" entry is out
    lost: set[str] = field(default_factory=set)  # handled as lost since the resume: no way back

    @cached_property
    def expected(self) -> list[str]:
        """The hosts whose ranks still ran when the journal was last written, in rank order:
        those whose every rank exited (they hung up) and evicted ones do not come back.
        Worked out once: the journal does not change, and every resume hello reads it."""
        exits, evicted = self.journal.exits, set(self.journal.evicted)
        return [
            s.host
            for s in self.journal.world
            if s.host not in evicted and any(r not in exits for r in s.ranks)
        ]

    @cached_property
    def _expected(self) -> frozenset[str]:
        return frozenset(self.expected)

    @property
    def deadline(self) -> float:
        return self.started + self.grace

    def judge(self, hello: Hello, live: set[str]) -> Refusal | None:
        """A hello to the restarted controller: a resume from one of the journal's hosts, or
        refused (a walk-in finds no window open: the world is training). ``live``: the hosts
        whose links are up (one whose resumed link broke may resume again)."""
        claim = hello.resume
        if claim is None:
            return Refusal(
                "window_closed",
                f"this controller resumed launch {self.journal.launch}: its world is training and "
                "admits only the hosts it journaled",
                "wait for the next run; --persist re-dials",
            )
        ranks = range(claim.first, claim.first + claim.count)
        why = judge_resume(self.journal, live, hello.host, claim.launch, ranks)
        if why is None and hello.host in self.lost:
            why = f"host {hello.host} was lost from launch {self.journal.launch} after the resume"
        if why is None and hello.host not in self._expected:
            why = f"host {hello.host}'s ranks had all exited in launch {self.journal.launch}"
        if why is None:
            return None
        return Refusal("resume_refused", why, "its ranks stop; --persist re-dials into the next launch")

    def admitted(self, host: str) -> None:
        self.back.add(host)

    def missing(self) -> list[str]:
        return [h for h in self.expected if h not in self.back]

    def complete(self) -> bool:
        return len(self.back) >= len(self.expected)  # back holds expected hosts only (judge)

    def words(self, now: float) -> str:
        """The timeline's entry, once: every host is back, or the grace ran out."""
        self.said = True
        expected = len(self.expected)
        return (
            f"controller resumed: {len(self.back)} of {expected} host{'s' if expected != 1 else ''} "
            f"back in {now - self.started:.1f} s"
        )

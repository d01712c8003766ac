"""The one shape of a failure a user meets: what went wrong, and the fix."""

from __future__ import annotations

# An agent's exit codes: done, try again (re-dial), stop (nothing a re-dial can fix).
CLEAN, TRANSIENT, PERMANENT = 0, 1, 2


class Failure(Exception):
    """A cause and its fix, worded for the person who has to act on it."""

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def render(self) -> str:
        return f"{self.message}\n    fix: {self.fix}" if self.fix else self.message

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


# What OpenSSH says when the server's host key is not the one known_hosts pins (a changed
# key, or an unknown one under StrictHostKeyChecking=yes): ssh, rsync, git and sshfs alike.
_HOST_KEY_WORDS = ("REMOTE HOST IDENTIFICATION HAS CHANGED", "Host key verification failed")


def host_key_mismatch(doing: str, ssh_output: str) -> Failure | None:
    """The failure to stop on when ``ssh_output`` says the host key does not match its pin:
    a man in the middle, or a door re-keyed without its pin following. Permanent wherever it
    happens (the tunnel, a fetch, a mount): re-dialling would only talk to it again."""
    if not any(words in ssh_output for words in _HOST_KEY_WORDS):
        return None
    return Failure(
        f"{doing}: the host key does not match the one pinned in known_hosts "
        "(ssh: Host key verification failed)",
        "if the door was re-keyed on purpose, pin its new key (site.yml pins it in every worker's "
        "known_hosts; by hand: ssh-keygen -R HOST, then add the new key); otherwise something "
        "answers in its place. Never turn StrictHostKeyChecking off",
    )

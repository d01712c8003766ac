"""The join protocol's events: what ``join_protocol``'s two sides hand their IO shells (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from . import wire
from .messages import Accept, Challenge, Hello, Msg, Reject, WorldFormed


@dataclass(frozen=True)
class Challenged:
    """Client: the controller's challenge, which this box can answer."""

    challenge: Challenge


@dataclass(frozen=True)
class HelloReceived:
    """Server: an authenticated hello that answers this connection's challenge."""

    hello: Hello


@dataclass(frozen=True)
class KeyRefused:
    """Server: the walk-in says the challenge is bound and it holds no key (``preamble.NO_KEY``).
    Unproven, like everything before a hello: count it, log it."""


@dataclass(frozen=True)
class Accepted:
    """Client: admitted; the link has switched to the connection key."""

    accept: Accept


@dataclass(frozen=True)
class Refused:
    """Client: refused by name, with the fix; nothing more comes on this connection."""

    reject: Reject


@dataclass(frozen=True)
class Formed:
    """Client: the world formed; this host's share of it."""

    world: WorldFormed


@dataclass(frozen=True)
class Aborted:
    """Client: the controller aborted the run."""

    reason: str


@dataclass(frozen=True)
class Message:
    """Either side, after admission: a link message and, for the bulk kinds, its raw bytes
    (a view into the receive buffer, valid until the next ``receive_data``)."""

    message: Msg | None
    blob: wire.Blob = b""


@dataclass(frozen=True)
class Closed:
    """The peer closed its side."""


Event = Challenged | HelloReceived | KeyRefused | Accepted | Refused | Formed | Aborted | Message | Closed

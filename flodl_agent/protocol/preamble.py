"""What a connection's first bytes say on the controller port: the channel it asks for
(a four-byte preamble, or an HTTP method), and the fixed bytes a refused peer reads instead
of a frame.

One port carries every channel (DESIGN.md: the mux); the listener reads these bytes before
any frame, so they are kept apart from the framing in :mod:`flodl_agent.protocol.wire`.
"""

from __future__ import annotations

from enum import Enum


class Channel(Enum):
    JOIN = b"FLJ1"
    RENDEZVOUS = b"FLR1"
    DATA = b"FLD1"
    CONTROL = b"FLC1"
    HTTP = b"HTTP"  # not a preamble: any HTTP method (see classify)


# What a peer the dial guard turns away reads instead of a challenge: fixed bytes, so a flood
# of refused connections costs one send each (no allocation, no crypto), and never a frame
# ("FL" and then no protocol version).
RATE_LIMITED = b"FL!rate-limited\n"

# What a box reads instead of an answer when its hello does not verify under the key of the
# host it names (another host's key, or one from before the token changed): fixed bytes like
# RATE_LIMITED, so the box can say why and stop, and a flood of them costs one send each.
WRONG_KEY = b"FL!wrong-key\n"

# What a walk-in sends instead of a hello when the challenge is bound (the run needs a key)
# and it holds none, so the controller can log and count the refusal (``bad_key``) instead
# of seeing a silent hang-up. It proves nothing. (A wrong key is caught by the controller
# itself: its hello does not verify, and the box reads WRONG_KEY.)
NO_KEY = b"FL?no-key\n"

# TLS records begin with a content type (0x15 alert, 0x16 handshake) and major version 3:
# what a cleartext walk-in reads where a challenge should be when the port speaks TLS.
TLS_RECORDS = (b"\x15\x03", b"\x16\x03")
# Fatal alerts the controller sends in cleartext before any handshake: to a cleartext dial on
# its TLS port (protocol_version), and to a TLS dial the dial guard turns away (access_denied).
TLS_CLEARTEXT_ALERT = b"\x15\x03\x03\x00\x02\x02\x46"
TLS_DENIED_ALERT = b"\x15\x03\x03\x00\x02\x02\x31"


# The first four bytes of every HTTP method: the status surface answers the others 405.
def _method(first: bytes) -> bool:
    """Whether ``first`` opens an HTTP request line: a method token in capitals, of three
    letters and a space (GET, PUT) or four or more (POST, PROPFIND, BREW). Any such token
    is HTTP, so a method the surface does not serve is answered 501, not dropped as junk."""
    word = first[:3] if first[3:] == b" " else first
    return len(first) == 4 and len(word) >= 3 and word.isalpha() and word.isupper() and first != b"HTTP"


def classify(first: bytes) -> Channel | None:
    """The channel a connection's ``first`` four bytes ask for, or ``None`` for junk."""
    if _method(first):
        return Channel.HTTP
    try:
        channel = Channel(first)
    except ValueError:
        return None
    return None if channel is Channel.HTTP else channel

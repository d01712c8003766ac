"""The wire: one port, four channels, authenticated frames (sans-IO).

Every connection to the controller opens with 4 bytes that pick its channel —
``FLJ1`` join, ``FLR1`` rendezvous, ``FLD1`` data, ``FLC1`` control — or an
HTTP method for the status surface. After the preamble, both directions
carry frames::

    magic "FL" | version u8 | kind u8 | length u32 | tag 32 bytes | payload

The tag is HMAC-SHA256 over (sequence u64, kind, length, payload). The
sequence number is implicit — each side counts the frames it sent and
received on this connection — so a frame cannot be replayed, dropped or
reordered within a stream without the tag failing. Payloads are msgpack
maps. Caps are checked on the header before any payload is buffered, a
version mismatch is refused before anything is decoded, and the first bad
frame ends the stream: the caller drops the connection without a reply.

Keys: the run key is ``join.token`` when one is configured, else a fresh
128-bit session salt. Join frames are tagged with the run key, except under
open admission where the pre-admission key is all zeros and Accept hands the
salt out. Each connection opens with a server challenge (a fresh nonce) that
the hello must echo, and after admission both sides switch to a connection
key derived from the run key and both nonces, so a captured hello or frame is
useless on any other connection.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Any

import msgpack
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MAGIC = b"FL"
VERSION = 1
HEADER = struct.Struct(">2sBBI32s")
TAG_INPUT = struct.Struct(">QBI")
KEY_BYTES = 16
OPEN_KEY = bytes(KEY_BYTES)  # open admission: reachability is the credential
CONTROL_MAX = 256 * 1024  # join/control frames are small; anything bigger is hostile
PRE_ADMISSION_MAX = 64 * 1024  # a challenge or a hello; an unauthenticated peer gets no more


class Channel(Enum):
    JOIN = b"FLJ1"
    RENDEZVOUS = b"FLR1"
    DATA = b"FLD1"
    CONTROL = b"FLC1"
    HTTP = b"HTTP"  # not a preamble: any of HTTP_METHODS


HTTP_METHODS = frozenset({b"GET ", b"POST", b"HEAD"})


def classify(preamble: bytes) -> Channel | None:
    """The channel a connection asked for, or ``None`` for junk."""
    if preamble in HTTP_METHODS:
        return Channel.HTTP
    try:
        channel = Channel(preamble)
    except ValueError:
        return None
    return None if channel is Channel.HTTP else channel


class Kind(IntEnum):
    CHALLENGE = 1
    HELLO = 2
    ACCEPT = 3
    REJECT = 4
    WORLD_FORMED = 5
    RANK_EXITED = 6
    ABORT = 7
    HEARTBEAT = 8
    ATTACH = 9  # first frame on a rendezvous/data/control channel
    REQUEST = 10
    REPLY = 11
    STREAM = 12  # a rendezvous stream's bytes, carried on a control link
    AVERAGE = 13  # the CPU plane: a host's folded parameters for a round
    AVERAGED = 14  # the CPU plane: the round's average


class Dropped(Exception):
    """A frame that must end the stream; ``cause`` is counted, never answered."""

    def __init__(self, cause: str, detail: str = "") -> None:
        super().__init__(f"{cause}: {detail}" if detail else cause)
        self.cause = cause


CAUSES = ("magic", "version", "too_large", "kind", "tag", "payload")


@dataclass(frozen=True)
class Frame:
    kind: Kind
    body: dict[str, Any]


def new_salt() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def new_nonce() -> bytes:
    return secrets.token_bytes(16)


def run_key(token: str | None, salt: bytes) -> bytes:
    """The token replaces the salt when one is configured."""
    return bytes.fromhex(token) if token else salt


def connection_key(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return HKDF(
        algorithm=hashes.SHA256(), length=32, salt=server_nonce + client_nonce, info=b"flodl connection"
    ).derive(key)


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not part of the protocol")


class Codec:
    """Frame encoder and decoder for one connection (both directions).

    ``feed`` bytes as they arrive, then iterate ``frames()``; ``encode`` what
    to send. Keys can change mid-stream (``rekey``) — the counters carry on.
    """

    def __init__(self, key: bytes, *, max_payload: int = CONTROL_MAX) -> None:
        self.key = key
        self.max_payload = max_payload
        self.sent = 0
        self.received = 0
        self._buffer = bytearray()

    def rekey(self, key: bytes) -> None:
        self.key = key

    def _tag(self, seq: int, kind: int, payload: bytes) -> bytes:
        mac = hmac.new(self.key, TAG_INPUT.pack(seq, kind, len(payload)), hashlib.sha256)
        mac.update(payload)
        return mac.digest()

    def encode(self, kind: Kind, body: Mapping[str, Any] | None = None) -> bytes:
        payload: bytes = msgpack.packb(dict(body or {}), use_bin_type=True)
        if len(payload) > self.max_payload:
            raise ValueError(f"frame of {len(payload)} bytes exceeds the {self.max_payload}-byte cap")
        tag = self._tag(self.sent, kind, payload)
        self.sent += 1
        return HEADER.pack(MAGIC, VERSION, kind, len(payload), tag) + payload

    def feed(self, data: bytes) -> None:
        self._buffer += data
        # A peer may stream bytes faster than we read frames; never hold more
        # than one maximal frame plus what just arrived.
        if len(self._buffer) > HEADER.size + self.max_payload + len(data):
            raise Dropped("too_large", "peer sent more than one maximal frame at once")

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def frames(self) -> Iterator[Frame]:
        while True:
            frame = self.next_frame()
            if frame is None:
                return
            yield frame

    def next_frame(self) -> Frame | None:
        buf = self._buffer
        if len(buf) < HEADER.size:
            if buf[: len(MAGIC)] != MAGIC[: len(buf)]:
                raise Dropped("magic")
            return None
        magic, version, kind, length, tag = HEADER.unpack_from(buf)
        if magic != MAGIC:
            raise Dropped("magic")
        if version != VERSION:
            raise Dropped("version", f"peer speaks protocol {version}, this side {VERSION}")
        if length > self.max_payload:
            raise Dropped("too_large", f"{length} bytes announced, cap {self.max_payload}")
        if kind not in Kind._value2member_map_:
            raise Dropped("kind", f"unknown frame kind {kind}")
        end = HEADER.size + length
        if len(buf) < end:
            return None
        payload = bytes(buf[HEADER.size : end])
        if not hmac.compare_digest(tag, self._tag(self.received, kind, payload)):
            raise Dropped("tag")
        del buf[:end]
        self.received += 1
        try:
            body = msgpack.unpackb(payload, raw=False, strict_map_key=True, ext_hook=_reject_ext)
        except Exception as exc:  # msgpack raises several unrelated types
            raise Dropped("payload", str(exc)) from None
        if not isinstance(body, dict):
            raise Dropped("payload", "payload is not a map")
        return Frame(Kind(kind), body)

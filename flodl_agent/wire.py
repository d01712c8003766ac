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
maps, except for the CPU plane's bulk kinds (``BLOB_KINDS``), whose payload
is ``meta length u32 | msgpack map | raw bytes``: parameters travel as they
lie in memory, never packed, and the receiver hands them out without a copy.
Their tag covers the raw bytes through a Poly1305 tag under a one-time key
derived from the frame's key, sequence and kind (HMAC-SHA256 over hundreds of
megabytes would cost more than the averaging itself). A bulk kind travels one
way on a connection (``AVERAGE`` towards the controller, ``AVERAGED`` back),
so no one-time key ever authenticates two messages; the codec enforces it.
Caps are checked on the header before any payload is buffered, a
version mismatch is refused before anything is decoded, and the first bad
frame ends the stream: the caller drops the connection without a reply.

Keys: the run key is ``join.token`` when one is configured, else a fresh
128-bit session salt. No box dials with the run key itself: each holds the
*host key* derived from it for its own name (``host_key``: HKDF, so a host key
reveals neither the run key nor any other host's), and tags its hello with it;
the controller derives the key of the name a hello claims and verifies the tag
under it, so a name is as good as the credential that proves it. The challenge
goes out under the all-zeros key (the controller cannot know which host is
dialling yet); the controller proves itself with its answer, tagged under the
host key. Under open admission every pre-admission frame is under zeros and
Accept hands the salt out. Each connection opens with a server challenge (a
fresh nonce) that the hello must echo, and after admission both sides switch
to a connection key derived from the host key (open: the salt) and both
nonces, so a captured hello or frame is useless on any other connection.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Any

import msgpack
from cryptography.hazmat.primitives import hashes, poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MAGIC = b"FL"
VERSION = 1
HEADER = struct.Struct(">2sBBI32s")
TAG_INPUT = struct.Struct(">QBI")
KEY_BYTES = 16
OPEN_KEY = bytes(KEY_BYTES)  # open admission: reachability is the credential
CONTROL_MAX = 256 * 1024  # join/control frames are small; anything bigger is hostile
PRE_ADMISSION_MAX = 64 * 1024  # a challenge or a hello; an unauthenticated peer gets no more
LINK_MAX = 1 << 30  # an admitted link: one frame of parameters, a 256M-parameter model in float32
META = struct.Struct(">I")
BIG = 1 << 20  # payloads above this are received into one buffer of their final size


class Channel(Enum):
    JOIN = b"FLJ1"
    RENDEZVOUS = b"FLR1"
    DATA = b"FLD1"
    CONTROL = b"FLC1"
    HTTP = b"HTTP"  # not a preamble: any of HTTP_METHODS


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
HTTP_METHODS = frozenset({b"GET ", b"POST", b"HEAD", b"PUT ", b"DELE", b"PATC", b"OPTI"})


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


BLOB_KINDS = frozenset({Kind.AVERAGE, Kind.AVERAGED})
Blob = bytes | bytearray | memoryview


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
    # A bulk kind's raw bytes: a view into the receive buffer (no copy), valid until
    # the next feed() — the codec reuses a big frame's buffer for the next one.
    blob: Blob = b""


def new_salt() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def new_nonce() -> bytes:
    return secrets.token_bytes(16)


def run_key(token: str | None, salt: bytes) -> bytes:
    """The token replaces the salt when one is configured."""
    return bytes.fromhex(token) if token else salt


HOST_KEY_INFO = b"flodl host "  # HKDF info: these bytes, then the host name (UTF-8)


def host_key(run_key: bytes, host: str) -> bytes:
    """The key of one host name, derived from the run key: what that host tags its hello with.

    HKDF is one-way: a host key gives its holder neither the run key nor another host's key.
    The worker role derives the same bytes (the collection's ``host_key`` filter)."""
    info = HOST_KEY_INFO + host.encode()
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(run_key)


def connection_key(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return HKDF(
        algorithm=hashes.SHA256(), length=32, salt=server_nonce + client_nonce, info=b"flodl connection"
    ).derive(key)


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not part of the protocol")


class Codec:
    """Frame encoder and decoder for one connection (both directions).

    ``feed`` bytes as they arrive, then iterate ``frames()``; ``encode`` what
    to send (``encode_parts`` for a bulk frame, to hand its raw bytes to the
    transport without joining them). Keys can change mid-stream (``rekey``) —
    the counters carry on.
    """

    def __init__(self, key: bytes, *, max_payload: int = CONTROL_MAX) -> None:
        self.key = key
        self.max_payload = max_payload
        self.sent = 0
        self.received = 0
        self._buffer = bytearray()
        self._fill: int | None = None  # a big frame: _buffer is its final size, filled this far
        self._after = bytearray()  # bytes that arrived behind a big frame
        self._spare = bytearray()  # the last big frame's buffer (fresh pages cost a fault each)
        self._sent_kinds: set[Kind] = set()
        self._received_kinds: set[Kind] = set()

    def rekey(self, key: bytes) -> None:
        self.key = key

    def _tag(self, seq: int, kind: int, payload: Blob, blob: Blob = b"") -> bytes:
        mac = hmac.new(self.key, TAG_INPUT.pack(seq, kind, len(payload) + len(blob)), hashlib.sha256)
        mac.update(payload)
        if kind in BLOB_KINDS:
            one_time = hmac.new(self.key, b"flodl blob" + TAG_INPUT.pack(seq, kind, 0), hashlib.sha256)
            mac.update(poly1305.Poly1305.generate_tag(one_time.digest(), blob))
        return mac.digest()

    def encode(self, kind: Kind, body: Mapping[str, Any] | None = None) -> bytes:
        return b"".join(self.encode_parts(kind, body))

    def encode_parts(self, kind: Kind, body: Mapping[str, Any] | None = None, blob: Blob = b"") -> list[Blob]:
        """The frame as buffers to write in order: header and map, then the raw bytes (bulk kinds)."""
        payload: bytes = msgpack.packb(dict(body or {}), use_bin_type=True)
        if kind in BLOB_KINDS:
            if kind in self._received_kinds:
                raise ValueError(f"{kind.name} already flows the other way on this connection")
            self._sent_kinds.add(kind)
            payload = META.pack(len(payload)) + payload
        elif blob:
            raise ValueError(f"{kind.name} frames carry no raw bytes")
        length = len(payload) + len(blob)
        if length > self.max_payload:
            raise ValueError(f"frame of {length} bytes exceeds the {self.max_payload}-byte cap")
        tag = self._tag(self.sent, kind, payload, blob)
        self.sent += 1
        head = HEADER.pack(MAGIC, VERSION, kind, length, tag) + payload
        return [head, blob] if len(blob) else [head]

    def feed(self, data: Blob) -> None:
        if self._fill is not None:
            view = memoryview(data)
            take = min(len(view), len(self._buffer) - self._fill)
            self._buffer[self._fill : self._fill + take] = view[:take]
            self._fill += take
            self._after += view[take:]
            if len(self._after) > HEADER.size + self.max_payload + len(data):
                raise Dropped("too_large", "peer sent more than one maximal frame at once")
            return
        self._buffer += data
        # A peer may stream bytes faster than we read frames; never hold more
        # than one maximal frame plus what just arrived.
        if len(self._buffer) > HEADER.size + self.max_payload + len(data):
            raise Dropped("too_large", "peer sent more than one maximal frame at once")
        if len(self._buffer) >= HEADER.size:
            try:
                length = self._header()[1]
            except Dropped:
                return  # next_frame refuses it
            end = HEADER.size + length
            if length > BIG and len(self._buffer) < end:
                # Receive the rest in place: no regrowing, and the payload is handed out as a view.
                whole = self._spare if len(self._spare) == end else bytearray(end)
                self._spare = bytearray()
                whole[: len(self._buffer)] = self._buffer
                self._fill = len(self._buffer)
                self._buffer = whole

    @property
    def buffered(self) -> int:
        return (self._fill if self._fill is not None else len(self._buffer)) + len(self._after)

    @property
    def wanted(self) -> int:
        """Bytes still missing from the frame being received (a hint for the read size)."""
        if self._fill is not None:
            return len(self._buffer) - self._fill
        if len(self._buffer) < HEADER.size:
            return HEADER.size - len(self._buffer)
        try:
            return max(0, HEADER.size + self._header()[1] - len(self._buffer))
        except Dropped:
            return 0  # next_frame refuses it

    def frames(self) -> Iterator[Frame]:
        while True:
            frame = self.next_frame()
            if frame is None:
                return
            yield frame

    def _header(self) -> tuple[int, int, bytes]:
        """(kind, length, tag) of the frame at the front, checked before any payload is kept."""
        magic, version, kind, length, tag = HEADER.unpack_from(self._buffer)
        if magic != MAGIC:
            raise Dropped("magic")
        if version != VERSION:
            raise Dropped("version", f"peer speaks protocol {version}, this side {VERSION}")
        if length > self.max_payload:
            raise Dropped("too_large", f"{length} bytes announced, cap {self.max_payload}")
        if kind not in Kind._value2member_map_:
            raise Dropped("kind", f"unknown frame kind {kind}")
        return kind, length, tag

    def next_frame(self) -> Frame | None:
        buf = self._buffer
        if len(buf) < HEADER.size:
            if buf[: len(MAGIC)] != MAGIC[: len(buf)]:
                raise Dropped("magic")
            return None
        kind, length, tag = self._header()
        end = HEADER.size + length
        if self._fill is not None:
            if self._fill < end:
                return None
            # The big frame is whole: it keeps its buffer, the bytes behind it start the next.
            payload = memoryview(buf)[HEADER.size :]
            self._buffer, self._after, self._fill, self._spare = self._after, bytearray(), None, buf
        elif len(buf) < end:
            return None
        else:
            payload = memoryview(bytes(buf[HEADER.size : end]))
            del buf[:end]
        blob: Blob = b""
        meta: Blob = payload
        if kind in BLOB_KINDS:
            if length < META.size or META.unpack_from(payload)[0] > length - META.size:
                raise Dropped("payload", "bulk frame's map overruns the frame")
            split = META.size + META.unpack_from(payload)[0]
            meta, blob = payload[:split], payload[split:]
        if not hmac.compare_digest(tag, self._tag(self.received, kind, meta, blob)):
            raise Dropped("tag")
        self.received += 1
        if kind in BLOB_KINDS:
            if kind in self._sent_kinds:
                raise Dropped("kind", f"{Kind(kind).name} already flows the other way on this connection")
            self._received_kinds.add(Kind(kind))
            meta = meta[META.size :]
        return Frame(Kind(kind), _unpack(meta), blob)

    def next_frame_keyed(self, key_of: Callable[[Kind, dict[str, Any]], bytes]) -> Frame | None:
        """The next frame, verified under the key its own map names (``key_of(kind, body)``):
        a hello claims a host name, and only that host's key may tag it. For the small frames
        before admission; the key stays for the frames that follow."""
        buf = self._buffer
        if self._fill is None and len(buf) >= HEADER.size:
            kind, length, _ = self._header()
            if len(buf) >= HEADER.size + length:
                payload = buf[HEADER.size : HEADER.size + length]
                self.key = key_of(Kind(kind), {} if kind in BLOB_KINDS else _unpack(payload))
        return self.next_frame()


def _unpack(meta: Blob) -> dict[str, Any]:
    try:
        body = msgpack.unpackb(meta, raw=False, strict_map_key=True, ext_hook=_reject_ext)
    except Exception as exc:  # msgpack raises several unrelated types
        raise Dropped("payload", str(exc)) from None
    if not isinstance(body, dict):
        raise Dropped("payload", "payload is not a map")
    return body

"""The wire: one port, four channels, authenticated frames (sans-IO).

Every connection to the controller opens with 4 bytes that pick its channel —
``FLJ1`` join, ``FLR1`` rendezvous, ``FLD1`` data, ``FLC1`` control — or an
HTTP method for the status surface (:mod:`.preamble`). After the preamble,
both directions carry frames::

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

Keys (the run key, host keys, connection keys) are :mod:`.keys`'s.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import msgpack
from cryptography.hazmat.primitives import poly1305

from .keys import KEY_BYTES as KEY_BYTES
from .keys import connection_key as connection_key
from .keys import host_key as host_key
from .keys import new_nonce as new_nonce
from .keys import new_salt as new_salt
from .keys import run_key as run_key

MAGIC = b"FL"
VERSION = 1
HEADER = struct.Struct(">2sBBI32s")
TAG_INPUT = struct.Struct(">QBI")
OPEN_KEY = bytes(KEY_BYTES)  # open admission: reachability is the credential
CONTROL_MAX = 256 * 1024  # join/control frames are small; anything bigger is hostile
PRE_ADMISSION_MAX = 64 * 1024  # a challenge or a hello; an unauthenticated peer gets no more
LINK_MAX = 1 << 30  # an admitted link: one frame of parameters, a 256M-parameter model in float32
META = struct.Struct(">I")
BIG = 1 << 20  # payloads above this are received into one buffer of their final size
DIRECT = 64 * 1024  # bulk frames' raw bytes above this go straight to their destination (``Codec.direct``)


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
    REFORM = 15  # a process-group world re-forms: stop the ranks, a new WorldFormed follows
    RELEASE = 16  # an elastic world goes on without this host's failed ranks: hang up


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


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not part of the protocol")


def _unpack(data: Blob) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_reject_ext)


def _map_header(count: int) -> bytes:
    if count < 16:
        return bytes((0x80 | count,))
    return b"\xde" + struct.pack(">H", count) if count < 1 << 16 else b"\xdf" + struct.pack(">I", count)


@dataclass(frozen=True)
class SharedMap:
    """Entries of a frame's map packed once, for a frame that goes to many peers with a few
    entries of each one's own (``Codec.encode_shared``: a formation's fan-out)."""

    count: int
    packed: bytes

    @classmethod
    def of(cls, entries: Mapping[str, Any]) -> SharedMap:
        # A msgpack map is its header, then key and value after key and value: entries pack alone.
        return cls(len(entries), b"".join(_pack(k) + _pack(v) for k, v in entries.items()))


_IPAD = bytes(b ^ 0x36 for b in range(256))
_OPAD = bytes(b ^ 0x5C for b in range(256))


def _pads(key: bytes) -> tuple[bytes, Any, Any]:
    """HMAC-SHA256's inner and outer hash states for ``key`` (RFC 2104)."""
    block = (key if len(key) <= 64 else hashlib.sha256(key).digest()).ljust(64, b"\0")
    return key, hashlib.sha256(block.translate(_IPAD)), hashlib.sha256(block.translate(_OPAD))


_packers = threading.local()  # one Packer per thread: msgpack.packb makes a fresh one per call


def _pack(value: Any) -> bytes:
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    packed: bytes = packer.pack(value)
    return packed


# Where a bulk frame's raw bytes go: (kind, its map, not yet verified, their length) -> a writable
# view of exactly that many bytes, or None for the codec's own buffer. Nothing may read the
# view before the frame verifies: a frame that fails its tag ends the connection.
Sink = Callable[["Kind", dict[str, Any], int], memoryview | None]


class Codec:
    """Frame encoder and decoder for one connection (both directions).

    ``feed`` bytes as they arrive, then iterate ``frames()``; ``encode`` what
    to send (``encode_parts`` for a bulk frame, to hand its raw bytes to the
    transport without joining them). Keys can change mid-stream (``rekey``) —
    the counters carry on.
    """

    def __init__(self, key: bytes, *, max_payload: int = CONTROL_MAX) -> None:
        self.key = key
        self._pads: tuple[bytes, Any, Any] = (b"", None, None)  # (key, inner, outer) HMAC states
        self.max_payload = max_payload
        self.sent = 0
        self.received = 0
        self._buffer = bytearray()
        self._fill: int | None = None  # a big frame: _buffer is its final size, filled this far
        self._after = bytearray()  # bytes that arrived behind a big frame
        self._spare = bytearray()  # the last big frame's buffer (fresh pages cost a fault each)
        self._dest: memoryview | None = None  # a bulk frame's raw bytes: their destination,
        self._dest_fill = 0  # filled this far (its map waits in _buffer)
        self._own: bytearray | None = None  # the destination when it is our own buffer
        self.sink: Sink | None = None  # where bulk frames' raw bytes go (None: our own buffer)
        self._sent_kinds: set[Kind] = set()
        self._received_kinds: set[Kind] = set()

    def rekey(self, key: bytes) -> None:
        self.key = key
        self._pads = _pads(key)  # now, during admission, rather than at the first frame

    def _mac(self, head: Blob, payload: Blob = b"", tail: Blob = b"") -> bytes:
        """HMAC-SHA256 under the current key: its padded key states are hashed once per key (a
        fleet's fan-out tags thousands of small frames, where the key schedule would dominate)."""
        pads = self._pads if self._pads[0] is self.key else self._repad()
        inner = pads[1].copy()
        inner.update(head)
        inner.update(payload)
        if tail:
            inner.update(tail)
        outer = pads[2].copy()
        outer.update(inner.digest())
        tag: bytes = outer.digest()
        return tag

    def _repad(self) -> tuple[bytes, Any, Any]:
        self._pads = _pads(self.key)
        return self._pads

    def _tag(self, seq: int, kind: int, payload: Blob, blob: Blob = b"") -> bytes:
        head = TAG_INPUT.pack(seq, kind, len(payload) + len(blob))
        if kind not in BLOB_KINDS:
            return self._mac(head, payload)
        one_time = self._mac(b"flodl blob", TAG_INPUT.pack(seq, kind, 0))
        return self._mac(head, payload, poly1305.Poly1305.generate_tag(one_time, blob))

    def encode(self, kind: Kind, body: Mapping[str, Any] | None = None) -> bytes:
        return b"".join(self.encode_parts(kind, body))

    def encode_shared(self, kind: Kind, shared: SharedMap, own: Mapping[str, Any]) -> bytes:
        """A frame whose map is ``shared``'s entries (packed once for every peer) and ``own``'s."""
        if kind in BLOB_KINDS:
            raise ValueError(f"{kind.name} frames are encoded with encode_parts")
        # own's entries packed in one call (its map's header cut off), behind the shared ones
        payload = (
            _map_header(shared.count + len(own)) + shared.packed + _pack(own)[len(_map_header(len(own))) :]
        )
        if len(payload) > self.max_payload:
            raise ValueError(f"frame of {len(payload)} bytes exceeds the {self.max_payload}-byte cap")
        tag = self._tag(self.sent, kind, payload)
        self.sent += 1
        return HEADER.pack(MAGIC, VERSION, kind, len(payload), tag) + payload

    def encode_parts(self, kind: Kind, body: Mapping[str, Any] | None = None, blob: Blob = b"") -> list[Blob]:
        """The frame as buffers to write in order: header and map, then the raw bytes (bulk kinds)."""
        payload = _pack(dict(body or {}))
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
        view = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)
        target, filled = self._filling()
        if target is not None:
            take = min(len(view), len(target) - filled)
            target[filled : filled + take] = view[:take]
            self._filled(take)
            self._after += view[take:]
            if len(self._after) > HEADER.size + self.max_payload + len(view):
                raise Dropped("too_large", "peer sent more than one maximal frame at once")
            return
        self._buffer += view
        # A peer may stream bytes faster than we read frames; never hold more
        # than one maximal frame plus what just arrived.
        if len(self._buffer) > HEADER.size + self.max_payload + len(view):
            raise Dropped("too_large", "peer sent more than one maximal frame at once")
        self._arm()

    def direct(self) -> memoryview | None:
        """Where the next bytes can be received straight into (``recv_into``): the rest of a
        bulk frame's raw bytes in their destination, or of a big frame's buffer. None: receive
        them anywhere and ``feed`` them (a header, a small frame)."""
        if not self._after:
            self._arm()
            target, filled = self._filling()
            if target is not None and filled < len(target):
                return target[filled:]
        return None

    def filled(self, n: int) -> None:
        """``n`` bytes were received into the view ``direct()`` returned."""
        self._filled(n)

    def _filling(self) -> tuple[memoryview | None, int]:
        if self._dest is not None:
            return self._dest, self._dest_fill
        if self._fill is not None:
            return memoryview(self._buffer), self._fill
        return None, 0

    def _filled(self, n: int) -> None:
        if self._dest is not None:
            self._dest_fill += n
        elif self._fill is not None:
            self._fill += n

    def _arm(self) -> None:
        """Once a frame's head is in, give a big frame its final buffer (no regrowing, and the
        payload is handed out as a view) and a bulk frame's raw bytes their destination."""
        buf = self._buffer
        if self._dest is not None or self._fill is not None or len(buf) < HEADER.size:
            return
        try:
            kind, length, _ = self._header()
        except Dropped:
            return  # next_frame refuses it
        end = HEADER.size + length
        if len(buf) >= end:
            return
        if kind in BLOB_KINDS and length > DIRECT:
            try:
                head = self._head_end(kind, length)
            except Dropped:
                return  # next_frame refuses it
            if head is None or len(buf) < head:
                return
            dest = self._destination(Kind(kind), buf[HEADER.size + META.size : head], end - head)
            dest[: len(buf) - head] = buf[head:]
            self._dest, self._dest_fill = dest, len(buf) - head
            del buf[head:]
        elif length > BIG:
            whole = self._spare if len(self._spare) == end else bytearray(end)
            self._spare = bytearray()
            whole[: len(buf)] = buf
            self._fill = len(buf)
            self._buffer = whole

    def _head_end(self, kind: int, length: int) -> int | None:
        """Where a bulk frame's map ends (its raw bytes start), once its length is in."""
        if kind not in BLOB_KINDS:
            return None
        if length < META.size:  # found by the fuzzer: a frame too short to say its map's length
            raise Dropped("payload", f"bulk frame of {length} bytes: too short for its map's length")
        if len(self._buffer) < HEADER.size + META.size:
            return None
        (meta,) = META.unpack_from(self._buffer, HEADER.size)
        if meta > length - META.size:
            raise Dropped("payload", "bulk frame's map overruns the frame")
        if meta > CONTROL_MAX:
            raise Dropped("payload", f"bulk frame's map of {meta} bytes (cap {CONTROL_MAX})")
        return HEADER.size + META.size + int(meta)

    def _destination(self, kind: Kind, meta: Blob, n: int) -> memoryview:
        if self.sink is not None:
            try:
                body = _unpack(meta)
            except Exception:  # the frame will not verify: it lands in our own buffer and is refused
                body = None
            view = self.sink(kind, body, n) if isinstance(body, dict) else None
            if view is not None:
                view = view.cast("B") if view.format != "B" else view
                if view.readonly or not view.c_contiguous or view.nbytes != n:
                    raise ValueError(f"a sink's view must be {n} writable contiguous bytes")
                return view
        own = self._spare if len(self._spare) >= n else bytearray(n)
        self._spare, self._own = bytearray(), own
        return memoryview(own)[:n]

    @property
    def buffered(self) -> int:
        target, filled = self._filling()
        if self._dest is not None:
            filled += len(self._buffer)
        return (filled if target is not None else len(self._buffer)) + len(self._after)

    @property
    def wanted(self) -> int:
        """Bytes still missing from the frame being received (a hint for the read size); for a
        bulk frame whose raw bytes have a destination, only the bytes before them."""
        target, filled = self._filling()
        if target is not None:
            return len(target) - filled
        if len(self._buffer) < HEADER.size:
            return HEADER.size - len(self._buffer)
        try:
            kind, length, _ = self._header()
            if kind in BLOB_KINDS and length > DIRECT:
                if len(self._buffer) < HEADER.size + META.size:
                    return HEADER.size + META.size - len(self._buffer)
                head = self._head_end(kind, length)
                return max(0, (head or 0) - len(self._buffer))
        except Dropped:
            return 0  # next_frame refuses it
        return max(0, HEADER.size + length - len(self._buffer))

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
        self._head_end(kind, length)  # a bulk frame's map that overruns it is refused at once
        end = HEADER.size + length
        blob: Blob = b""
        if self._dest is not None:
            if self._dest_fill < len(self._dest):
                return None
            # The raw bytes are in their destination, the map in front of them in _buffer.
            meta: Blob = memoryview(bytes(buf[HEADER.size :]))
            blob = self._dest
            self._buffer, self._after, self._dest = self._after, bytearray(), None
            if self._own is not None:
                self._spare, self._own = self._own, None
        elif self._fill is not None:
            if self._fill < end:
                return None
            # The big frame is whole: it keeps its buffer, the bytes behind it start the next.
            meta = memoryview(buf)[HEADER.size :]
            self._buffer, self._after, self._fill, self._spare = self._after, bytearray(), None, buf
        elif len(buf) < end:
            return None
        else:
            meta = memoryview(bytes(buf[HEADER.size : end]))
            del buf[:end]
        if kind in BLOB_KINDS:
            return self._bulk_frame(kind, tag, meta, blob)
        self._verify(kind, tag, meta, blob)
        return Frame(Kind(kind), _map(meta), blob)

    def _bulk_frame(self, kind: int, tag: bytes, meta: Blob, blob: Blob) -> Frame:
        """A whole bulk frame: its raw bytes split from its map (unless they arrived in a
        destination of their own), the frame verified, then held to its one direction."""
        if not len(blob):
            split = META.size + META.unpack_from(meta)[0]
            meta, blob = meta[:split], meta[split:]
        self._verify(kind, tag, meta, blob)
        if kind in self._sent_kinds:
            raise Dropped("kind", f"{Kind(kind).name} already flows the other way on this connection")
        self._received_kinds.add(Kind(kind))
        return Frame(Kind(kind), _map(meta[META.size :]), blob)

    def _verify(self, kind: int, tag: bytes, meta: Blob, blob: Blob) -> None:
        """A whole frame's tag, checked at this stream's sequence number: a frame that
        verifies counts as received, and the first that does not ends the stream."""
        if not hmac.compare_digest(tag, self._tag(self.received, kind, meta, blob)):
            raise Dropped("tag")
        self.received += 1

    def next_frame_keyed(self, key_of: Callable[[Kind, dict[str, Any]], bytes]) -> Frame | None:
        """The next frame, verified under the key its own map names (``key_of(kind, body)``):
        a hello claims a host name, and only that host's key may tag it. For the small frames
        before admission; the key stays for the frames that follow."""
        buf = self._buffer
        if self._fill is None and self._dest is None and len(buf) >= HEADER.size:
            kind, length, _ = self._header()
            if len(buf) >= HEADER.size + length:
                payload = buf[HEADER.size : HEADER.size + length]
                self.key = key_of(Kind(kind), {} if kind in BLOB_KINDS else _map(payload))
        return self.next_frame()


def _map(meta: Blob) -> dict[str, Any]:
    """A frame's map, unverified or verified: anything else is a bad payload."""
    try:
        body = _unpack(meta)
    except Exception as exc:  # msgpack raises several unrelated types
        raise Dropped("payload", str(exc)) from None
    if not isinstance(body, dict):
        raise Dropped("payload", "payload is not a map")
    return body

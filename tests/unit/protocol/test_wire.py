"""The frame codec: authenticity, caps before allocation, versions, replay within a stream."""

from __future__ import annotations

import hashlib
import hmac

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_agent.protocol import preamble, wire

KEY = bytes(range(16))


def pair(key: bytes = KEY) -> tuple[wire.Codec, wire.Codec]:
    return wire.Codec(key), wire.Codec(key)


def test_round_trip_in_order() -> None:
    tx, rx = pair()
    data = b"".join(tx.encode(wire.Kind.HEARTBEAT, {"n": i, "blob": b"\x00" * i}) for i in range(5))
    rx.feed(data)
    assert [(f.kind, f.body["n"]) for f in rx.frames()] == [(wire.Kind.HEARTBEAT, i) for i in range(5)]


def test_frames_arrive_in_any_chunking() -> None:
    tx, rx = pair()
    data = tx.encode(wire.Kind.ABORT, {"reason": "x" * 300}) + tx.encode(wire.Kind.HEARTBEAT)
    got = []
    for i in range(len(data)):
        rx.feed(data[i : i + 1])
        got += list(rx.frames())
    assert [f.kind for f in got] == [wire.Kind.ABORT, wire.Kind.HEARTBEAT]


@pytest.mark.parametrize("offset", range(0, wire.HEADER.size + 8))
def test_any_flipped_byte_is_refused(offset: int) -> None:
    tx, rx = pair()
    data = bytearray(tx.encode(wire.Kind.HELLO, {"host": "abcdefgh"}))
    data[offset] ^= 0x40
    rx.feed(bytes(data))
    try:
        frames = list(rx.frames())
    except wire.Dropped:
        return
    assert frames == []  # a longer announced length just waits for bytes that never verify


def test_wrong_key_is_a_tag_failure() -> None:
    tx, rx = wire.Codec(KEY), wire.Codec(bytes(16))
    rx.feed(tx.encode(wire.Kind.HELLO, {"host": "a"}))
    with pytest.raises(wire.Dropped) as caught:
        rx.next_frame()
    assert caught.value.cause == "tag"


def test_version_mismatch_is_refused_before_decoding() -> None:
    tx, rx = pair()
    data = bytearray(tx.encode(wire.Kind.HELLO, {"host": "a"}))
    data[2] = wire.VERSION + 1
    rx.feed(bytes(data[: wire.HEADER.size]))  # the header alone is enough to refuse
    with pytest.raises(wire.Dropped) as caught:
        rx.next_frame()
    assert caught.value.cause == "version" and "protocol 2" in str(caught.value)


def test_size_cap_is_checked_on_the_header_before_the_payload_arrives() -> None:
    rx = wire.Codec(KEY, max_payload=1024)
    header = wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.Kind.HELLO, 10**9, bytes(32))
    rx.feed(header)
    with pytest.raises(wire.Dropped) as caught:
        rx.next_frame()
    assert caught.value.cause == "too_large" and rx.buffered == wire.HEADER.size


def test_a_peer_cannot_make_the_buffer_grow_without_bound() -> None:
    rx = wire.Codec(KEY, max_payload=1024)
    with pytest.raises(wire.Dropped):
        for _ in range(100):
            rx.feed(b"FL" + b"\x00" * 1000)


def test_replaying_a_frame_within_a_stream_fails() -> None:
    tx, rx = pair()
    frame = tx.encode(wire.Kind.RANK_EXITED, {"rank": 0, "code": 0})
    rx.feed(frame)
    assert rx.next_frame() is not None
    rx.feed(frame)  # the same bytes again: the receiver expects sequence 1 now
    with pytest.raises(wire.Dropped) as caught:
        rx.next_frame()
    assert caught.value.cause == "tag"


def test_rekey_switches_both_sides_to_the_connection_key() -> None:
    tx, rx = pair()
    rx.feed(tx.encode(wire.Kind.ACCEPT, {}))
    rx.next_frame()
    conn = wire.connection_key(KEY, b"s" * 16, b"c" * 16)
    assert conn != wire.connection_key(KEY, b"s" * 16, b"d" * 16)
    tx.rekey(conn)
    rx.feed(tx.encode(wire.Kind.HEARTBEAT))
    with pytest.raises(wire.Dropped):
        rx.next_frame()  # rx still on the old key
    rx2_tx, rx2 = wire.Codec(KEY), wire.Codec(KEY)
    rx2.feed(rx2_tx.encode(wire.Kind.ACCEPT, {}))
    rx2.next_frame()
    rx2_tx.rekey(conn)
    rx2.rekey(conn)
    rx2.feed(rx2_tx.encode(wire.Kind.HEARTBEAT))
    assert rx2.next_frame() is not None


def test_payloads_must_be_maps_without_extension_types() -> None:
    import msgpack

    for payload in (msgpack.packb([1, 2]), msgpack.packb({"x": msgpack.ExtType(5, b"zz")})):
        tx = wire.Codec(KEY)
        tag = tx._tag(0, wire.Kind.HELLO, payload)
        rx = wire.Codec(KEY)
        rx.feed(wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.Kind.HELLO, len(payload), tag) + payload)
        with pytest.raises(wire.Dropped) as caught:
            rx.next_frame()
        assert caught.value.cause == "payload"


@pytest.mark.parametrize(
    ("first", "channel"),
    [
        (b"FLJ1", preamble.Channel.JOIN),
        (b"FLR1", preamble.Channel.RENDEZVOUS),
        (b"FLD1", preamble.Channel.DATA),
        (b"FLC1", preamble.Channel.CONTROL),
        (b"GET ", preamble.Channel.HTTP),
        (b"POST", preamble.Channel.HTTP),
        (b"HTTP", None),
        (b"\x00\x00\x00\x00", None),
        (b"PUT ", preamble.Channel.HTTP),  # answered 405 by the status surface
        (b"OPTI", preamble.Channel.HTTP),
        (b"PUTS", preamble.Channel.HTTP),  # a method the surface does not serve: 501
        (b"BREW", preamble.Channel.HTTP),
        (b"PROP", preamble.Channel.HTTP),
        (b"Get ", None),
        (b"GE  ", None),
        (b"FLX1", None),
        (b"\x16\x03\x01\x02", None),  # a TLS ClientHello on a cleartext port
    ],
)
def test_preamble_selects_the_channel(first: bytes, channel: preamble.Channel | None) -> None:
    assert preamble.classify(first) is channel


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=600), st.integers(1, 64))
def test_fuzzed_bytes_never_crash_and_never_authenticate(data: bytes, chunk: int) -> None:
    rx = wire.Codec(KEY, max_payload=512)
    try:
        for i in range(0, len(data), chunk):
            rx.feed(data[i : i + chunk])
            assert list(rx.frames()) == []  # random bytes never carry a valid tag
    except wire.Dropped as exc:
        assert exc.cause in wire.CAUSES
    assert rx.buffered <= wire.HEADER.size + 512 + chunk


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.text(max_size=8),
        st.one_of(
            st.integers(-(2**63), 2**64 - 1),
            st.text(max_size=20),
            st.binary(max_size=20),
            st.booleans(),
            st.none(),
        ),
        max_size=6,
    )
)
def test_any_map_round_trips(body: dict[str, object]) -> None:
    tx, rx = pair()
    rx.feed(tx.encode(wire.Kind.REPLY, body))
    frame = rx.next_frame()
    assert frame is not None and frame.body == body


def test_bulk_frames_carry_raw_bytes_in_any_chunking() -> None:
    tx, rx = wire.Codec(KEY, max_payload=8 << 20), wire.Codec(KEY, max_payload=8 << 20)
    blobs = [b"", bytes(range(256)) * (3 << 12), bytes(reversed(range(256))) * (3 << 12)]  # 3 MiB: > BIG
    data = b"".join(
        b"".join(tx.encode_parts(wire.Kind.AVERAGE, {"round": r}, blob)) for r, blob in enumerate(blobs)
    ) + tx.encode(wire.Kind.HEARTBEAT)
    got = []
    for i in range(0, len(data), 100_003):
        rx.feed(data[i : i + 100_003])
        # A blob is a view valid until the next feed (the second big frame reuses the first's buffer).
        got += [(f.kind, f.body.get("round"), bytes(f.blob)) for f in rx.frames()]
    assert got == [
        *((wire.Kind.AVERAGE, r, blob) for r, blob in enumerate(blobs)),
        (wire.Kind.HEARTBEAT, None, b""),
    ]
    assert rx.buffered == 0


@pytest.mark.parametrize("where", ["map", "blob", "length"])
def test_a_flipped_byte_in_a_bulk_frame_is_refused(where: str) -> None:
    tx, rx = pair()
    data = bytearray(b"".join(tx.encode_parts(wire.Kind.AVERAGED, {"round": 3}, b"\x01" * 1000)))
    meta = wire.HEADER.size
    offset = {"map": meta + wire.META.size + 2, "blob": len(data) - 7, "length": meta + 3}
    data[offset[where]] ^= 0x40
    rx.feed(bytes(data))
    with pytest.raises(wire.Dropped) as caught:
        rx.next_frame()
    assert caught.value.cause in ("tag", "payload")


def test_a_bulk_kind_flows_one_way_on_a_connection() -> None:
    a, b = pair()
    b.feed(b"".join(a.encode_parts(wire.Kind.AVERAGE, {"round": 0}, b"\x00" * 8)))
    assert b.next_frame() is not None
    with pytest.raises(ValueError, match="other way"):
        b.encode_parts(wire.Kind.AVERAGE, {"round": 0}, b"\x00" * 8)
    # A peer that sends it back anyway (same one-time key: a forgery risk) is dropped.
    b2 = wire.Codec(KEY)
    b2.encode_parts(wire.Kind.AVERAGE, {"round": 0}, b"")
    b2.feed(b"".join(wire.Codec(KEY).encode_parts(wire.Kind.AVERAGE, {"round": 0}, b"")))
    with pytest.raises(wire.Dropped) as caught:
        b2.next_frame()
    assert caught.value.cause == "kind"


@pytest.mark.parametrize("forged", [True, False])
def test_a_bulk_frame_in_its_destination_is_verified_before_its_direction_is_judged(forged: bool) -> None:
    # Raw bytes received straight into their destination take the same checks, in the same
    # order: a forgery is counted as a bad tag, whichever way its kind flows.
    tx, back = wire.Codec(KEY, max_payload=2 << 20), wire.Codec(KEY, max_payload=2 << 20)
    back.encode_parts(wire.Kind.AVERAGE, {"r": 0}, b"")  # AVERAGE now flows from this side
    data = bytearray(b"".join(tx.encode_parts(wire.Kind.AVERAGE, {"r": 0}, b"\x01" * (1 << 20))))
    if forged:
        data[-3] ^= 0x10
    with pytest.raises(wire.Dropped) as caught:
        receive(back, bytes(data), 1 << 16)
    assert caught.value.cause == ("tag" if forged else "kind")


def test_only_bulk_kinds_carry_raw_bytes() -> None:
    with pytest.raises(ValueError, match="no raw bytes"):
        wire.Codec(KEY).encode_parts(wire.Kind.HEARTBEAT, {}, b"x")


def _rfc5869(ikm: bytes, info: bytes, length: int) -> bytes:
    """HKDF-SHA256 as RFC 5869 writes it (no salt: a hash-length string of zeros), by hand."""
    prk = hmac.new(bytes(32), ikm, hashlib.sha256).digest()
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out, counter = out + block, counter + 1
    return out[:length]


TOKEN = bytes.fromhex("00112233445566778899aabbccddeeff")


@pytest.mark.parametrize("host", ["w1", "w2", "node-a.example.com", "ünï"])
def test_a_host_key_is_hkdf_of_the_run_key_for_that_name(host: str) -> None:
    key = wire.host_key(TOKEN, host)
    assert key == _rfc5869(TOKEN, b"flodl host " + host.encode(), 16)
    assert len(key) == wire.KEY_BYTES and key != TOKEN


def test_host_keys_differ_per_name_and_per_run_key() -> None:
    names = ["w1", "w2", "w10", "w1 ", "W1", ""]
    keys = {wire.host_key(TOKEN, n) for n in names}
    assert len(keys) == len(names)
    assert wire.host_key(TOKEN, "w1") != wire.host_key(TOKEN[::-1], "w1")
    # a host key is no run key: deriving from it gives nobody else's key
    assert wire.host_key(wire.host_key(TOKEN, "w1"), "w2") != wire.host_key(TOKEN, "w2")


def test_a_frame_keyed_by_its_own_map_verifies_under_the_key_it_names() -> None:
    keys = {"a": wire.host_key(TOKEN, "a"), "b": wire.host_key(TOKEN, "b")}
    frame = wire.Codec(keys["a"]).encode(wire.Kind.HELLO, {"host": "a"})
    asked: list[object] = []

    def key_of(kind: wire.Kind, body: dict[str, object]) -> bytes:
        asked.append((kind, body))
        return keys[str(body["host"])]

    receiver = wire.Codec(wire.OPEN_KEY)
    receiver.feed(frame[:-1])
    assert receiver.next_frame_keyed(key_of) is None and asked == []  # not whole: nothing asked
    receiver.feed(frame[-1:])
    got = receiver.next_frame_keyed(key_of)
    assert got is not None and got.body == {"host": "a"} and receiver.key == keys["a"]
    assert asked == [(wire.Kind.HELLO, {"host": "a"})]
    # the same frame claiming another name fails that name's key
    forged = wire.Codec(keys["a"]).encode(wire.Kind.HELLO, {"host": "b"})
    other = wire.Codec(wire.OPEN_KEY)
    other.feed(forged)
    with pytest.raises(wire.Dropped) as caught:
        other.next_frame_keyed(key_of)
    assert caught.value.cause == "tag"


def receive(rx: wire.Codec, data: bytes, step: int) -> list[wire.Frame]:
    """What a link's protocol does: straight into ``direct()`` when the codec has a place for
    the bytes, else stage and feed; a frame is handed out (and consumed) as it verifies."""
    got, at = [], 0
    while at < len(data):
        into = rx.direct()
        n = min(step, len(data) - at, len(into) if into is not None else step)
        if into is not None:
            into[:n] = data[at : at + n]
            rx.filled(n)
        else:
            rx.feed(data[at : at + n])
        at += n
        got += [wire.Frame(f.kind, f.body, bytes(f.blob)) for f in rx.frames()]
    return got


def test_bulk_bytes_are_received_straight_into_the_sinks_destination() -> None:
    tx, rx = wire.Codec(KEY, max_payload=8 << 20), wire.Codec(KEY, max_payload=8 << 20)
    place = bytearray(4 << 20)
    asked: list[tuple[wire.Kind, int, int]] = []

    def sink(kind: wire.Kind, body: dict[str, object], n: int) -> memoryview | None:
        asked.append((kind, int(body["at"]), n))  # type: ignore[call-overload]
        return memoryview(place)[int(body["at"]) : int(body["at"]) + n]  # type: ignore[call-overload]

    rx.sink = sink
    blobs = [bytes([i + 1]) * (1 << 20) for i in range(3)]
    data = b"".join(
        b"".join(tx.encode_parts(wire.Kind.AVERAGE, {"at": i << 20}, blob)) for i, blob in enumerate(blobs)
    ) + tx.encode(wire.Kind.HEARTBEAT)
    got = receive(rx, data, 300_007)
    assert [(f.kind, f.blob) for f in got] == [(wire.Kind.AVERAGE, b) for b in blobs] + [
        (wire.Kind.HEARTBEAT, b"")
    ]
    assert asked == [(wire.Kind.AVERAGE, i << 20, 1 << 20) for i in range(3)]
    assert bytes(place[: 3 << 20]) == b"".join(blobs)  # the bytes lie where the sink said
    assert rx.buffered == 0


def test_without_a_sink_bulk_bytes_land_in_one_reused_buffer() -> None:
    tx, rx = wire.Codec(KEY, max_payload=8 << 20), wire.Codec(KEY, max_payload=8 << 20)
    data = b"".join(
        b"".join(tx.encode_parts(wire.Kind.AVERAGE, {"r": r}, bytes([r]) * (1 << 20))) for r in range(3)
    )
    views = []
    at = 0
    while at < len(data):
        if (into := rx.direct()) is not None:
            n = min(len(into), len(data) - at)
            into[:n] = data[at : at + n]
            rx.filled(n)
        else:
            n = min(rx.wanted or 1, len(data) - at)  # only what the frame's head needs
            rx.feed(data[at : at + n])
        at += n
        for frame in rx.frames():
            views.append((frame.body["r"], bytes(frame.blob[:2]), frame.blob.obj))  # type: ignore[union-attr]
    assert [(r, head) for r, head, _ in views] == [(r, bytes([r]) * 2) for r in range(3)]
    assert views[0][2] is views[1][2] is views[2][2]  # fresh pages cost a fault each: one buffer serves


def test_a_bulk_frame_whose_raw_bytes_fail_their_tag_is_refused_though_they_landed() -> None:
    tx, rx = wire.Codec(KEY, max_payload=2 << 20), wire.Codec(KEY, max_payload=2 << 20)
    place = bytearray(1 << 20)
    rx.sink = lambda kind, body, n: memoryview(place)[:n]
    data = bytearray(b"".join(tx.encode_parts(wire.Kind.AVERAGE, {"r": 0}, b"\x07" * (1 << 20))))
    data[-3] ^= 0x10
    with pytest.raises(wire.Dropped) as caught:
        receive(rx, bytes(data), 1 << 16)
    assert caught.value.cause == "tag" and place[0] == 7  # in place, and never handed out


def test_a_bulk_frames_map_is_checked_before_its_raw_bytes_arrive() -> None:
    rx = wire.Codec(KEY, max_payload=8 << 20)
    head = wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.Kind.AVERAGE, 4 << 20, bytes(32))
    rx.feed(head + wire.META.pack(wire.CONTROL_MAX + 1))
    with pytest.raises(wire.Dropped, match="map of"):
        rx.next_frame()
    rx = wire.Codec(KEY, max_payload=8 << 20)
    rx.feed(head + wire.META.pack(5 << 20))
    with pytest.raises(wire.Dropped, match="overruns"):
        rx.next_frame()


@pytest.mark.parametrize("length", [0, 1, 3])
def test_a_bulk_frame_too_short_to_say_its_maps_length_is_a_bad_payload(length: int) -> None:
    # The fuzzer's find: an authentic bulk frame of fewer than 4 bytes broke the map's unpacking.
    payload = bytes(length)
    tag = wire.Codec(KEY)._tag(0, wire.Kind.AVERAGE, payload, b"")
    rx = wire.Codec(KEY)
    rx.feed(wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.Kind.AVERAGE, length, tag) + payload)
    with pytest.raises(wire.Dropped, match="too short for its map's length") as caught:
        rx.next_frame()
    assert caught.value.cause == "payload"


@given(
    shared=st.dictionaries(
        st.text(max_size=8), st.integers(-(2**63), 2**63 - 1) | st.text(max_size=20), max_size=20
    ),
    own=st.dictionaries(st.text(min_size=9, max_size=12), st.integers(0, 2**32), max_size=3),
)
def test_a_shared_map_encodes_the_frame_its_merged_map_would(
    shared: dict[str, object], own: dict[str, object]
) -> None:
    a, b = pair()
    assert a.encode_shared(wire.Kind.WORLD_FORMED, wire.SharedMap.of(shared), own) == b.encode(
        wire.Kind.WORLD_FORMED, {**shared, **own}
    )

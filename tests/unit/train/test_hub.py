"""The CPU plane's hub: weighted averaging rounds, streamed piece by piece (pure)."""

from __future__ import annotations

import numpy as np
import pytest

from flodl_agent.train.hub import (
    CHUNK,
    CHUNKS_MAX,
    Averaged,
    Hub,
    Mismatch,
    chunk_for,
    from_bf16,
    plan,
    to_bf16,
)


def f32(*values: float) -> bytes:
    return np.array(values, dtype=np.float32).tobytes()


def floats(piece: Averaged) -> list[float]:
    return np.frombuffer(piece.data, np.float32).tolist()


def test_a_round_completes_when_every_training_host_pushed_and_divides_once() -> None:
    hub = Hub({"a", "b"})
    # pre-scaled: a holds two ranks (weights 1 and 2), b one (weight 3)
    assert hub.push("a", 0, 3.0, f32(1 * 1 + 2 * 2, 0)) == []
    (done,) = hub.push("b", 0, 3.0, f32(3 * 3, 6))
    assert done.hosts == {"a", "b"} and done.weight == 6.0 and done.last
    assert floats(done) == pytest.approx([14 / 6, 1.0])
    assert hub.rounds_done == 1
    assert done.weights == {"a": 3.0, "b": 3.0}  # what each host brought: its share of the round


def test_zero_weight_hosts_are_excluded_but_still_answered() -> None:
    hub = Hub({"a", "b"})
    hub.push("a", 0, 0.0, f32(100, 100))
    (done,) = hub.push("b", 0, 2.0, f32(4, 2))
    assert done.hosts == {"a", "b"} and done.weights == {"a": 0.0, "b": 2.0}
    assert floats(done) == [2.0, 1.0]
    # A host that took no step sends one empty piece: it holds up nothing.
    assert hub.push("a", 1, 0.0, b"", params=2) == []
    (done,) = hub.push("b", 1, 1.0, f32(3, 5))
    assert floats(done) == [3.0, 5.0] and done.weights == {"a": 0.0, "b": 1.0}


def test_a_round_nobody_stepped_is_answered_without_data() -> None:
    hub = Hub({"a", "b"})
    hub.push("a", 0, 0.0, b"", params=3)
    (done,) = hub.push("b", 0, 0.0, b"", params=3)
    assert done.last and done.weight == 0.0 and done.data == b"" and done.params == 3


def test_a_host_that_leaves_no_longer_holds_rounds_and_shares_renormalize() -> None:
    hub = Hub({"a", "b", "c"})
    hub.push("a", 0, 1.0, f32(1))
    hub.push("b", 0, 1.0, f32(3))
    (done,) = hub.leave("c")  # c died: round 0 completes with a and b
    assert done.round == 0 and floats(done) == [2.0]
    assert hub.push("a", 1, 1.0, f32(5)) == []
    assert hub.push("b", 1, 1.0, f32(7)) != []


def test_pieces_are_averaged_and_handed_out_as_soon_as_every_host_has_sent_them() -> None:
    rng = np.random.default_rng(7)
    size = 10
    a, b = rng.standard_normal(size).astype(np.float32), rng.standard_normal(size).astype(np.float32)
    pieces = plan(size, chunk=4)
    assert pieces == [(0, 4), (4, 8), (8, 10)]
    hub = Hub({"a", "b"})
    for first, stop in pieces:  # a races ahead: nothing is whole until b catches up
        assert hub.push("a", 0, 2.0, a[first:stop].tobytes(), offset=first, params=size) == []
    out: list[Averaged] = []
    for first, stop in pieces:
        (piece,) = hub.push("b", 0, 3.0, b[first:stop].tobytes(), offset=first, params=size)
        assert (piece.offset, len(piece.data) // 4, piece.last) == (first, stop - first, stop == size)
        out.append(piece)
    assert np.concatenate([np.frombuffer(p.data, np.float32) for p in out]) == pytest.approx((a + b) / 5)
    assert out[-1].weights == {"a": 2.0, "b": 3.0} and hub.rounds_done == 1


def test_interleaved_pieces_of_any_size_come_back_in_order() -> None:
    hub = Hub({"a", "b"})
    got = hub.push("a", 0, 1.0, f32(1, 2, 3), params=6)
    got += hub.push("b", 0, 1.0, f32(3, 4), params=6)  # b chunks differently: 2 are whole
    got += hub.push("b", 0, 1.0, f32(5, 6, 7, 8), offset=2, params=6)
    got += hub.push("a", 0, 1.0, f32(4, 5, 6), offset=3, params=6)
    assert [(p.offset, floats(p)) for p in got] == [(0, [2.0, 3.0]), (2, [4.0]), (3, [5.0, 6.0, 7.0])]


def test_a_host_gone_mid_round_counts_where_it_delivered() -> None:
    hub = Hub({"a", "b", "c"})
    hub.push("a", 0, 1.0, f32(1, 1, 1, 1), params=4)  # pre-scaled: a weighs 1, b 1, c 2
    hub.push("b", 0, 1.0, f32(3, 3), params=4)
    (first,) = hub.push("c", 0, 2.0, f32(6, 6, 6), params=4)
    assert (first.offset, floats(first), first.weight) == (0, [2.5, 2.5], 4.0)
    assert hub.push("c", 0, 2.0, b"", offset=3, params=4) == []  # an empty piece: no progress
    # b dies having delivered 2 of 4: what it sent counted, the rest averages over a and c.
    (piece,) = hub.leave("b")
    assert (piece.offset, floats(piece), piece.weight) == (2, [pytest.approx(7 / 3)], 3.0)
    assert piece.hosts == {"a", "c"} and not piece.last and hub.missing(0) == {"c"}
    (last,) = hub.push("c", 0, 2.0, f32(8), offset=3, params=4)
    assert last.last and floats(last) == [3.0] and hub.missing(0) == set()
    assert last.weights == {"a": 1.0, "b": 1.0, "c": 2.0}


def test_a_departure_splits_a_stretch_where_the_host_stopped() -> None:
    hub = Hub({"a", "b"})
    hub.push("a", 0, 1.0, f32(2, 2), params=4)
    hub.push("b", 0, 1.0, f32(4), params=4)  # one whole piece out: [0, 1)
    pieces = hub.leave("a")  # a delivered 2, b only 1: nothing more is whole until b goes on
    assert pieces == []
    got = hub.push("b", 0, 1.0, f32(4, 4, 4), offset=1, params=4)
    assert [(p.offset, floats(p), p.weight) for p in got] == [(1, [3.0], 2.0), (2, [4.0, 4.0], 1.0)]
    assert got[-1].last and got[-1].hosts == {"b"}


def test_refusals_parameter_count_repeats_order_and_bad_weights() -> None:
    hub = Hub({"a", "b"})
    hub.push("a", 0, 1.0, f32(1, 2))
    with pytest.raises(Mismatch, match="parameter count mismatch: b averages 3 parameters, the world 2"):
        hub.push("b", 0, 1.0, f32(1, 2, 3))
    with pytest.raises(Mismatch, match="twice"):
        hub.push("a", 0, 1.0, f32(1, 2))
    with pytest.raises(Mismatch, match="weight"):
        hub.push("b", 0, float("nan"), f32(1, 2))
    with pytest.raises(Mismatch, match="float32"):
        hub.push("b", 0, 1.0, b"\x00" * 7)
    hub.push("b", 1, 1.0, f32(1), params=2)
    with pytest.raises(Mismatch, match="parameters 0-1 of round 1; expected the next from 1 of 2"):
        hub.push("b", 1, 1.0, f32(1), offset=0, params=2)  # a piece again, or out of order
    with pytest.raises(Mismatch, match="expected the next from 1 of 2"):
        hub.push("b", 1, 1.0, f32(1, 2), offset=1, params=2)  # past the end
    with pytest.raises(Mismatch, match="changed its weight"):
        hub.push("b", 1, 2.0, f32(1), offset=1, params=2)
    assert hub.missing(1) == {"a", "b"}


def test_an_answered_rounds_buffer_is_not_reused_by_the_next_round() -> None:
    hub = Hub({"a"})
    (first,) = hub.push("a", 0, 1.0, f32(1, 2))
    hub.push("a", 1, 1.0, f32(3, 4))  # round 0's pieces may still be on a slow link
    assert floats(first) == [1.0, 2.0]
    (third,) = hub.push("a", 2, 1.0, f32(5, 6))  # two rounds on: round 0's buffer comes back
    assert floats(third) == [5.0, 6.0]


def test_bfloat16_wire_matches_torch_rounding_and_halves_the_bytes() -> None:
    torch = pytest.importorskip("torch")

    values = np.array([1.0, -2.5, 3.14159, 1e-8, 65504.0, 1.00390625, float("inf"), float("nan")], np.float32)
    ours = np.frombuffer(to_bf16(values), np.uint16)
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert ours[:-1].tolist() == theirs[:-1].tolist() and np.isnan(from_bf16(ours.tobytes())[-1])
    assert len(to_bf16(values)) == 2 * len(values)

    hub = Hub({"a", "b"})
    hub.push("a", 0, 1.0, to_bf16(np.array([1.0, 2.0], np.float32)), bf16=True)
    (done,) = hub.push("b", 0, 1.0, to_bf16(np.array([3.0, 4.0], np.float32)), bf16=True)
    assert done.bf16 and len(done.data) == 4
    assert from_bf16(done.data).tolist() == [2.0, 3.0]
    with pytest.raises(Mismatch, match="not bfloat16"):
        Hub({"a"}).push("a", 0, 1.0, b"\x00" * 3, bf16=True)


def test_bfloat16_rounding_of_finite_pieces_and_a_lone_nan() -> None:
    """The finite fast path rounds as torch does (ties to even included); a NaN whose bits
    would round into an infinity stays a NaN."""
    torch = pytest.importorskip("torch")

    bits = np.random.default_rng(0).integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    bits[:4] = [0x3F808000, 0x3F818000, 0x00008000, 0x7F7F8000]  # exact ties, the largest float's
    values = bits.view(np.float32)
    values = values[np.isfinite(values)]
    ours = np.frombuffer(to_bf16(values), np.uint16)
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert ours.tolist() == theirs.tolist()
    lone = np.array([1.0, np.uint32(0x7F800001).view(np.float32)], np.float32)  # a NaN, no infinity
    assert np.frombuffer(to_bf16(lone), np.uint16).tolist() == [0x3F80, 0x7FC0]


def test_pieces_are_what_the_link_carries_in_a_few_milliseconds_within_bounds() -> None:
    gbit = 125e6  # bytes a second: a 1 Gbit/s worker link
    assert chunk_for(None) == CHUNK  # no round yet
    assert chunk_for(gbit) == CHUNK  # a 1 MiB piece takes 8 ms there already
    assert chunk_for(1.3 * gbit) == 2 * CHUNK
    assert chunk_for(10 * gbit) == CHUNKS_MAX * CHUNK  # a fast link: capped
    assert chunk_for(1.3 * gbit, width=2) == 2 * chunk_for(1.3 * gbit)  # bfloat16: half the bytes a parameter
    assert chunk_for(0.0) == chunk_for(float("nan")) == chunk_for(-1.0) == CHUNK
    size = 10 * CHUNK + 3
    pieces = plan(size, chunk_for(10 * gbit))
    assert pieces[0] == (0, 4 * CHUNK) and pieces[-1] == (8 * CHUNK, size) and len(pieces) == 3


def test_a_round_below_the_resumed_floor_is_answered_with_weight_zero_and_never_opened() -> None:
    hub = Hub({"a", "b"})
    assert hub.resume(3) == [] and hub.floor == 3 and hub.active  # the re-adopted hosts had averaged
    (abandoned,) = hub.push("b", 2, 1.0, f32(1, 2), params=4)  # b lagged a round behind the floor
    assert (abandoned.round, abandoned.hosts, abandoned.weight, abandoned.data) == (2, {"b"}, 0.0, b"")
    assert abandoned.last and hub.missing(2) == set()  # never opened: nothing waits on it
    assert hub.push("b", 2, 1.0, f32(3, 4), offset=2, params=4) == []  # the round's later pieces
    assert hub.resume(2) == [] and hub.floor == 3  # the floor is the highest round said
    hub.push("a", 3, 1.0, f32(1, 1, 1, 1))  # at the floor: averaged as ever
    (done,) = hub.push("b", 3, 1.0, f32(3, 3, 3, 3))
    assert floats(done) == [2.0] * 4 and done.weight == 2.0 and hub.rounds_done == 1


def test_a_rising_floor_ends_the_open_rounds_below_it_for_the_hosts_that_pushed_them() -> None:
    hub = Hub({"a", "b", "c"})
    hub.push("b", 4, 1.0, f32(1, 2), params=4)  # b and c resumed at 4 and pushed it, half of it for b
    hub.push("c", 4, 2.0, f32(2, 4, 6, 8), params=4)
    hub.push("c", 5, 1.0, f32(1, 1, 1, 1))  # and one round on (a round at the floor stays open)
    (abandoned,) = hub.resume(5)  # a had round 4 answered before the controller died
    assert (abandoned.round, abandoned.hosts, abandoned.weight, abandoned.last) == (4, {"b", "c"}, 0.0, True)
    assert abandoned.data == b"" and abandoned.params == 4 and hub.missing(4) == set()
    assert hub.push("b", 4, 1.0, f32(3, 4), offset=2, params=4) == []  # b's rest of round 4
    assert hub.missing(5) == {"a", "b"}
    hub.push("a", 5, 1.0, f32(2, 2, 2, 2))
    (done,) = hub.push("b", 5, 1.0, f32(3, 3, 3, 3))
    assert floats(done) == [2.0] * 4 and done.hosts == {"a", "b", "c"}

"""The CPU plane's hub: weighted averaging rounds (pure)."""

from __future__ import annotations

import numpy as np
import pytest

from flodl_agent.hub import Hub, Mismatch


def f32(*values: float) -> bytes:
    return np.array(values, dtype=np.float32).tobytes()


def test_a_round_completes_when_every_training_host_pushed_and_divides_once() -> None:
    hub = Hub({"a", "b"})
    # pre-scaled: a holds two ranks (weights 1 and 2), b one (weight 3)
    assert hub.push("a", 0, 3.0, f32(1 * 1 + 2 * 2, 0)) is None
    done = hub.push("b", 0, 3.0, f32(3 * 3, 6))
    assert done is not None and done.hosts == {"a", "b"} and done.weight == 6.0
    assert np.frombuffer(done.data, np.float32).tolist() == pytest.approx([14 / 6, 1.0])
    assert hub.rounds_done == 1
    assert done.weights == {"a": 3.0, "b": 3.0}  # what each host brought: its share of the round


def test_zero_weight_hosts_are_excluded_but_still_answered() -> None:
    hub = Hub({"a", "b"})
    hub.push("a", 0, 0.0, f32(100, 100))
    done = hub.push("b", 0, 2.0, f32(4, 2))
    assert done is not None and done.hosts == {"a", "b"} and done.weights == {"a": 0.0, "b": 2.0}
    assert np.frombuffer(done.data, np.float32).tolist() == [2.0, 1.0]


def test_a_host_that_leaves_no_longer_holds_rounds_and_shares_renormalize() -> None:
    hub = Hub({"a", "b", "c"})
    hub.push("a", 0, 1.0, f32(1))
    hub.push("b", 0, 1.0, f32(3))
    (done,) = hub.leave("c")  # c died: round 0 completes with a and b
    assert done.round == 0 and np.frombuffer(done.data, np.float32).tolist() == [2.0]
    assert hub.push("a", 1, 1.0, f32(5)) is None
    assert hub.push("b", 1, 1.0, f32(7)) is not None


def test_refusals_parameter_count_repeats_and_bad_weights() -> None:
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


def test_bfloat16_wire_matches_torch_rounding_and_halves_the_bytes() -> None:
    torch = pytest.importorskip("torch")
    from flodl_agent.hub import from_bf16, to_bf16

    values = np.array([1.0, -2.5, 3.14159, 1e-8, 65504.0, 1.00390625, float("inf"), float("nan")], np.float32)
    ours = np.frombuffer(to_bf16(values), np.uint16)
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert ours[:-1].tolist() == theirs[:-1].tolist() and np.isnan(from_bf16(ours.tobytes())[-1])
    assert len(to_bf16(values)) == 2 * len(values)

    hub = Hub({"a", "b"})
    hub.push("a", 0, 1.0, to_bf16(np.array([1.0, 2.0], np.float32)), bf16=True)
    done = hub.push("b", 0, 1.0, to_bf16(np.array([3.0, 4.0], np.float32)), bf16=True)
    assert done is not None and done.bf16 and len(done.data) == 4
    assert from_bf16(done.data).tolist() == [2.0, 3.0]
    with pytest.raises(Mismatch, match="not bfloat16"):
        Hub({"a"}).push("a", 0, 1.0, b"\x00" * 3, bf16=True)

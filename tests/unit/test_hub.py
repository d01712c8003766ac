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


def test_zero_weight_hosts_are_excluded_but_still_answered() -> None:
    hub = Hub({"a", "b"})
    hub.push("a", 0, 0.0, f32(100, 100))
    done = hub.push("b", 0, 2.0, f32(4, 2))
    assert done is not None and done.hosts == {"a", "b"}
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

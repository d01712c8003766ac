"""Message bodies parsed off the wire: typed, and bounded before anything trusts them."""

from __future__ import annotations

import pytest

from flodl_agent.protocol import wire
from flodl_agent.protocol.messages import BadMessage, Heartbeat, parse


def test_heartbeats_are_bounded_and_typed() -> None:
    frame = wire.Frame(wire.Kind.HEARTBEAT, {"ranks": {"3": {"step": 4, "loss": 0.25, "at": 1.0}}})
    beat = parse(frame)
    assert isinstance(beat, Heartbeat) and beat.ranks[3].step == 4
    with pytest.raises(BadMessage, match="heartbeat"):
        parse(wire.Frame(wire.Kind.HEARTBEAT, {"ranks": {"0": {"step": -1}}}))
    with pytest.raises(BadMessage):
        parse(wire.Frame(wire.Kind.HEARTBEAT, {"ranks": {str(r): {"step": 0} for r in range(2000)}}))

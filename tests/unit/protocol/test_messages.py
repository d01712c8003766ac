"""Message bodies parsed off the wire: typed, and bounded before anything trusts them."""

from __future__ import annotations

import pytest

from flodl_agent.protocol import wire
from flodl_agent.protocol.messages import BadMessage, Heartbeat, Hello, WorldFormed, parse


def test_heartbeats_are_bounded_and_typed() -> None:
    frame = wire.Frame(wire.Kind.HEARTBEAT, {"ranks": {"3": {"step": 4, "loss": 0.25, "at": 1.0}}})
    beat = parse(frame)
    assert isinstance(beat, Heartbeat) and beat.ranks[3].step == 4
    with pytest.raises(BadMessage, match="heartbeat"):
        parse(wire.Frame(wire.Kind.HEARTBEAT, {"ranks": {"0": {"step": -1}}}))
    with pytest.raises(BadMessage):
        parse(wire.Frame(wire.Kind.HEARTBEAT, {"ranks": {str(r): {"step": 0} for r in range(2000)}}))


WORLD = {"world_size": 1, "host": {"host": "a", "first_rank": 0, "count": 1}, "group": 0, "hosts": 1}


@pytest.mark.parametrize(
    ("fields", "where", "fragment"),
    [
        ({"command": ["x"], "env": {"A": "x\x00y"}}, "env.A", "NUL byte"),
        ({"command": ["x"], "env": {"A": "\ud800"}}, "env.A", "lone surrogate"),
        ({"command": ["x"], "env": {"A\x00": "x"}}, "env.A\\x00", "NUL byte"),
        ({"command": ["x"], "env": {"A=B": "x"}}, "env.A=B", "holds `=`"),
        ({"command": ["x"], "env": {"": "x"}}, "env.", "name is empty"),
        ({"command": ["python", "a\x00"]}, "command.1", "NUL byte"),
        ({"command": []}, "command", "at least 1"),
        ({"command": ["x"], "host": {**WORLD["host"], "docker": "-x"}}, "host.docker", "compose service"),
    ],
)
def test_a_world_no_process_could_be_started_from_is_a_bad_message_naming_the_field(
    fields: dict[str, object], where: str, fragment: str
) -> None:
    # What a controller says to run reaches exec and the ranks' environment: refused as a
    # malformed message (a transient failure at the agent), not a crash at spawn.
    with pytest.raises(BadMessage) as caught:
        parse(wire.Frame(wire.Kind.WORLD_FORMED, {**WORLD, **fields}))
    assert str(caught.value).startswith(f"world_formed: {where}: ") and fragment in str(caught.value)


def test_a_world_with_passable_text_parses() -> None:
    body = {**WORLD, "command": ["python", "-c", "print('a=b')"], "env": {"A": "x=y\nz", "B": ""}}
    world = parse(wire.Frame(wire.Kind.WORLD_FORMED, body))
    assert isinstance(world, WorldFormed) and world.env == {"A": "x=y\nz", "B": ""}


HELLO = {"nonce": b"n" * 16, "client_nonce": b"c" * 16, "host": "a", "devices": ["cpu:0"]}


@pytest.mark.parametrize(
    ("claim", "where"),
    [
        ({"launch": "0A1B2C3D", "first": 0, "count": 1}, "resume.launch"),  # its label is lower hex
        ({"launch": "0a1b2c3d", "first": -1, "count": 1}, "resume.first"),
        ({"launch": "0a1b2c3d", "first": 0, "count": 0}, "resume.count"),
        ({"launch": "0a1b2c3d", "first": 0}, "resume.count"),
    ],
)
def test_a_resume_claim_the_journal_could_not_hold_is_a_bad_hello_naming_the_field(
    claim: dict[str, object], where: str
) -> None:
    with pytest.raises(BadMessage) as caught:
        parse(wire.Frame(wire.Kind.HELLO, {**HELLO, "resume": claim}))
    assert str(caught.value).startswith(f"hello: {where}: ")
    plain = parse(wire.Frame(wire.Kind.HELLO, HELLO))
    good = {"launch": "0a1b2c3d", "first": 2, "count": 1}
    resumed = parse(wire.Frame(wire.Kind.HELLO, {**HELLO, "resume": good}))
    assert isinstance(plain, Hello) and isinstance(resumed, Hello)
    assert plain.resume is None and resumed.resume is not None and resumed.resume.first == 2

"""The join handshake as bytes in, events out: every path without a socket."""

from __future__ import annotations

from typing import Any

import pytest

from flodl_agent.protocol import preamble, wire
from flodl_agent.protocol.join_protocol import (
    NEED_DATA,
    RATE_LIMITED,
    Aborted,
    Accepted,
    Challenged,
    Closed,
    Formed,
    HelloReceived,
    JoinClient,
    JoinError,
    JoinServer,
    KeyRefused,
    Message,
    Refused,
    State,
    WrongKey,
    wrong_key,
)
from flodl_agent.protocol.messages import Average, BadMessage, Heartbeat, RankExited, Stream

TOKEN = bytes.fromhex("00112233445566778899aabbccddeeff")
SALT = bytes(range(16))
HELLO: dict[str, Any] = {"host": "box-a", "devices": ["cpu:0", "cpu:1"]}
BOX_A = wire.host_key(TOKEN, "box-a")  # what box-a holds: its own name's key


def open_server() -> JoinServer:
    """Open admission: pre-admission frames under zeros, the salt handed out in Accept."""
    return JoinServer(None, salt=SALT)


def token_server() -> JoinServer:
    """Names bound: a hello must be tagged with the host key of the name it gives."""
    return JoinServer(TOKEN)


def events(side: JoinServer | JoinClient, data: bytes, chunk: int | None = None) -> list[Any]:
    """Feed ``data`` (in pieces of ``chunk`` bytes) and take every event it yields."""
    out: list[Any] = []
    pieces = [data] if chunk is None else [data[i : i + chunk] for i in range(0, len(data), chunk)]
    for piece in pieces:
        side.receive_data(piece)
        while (event := side.next_event()) is not NEED_DATA:
            out.append(event)
            if isinstance(event, Closed):
                return out
    return out


def admitted(server: JoinServer, client: JoinClient, first: int = 0) -> tuple[JoinServer, JoinClient]:
    [challenged] = events(client, server.start())
    assert isinstance(challenged, Challenged)
    [hello] = events(server, client.hello(HELLO))
    assert isinstance(hello, HelloReceived)
    [accepted] = events(client, server.accept(first, len(hello.hello.devices)))
    assert isinstance(accepted, Accepted)
    return server, client


def world(host: str = "box-a") -> dict[str, Any]:
    return {
        "world_size": 2,
        "host": {"host": host, "first_rank": 0, "count": 2},
        "group": 0,
        "hosts": 1,
        "command": ["python", "train.py"],
        "launch": "0a1b2c3d",
    }


@pytest.mark.parametrize("make_server, key", [(open_server, None), (token_server, BOX_A)])
@pytest.mark.parametrize("chunk", [None, 1, 7])
def test_a_walk_in_is_admitted_and_both_sides_speak_the_connection_key(
    make_server: Any, key: bytes | None, chunk: int | None
) -> None:
    server, client = make_server(), JoinClient(key)
    assert client.start() == preamble.Channel.JOIN.value
    [challenged] = events(client, server.start(), chunk)
    assert isinstance(challenged, Challenged)
    [hello] = events(server, client.hello(HELLO), chunk)
    assert isinstance(hello, HelloReceived) and hello.hello.host == "box-a"
    assert hello.hello.client_nonce == client.client_nonce
    [accepted] = events(client, server.accept(3, 2), chunk)
    assert isinstance(accepted, Accepted) and accepted.accept.ranks == (3, 2)
    assert (accepted.accept.salt is not None) is (key is None)  # the salt goes out under open admission only
    assert server.state is client.state is State.ADMITTED
    assert server.codec.key == client.codec.key != (key or wire.OPEN_KEY)
    assert server.codec.max_payload == client.codec.max_payload == wire.LINK_MAX

    [formed] = events(client, b"".join(server.send(wire.Kind.WORLD_FORMED, world())), chunk)
    assert isinstance(formed, Formed) and formed.world.host.first_rank == 0
    up = b"".join(client.send(wire.Kind.RANK_EXITED, {"rank": 3, "code": 0}))
    [exited] = events(server, up, chunk)
    assert isinstance(exited, Message) and exited.message == RankExited(rank=3, code=0)
    [aborted] = events(client, b"".join(server.send(wire.Kind.ABORT, {"reason": "operator stop"})), chunk)
    assert aborted == Aborted("operator stop")


def test_a_world_behind_the_accept_in_one_read_is_decoded_under_the_new_key() -> None:
    server, client = open_server(), JoinClient(None)
    events(client, server.start())
    events(server, client.hello(HELLO))
    both = server.accept(0, 2) + b"".join(server.send(wire.Kind.WORLD_FORMED, world()))
    accepted, formed = events(client, both)
    assert isinstance(accepted, Accepted) and isinstance(formed, Formed)


def test_a_world_with_a_nul_in_its_env_is_a_bad_message_at_the_walk_in() -> None:
    # It authenticates, so only its shape is wrong: the agent's "malformed message" path
    # (a transient failure), never a crash when the ranks spawn.
    server, client = admitted(open_server(), JoinClient(None))
    bad = b"".join(server.send(wire.Kind.WORLD_FORMED, {**world(), "env": {"A": "x\x00y"}}))
    with pytest.raises(BadMessage, match=r"world_formed: env\.A: holds a NUL byte"):
        events(client, bad)


def test_link_messages_carry_bulk_bytes_and_heartbeats() -> None:
    server, client = admitted(open_server(), JoinClient(None))
    params = bytes(range(256)) * 64
    up = client.send(wire.Kind.AVERAGE, {"round": 1, "weight": 2.0}, params)
    [pushed] = events(server, b"".join(bytes(part) for part in up))
    assert isinstance(pushed, Message) and isinstance(pushed.message, Average)
    assert bytes(pushed.blob) == params
    beat = {"ranks": {"0": {"step": 5, "loss": 0.5}}}
    [hb] = events(server, b"".join(client.send(wire.Kind.HEARTBEAT, beat)))
    assert isinstance(hb.message, Heartbeat) and hb.message.ranks[0].step == 5
    [stream] = events(client, b"".join(server.send(wire.Kind.STREAM, {"id": 1, "data": b"x"})))
    assert isinstance(stream.message, Stream) and stream.message.data == b"x"


def test_a_box_without_a_key_fails_permanently_and_says_so_before_any_hello() -> None:
    client = JoinClient(None)
    server = token_server()
    with pytest.raises(JoinError, match="requires a join key and this box has none") as caught:
        events(client, server.start())
    assert caught.value.permanent and "join.token" in caught.value.fix
    assert client.state is State.CHALLENGE  # no hello was said
    # It tells the controller why it hangs up, so the refusal is logged and counted there.
    assert caught.value.reply == preamble.NO_KEY
    assert events(server, caught.value.reply, chunk=2) == [KeyRefused(), Closed()]
    assert server.state is State.REFUSED


def test_a_hello_that_merely_starts_like_the_no_key_notice_is_still_a_hello() -> None:
    server, client = token_server(), JoinClient(BOX_A)
    events(client, server.start())
    hello = client.hello(HELLO)
    assert hello[:2] == preamble.NO_KEY[:2]  # "FL": held until the third byte tells them apart
    [received] = events(server, hello, chunk=1)
    assert isinstance(received, HelloReceived) and received.hello.host == "box-a"


def test_a_box_holding_a_key_will_not_be_admitted_by_an_open_challenge() -> None:
    """Anyone can send an open challenge: an impostor's would admit a keyed box and feed it a world."""
    client = JoinClient(BOX_A)
    with pytest.raises(JoinError, match="cannot prove it is this run's controller") as caught:
        events(client, open_server().start())
    assert caught.value.permanent and "cluster.controller.join.token" in caught.value.fix
    assert not caught.value.reply


# (key the box holds, name its hello gives): each fails the bound hello's tag
WRONG_KEYS = [
    (wire.host_key(TOKEN, "box-b"), "box-a"),  # another worker's key, claiming this name
    (BOX_A, "box-b"),  # this box's key, claiming another worker's name
    (TOKEN, "box-a"),  # the run's token itself: a box dials with a derived key only
    (wire.host_key(bytes(16), "box-a"), "box-a"),  # derived from another token
]


@pytest.mark.parametrize("key, host", WRONG_KEYS, ids=["other-key", "other-name", "token", "other-token"])
def test_a_hello_under_a_key_that_is_not_its_names_is_refused_permanently(key: bytes, host: str) -> None:
    server, client = token_server(), JoinClient(key)
    events(client, server.start())
    with pytest.raises(WrongKey) as caught:
        events(server, client.hello({**HELLO, "host": host}))
    assert caught.value.cause == "tag" and caught.value.host == host  # the controller logs the name
    assert server.hello is None and server.state is State.REFUSED
    # what the controller writes before it hangs up: the box says why and stops
    told = events(client, caught.value.reply, chunk=3)
    assert told == [Refused(wrong_key(host)), Closed()]  # nothing more comes
    assert told[0].reject.permanent and f"key of host {host}" in told[0].reject.reason


def test_an_answer_under_another_key_does_not_verify() -> None:
    """The controller proves itself in its answer: an impostor without the run key cannot."""
    impostor = JoinServer(bytes(16))
    client = JoinClient(BOX_A)
    events(client, impostor.start())
    impostor.receive_data(client.hello(HELLO))
    with pytest.raises(WrongKey):
        impostor.next_event()
    forged = wire.Codec(BOX_A[::-1])
    forged.sent = 1  # what a real answer would count
    with pytest.raises(wire.Dropped) as caught:
        events(client, forged.encode(wire.Kind.ACCEPT, {"ranks": [0, 2]}))
    assert caught.value.cause == "tag"


def test_a_bound_hello_that_names_no_host_or_is_not_a_hello_is_dropped() -> None:
    for body, kind, cause in [
        ({"host": 7}, wire.Kind.HELLO, "payload"),
        ({}, wire.Kind.HELLO, "payload"),
        ({"host": "box-a"}, wire.Kind.ACCEPT, "kind"),
    ]:
        server = token_server()
        server.start()
        with pytest.raises(wire.Dropped) as caught:
            events(server, wire.Codec(BOX_A).encode(kind, body))
        assert caught.value.cause == cause and not isinstance(caught.value, WrongKey)


@pytest.mark.parametrize(
    "record", [preamble.TLS_CLEARTEXT_ALERT, preamble.TLS_DENIED_ALERT, b"\x16\x03\x03\x00\x7a\x02"]
)
def test_a_tls_record_where_the_challenge_should_be_says_pin_the_certificate(record: bytes) -> None:
    with pytest.raises(JoinError) as caught:
        events(JoinClient(BOX_A), record)
    assert (
        caught.value.permanent and caught.value.message == "this controller speaks TLS: pin its certificate"
    )
    assert "FDL_TLS_FINGERPRINT" in caught.value.fix and not caught.value.reply


def test_a_refusal_reaches_the_client_by_name() -> None:
    server, client = open_server(), JoinClient(None)
    events(client, server.start())
    events(server, client.hello(HELLO))
    refused, after = events(client, server.refuse("host box-a already joined", "pick --host", permanent=True))
    assert after == Closed()  # nothing more comes on a refused connection
    assert isinstance(refused, Refused)
    assert (refused.reject.reason, refused.reject.fix, refused.reject.permanent) == (
        "host box-a already joined",
        "pick --host",
        True,
    )
    assert server.state is client.state is State.REFUSED


@pytest.mark.parametrize("split", [len(preamble.RATE_LIMITED), 3])
def test_a_rate_limited_dial_reads_a_transient_refusal_instead_of_a_challenge(split: int) -> None:
    """The dial guard's fixed marker, whole or in pieces: known as soon as it is whole, so a
    reset behind the close cannot hide it."""
    client = JoinClient(TOKEN)
    told = events(client, preamble.RATE_LIMITED[:split])
    if split < len(preamble.RATE_LIMITED):
        assert told == []  # a piece of it is not yet anything
        told = events(client, preamble.RATE_LIMITED[split:])
    assert told == [Refused(RATE_LIMITED), Closed()]  # nothing more comes
    assert not RATE_LIMITED.permanent and "rate-limited" in RATE_LIMITED.reason
    assert client.state is State.REFUSED


def hello_frame(server: JoinServer, kind: wire.Kind = wire.Kind.HELLO, **body: Any) -> bytes:
    """A frame a client under the server's join key could send, of any kind and shape."""
    codec = wire.Codec(server.codec.key)
    codec.feed(server.start())
    assert codec.next_frame() is not None
    return codec.encode(kind, body)


def _nonce(server: JoinServer) -> bytes:
    return server.nonce


CLIENT_NONCE = bytes(16)
SERVER_REFUSALS = [
    ("kind", lambda s: hello_frame(s, wire.Kind.ACCEPT, ranks=[0, 1])),
    ("payload", lambda s: hello_frame(s, nonce=_nonce(s), client_nonce=CLIENT_NONCE, host="a b", devices=[])),
    ("payload", lambda s: hello_frame(s, nonce=b"short", client_nonce=CLIENT_NONCE, host="a", devices=[])),
    (
        "replay",
        lambda s: hello_frame(s, nonce=bytes(16), client_nonce=CLIENT_NONCE, host="a", devices=["cpu:0"]),
    ),
    ("tag", lambda s: wire.Codec(bytes(16 * [9])).encode(wire.Kind.HELLO, {"host": "a"})),
    ("magic", lambda s: b"GET / HTTP/1.1\r\n\r\n" + bytes(64)),
    ("too_large", lambda s: wire.HEADER.pack(wire.MAGIC, wire.VERSION, 2, 1 << 20, bytes(32))),
    ("version", lambda s: wire.HEADER.pack(wire.MAGIC, 9, 2, 10, bytes(32))),
]


@pytest.mark.parametrize(
    "cause, make", SERVER_REFUSALS, ids=[f"{c}-{i}" for i, (c, _) in enumerate(SERVER_REFUSALS)]
)
def test_a_hello_that_does_not_answer_the_challenge_is_dropped_by_cause(cause: str, make: Any) -> None:
    server = open_server()
    data = make(server)
    with pytest.raises(wire.Dropped) as caught:
        events(server, data)
    assert caught.value.cause == cause
    assert server.state is State.CHALLENGE and server.hello is None


def test_a_hello_captured_on_one_connection_is_useless_on_another() -> None:
    first, client = open_server(), JoinClient(None)
    events(client, first.start())
    captured = client.hello(HELLO)
    [ok] = events(first, captured)
    assert isinstance(ok, HelloReceived)
    second = open_server()
    second.start()
    with pytest.raises(wire.Dropped) as caught:
        events(second, captured)
    assert caught.value.cause == "replay"


def test_a_link_frame_from_another_connection_does_not_verify() -> None:
    _, client_a = admitted(open_server(), JoinClient(None))
    server_b, _ = admitted(open_server(), JoinClient(None))
    spliced = b"".join(client_a.send(wire.Kind.RANK_EXITED, {"rank": 0, "code": 0}))
    with pytest.raises(wire.Dropped) as caught:
        events(server_b, spliced)
    assert caught.value.cause == "tag"


@pytest.mark.parametrize(
    "reply, message",
    [
        (lambda c: c.encode(wire.Kind.ABORT, {"reason": "x"}), "something other than Accept"),
    ],
)
def test_a_controller_that_answers_nonsense_is_named(reply: Any, message: str) -> None:
    server, client = open_server(), JoinClient(None)
    events(client, server.start())
    server_codec = server.codec
    client.hello(HELLO)
    with pytest.raises(JoinError, match=message):
        events(client, reply(server_codec))


def test_a_first_frame_too_large_for_a_challenge_is_not_a_flodl_port() -> None:
    client = JoinClient(None)
    client.receive_data(wire.HEADER.pack(wire.MAGIC, wire.VERSION, 1, 1 << 20, bytes(32)))
    with pytest.raises(JoinError, match="not a challenge"):
        client.next_event()


def test_a_first_frame_that_is_not_a_challenge_is_named() -> None:
    client = JoinClient(None)
    with pytest.raises(JoinError, match="did not open with a challenge"):
        events(client, wire.Codec(wire.OPEN_KEY).encode(wire.Kind.ABORT, {"reason": "x"}))


@pytest.mark.parametrize("stage", ["challenge", "answer", "link"])
def test_the_peer_closing_is_an_event_at_every_stage(stage: str) -> None:
    server, client = open_server(), JoinClient(None)
    if stage != "challenge":
        events(client, server.start())
        events(server, client.hello(HELLO))
    if stage == "link":
        events(client, server.accept(0, 2))
    assert events(client, b"") == [Closed()]
    assert client.state is State.CLOSED
    assert events(open_server(), b"") == [Closed()]


def test_nothing_is_sent_on_a_link_that_is_not_admitted() -> None:
    server, client = open_server(), JoinClient(None)
    with pytest.raises(RuntimeError):
        server.send(wire.Kind.ABORT, {"reason": "x"})
    with pytest.raises(RuntimeError):
        client.hello(HELLO)  # before the challenge
    with pytest.raises(RuntimeError):
        server.accept(0, 1)  # before a hello


def test_wanted_says_how_many_bytes_finish_the_frame() -> None:
    server, client = open_server(), JoinClient(None)
    challenge = server.start()
    assert client.wanted == wire.HEADER.size
    client.receive_data(challenge[:10])
    assert client.wanted == wire.HEADER.size - 10  # the header first: only it knows the length
    client.receive_data(challenge[10:50])
    assert client.wanted == len(challenge) - 50
    client.receive_data(challenge[50:])
    assert client.wanted == 0


def test_a_hello_this_box_cannot_send_is_named_before_it_is_sent() -> None:
    server, client = open_server(), JoinClient(None)
    events(client, server.start())
    with pytest.raises(JoinError, match="host") as caught:
        client.hello({"host": "two words", "devices": ["cpu:0"]})
    assert caught.value.permanent and client.state is State.HELLO  # nothing was sent
    assert isinstance(events(server, client.hello(HELLO))[0], HelloReceived)

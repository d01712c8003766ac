"""The join handshake and the host link, sans-IO (h11's shape).

Two objects, one per side of a join connection, over ``wire.Codec``: feed
them the bytes that arrived (``receive_data``; ``b""`` is the peer's EOF),
take events (``next_event``) until one says ``NEED_DATA``, and write the
bytes their methods return. They never touch a socket or a clock, so the
controller, the agent, the join-storm bench and the abuse suite all drive the
same code, and a table of byte strings tests every path.

The exchange::

    agent                                   controller
      "FLJ1"                   ──>
                               <──          Challenge {nonce}   (run key, or zeros when open)
                                            (or wire.RATE_LIMITED, then close: the dial guard said no)
      Hello {nonce echoed, client_nonce, host, devices, …}  ──>
                               <──          Accept {ranks, salt?}  |  Reject {reason, fix, permanent}
      ── both sides rekey: connection_key(run key, server nonce, client nonce) ──
                               <──          WorldFormed {…} | Abort {reason}
      Heartbeat / Stream / Average / RankExited  <──>  Stream / Averaged / Abort

The server's challenge makes a captured hello useless on another connection;
after Accept every frame on the link speaks the connection key, so the link
and the handshake cannot be spliced either.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final

from pydantic import ValidationError

from . import wire
from .messages import (
    Abort,
    Accept,
    BadMessage,
    Challenge,
    Hello,
    Msg,
    Reject,
    WorldFormed,
)
from .messages import parse as parse_message


class _NeedData(Enum):
    NEED_DATA = "need data"


NEED_DATA: Final = _NeedData.NEED_DATA


# --- events ---------------------------------------------------------------------


@dataclass(frozen=True)
class Challenged:
    """Client: the controller's challenge verified under one of this box's keys."""

    challenge: Challenge


@dataclass(frozen=True)
class HelloReceived:
    """Server: an authenticated hello that answers this connection's challenge."""

    hello: Hello


@dataclass(frozen=True)
class Accepted:
    """Client: admitted; the link has switched to the connection key."""

    accept: Accept


@dataclass(frozen=True)
class Refused:
    """Client: refused by name, with the fix; nothing more comes on this connection."""

    reject: Reject


@dataclass(frozen=True)
class Formed:
    """Client: the world formed; this host's share of it."""

    world: WorldFormed


@dataclass(frozen=True)
class Aborted:
    """Client: the controller aborted the run."""

    reason: str


@dataclass(frozen=True)
class Message:
    """Either side, after admission: a link message and, for the bulk kinds, its raw bytes
    (a view into the receive buffer, valid until the next ``receive_data``)."""

    message: Msg | None
    blob: wire.Blob = b""


@dataclass(frozen=True)
class Closed:
    """The peer closed its side."""


Event = Challenged | HelloReceived | Accepted | Refused | Formed | Aborted | Message | Closed


# Read instead of a challenge when the controller's dial guard turns this peer away.
RATE_LIMITED = Reject(
    reason="rate-limited by the controller after bad dials (wrong token?)",
    fix="wait; --persist backs off",
)


class JoinError(Exception):
    """The controller's side of the handshake makes no sense to this box.

    ``permanent`` when no re-dial can fix it (this box holds the wrong key)."""

    def __init__(self, message: str, fix: str = "", *, permanent: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix
        self.permanent = permanent


class State(Enum):
    CHALLENGE = "challenge"  # client: waiting for it; server: sent, waiting for the hello
    HELLO = "hello"  # client: challenged, the hello is ours to send
    ANSWER = "answer"  # client: hello sent; server: hello received, admission decides
    ADMITTED = "admitted"  # the link: both sides speak the connection key
    REFUSED = "refused"
    CLOSED = "closed"


class _Side:
    def __init__(self, codec: wire.Codec) -> None:
        self.codec = codec
        self.state = State.CHALLENGE
        self._eof = False

    def receive_data(self, data: wire.Blob) -> None:
        """Bytes that arrived; ``b""`` when the peer closed. A bad frame raises ``wire.Dropped``."""
        if not data:
            self._eof = True
            return
        self.codec.feed(data)

    @property
    def wanted(self) -> int:
        """Bytes still missing from the frame being received: a hint for the read size."""
        return self.codec.wanted

    def direct(self) -> memoryview | None:
        """An admitted link: where the next bytes can be received straight into (``Codec.direct``);
        None: receive them anywhere and pass them to ``receive_data``."""
        return self.codec.direct() if self.state is State.ADMITTED else None

    def filled(self, n: int) -> None:
        """``n`` bytes were received into the view ``direct()`` returned."""
        self.codec.filled(n)

    def send(self, kind: wire.Kind, body: Mapping[str, Any], blob: wire.Blob = b"") -> list[wire.Blob]:
        """A link frame as buffers to write in order (the raw bytes of a bulk frame never joined)."""
        if self.state is not State.ADMITTED:
            raise RuntimeError(f"no link to send {kind.name} on: the connection is {self.state.value}")
        return self.codec.encode_parts(kind, body, blob)

    def send_shared(self, kind: wire.Kind, shared: wire.SharedMap, own: Mapping[str, Any]) -> bytes:
        """A link frame whose map is ``shared`` (packed once for many links) and ``own``."""
        if self.state is not State.ADMITTED:
            raise RuntimeError(f"no link to send {kind.name} on: the connection is {self.state.value}")
        return self.codec.encode_shared(kind, shared, own)

    def _frame(self) -> wire.Frame | _NeedData | Closed:
        frame = self.codec.next_frame()
        if frame is not None:
            return frame
        if self._eof:
            self.state = State.CLOSED
            return Closed()
        return NEED_DATA

    def _admitted(self, key: bytes, server_nonce: bytes, client_nonce: bytes) -> None:
        # Rekey before anything else is encoded or decoded: whatever follows speaks this connection's key.
        self.codec.rekey(wire.connection_key(key, server_nonce, client_nonce))
        self.codec.max_payload = wire.LINK_MAX  # the link carries the CPU plane's rounds
        self.state = State.ADMITTED

    def _link_event(self) -> Event | _NeedData:
        frame = self._frame()
        if not isinstance(frame, wire.Frame):
            return frame
        return Message(parse_message(frame), frame.blob)


class JoinServer(_Side):
    """The controller's side of one join connection (after the ``FLJ1`` preamble).

    ``join_key`` tags the pre-admission frames (the run key, or zeros under open
    admission); ``run_key`` derives the link's connection key; ``salt`` goes out in
    Accept under open admission, where reachability is the credential.
    """

    def __init__(
        self, join_key: bytes, run_key: bytes, *, salt: bytes | None = None, nonce: bytes | None = None
    ):
        # Until admitted, a peer gets a small frame cap: it has proven nothing yet.
        super().__init__(wire.Codec(join_key, max_payload=wire.PRE_ADMISSION_MAX))
        self.run_key = run_key
        self.salt = salt
        self.nonce = nonce if nonce is not None else wire.new_nonce()
        self.hello: Hello | None = None

    def start(self) -> bytes:
        """The challenge: the first bytes on the connection."""
        return self.codec.encode(wire.Kind.CHALLENGE, Challenge(nonce=self.nonce).model_dump())

    def next_event(self) -> Event | _NeedData:
        """HelloReceived, then (after ``accept``) the host's link messages; Closed at EOF.

        Anything that is not an answer to this connection's challenge raises ``wire.Dropped``
        (the caller hangs up without a reply, and counts the cause); a malformed link message
        raises ``BadMessage``."""
        if self.state is State.ADMITTED:
            return self._link_event()
        if self.state is State.ANSWER:
            return NEED_DATA  # admission decides first (accept or refuse)
        if self.state is not State.CHALLENGE:
            return Closed()  # refused or closed: nothing more comes
        frame = self._frame()
        if not isinstance(frame, wire.Frame):
            return frame
        if frame.kind is not wire.Kind.HELLO:
            raise wire.Dropped("kind", "expected a hello")
        try:
            hello = parse_message(frame)
        except BadMessage as exc:
            raise wire.Dropped("payload", str(exc)) from None
        assert isinstance(hello, Hello)
        if not hmac.compare_digest(hello.nonce, self.nonce):
            raise wire.Dropped("replay", "hello does not answer this connection's challenge")
        self.hello = hello
        self.state = State.ANSWER
        return HelloReceived(hello)

    def accept(self, first: int, count: int) -> bytes:
        """Admit the host at provisional ranks ``[first, first + count)``; the link rekeys."""
        hello = self._deciding()
        data = self.codec.encode(wire.Kind.ACCEPT, Accept(ranks=(first, count), salt=self.salt).model_dump())
        self._admitted(self.run_key, self.nonce, hello.client_nonce)
        return data

    def refuse(self, reason: str, fix: str = "", *, permanent: bool = False) -> bytes:
        """Refuse the hello by name; nothing follows on this connection."""
        self._deciding()
        self.state = State.REFUSED
        return self.codec.encode(
            wire.Kind.REJECT, Reject(reason=reason, fix=fix, permanent=permanent).model_dump()
        )

    def _deciding(self) -> Hello:
        if self.state is not State.ANSWER or self.hello is None:
            raise RuntimeError(f"no hello to answer while the connection is {self.state.value}")
        return self.hello


class JoinClient(_Side):
    """The agent's side of one join connection.

    ``key`` is the run's join.token (or a launcher's salt); ``None`` under open
    admission. The challenge is tagged with the run key, or with zeros under open
    admission: the client tries the key it holds, then zeros.
    """

    def __init__(self, key: bytes | None) -> None:
        super().__init__(wire.Codec(key if key is not None else wire.OPEN_KEY))
        self.key = key
        self.challenge: Challenge | None = None
        self.client_nonce = b""
        self._pending = bytearray()  # the challenge's bytes, until a key verifies them

    @staticmethod
    def start() -> bytes:
        """The preamble that asks for the join channel."""
        return wire.Channel.JOIN.value

    def receive_data(self, data: wire.Blob) -> None:
        if self.state is State.CHALLENGE and data:
            self._pending += data  # which key verifies it is only known once it is whole
            return
        super().receive_data(data)

    @property
    def wanted(self) -> int:
        if self.state is State.CHALLENGE:
            if len(self._pending) < wire.HEADER.size:
                return wire.HEADER.size - len(self._pending)
            length: int = wire.HEADER.unpack_from(self._pending)[3]
            return max(0, wire.HEADER.size + length - len(self._pending))
        return super().wanted

    def next_event(self) -> Event | _NeedData:
        """Challenged (or Refused: rate-limited); then Accepted or Refused; then Formed, Aborted
        and link Messages; Closed at EOF.

        Raises ``JoinError`` when the controller's side makes no sense, ``wire.Dropped``
        for a frame that does not verify and ``BadMessage`` for a malformed one."""
        if self.state is State.CHALLENGE:
            return self._challenge()
        if self.state is State.ANSWER:
            return self._answer()
        if self.state is State.ADMITTED:
            event = self._link_event()
            if isinstance(event, Message):
                if isinstance(event.message, WorldFormed):
                    return Formed(event.message)
                if isinstance(event.message, Abort):
                    return Aborted(event.message.reason)
            return event
        if self.state is State.HELLO:
            return NEED_DATA  # the hello is ours to send first
        return Closed()  # refused or closed: nothing more comes

    def _challenge(self) -> Event | _NeedData:
        pending = self._pending
        if pending[: len(wire.RATE_LIMITED)] == wire.RATE_LIMITED:
            self.state = State.REFUSED
            return Refused(RATE_LIMITED)
        if len(pending) >= wire.HEADER.size:
            length = wire.HEADER.unpack_from(pending)[3]
            if length > wire.PRE_ADMISSION_MAX:
                raise JoinError("the controller's first frame is not a challenge (is this a flodl port?)")
            end = wire.HEADER.size + length
            if len(pending) >= end:
                return self._verify_challenge(bytes(pending[:end]), bytes(pending[end:]))
        if self._eof:
            self.state = State.CLOSED
            return Closed()
        return NEED_DATA

    def _verify_challenge(self, data: bytes, rest: bytes) -> Event:
        self._pending = bytearray()
        first: wire.Frame | None = None
        for candidate in [k for k in (self.key, wire.OPEN_KEY) if k is not None]:
            codec = wire.Codec(candidate)
            codec.feed(data)
            try:
                first = codec.next_frame()
            except wire.Dropped:
                continue
            self.codec = codec
            break
        if first is None:
            raise JoinError(
                "the controller's challenge does not verify with this box's join key"
                if self.key is not None
                else "the controller requires a join key and this box has none",
                "pass the run's join.token (FDL_TOKEN, --token -, or join.token in fdl.yml)",
                permanent=True,
            )
        challenge = parse_message(first)
        if not isinstance(challenge, Challenge):
            raise JoinError("the controller did not open with a challenge")
        self.challenge = challenge
        self.state = State.HELLO
        if rest:
            self.codec.feed(rest)
        return Challenged(challenge)

    def hello(self, fields: Mapping[str, Any], *, check: bool = True) -> bytes:
        """Say who this box is; the challenge's nonce and a fresh client nonce are filled in.

        With ``check`` the hello is validated here first, so a box that would be dropped for
        a malformed hello (a host name with a space, say) is told why (``JoinError``, permanent);
        the abuse suite sends hellos of any shape with ``check=False``."""
        if self.state is not State.HELLO or self.challenge is None:
            raise RuntimeError(f"no challenge to answer while the connection is {self.state.value}")
        body = {"nonce": self.challenge.nonce, "client_nonce": wire.new_nonce(), **fields}
        if check:
            try:
                Hello.model_validate(body)
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first["loc"])
                raise JoinError(
                    f"this box's hello is not valid: {where}: {first['msg']}",
                    "check --host (a name without spaces, slashes or colons) and --devices",
                    permanent=True,
                ) from None
        nonce = body["client_nonce"]
        self.client_nonce = nonce if isinstance(nonce, bytes) else b""
        self.state = State.ANSWER
        return self.codec.encode(wire.Kind.HELLO, body)

    def _answer(self) -> Event | _NeedData:
        frame = self._frame()
        if not isinstance(frame, wire.Frame):
            return frame
        reply = parse_message(frame)
        if isinstance(reply, Reject):
            self.state = State.REFUSED
            return Refused(reply)
        if not isinstance(reply, Accept):
            raise JoinError("the controller answered the hello with something other than Accept")
        assert self.challenge is not None
        key = reply.salt if reply.salt is not None else (self.key or wire.OPEN_KEY)
        self._admitted(key, self.challenge.nonce, self.client_nonce)
        return Accepted(reply)

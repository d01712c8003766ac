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
                               <──          Challenge {nonce, bound}   (under zeros)
                                            (or preamble.RATE_LIMITED, then close: the dial guard said no)
      Hello {nonce echoed, client_nonce, host, devices, …}  ──>
                                            (bound: tagged with the host key of the name it gives)
      (or preamble.NO_KEY, then close: the challenge is bound and this box holds no key)
                               <──          Accept {ranks, salt?}  |  Reject {reason, fix, permanent}
                                            (under that host key: the controller proves it holds it)
                                            (or preamble.WRONG_KEY, then close: the tag did not verify)
      ── both sides rekey: connection_key(host key | open: salt, server nonce, client nonce) ──
                               <──          WorldFormed {…} | Abort {reason}
      Heartbeat / Stream / Average / RankExited  <──>  Stream / Averaged / Abort

The server's challenge makes a captured hello useless on another connection;
after Accept every frame on the link speaks the connection key, so the link
and the handshake cannot be spliced either. A bound hello is verified under
the key of the host it names (one HKDF per hello, whatever the roster's size),
so a box can only ever be admitted as the name its key was derived for.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any, Final

from pydantic import ValidationError

from . import preamble, wire
from .join_events import Aborted as Aborted
from .join_events import Accepted as Accepted
from .join_events import Challenged as Challenged
from .join_events import Closed as Closed
from .join_events import Event as Event
from .join_events import Formed as Formed
from .join_events import HelloReceived as HelloReceived
from .join_events import KeyRefused as KeyRefused
from .join_events import Message as Message
from .join_events import Refused as Refused
from .messages import Abort, Accept, BadMessage, Challenge, Hello, Reject, WorldFormed
from .messages import parse as parse_message


class _NeedData(Enum):
    NEED_DATA = "need data"


NEED_DATA: Final = _NeedData.NEED_DATA


# Read instead of a challenge when the controller's dial guard turns this peer away.
RATE_LIMITED = Reject(
    reason="rate-limited by the controller after bad dials (wrong token?)",
    fix="wait; --persist backs off",
)


class WrongKey(wire.Dropped):
    """Server: a bound hello whose tag does not verify under the key of the host it names.
    A bad dial like any bad tag (counted, charged), except that ``reply`` goes out first: an
    honest box holding a stale or another host's key learns why and stops."""

    reply = preamble.WRONG_KEY

    def __init__(self, host: str) -> None:
        super().__init__("tag", f"the hello does not verify under the key of host {host}")
        self.host = host


def wrong_key(host: str) -> Reject:
    """What a box reads in ``preamble.WRONG_KEY``: its key is not the key of the name it gave."""
    return Reject(
        reason=f"the controller cannot verify this box's hello under the key of host {host}: "
        "this box's key was derived for another name, or from another token",
        fix="a host key holds for the name it was made for: dial as that name (join.host), re-run "
        "site.yml for this box after a rename or a new token, or pass the run's join.token "
        "(FDL_TOKEN, --token -)",
        permanent=True,
    )


class JoinError(Exception):
    """The controller's side of the handshake makes no sense to this box.

    ``permanent`` when no re-dial can fix it (this box holds no key); ``reply``: bytes
    to send the controller before hanging up (``preamble.NO_KEY``, so the refusal is counted there)."""

    def __init__(self, message: str, fix: str = "", *, permanent: bool = False, reply: bytes = b"") -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix
        self.permanent = permanent
        self.reply = reply


TLS_FIX = (
    "pin its certificate: --tls-fingerprint SHA256, FDL_TLS_FINGERPRINT or join.tls_fingerprint "
    "(`fdl tls fingerprint CERT` on the controller prints it; site.yml pins it for you)"
)


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

    def _frame(
        self, key_of: Callable[[wire.Kind, dict[str, Any]], bytes] | None = None
    ) -> wire.Frame | _NeedData | Closed:
        frame = self.codec.next_frame() if key_of is None else self.codec.next_frame_keyed(key_of)
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

    ``run_key`` set: names are bound. The hello must be tagged with
    ``wire.host_key(run_key, host)`` for the host it names, the answer goes out under that
    key, and it derives the link's connection key. ``None`` is open admission, where
    reachability is the credential: everything before Accept under zeros, and ``salt``
    (handed out in Accept) derives the connection key.
    """

    def __init__(self, run_key: bytes | None, *, salt: bytes | None = None, nonce: bytes | None = None):
        # Until admitted, a peer gets a small frame cap: it has proven nothing yet.
        super().__init__(wire.Codec(wire.OPEN_KEY, max_payload=wire.PRE_ADMISSION_MAX))
        if run_key is None and salt is None:
            raise ValueError("open admission hands a salt out in Accept: pass one")
        self.run_key = run_key
        self.salt = salt if run_key is None else None
        self.nonce = nonce if nonce is not None else wire.new_nonce()
        self.hello: Hello | None = None
        self._opening: bytearray | None = bytearray()  # the first bytes, until they cannot be NO_KEY
        self._notice = False
        self._claimed_host = ""

    def receive_data(self, data: wire.Blob) -> None:
        opening = self._opening
        if opening is None or not data:
            super().receive_data(data)
            return
        opening += data
        self._notice = opening.startswith(preamble.NO_KEY)
        if not self._notice and preamble.NO_KEY.startswith(opening):
            return  # still a prefix of the notice: wait for the rest
        self._opening = None
        if not self._notice:
            super().receive_data(bytes(opening))

    def start(self) -> bytes:
        """The challenge: the first bytes on the connection."""
        challenge = Challenge(nonce=self.nonce, bound=self.run_key is not None)
        return self.codec.encode(wire.Kind.CHALLENGE, challenge.model_dump())

    def _claimed(self, kind: wire.Kind, body: dict[str, Any]) -> bytes:
        """The key a bound hello must be tagged with: the host key of the name it gives."""
        assert self.run_key is not None
        host = body.get("host")
        if kind is not wire.Kind.HELLO:
            raise wire.Dropped("kind", "expected a hello")
        if not isinstance(host, str):
            raise wire.Dropped("payload", "the hello names no host")
        self._claimed_host = host
        return wire.host_key(self.run_key, host)

    def next_event(self) -> Event | _NeedData:
        """HelloReceived, then (after ``accept``) the host's link messages; Closed at EOF.

        Anything that is not an answer to this connection's challenge raises ``wire.Dropped``
        (the caller hangs up without a reply, and counts the cause; a ``WrongKey`` has its
        reply written first); a malformed link message raises ``BadMessage``."""
        if self.state is State.ADMITTED:
            return self._link_event()
        if self.state is State.ANSWER:
            return NEED_DATA  # admission decides first (accept or refuse)
        if self.state is not State.CHALLENGE:
            return Closed()  # refused or closed: nothing more comes
        if self._notice:
            self.state = State.REFUSED
            return KeyRefused()
        return self._read_hello()

    def _read_hello(self) -> Event | _NeedData:
        """The hello, once whole: tagged with the key of the host it names (bound) and echoing
        this connection's nonce."""
        try:
            frame = self._frame(self._claimed if self.run_key is not None else None)
        except wire.Dropped as exc:
            if exc.cause == "tag" and self.run_key is not None:
                self.state = State.REFUSED
                raise WrongKey(self._claimed_host) from None
            raise
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
        # Bound: the codec holds the hello's host key; open: the salt derives the link's key.
        self._admitted(self.codec.key if self.salt is None else self.salt, self.nonce, hello.client_nonce)
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

    ``key`` is this box's host key: derived from the run's token for the name its hello
    gives (``wire.host_key``), or handed to it for that name (join.host_key, a launcher's
    spec); ``None`` under open admission. A box holding a key dials only a controller that
    asks for one (a bound challenge), and trusts its answer only under that key.
    """

    def __init__(self, key: bytes | None) -> None:
        super().__init__(wire.Codec(wire.OPEN_KEY))
        self.key = key
        self.challenge: Challenge | None = None
        self.client_nonce = b""
        self.host = ""  # the name this box's hello gave
        # Bytes held back until it is clear what they are: the challenge (or RATE_LIMITED),
        # then the answer (or WRONG_KEY, which is no frame).
        self._pending = bytearray()
        self._screening = False

    @staticmethod
    def start() -> bytes:
        """The preamble that asks for the join channel."""
        return preamble.Channel.JOIN.value

    def receive_data(self, data: wire.Blob) -> None:
        if data and (self.state is State.CHALLENGE or self._screening):
            self._pending += data
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
        if pending[: len(preamble.RATE_LIMITED)] == preamble.RATE_LIMITED:
            self.state = State.REFUSED
            return Refused(RATE_LIMITED)
        if bytes(pending[:2]) in preamble.TLS_RECORDS:
            raise JoinError("this controller speaks TLS: pin its certificate", TLS_FIX, permanent=True)
        if len(pending) >= wire.HEADER.size:
            length = wire.HEADER.unpack_from(pending)[3]
            if length > wire.PRE_ADMISSION_MAX:
                raise JoinError("the controller's first frame is not a challenge (is this a flodl port?)")
            end = wire.HEADER.size + length
            if len(pending) >= end:
                return self._read_challenge(bytes(pending[:end]), bytes(pending[end:]))
        if self._eof:
            self.state = State.CLOSED
            return Closed()
        return NEED_DATA

    def _read_challenge(self, data: bytes, rest: bytes) -> Event:
        self._pending = bytearray()
        self.codec.feed(data)
        try:
            first = self.codec.next_frame()
        except wire.Dropped:
            first = None
        if first is None:
            raise JoinError(
                "the controller's first frame does not verify as a challenge (a controller of "
                "another flodl version?)",
                "run the same flodl version on the controller and this box",
                permanent=True,
            )
        challenge = parse_message(first)
        if not isinstance(challenge, Challenge):
            raise JoinError("the controller did not open with a challenge")
        if challenge.bound and self.key is None:
            raise JoinError(
                "the controller requires a join key and this box has none",
                "pass the run's join.token (FDL_TOKEN, --token -, or join.token in fdl.yml)",
                permanent=True,
                reply=preamble.NO_KEY,  # so the controller logs and counts why this box hangs up
            )
        if not challenge.bound and self.key is not None:
            # Anyone can send an open challenge: a box that holds a key would be admitted by an
            # impostor and run whatever it is told.
            raise JoinError(
                "this box holds a join key and the controller admits without one (open admission): "
                "it cannot prove it is this run's controller",
                "give the controller the run's token (cluster.controller.join.token), or drop the "
                "key from this box (FDL_TOKEN, --token, join.token, join.host_key)",
                permanent=True,
            )
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
        self.host = str(body.get("host", ""))
        self.state = State.ANSWER
        if self.challenge.bound:
            assert self.key is not None  # a bound challenge without a key was refused on arrival
            self.codec.rekey(self.key)  # the hello and its answer speak this host's key
            self._screening = True  # the answer may be WRONG_KEY instead of a frame
        return self.codec.encode(wire.Kind.HELLO, body)

    def _answer(self) -> Event | _NeedData:
        if self._screening:
            pending = bytes(self._pending)
            if pending[: len(preamble.WRONG_KEY)] == preamble.WRONG_KEY:
                self.state = State.REFUSED
                return Refused(wrong_key(self.host))
            if preamble.WRONG_KEY.startswith(pending) and not self._eof:
                return NEED_DATA  # it may still be the marker
            self._screening, self._pending = False, bytearray()
            self.codec.feed(pending)
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
        if self.challenge.bound:
            key = self.codec.key  # this host's key: the answer verified under it
        else:
            key = reply.salt if reply.salt is not None else wire.OPEN_KEY
        self._admitted(key, self.challenge.nonce, self.client_nonce)
        return Accepted(reply)

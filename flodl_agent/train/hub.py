"""The CPU plane's hub: weighted parameter averaging through the controller, streamed.

Each host's relay sends, per round, the sum of its ranks' weighted parameters
(``weight_i * params_i``, raw float32 or bfloat16) and the sum of their weights,
as pieces in order (``plan``: 1 to ``CHUNKS_MAX`` ``CHUNK``s each, sized by the
relay to what its link carried in the last round, ``chunk_for``). The hub adds
each piece into the round's total the moment it arrives; the stretch that every
host still training has delivered is divided once by the round's weight and
goes back at once, while the rest of the round is still arriving. Memory: one
model per open round (and the last round's, whose pieces may still be on their
way out), whatever the world size. Needs only worker -> controller
reachability, so it works through ssh tunnels and across GPU vendors.

A host that leaves mid-round counts in the stretch it delivered: every piece
is the weighted average of the hosts whose parameters it holds.

A walk-in admitted into a training world (an elastic launch) joins once its ranks are
ready (``join``): it is counted in the lowest open round that has handed nothing out yet
(or the next round to open), with weight 0 — it brings nothing and holds nothing up, and
takes that round's average whole as its starting point — and is waited for in every round
after. Each round's last piece says how much weight the world has accepted so far
(``taken``), so a walk-in's ranks stop on the same round as everyone else's.

A restarted controller's hub hears from each host it re-adopts which round its ranks push
next (``resume``); the highest it heard is the floor. A round below it is abandoned: it is
answered at once with weight 0 (its ranks keep their parameters and go on to the next
round), so that hosts the old controller left a round apart meet again at the floor.

Pure: no sockets. The controller feeds it pieces and departures and sends what
it returns.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

CHUNK = 1 << 18  # parameters per piece at the least: 1 MiB of float32
CHUNKS_MAX = 4  # and at the most, on a link fast enough (see ``chunk_for``)
LAG = 0.016  # seconds of its link a piece may take: every hop holds a piece whole before passing it on
Blob = bytes | bytearray | memoryview


def to_bf16(values: np.ndarray) -> memoryview:
    """float32 -> bfloat16 bytes (the top half of each float, rounded to nearest even).

    In place on one scratch array (the obvious expression makes four temporaries of the
    model's size), and NaNs looked for only when the sum says something is not finite: a
    pass that allocates nothing, where ``isnan`` costs as much as the rounding.
    """
    values = np.ascontiguousarray(values, dtype=np.float32)
    bits = values.view(np.uint32)
    scratch = np.right_shift(bits, 16)
    np.bitwise_and(scratch, 1, out=scratch)
    np.add(scratch, bits, out=scratch)
    np.add(scratch, 0x7FFF, out=scratch)
    np.right_shift(scratch, 16, out=scratch)
    out = scratch.astype(np.uint16)
    with np.errstate(over="ignore", invalid="ignore"):  # big finite values may sum past the range
        finite = np.isfinite(np.add.reduce(values, dtype=np.float32))
    if not finite:
        nan = np.isnan(values)
        out[nan] = np.uint16(0x7FC0)  # rounding must not turn a NaN into an infinity
    return out.data.cast("B")


def from_bf16(data: Blob) -> np.ndarray:
    """bfloat16 bytes -> float32 (exact: bf16 is float32 with the low half zero)."""
    return (np.frombuffer(data, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def decode(data: Blob, bf16: bool) -> np.ndarray:
    return from_bf16(data) if bf16 else np.frombuffer(data, dtype=np.float32)


def encode(values: np.ndarray, bf16: bool) -> Blob:
    """The wire's bytes for ``values``: a view of them in float32 (no copy), or bfloat16."""
    if bf16:
        return to_bf16(values)
    return np.ascontiguousarray(values, dtype=np.float32).data.cast("B")


def chunk_for(rate: float | None, width: int = 4) -> int:
    """Parameters per piece on a link that carried ``rate`` bytes a second in the last round
    (None: no round yet), ``width`` bytes each: what the link carries in ``LAG``, in whole
    ``CHUNK``s, 1 to ``CHUNKS_MAX`` of them.

    A piece is verified whole before it is summed, and summed whole before its average
    leaves, so a round ends about one piece's time on the link after its last byte went up:
    small pieces where the link is the limit. Where it is not (loopback, a fast fabric),
    each piece's frame, callbacks and syscalls are the cost, and fewer pieces cut the
    controller's CPU a round by a fifth (docs/performance.md).
    """
    if rate is None or not rate > 0:  # also NaN
        return CHUNK
    chunks = int(min(rate * LAG / (CHUNK * width), CHUNKS_MAX))
    return CHUNK * max(1, chunks)


def plan(params: int, chunk: int = CHUNK) -> list[tuple[int, int]]:
    """A round's pieces: (first parameter, end) of each, in the order they travel."""
    return [(first, min(first + chunk, params)) for first in range(0, params, chunk)]


class Mismatch(Exception):
    """A host's parameters do not line up with the round's (a different model)."""


@dataclass
class _Round:
    total: np.ndarray
    bf16: bool  # the wire format of the answers (the round's first piece's)
    weights: dict[str, float] = field(default_factory=dict)  # what each host brought (its share)
    prefix: dict[str, int] = field(default_factory=dict)  # parameters each host delivered, in order
    covered: int = 0  # total[:covered] holds a contribution (beyond it: stale until written)
    sent: int = 0  # total[:sent] was averaged and handed out
    least: float | None = None  # the least weight of its pieces: what its ranks count as the round's


@dataclass(frozen=True)
class Averaged:
    """A piece of a round's average, and to whom it goes (``bf16``: in the wire format it came in).

    Parameters ``[offset, offset + len)`` of ``params``; ``weight`` is what they were divided by
    (0: nobody's parameters, and no data). ``last``: the round is complete with this piece, and
    ``weights`` says what each host brought. ``data`` may be a view of the hub's buffer, valid
    until the round after next opens.
    """

    round: int
    data: Blob
    hosts: frozenset[str]
    weight: float
    bf16: bool = False
    weights: Mapping[str, float] = field(default_factory=dict)  # host -> its weight in the round
    offset: int = 0
    params: int = 0
    last: bool = True
    taken: float = 0.0  # the world's accepted weight through this round (set on the last piece)


class Hub:
    def __init__(self, hosts: set[str]) -> None:
        self.training = set(hosts)  # hosts expected in every round
        self.floor = 0  # rounds below it are abandoned (a restarted controller's resumes)
        self._rounds: dict[int, _Round] = {}
        self._size: int | None = None  # parameters per round, fixed by the first push
        self.rounds_done = 0
        self.bytes_in = 0
        self.taken = 0.0  # the accepted weight of every round finished so far, summed in order
        self.last_round = -1  # the highest round pushed so far
        self._joining: set[str] = set()  # walk-ins ready, waiting for the next round to open
        # Finished rounds' buffers, reused (fresh pages cost faults): never the newest, whose
        # pieces may still be queued on a slow link (views, not copies).
        self._spares: list[np.ndarray] = []

    def push(
        self,
        host: str,
        round_no: int,
        weight: float,
        data: Blob,
        bf16: bool = False,
        offset: int = 0,
        params: int = 0,
    ) -> list[Averaged]:
        """A piece of one host's folded round: its parameters ``[offset, offset + len)`` of
        ``params`` (0: the whole round in one piece); the pieces of the average it completes.

        ``bf16``: the parameters came as bfloat16 (half the bytes on the link); the sum is float32.
        A round below the floor is never opened: its first piece is answered with weight 0.
        """
        if round_no < self.floor:  # once per round, not per piece
            return [self._abandoned(round_no, frozenset({host}), bf16)] if offset == 0 else []
        width = 2 if bf16 else 4
        if len(data) % width:
            kind = "bfloat16" if bf16 else "float32"
            raise Mismatch(f"{host} sent {len(data)} bytes for round {round_no}: not {kind} parameters")
        count = len(data) // width
        size = params or count
        if self._size is None:
            self._size = size
        elif size != self._size:
            raise Mismatch(
                f"parameter count mismatch: {host} averages {size} parameters, the world {self._size}"
            )
        if not weight >= 0.0:  # also refuses NaN
            raise Mismatch(f"{host} sent weight {weight} for round {round_no}")
        state = self._rounds.get(round_no)
        if state is None:
            state = self._rounds[round_no] = _Round(self._buffer(size), bf16)
            self.last_round = max(self.last_round, round_no)
            for joiner in self._joining:
                self._enter(state, joiner)
            self._joining.clear()
        self._follows(state, host, round_no, weight, offset, count, size)
        if weight > 0:  # a host whose ranks took no step contributes nothing
            self._add(state, offset, decode(data, bf16))
        state.prefix[host] = offset + count
        self.bytes_in += len(data)
        return self._ready(round_no)

    @staticmethod
    def _follows(
        state: _Round, host: str, round_no: int, weight: float, offset: int, count: int, size: int
    ) -> None:
        """A host's pieces of a round come once each, in order, under one weight: its first
        piece's, recorded as its share."""
        have = state.prefix.get(host)
        if have is not None and (have >= size or state.weights[host] == 0):
            raise Mismatch(f"{host} sent round {round_no} twice")  # a zero weight's first piece is all
        if have is None:
            state.weights[host], have = weight, 0
        elif weight != state.weights[host]:
            raise Mismatch(f"{host} changed its weight within round {round_no}")
        if offset != have or offset + count > size:
            raise Mismatch(
                f"{host} sent parameters {offset}-{offset + count} of round {round_no}; "
                f"expected the next from {have} of {size}"
            )

    def _buffer(self, size: int) -> np.ndarray:
        if len(self._spares) >= 2 and len(self._spares[0]) == size:
            return self._spares.pop(0)
        return np.empty(size, dtype=np.float32)

    @staticmethod
    def _add(state: _Round, offset: int, values: np.ndarray) -> None:
        """Into the total: added where another host's parameters are, copied where none are yet."""
        stop, covered, total = offset + len(values), state.covered, state.total
        if offset < covered:
            end = min(stop, covered)
            np.add(total[offset:end], values[: end - offset], out=total[offset:end])
        if stop > covered:
            first = max(offset, covered)
            total[first:stop] = values[first - offset :]
            state.covered = stop

    def join(self, host: str, params: int = 0) -> list[Averaged]:
        """A walk-in's ranks are ready, averaging ``params`` parameters (0: not said): counted,
        with weight 0, in the lowest open round that has handed nothing out (or the next to
        open), and waited for in every round after. What it returns is for a world with nobody
        left to average with: the walk-in trains alone. Mismatch: it may not join."""
        if host in self.training or host in self._joining:
            raise Mismatch(f"{host} joined twice")
        if params and self._size is not None and params != self._size:
            raise Mismatch(
                f"parameter count mismatch: {host} averages {params} parameters, the world {self._size}"
            )
        for round_no in sorted(self._rounds):
            if (state := self._rounds[round_no]).sent == 0:
                self._enter(state, host)
                return []
        if not self.training:
            return [self._alone(frozenset({host}))]
        self._joining.add(host)
        return []

    @property
    def waiting(self) -> frozenset[str]:
        """Walk-ins ready, waiting for the next round to open."""
        return frozenset(self._joining)

    def _enter(self, state: _Round, host: str) -> None:
        state.weights[host], state.prefix[host] = 0.0, 0
        self.training.add(host)

    def _alone(self, hosts: frozenset[str]) -> Averaged:
        """The answer to walk-ins that nobody is left to average with: a round of nobody's
        parameters (they keep their own), numbered after the last one."""
        return Averaged(
            self.last_round + 1, b"", hosts, 0.0, params=self._size or 0, last=True, taken=self.taken
        )

    def resume(self, round_no: int) -> list[Averaged]:
        """A re-adopted host's ranks push ``round_no`` next: the floor rises to it, and the open
        rounds below it are dropped, answered with weight 0 to the hosts that pushed them."""
        if round_no <= self.floor:
            return []
        self.floor = round_no
        dropped = [(r, self._rounds.pop(r)) for r in sorted(self._rounds) if r < round_no]
        return [self._abandoned(r, frozenset(state.weights), state.bf16) for r, state in dropped]

    def _abandoned(self, round_no: int, hosts: frozenset[str], bf16: bool = False) -> Averaged:
        """The word for a round abandoned at a resume: nobody's parameters, the round is over."""
        return Averaged(round_no, b"", hosts, 0.0, bf16, params=self._size or 0, last=True, taken=self.taken)

    @property
    def active(self) -> bool:
        """Ranks average through the plane (a round finished or is open, or the hosts a restarted
        controller re-adopted had averaged: the floor)."""
        return bool(self.rounds_done or self._rounds or self.floor)

    def _delivered(self, state: _Round, host: str) -> int:
        """How far ``host`` holds up the round (a host that brings nothing holds up nothing)."""
        if host not in state.weights:
            return -1  # it has not started the round
        return (self._size or 0) if state.weights[host] == 0 else state.prefix[host]

    def missing(self, round_no: int) -> set[str]:
        """The training hosts a round still waits for."""
        state = self._rounds.get(round_no)
        if state is None:
            return set()
        return {h for h in self.training if self._delivered(state, h) < (self._size or 0)}

    def shutdown(self) -> list[tuple[int, set[str]]]:
        """Drop the open rounds: (round, hosts that pushed it), to be answered with the shutdown;
        walk-ins still waiting for a round are answered too (as the next round)."""
        open_rounds = [(r, set(state.weights)) for r, state in sorted(self._rounds.items())]
        if self._joining:
            open_rounds.append((self.last_round + 1, set(self._joining)))
        self._rounds.clear()
        self._joining.clear()
        return open_rounds

    def leave(self, host: str) -> list[Averaged]:
        """A host stopped training (its ranks exited or it died): rounds no longer wait for it;
        what it delivered of an open round still counts. Walk-ins waiting for a round that
        nobody is left to open train alone."""
        self.training.discard(host)
        self._joining.discard(host)
        pieces = [piece for r in sorted(self._rounds) for piece in self._ready(r)]
        if self._joining and not self.training and not self._rounds:
            pieces.append(self._alone(frozenset(self._joining)))
            self._joining.clear()
        return pieces

    def _ready(self, round_no: int) -> list[Averaged]:
        """The pieces of the round every training host has now delivered, averaged."""
        state = self._rounds[round_no]
        size = self._size or 0
        upto = min((self._delivered(state, h) for h in self.training), default=size)
        if upto < 0 or (upto <= state.sent and upto < size):
            return []  # someone has not started it, or nothing new is whole
        # A host gone mid-round counts where it delivered: a piece ends where its delivery did.
        gone = {h: p for h, p in state.prefix.items() if h not in self.training and state.weights[h] > 0}
        cuts = sorted({p for p in gone.values() if state.sent < p < upto})
        hosts = frozenset(h for h in state.weights if h in self.training)
        pieces = []
        first = state.sent
        for stop in [*cuts, upto]:
            weight = sum(
                w for h, w in state.weights.items() if w > 0 and (h in self.training or gone[h] >= stop)
            )
            pieces.append(self._average(round_no, state, first, stop, weight, hosts, stop == size))
            first = stop
        state.sent = upto
        least = min(piece.weight for piece in pieces)
        state.least = least if state.least is None else min(state.least, least)
        if upto == size:
            del self._rounds[round_no]
            self.rounds_done += 1
            self.taken += state.least
            self._spares = [*self._spares, state.total][-2:]
            pieces[-1] = replace(pieces[-1], taken=self.taken)
        return pieces

    def _average(
        self,
        round_no: int,
        state: _Round,
        first: int,
        stop: int,
        weight: float,
        hosts: frozenset[str],
        last: bool,
    ) -> Averaged:
        data: Blob = b""
        if weight > 0:  # nobody's parameters (nobody stepped): no data, the ranks keep theirs
            view = state.total[first:stop]
            np.divide(view, np.float32(weight), out=view)
            data = encode(view, state.bf16)
        return Averaged(
            round_no,
            data,
            hosts,
            weight,
            state.bf16,
            dict(state.weights) if last else {},
            offset=first,
            params=self._size or 0,
            last=last,
        )

"""The CPU plane's hub: weighted parameter averaging through the controller.

Each host's relay sends, per round, one frame: the sum of its ranks'
pre-scaled parameters (``weight_i * params_i``, raw float32 bytes) and the sum
of their weights. The hub adds the frames of a round as they come, and once
every host still training has sent it, divides once by the accepted weight
and hands the average back. Memory is one model per open round, whatever the
world size. Needs only worker -> controller reachability, so it works through
ssh tunnels and across GPU vendors.

Pure: no sockets. The controller feeds it pushes and departures and sends
what it returns.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

Blob = bytes | bytearray | memoryview


def to_bf16(values: np.ndarray) -> bytes:
    """float32 -> bfloat16 bytes (the top half of each float, rounded to nearest even).

    In place on one scratch array: the obvious expression makes four temporaries
    of the model's size, which costs more than the rounding.
    """
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    scratch = np.right_shift(bits, 16)
    np.bitwise_and(scratch, 1, out=scratch)
    np.add(scratch, 0x7FFF, out=scratch)
    np.add(scratch, bits, out=scratch)
    np.right_shift(scratch, 16, out=scratch)
    out = scratch.astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)  # rounding must not turn a NaN into an infinity
    return out.tobytes()


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


class Mismatch(Exception):
    """A host's parameters do not line up with the round's (a different model)."""


@dataclass
class _Round:
    total: np.ndarray
    weight: float
    bf16: bool
    hosts: set[str] = field(default_factory=set)
    weights: dict[str, float] = field(default_factory=dict)  # what each host brought (its share)


@dataclass(frozen=True)
class Averaged:
    """A finished round: what to send back, and to whom (``bf16``: in the wire format it came in).

    ``data`` may be a view of the hub's buffer: send it before the next push.
    """

    round: int
    data: Blob
    hosts: frozenset[str]
    weight: float
    bf16: bool = False
    weights: Mapping[str, float] = field(default_factory=dict)  # host -> its weight in the round


class Hub:
    def __init__(self, hosts: set[str]) -> None:
        self.training = set(hosts)  # hosts expected in every round
        self._rounds: dict[int, _Round] = {}
        self._size: int | None = None  # parameters per round, fixed by the first push
        self.rounds_done = 0
        self.bytes_in = 0
        self._spare: np.ndarray | None = None  # a finished round's buffer, reused (fresh pages cost faults)

    def push(
        self, host: str, round_no: int, weight: float, data: Blob, bf16: bool = False
    ) -> Averaged | None:
        """One host's folded contribution to a round; the round's average once it is complete.

        ``bf16``: the parameters came as bfloat16 (half the bytes on the link); the sum is float32.
        """
        width = 2 if bf16 else 4
        if len(data) % width:
            kind = "bfloat16" if bf16 else "float32"
            raise Mismatch(f"{host} sent {len(data)} bytes for round {round_no}: not {kind} parameters")
        size = len(data) // width
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
            total = self._spare if self._spare is not None and len(self._spare) == size else None
            self._spare = None
            if total is None:
                total = np.zeros(size, dtype=np.float32)
            else:
                total.fill(0.0)
            state = self._rounds[round_no] = _Round(total, 0.0, bf16)
        if host in state.hosts:
            raise Mismatch(f"{host} sent round {round_no} twice")
        state.hosts.add(host)
        state.weights[host] = weight
        if weight > 0:  # a host whose ranks took no step contributes nothing
            state.total += decode(data, bf16)
            state.weight += weight
        self.bytes_in += len(data)
        return self._finish(round_no)

    @property
    def active(self) -> bool:
        """Ranks average through the plane (a round finished or is open)."""
        return bool(self.rounds_done or self._rounds)

    def missing(self, round_no: int) -> set[str]:
        """The training hosts a round still waits for."""
        state = self._rounds.get(round_no)
        return set() if state is None else self.training - state.hosts

    def shutdown(self) -> list[tuple[int, set[str]]]:
        """Drop the open rounds: (round, hosts that pushed it), to be answered with the shutdown."""
        open_rounds = [(r, set(state.hosts)) for r, state in sorted(self._rounds.items())]
        self._rounds.clear()
        return open_rounds

    def leave(self, host: str) -> list[Averaged]:
        """A host stopped training (its ranks exited or it died): rounds waiting only on it finish."""
        self.training.discard(host)
        return [done for r in sorted(self._rounds) if (done := self._finish(r)) is not None]

    def _finish(self, round_no: int) -> Averaged | None:
        state = self._rounds[round_no]
        if not self.training <= state.hosts:
            return None
        del self._rounds[round_no]
        self.rounds_done += 1
        if state.weight > 0:
            state.total /= np.float32(state.weight)
        self._spare = state.total
        return Averaged(
            round_no,
            encode(state.total, state.bf16),
            frozenset(state.hosts),
            state.weight,
            state.bf16,
            state.weights,
        )

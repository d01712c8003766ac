"""The CPU plane on a worker: a rank's :class:`Averager` and the agent's :class:`AverageRelay`.

A rank writes its parameters as raw float32 into its own shared-memory segment
(no copy at all for tensors it adopted there: ``Averager.adopt``) and tells its
agent so on loopback (a small authenticated frame), with its weight (its
realized steps). The agent's relay weighs and folds its host's ranks piece by
piece (``hub.plan``) — straight from the segments, no copy for a host with one
rank of weight 1 — and streams the pieces up its control link, each folded as
the one before leaves; the controller's hub (:mod:`flodl_agent.train.hub`) divides
once by the accepted weight and streams the average back, which lands (float32:
received straight into it) where the ranks read it once the last piece is in:
on a host of one rank, that rank's own segment (its adopted tensors hold the
average with no copy); on a host of several, one shared segment every local
rank copies from.
Ranks with weight 0 (no step taken) are excluded from the average and still
receive it. Nothing is pickled; parameters never cross loopback as bytes.
A walk-in host's ranks join a world that is training with a round of weight 0 marked
``join``: it is answered with the average of whichever round the controller attaches them
to, and they count their rounds on from that one's number.

The segments live in a private directory (mode 0700) the agent creates under
``/dev/shm`` and removes when the run ends; the agent derives every path from
a rank number it owns, never from what a frame says.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..protocol import wire
from ..protocol.messages import Average, BadMessage
from ..protocol.messages import parse as parse_message
from ..protocol.streams import next_frame
from .hub import chunk_for, decode, encode, plan
from .segments import AVERAGE_FILE, ENV_DIR, ENV_KEY, ENV_PORT, Mapped, segment_path

DATA_MAX = wire.LINK_MAX  # one frame of parameters on a host's link
LOOPBACK_MAX = 64 * 1024  # loopback frames carry no parameters


class AveragingError(RuntimeError):
    """The plane refused a round (a parameter count mismatch, the run ended, a shutdown).

    ``saver`` is set for ShutdownWithSave: the rank that writes the checkpoint.
    """

    def __init__(self, message: str, saver: int | None = None) -> None:
        super().__init__(message)
        self.saver = saver


class Averager:
    """A rank's handle on the CPU plane (blocking; one call per round, in step with the other ranks)."""

    def __init__(
        self,
        port: int | None = None,
        key: bytes | None = None,
        bf16_wire: bool = False,
        directory: str | None = None,
    ) -> None:
        """``bf16_wire``: the host's frames travel to the controller as bfloat16 (half the
        bytes; the sum stays float32). The segments on this host are float32 either way."""
        self.bf16_wire = bf16_wire
        port = port if port is not None else int(os.environ[ENV_PORT])
        key = key if key is not None else bytes.fromhex(os.environ[ENV_KEY])
        where = Path(directory if directory is not None else os.environ[ENV_DIR])
        self.rank = int(os.environ.get("RANK", "0"))
        self._sock = socket.create_connection(("127.0.0.1", port))
        self._codec = wire.Codec(key, max_payload=LOOPBACK_MAX)
        self._mine = Mapped(segment_path(where, self.rank), writable=True, grow=True)
        self._average = Mapped(where / AVERAGE_FILE, writable=False)
        self._adopted: np.ndarray | None = None  # the mapping adopted tensors live in (kept mapped)
        self.round = 0  # the round this rank pushes next
        self.taken = 0.0  # the world's accepted weight through the last round answered, as told

    def adopt(self, tensors: list[Any]) -> None:
        """Move ``tensors`` into this rank's segment, in order from its start, so that a round
        whose leading tensors they are copies nothing in, nor (on a host of one rank, where the
        average lands in the segment) out.

        Tensors keep their identity (``.data`` is re-pointed: an optimizer holding the
        parameters goes on working); one that cannot live there (not float32 on the CPU) keeps
        its storage and is copied each round, as any tensor not adopted is. A round that does
        not come back whole leaves them as they were (the agent keeps what pieces of the average
        overwrote), unless the agent itself dies mid-round.
        """
        import torch

        segment = torch.from_numpy(self._mine.view(4 * sum(t.numel() for t in tensors)))
        offset = 0
        with torch.no_grad():
            for t in tensors:
                n = t.numel()
                if t.device.type == "cpu" and t.dtype == torch.float32:
                    place = segment[offset : offset + n].view(t.shape)
                    place.copy_(t)
                    t.data = place
                offset += n
        self._adopted = self._mine.array

    def _in_place(self, t: Any, base: int, offset: int) -> bool:
        """``t`` already lives at ``offset`` of the segment (mapped at ``base``, or where it was
        adopted: an older mapping of the same file, which only grows)."""
        if not t.is_contiguous() or not t.dtype.is_floating_point or t.dtype.itemsize != 4:
            return False
        at = t.data_ptr()
        adopted = self._adopted
        return at == base + 4 * offset or (adopted is not None and at == adopted.ctypes.data + 4 * offset)

    def average(self, tensors: list[Any], weight: float, join: bool = False) -> float:
        """Replace ``tensors`` (in place) by their weighted average across every rank.

        ``weight`` is this rank's share (its steps since the last round); returns
        the round's total weight (0: nobody stepped, and the tensors are left alone).
        ``join``: a walk-in's first round (weight 0): it takes the average of whichever round
        the controller attached it to, and counts its rounds on from that one's number.
        """
        size = 4 * sum(t.numel() for t in tensors)
        mine = self._mine.view(size)  # sized even with nothing to send: the average may land there
        if weight > 0:
            self._push(tensors, mine)
        body: dict[str, Any] = {"round": self.round, "rank": self.rank, "weight": float(weight), "size": size}
        body.update(bf16=self.bf16_wire, raw=True)  # raw: the parameters as they are, for the agent to weigh
        if join:
            body["join"] = True
        self._sock.sendall(self._codec.encode(wire.Kind.AVERAGE, body))
        reply = self._receive()
        if reply.get("error"):
            saver = reply.get("saver", -1)
            raise AveragingError(
                str(reply["error"]), saver if isinstance(saver, int) and saver >= 0 else None
            )
        # A join's answer is the world's round, whatever this rank's own count said.
        self.round = int(reply.get("round", self.round)) + 1 if join else self.round + 1
        self.taken = float(reply.get("taken", self.taken))
        total = float(reply.get("weight", 0.0))
        if total > 0:
            if not reply.get("raw"):
                raise AveragingError(
                    "the agent's flodl_agent is older than this rank's (it expects pre-weighted "
                    "parameters): run the ranks with the agent's installation"
                )
            try:
                averaged = mine if reply.get("own") else self._average.view(size)
            except (OSError, ValueError) as exc:
                raise AveragingError(f"the host's average cannot be read: {exc}") from None
            self._pull(tensors, averaged, mine)
        return total

    def _push(self, tensors: list[Any], mine: np.ndarray) -> None:
        """The tensors into this rank's segment (those that live there already stay)."""
        import torch

        segment, base, offset = torch.from_numpy(mine), mine.ctypes.data, 0
        with torch.no_grad():
            for t in tensors:
                n = t.numel()
                if not self._in_place(t, base, offset):
                    segment[offset : offset + n].copy_(t.detach().reshape(-1))
                offset += n

    def _pull(self, tensors: list[Any], averaged: np.ndarray, mine: np.ndarray) -> None:
        """The average into the tensors (those that live where it landed hold it already)."""
        import torch

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only map: it is only read from
            source = torch.from_numpy(averaged)
        base, offset = averaged.ctypes.data, 0
        with torch.no_grad():
            for t in tensors:
                n = t.numel()
                if not (averaged is mine and self._in_place(t, base, offset)):
                    t.copy_(source[offset : offset + n].view_as(t))
                offset += n

    def _receive(self) -> dict[str, Any]:
        while True:
            frame = self._codec.next_frame()
            if frame is not None:
                return frame.body
            data = self._sock.recv(65536)
            if not data:
                raise AveragingError("the agent closed the averaging connection (the run ended)")
            self._codec.feed(data)

    def close(self) -> None:
        self._sock.close()
        self._mine.close()
        self._average.close()


@dataclass
class _Pending:
    pushes: dict[int, tuple[float, int]] = field(default_factory=dict)  # rank -> (weight, size in bytes)
    bf16: bool = False  # a rank asked for the bfloat16 wire
    raw: set[int] = field(default_factory=set)  # ranks whose segment holds their parameters unweighted
    join: bool = False  # a walk-in host's first round: it takes whichever round the world is at

    def add(self, pushed: Average) -> None:
        self.pushes[pushed.rank] = (pushed.weight, pushed.size)
        self.bf16 = self.bf16 or pushed.bf16
        if pushed.raw:
            self.raw.add(pushed.rank)
        self.join = self.join or pushed.join  # a host is new or not: any push says for all


Piece = tuple[dict[str, Any], wire.Blob]
Send = Callable[[Iterable[Piece]], None]


class AverageRelay:
    """The agent's end: ranks on loopback, one folded round at a time up the link.

    ``send`` takes a round's pieces (bodies and raw bytes of ``AVERAGE`` frames), made
    one at a time as the link asks for them. A round is folded once every local rank
    still running has pushed it.
    """

    def __init__(self, ranks: list[int], send: Send, clock: Callable[[], float] = time.monotonic) -> None:
        self.key = os.urandom(wire.KEY_BYTES)
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self.directory = Path(tempfile.mkdtemp(prefix="flodl-plane-", dir=shm))
        self._alive = set(ranks)
        self._send = send
        self._rounds: dict[int, _Pending] = {}
        # Written too: on a host of one rank, the average lands in that rank's own segment.
        self._segments = {rank: Mapped(segment_path(self.directory, rank), writable=True) for rank in ranks}
        self._average = Mapped(self.directory / AVERAGE_FILE, writable=True, grow=True)
        self._landing = self._average  # where the round coming back lands
        self._sum = np.empty(0, np.float32)  # one piece of the host's weighted sum
        self._term = np.empty(0, np.float32)  # one rank's weighted piece, on its way into the sum
        self._landed: memoryview | None = None  # the average's piece a frame was received straight into
        self._weight: float | None = None  # the round coming back: the least weight of its pieces
        self._clock = clock
        self._sent: tuple[float, int] | None = None  # the round up the link: when it left, its bytes
        self.rate: float | None = None  # the link's bytes a second in the last round (sizes pieces)
        self._writers: dict[int, tuple[asyncio.StreamWriter, wire.Codec]] = {}
        self._linked = True  # a controller link is in place (``link_lost``: rounds are held)
        self._next = 0  # the lowest round the ranks here have not had answered
        self._up: int | None = None  # the round folded up the link, its answer not whole yet
        self._joining = False  # that round is a join: its answer may carry any round number
        # What an own landing overwrote of the rank's parameters ([0, _kept)), until it adopts the average.
        self._backup, self._kept = np.empty(0, np.float32), 0
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[Any]] = set()

    def env(self, port: int) -> dict[str, str]:
        """What a rank needs to reach the plane (its environment)."""
        return {ENV_PORT: str(port), ENV_KEY: self.key.hex(), ENV_DIR: str(self.directory)}

    async def listen(self) -> int:
        self._server = await asyncio.start_server(self._accepted, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        self._conns.add(writer)
        codec = wire.Codec(self.key, max_payload=LOOPBACK_MAX)
        rank: int | None = None
        try:
            while (frame := await next_frame(reader, codec)) is not None:
                pushed = parse_message(frame)
                if not isinstance(pushed, Average):
                    continue
                rank = pushed.rank
                if rank not in self._alive:
                    return  # not one of this host's ranks: drop the connection
                self._writers[rank] = (writer, codec)
                self._rounds.setdefault(pushed.round, _Pending()).add(pushed)
                self._fold_ready()
        except (wire.Dropped, BadMessage, ConnectionError):
            pass  # a wrong key or a broken frame from loopback: that rank's connection ends
        finally:
            if rank is not None:
                self._writers.pop(rank, None)
            writer.close()
            self._conns.discard(writer)
            if task is not None:
                self._handlers.discard(task)

    def rank_exited(self, rank: int) -> None:
        """A local rank ended: rounds no longer wait for it."""
        self._alive.discard(rank)
        self._fold_ready()

    @property
    def next_round(self) -> int:
        """The lowest round the ranks here have not had answered: what they push next or wait on."""
        return self._next

    def link_lost(self) -> None:
        """The controller link broke (it reads no more): the round up it is abandoned (its ranks get
        weight 0, their parameters as pushed); rounds that become ready wait for ``link_back``."""
        self._linked, self._sent = False, None
        if self._up is not None:
            self._finish({"round": self._up, "weight": 0.0}, adopted=False)

    def link_back(self) -> None:
        """A new link is in place under ``send``: held rounds go up, in order."""
        self._linked = True
        self._fold_ready()

    def _fold_ready(self) -> None:
        for round_no in sorted(self._rounds):
            pending = self._rounds[round_no]
            if not self._linked or not self._alive <= pending.pushes.keys():
                return  # rounds are folded in order, and only up a link
            del self._rounds[round_no]
            # Before the send: a link may answer within it.
            self._up, self._joining = round_no, pending.join
            self._send(self._fold(round_no, pending))

    def _fold(self, round_no: int, pending: _Pending) -> Iterable[Piece]:
        sizes = {rank: size for rank, (_, size) in pending.pushes.items()}
        if len(set(sizes.values())) > 1:
            ordered = sorted(sizes.items(), key=lambda kv: kv[1])
            (a, na), (b, nb) = ordered[0], ordered[-1]
            error = f"parameter count mismatch: rank {a} averages {na // 4} parameters, rank {b} {nb // 4}"
            return [({"round": round_no, "error": error}, b"")]
        size = next(iter(sizes.values()), 0)
        if size % 4:
            error = f"a rank pushed {size} bytes: not float32 parameters"
            return [({"round": round_no, "error": error}, b"")]
        parts = []
        weight = 0.0
        try:
            for rank, (w, _) in sorted(pending.pushes.items()):
                if w > 0:
                    parts.append((self._segments[rank].view(size), w if rank in pending.raw else 1.0))
                    weight += w
            # One rank here, and it reads its average where it left its parameters: the
            # average lands there (the hub answers a piece only once it has the piece whole).
            own = len(self._segments) == 1 and pending.raw == pending.pushes.keys()
            self._landing = self._segments[next(iter(pending.pushes))] if own else self._average
            if own:
                self._landing.view(size)
        except (OSError, ValueError) as exc:
            return [({"round": round_no, "error": f"a rank's segment cannot be read: {exc}"}, b"")]
        head = {"round": round_no, "weight": weight, "bf16": pending.bf16, "params": size // 4}
        if pending.join:
            head["join"] = True
        if not parts:
            return [({**head, "offset": 0}, b"")]  # nobody here stepped: nothing to add, one empty piece
        return self._pieces(head, parts, size // 4)

    def _pieces(
        self, head: dict[str, Any], parts: list[tuple[np.ndarray, float]], params: int
    ) -> Iterator[Piece]:
        """The host's weighted sum, a piece at a time: each is made once the one before has
        left, so a piece of scratch serves (a rank of weight 1 alone sends its segment's own
        bytes)."""
        bf16 = bool(head["bf16"])
        width = 2 if bf16 else 4
        chunk = chunk_for(self.rate, width)
        piece = min(chunk, params)
        self._sent = (self._clock(), params * width)
        if len(self._sum) < piece and (len(parts) > 1 or parts[0][1] != 1.0):
            self._sum = np.empty(piece, np.float32)
        if len(self._term) < piece and any(w != 1.0 for _, w in parts[1:]):
            self._term = np.empty(piece, np.float32)
        for first, stop in plan(params, chunk) or [(0, 0)]:
            (values, w), n = parts[0], stop - first
            folded = values[first:stop]
            if w != 1.0:
                folded = np.multiply(folded, np.float32(w), out=self._sum[:n])
            for values, w in parts[1:]:
                term = values[first:stop]
                if w != 1.0:
                    term = np.multiply(term, np.float32(w), out=self._term[:n])
                folded = np.add(folded, term, out=self._sum[:n])
            yield {**head, "offset": first}, encode(folded, bf16)

    def destination(self, kind: wire.Kind, body: dict[str, Any], nbytes: int) -> memoryview | None:
        """A float32 piece of the average is received straight into where it lands (the codec's
        sink: ``body`` is not verified yet, and nothing reads the average until the round is in)."""
        params, offset = body.get("params"), body.get("offset")
        self._landed = None
        if kind is not wire.Kind.AVERAGED or body.get("bf16") or nbytes % 4 or not self._answers(body):
            return None  # not the round up the link (an abandoned one's late piece): nothing lands
        if not (isinstance(params, int) and isinstance(offset, int) and 0 <= offset <= params - nbytes // 4):
            return None
        if params > DATA_MAX // 4:
            return None
        try:
            average = self._landing.view(4 * params)
        except (OSError, ValueError):
            return None
        self._keep(average, offset + nbytes // 4)
        self._landed = average[offset : offset + nbytes // 4].data.cast("B")
        return self._landed

    def _answers(self, body: dict[str, Any]) -> bool:
        """``body`` answers the round up the link: its number, or any number for a join (the
        controller attaches a walk-in to the round the world is at)."""
        if self._up is None or not isinstance(round_no := body.get("round"), int):
            return False
        return round_no == self._up or self._joining

    def _keep(self, average: np.ndarray, stop: int) -> None:
        """Before a piece lands in a rank's own segment, what it overwrites: a round not adopted
        (abandoned, refused) leaves the rank's tensors as they were. One copy here, as the rest
        is on the link: landing elsewhere would have the rank copy the average in, every round."""
        stop = min(stop, len(average))
        if self._landing is self._average or stop <= self._kept:
            return
        if len(self._backup) < len(average):
            self._backup = np.empty(len(average), np.float32)
        self._backup[self._kept : stop] = average[self._kept : stop]
        self._kept = stop

    def deliver(self, body: dict[str, Any], blob: wire.Blob) -> None:
        """A piece of the controller's average: where the round lands; once the round is whole
        (or refused), word to every local rank. A round over here (abandoned) is ignored; a join's
        answer carries the world's round, whatever its number."""
        if isinstance(round_no := body.get("round"), int) and round_no < self._next and not self._joining:
            return
        if not body.get("error"):
            if not self._land(body, blob):
                return
            body = {**body, "weight": self._weight}
            if self._sent is not None:  # up and back: the link's pace, for the next round's pieces
                (began, nbytes), self._sent = self._sent, None
                if (seconds := self._clock() - began) > 0:
                    self.rate = nbytes / seconds
        self._finish(body, adopted=not body.get("error") and body["weight"] > 0)

    def _land(self, body: dict[str, Any], blob: wire.Blob) -> bool:
        """A piece into where the round lands (unless received there); True for the last."""
        bf16 = bool(body.get("bf16"))
        count = len(blob) // (2 if bf16 else 4)
        params = int(body.get("params") or count)
        weight = float(body.get("weight", 0.0))
        self._weight = weight if self._weight is None else min(self._weight, weight)
        if count and blob is not self._landed:
            offset, average = int(body.get("offset", 0)), self._landing.view(4 * params)
            self._keep(average, offset + count)
            np.copyto(average[offset : offset + count], decode(blob, bf16))
        self._landed = None
        return bool(body.get("last", True))

    def _finish(self, body: dict[str, Any], adopted: bool) -> None:
        """The round is over: word to every local rank (an own landing not adopted undone first)."""
        own = self._landing is not self._average
        if own and not adopted:
            self._restore()  # the rank's parameters as it pushed them
        self._weight, self._landing, self._landed, self._kept, self._up = None, self._average, None, 0, None
        self._joining = False
        if isinstance(round_no := body.get("round"), int):
            self._next = max(self._next, round_no + 1)
        # A join's round number and the world's batches so far are what a walk-in's ranks go on from.
        kept = ("round", "weight", "error", "saver", "taken")
        reply: dict[str, Any] = {k: body[k] for k in kept if k in body}
        reply.update(raw=True, own=own)  # the parameters were weighed here; where the average is
        for writer, codec in list(self._writers.values()):
            with contextlib.suppress(ConnectionError, RuntimeError):
                writer.write(codec.encode(wire.Kind.AVERAGED, reply))

    def _restore(self) -> None:
        kept = min(self._kept, len(self._landing.array))
        self._landing.array[:kept] = self._backup[:kept]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._up is not None and self._landing is not self._average:
            self._restore()  # the run ends mid-round: no partial average in the rank's tensors
        # Closing the connections ends each handler's read: they finish on their own.
        for writer in list(self._conns):
            writer.close()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        for segment in (*self._segments.values(), self._average):
            segment.close()
        shutil.rmtree(self.directory, ignore_errors=True)

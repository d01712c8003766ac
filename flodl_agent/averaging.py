"""The CPU plane on a worker: a rank's :class:`Averager` and the agent's :class:`AverageRelay`.

A rank hands its parameters and its weight (its realized steps) to
``Averager.average``; they travel as raw float32 bytes (no pickling), already
multiplied by the weight, to its agent on loopback. The agent's relay folds
its host's ranks into one frame per round and sends it up its control link;
the controller's hub (:mod:`flodl_agent.hub`) divides once by the accepted
weight and the average comes back the same way. Ranks with weight 0 (no step
taken) are excluded from the average and still receive it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import wire
from .hub import decode, encode

DATA_MAX = 512 * 1024 * 1024  # one frame of parameters: a 128M-parameter model in float32
ENV_PORT, ENV_KEY = "FLODL_AVERAGE_PORT", "FLODL_AVERAGE_KEY"


class AveragingError(RuntimeError):
    """The plane refused a round (a parameter count mismatch, the run ended, a shutdown).

    ``saver`` is set for ShutdownWithSave: the rank that writes the checkpoint.
    """

    def __init__(self, message: str, saver: int | None = None) -> None:
        super().__init__(message)
        self.saver = saver


class Averager:
    """A rank's handle on the CPU plane (blocking; one call per round, in step with the other ranks)."""

    def __init__(self, port: int | None = None, key: bytes | None = None, bf16_wire: bool = False) -> None:
        """``bf16_wire``: the host's frames travel to the controller as bfloat16 (half the
        bytes; the sum stays float32). Loopback to the agent is float32 either way."""
        self.bf16_wire = bf16_wire
        port = port if port is not None else int(os.environ[ENV_PORT])
        key = key if key is not None else bytes.fromhex(os.environ[ENV_KEY])
        self.rank = int(os.environ.get("RANK", "0"))
        self._sock = socket.create_connection(("127.0.0.1", port))
        self._codec = wire.Codec(key, max_payload=DATA_MAX)
        self.round = 0

    def average(self, tensors: list[Any], weight: float) -> float:
        """Replace ``tensors`` (in place) by their weighted average across every rank.

        ``weight`` is this rank's share (its steps since the last round); returns
        the round's total weight (0: nobody stepped, and the tensors are left alone).
        """
        import torch

        flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])
        scaled = (flat * float(weight)).numpy() if weight > 0 else np.zeros(flat.numel(), np.float32)
        body = {
            "round": self.round,
            "rank": self.rank,
            "weight": float(weight),
            "data": scaled.tobytes(),
            "bf16": self.bf16_wire,
        }
        self._sock.sendall(self._codec.encode(wire.Kind.AVERAGE, body))
        reply = self._receive()
        if reply.get("error"):
            saver = reply.get("saver", -1)
            raise AveragingError(
                str(reply["error"]), saver if isinstance(saver, int) and saver >= 0 else None
            )
        self.round += 1
        total = float(reply.get("weight", 0.0))
        if total > 0:
            averaged = torch.frombuffer(bytearray(reply["data"]), dtype=torch.float32)
            offset = 0
            with torch.no_grad():
                for t in tensors:
                    n = t.numel()
                    t.copy_(averaged[offset : offset + n].view_as(t).to(t.dtype))
                    offset += n
        return total

    def _receive(self) -> dict[str, Any]:
        while True:
            frame = self._codec.next_frame()
            if frame is not None:
                return frame.body
            data = self._sock.recv(1 << 20)
            if not data:
                raise AveragingError("the agent closed the averaging connection (the run ended)")
            self._codec.feed(data)

    def close(self) -> None:
        self._sock.close()


@dataclass
class _Pending:
    pushes: dict[int, tuple[float, bytes]] = field(default_factory=dict)  # rank -> (weight, data)
    bf16: bool = False  # a rank asked for the bfloat16 wire


Send = Callable[[dict[str, Any]], None]


class AverageRelay:
    """The agent's end: ranks on loopback, one folded frame per round up the link.

    ``send`` puts a body on the control link (an ``AVERAGE`` frame). A round is
    folded once every local rank still running has pushed it.
    """

    def __init__(self, ranks: list[int], send: Send) -> None:
        self.key = os.urandom(wire.KEY_BYTES)
        self._alive = set(ranks)
        self._send = send
        self._rounds: dict[int, _Pending] = {}
        self._writers: dict[int, tuple[asyncio.StreamWriter, wire.Codec]] = {}
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[Any]] = set()

    async def listen(self) -> int:
        self._server = await asyncio.start_server(self._accepted, "127.0.0.1", 0, limit=1 << 20)
        return int(self._server.sockets[0].getsockname()[1])

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        self._conns.add(writer)
        codec = wire.Codec(self.key, max_payload=DATA_MAX)
        rank: int | None = None
        try:
            while data := await reader.read(1 << 20):
                codec.feed(data)
                for frame in codec.frames():
                    if frame.kind is not wire.Kind.AVERAGE:
                        continue
                    body = frame.body
                    rank = int(body.get("rank", -1))
                    if rank not in self._alive:
                        return  # not one of this host's ranks: drop the connection
                    self._writers[rank] = (writer, codec)
                    pending = self._rounds.setdefault(int(body["round"]), _Pending())
                    pending.pushes[rank] = (float(body.get("weight", 0.0)), bytes(body.get("data", b"")))
                    pending.bf16 = pending.bf16 or bool(body.get("bf16"))
                    self._fold_ready()
        except (wire.Dropped, ConnectionError, KeyError, TypeError, ValueError):
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

    def _fold_ready(self) -> None:
        for round_no in sorted(self._rounds):
            pending = self._rounds[round_no]
            if not self._alive <= pending.pushes.keys():
                return  # rounds are folded in order
            del self._rounds[round_no]
            self._send(self._fold(round_no, pending))

    @staticmethod
    def _fold(round_no: int, pending: _Pending) -> dict[str, Any]:
        sizes = {rank: len(data) for rank, (_, data) in pending.pushes.items()}
        if len(set(sizes.values())) > 1:
            ordered = sorted(sizes.items(), key=lambda kv: kv[1])
            (a, na), (b, nb) = ordered[0], ordered[-1]
            return {
                "round": round_no,
                "error": f"parameter count mismatch: rank {a} averages {na // 4} parameters, "
                f"rank {b} {nb // 4}",
            }
        total = None
        weight = 0.0
        for w, data in pending.pushes.values():
            if w > 0:
                part = np.frombuffer(data, dtype=np.float32)
                total = part.copy() if total is None else total + part
                weight += w
        size = next(iter(sizes.values()), 0) // 4
        folded = total if total is not None else np.zeros(size, np.float32)
        return {
            "round": round_no,
            "weight": weight,
            "data": encode(folded, pending.bf16),
            "bf16": pending.bf16,
        }

    def deliver(self, body: dict[str, Any]) -> None:
        """The controller's average for a round: to every local rank that pushed it (in float32)."""
        keys = ("round", "weight", "data", "error", "saver")
        frame_body: dict[str, Any] = {k: body[k] for k in keys if k in body}
        if body.get("bf16") and frame_body.get("data"):
            frame_body["data"] = encode(decode(frame_body["data"], True), False)
        for writer, codec in list(self._writers.values()):
            with contextlib.suppress(ConnectionError, RuntimeError):
                writer.write(codec.encode(wire.Kind.AVERAGED, frame_body))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        # Closing the connections ends each handler's read: they finish on their own.
        for writer in list(self._conns):
            writer.close()
        await asyncio.gather(*self._handlers, return_exceptions=True)

"""One admitted host's link, as the controller holds it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from ..protocol import wire
from ..protocol.join_protocol import JoinServer
from ..protocol.messages import Hello
from ..protocol.streams import write_parts


@dataclass
class Link:
    """One admitted host: its hello, its stream and its side of the join protocol."""

    hello: Hello
    writer: asyncio.StreamWriter
    conn: JoinServer
    joined_at: float
    peer: str
    ranks: range | None = None  # its share of the formed world
    midrun_step: int | None = None  # it walked into the training world when it was at this step

    def send(self, kind: wire.Kind, body: dict[str, Any], blob: wire.Blob = b"") -> None:
        write_parts(self.writer, self.conn.send(kind, body, blob))

    def send_shared(self, kind: wire.Kind, shared: wire.SharedMap, own: dict[str, Any]) -> None:
        write_parts(self.writer, [self.conn.send_shared(kind, shared, own)])

"""The host's road to the controller while its ranks train.

Every message the training side sends up (a rank's exit, the heartbeat with the ranks'
reports, the store's streams, the averaging's pieces) goes through one Uplink rather than
the connection it was admitted on, so that the connection under it can be replaced while
the ranks run (a controller that comes back, ``grace``) without any of them knowing.
While the road is down, a rank's exit waits for the next connection (the restarted
controller must learn it) and what only describes the moment (a heartbeat) is dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from ..protocol import wire
from ..protocol.join_protocol import JoinClient
from ..protocol.streams import LinkStream, write_parts

HELD = frozenset({wire.Kind.RANK_EXITED})  # what a gap keeps for the next connection


class Uplink:
    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, client: JoinClient
    ) -> None:
        self.reader, self.writer, self.client = reader, writer, client
        self.link: LinkStream | None = None  # once the link is its own protocol (take_over)
        self._held: list[tuple[wire.Kind, dict[str, Any]]] = []
        self.up = asyncio.Event()  # set while a connection carries what is sent
        self.up.set()

    def send(self, kind: wire.Kind, body: dict[str, Any]) -> None:
        """One message, in order with what was sent before it on this road."""
        if not self.up.is_set():
            if kind in HELD:
                self._held.append((kind, body))
            return
        write_parts(self.writer, self.client.send(kind, body))

    def stream(self, pieces: Iterable[tuple[dict[str, Any], wire.Blob]]) -> None:
        """A round's averaging pieces, written as the link's flow allows."""
        if self.link is None:
            raise RuntimeError("the averaging streamed before the link was taken over")
        self.link.stream((wire.Kind.AVERAGE, body, blob) for body, blob in pieces)

    @property
    def closing(self) -> bool:
        return not self.up.is_set() or self.writer.is_closing()

    def lost(self) -> None:
        """The connection broke: hold what must reach the controller until ``rebind``."""
        self.up.clear()

    def rebind(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, client: JoinClient, link: LinkStream
    ) -> None:
        """A new connection is admitted under the same ranks: what was held goes first."""
        self.reader, self.writer, self.client, self.link = reader, writer, client, link
        self.up.set()
        held, self._held = self._held, []
        for kind, body in held:
            self.send(kind, body)

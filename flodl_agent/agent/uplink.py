"""The host's road to the controller while its ranks train.

Every message the training side sends up (a rank's exit, the heartbeat with the ranks'
reports, the store's streams, the averaging's pieces) goes through one Uplink rather than
the connection it was admitted on, so that the connection under it can be replaced while
the ranks run (a controller that comes back, ``grace``) without any of them knowing.
While the road is down, what only describes the moment (a heartbeat, a round's pieces) is
dropped; every rank's exit is sent again on the next connection, since one written just as
the old one broke may never have arrived (the controller ignores an exit it knows).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any

from ..protocol import wire
from ..protocol.join_protocol import JoinClient
from ..protocol.streams import LinkStream, write_parts


class Uplink:
    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, client: JoinClient
    ) -> None:
        self.reader, self.writer, self.client = reader, writer, client
        self.link: LinkStream | None = None  # once the link is its own protocol (take_over)
        self._exits: list[dict[str, Any]] = []  # every rank exit sent: a new connection resends them
        self.up = asyncio.Event()  # set while a connection carries what is sent
        self.up.set()
        self.down = asyncio.Event()  # its opposite: set from a break to the next connection

    def send(self, kind: wire.Kind, body: dict[str, Any]) -> None:
        """One message, in order with what was sent before it on this road."""
        if kind is wire.Kind.RANK_EXITED:
            self._exits.append(body)
        if self.up.is_set():
            with contextlib.suppress(RuntimeError):  # closed under us; the grace hears of it next
                write_parts(self.writer, self.client.send(kind, body))

    def stream(self, pieces: Iterable[tuple[dict[str, Any], wire.Blob]]) -> None:
        """A round's averaging pieces, written as the link's flow allows."""
        if self.link is None:
            raise RuntimeError("the averaging streamed before the link was taken over")
        if not self.up.is_set() or self.writer.is_closing():
            return  # the link just broke: the grace abandons this round (AverageRelay.link_lost)
        with contextlib.suppress(RuntimeError):  # closed under us, before the grace heard of it
            self.link.stream((wire.Kind.AVERAGE, body, blob) for body, blob in pieces)

    @property
    def closing(self) -> bool:
        return not self.up.is_set() or self.writer.is_closing()

    def lost(self) -> None:
        """The connection broke: nothing goes up until ``rebind``."""
        self.up.clear()
        self.down.set()

    def rebind(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, client: JoinClient, link: LinkStream
    ) -> None:
        """A new connection is admitted under the same ranks: the ranks' exits go first."""
        self.writer.close()  # the broken one: its socket goes now, not with the attempt
        self.reader, self.writer, self.client, self.link = reader, writer, client, link
        self.down.clear()
        self.up.set()
        for body in self._exits:
            write_parts(writer, client.send(wire.Kind.RANK_EXITED, body))

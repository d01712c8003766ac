"""The host's road to the controller while its ranks train.

Every message the training side sends up (a rank's exit, the heartbeat with the ranks'
reports, the store's streams, the averaging's pieces) goes through one Uplink rather than
the connection it was admitted on, so that the connection under it can be replaced while
the ranks run (a controller that comes back: issue 37) without any of them knowing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from ..protocol import wire
from ..protocol.join_protocol import JoinClient
from ..protocol.streams import LinkStream, write_parts


class Uplink:
    def __init__(self, writer: asyncio.StreamWriter, client: JoinClient) -> None:
        self.writer, self.client = writer, client
        self.link: LinkStream | None = None  # once the link is its own protocol (take_over)

    def send(self, kind: wire.Kind, body: dict[str, Any]) -> None:
        """One message, in order with what was sent before it on this road."""
        write_parts(self.writer, self.client.send(kind, body))

    def stream(self, pieces: Iterable[tuple[dict[str, Any], wire.Blob]]) -> None:
        """A round's averaging pieces, written as the link's flow allows."""
        if self.link is None:
            raise RuntimeError("the averaging streamed before the link was taken over")
        self.link.stream((wire.Kind.AVERAGE, body, blob) for body, blob in pieces)

    @property
    def closing(self) -> bool:
        return self.writer.is_closing()

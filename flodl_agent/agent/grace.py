"""The controller grace: a training host's ranks outlive their controller for a while.

When the link to the controller ends under running ranks without an Abort (the
controller was killed, its box rebooted, its unit restarted), the ranks train on:
their collectives never touch the controller. The agent holds their exits
(``Uplink``), pauses the CPU plane's rounds (``AverageRelay.link_lost``), ends the
store's relayed streams, and re-dials the same road with a *resume* hello (the
launch, its ranks, the round its ranks push next), proven with its host key as every
hello is. A restarted controller that resumed the launch re-adopts it, and the new
connection goes under the same Uplink. Refused (the controller opened a new window,
or does not know this host), or past the grace, the ranks stop as before.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..net import keepalive
from ..protocol import wire
from ..protocol.join_protocol import Event, JoinClient, JoinError
from ..protocol.messages import BadMessage
from ..protocol.streams import LinkEnded, dial, take_over
from ..retry import AgentFailure
from ..train.averaging import AverageRelay
from ..train.rendezvous import StreamRelay
from .greeting import HelloRefused, greet
from .uplink import Uplink

FIRST_WAIT = 0.25  # seconds before the second dial: a restart on the same box is that quick
LONGEST_WAIT = 1.0  # the re-dial's wait doubles up to this, jittered by a fifth: back within a second


@dataclass
class Grace:
    """Keeps a training host's road to its controller for the ranks' lifetime."""

    seconds: float  # 0: a lost controller stops the ranks at once
    road: tuple[str, int]  # what the agent dialled (a tunnel's local end included)
    pin: str  # the controller's TLS fingerprint ("": plain TCP)
    key: bytes | None
    hello: Callable[[], dict[str, Any]]  # the resume hello's fields, as of now (its round moves)
    uplink: Uplink
    averager: AverageRelay
    relay: StreamRelay
    events: Callable[[Event], None]
    log: Callable[[str], None]
    clock: Callable[[], float] = time.monotonic
    jitter: Callable[[], float] = random.random
    gaps: list[float] = field(default_factory=list)  # seconds each gap lasted (the bench reads them)

    async def keep(self) -> str:
        """Why the ranks must stop: the controller aborted the run, refused the resume, or
        did not come back within the grace. Cancelled when the ranks end first."""
        while True:
            link = self.uplink.link
            assert link is not None
            ended = await link.ended()
            if isinstance(ended, LinkEnded):
                return ended.reason  # the controller's Abort
            why = "the controller went away mid-run"
            if isinstance(ended, wire.Dropped):
                why = f"the controller link broke ({ended})"
            if self.seconds <= 0:
                return why
            if (refused := await self._gap(why)) is not None:
                return refused

    async def _gap(self, why: str) -> str | None:
        """The controller is away: train on and re-dial; None once re-adopted."""
        self.uplink.lost()
        self.averager.link_lost()
        self.relay.link_lost()
        self.log(f"{why}: this host's ranks train on; re-dialling to resume for up to {self.seconds:g}s")
        began = self.clock()
        deadline, tries = began + self.seconds, 0
        while (left := deadline - self.clock()) > 0:
            try:
                await asyncio.wait_for(self._resume(), left)
            except HelloRefused as exc:
                return f"the controller did not re-adopt this host: {exc.message}"
            except (
                AgentFailure, JoinError, BadMessage, OSError, TimeoutError, asyncio.IncompleteReadError,
                wire.Dropped,
            ):  # fmt: skip
                wait = min(LONGEST_WAIT, FIRST_WAIT * 2**tries) * (1.0 - 0.2 * self.jitter())
                tries += 1
                await asyncio.sleep(min(wait, max(0.0, deadline - self.clock())))  # the backoff itself
                continue
            self.gaps.append(self.clock() - began)
            self.log(f"resumed: the controller re-adopted this host after {self.gaps[-1]:.1f}s")
            return None
        return f"{why}, and did not come back within the {self.seconds:g}s controller grace"

    async def _resume(self) -> None:
        reader, writer = await dial(*self.road, self.pin)
        try:
            keepalive(writer)
            client = JoinClient(self.key)
            await greet(reader, writer, client, self.hello())
        except BaseException:
            writer.close()
            raise
        # As at the first admission: the average's pieces land in shared memory.
        client.codec.sink = self.averager.destination
        link = take_over(reader, writer, client, self.events)
        self.uplink.rebind(reader, writer, client, link)
        self.relay.link_back()
        self.averager.link_back()

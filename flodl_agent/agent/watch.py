"""A training host's watch: what its link brings, and its ranks until they all end.

The agent's ``_train`` runs the ranks; this says when that is over: every rank exited
(the store kept up for the other hosts' last words when this host serves it), or the
controller's road ended for good first (``grace``: an Abort, a refused resume, the grace
run out), which cancels the ranks and fails the attempt (transient).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from ..protocol.join_protocol import Aborted, Event, Formed, Message
from ..protocol.messages import Averaged, Reform, Release, Stream
from ..protocol.streams import LinkEnded
from ..retry import Transient
from ..train.averaging import AverageRelay
from ..train.rendezvous import StreamRelay
from .regrowth import Regrowth
from .uplink import Uplink


def link_events(relay: StreamRelay, averager: AverageRelay, regrowth: Regrowth) -> Callable[[Event], None]:
    """What the link brings while the ranks train: store bytes, averages, the controller's abort,
    a process-group world's re-formation (the request to stop, then the new world), and an
    elastic world's word that it goes on without this host's failed ranks."""

    def on_event(event: Event) -> None:
        if isinstance(event, Aborted):
            raise LinkEnded(f"the controller aborted the run: {event.reason}")
        if isinstance(event, Formed):
            regrowth.formed(event.world)
        elif isinstance(event, Message) and isinstance(event.message, Reform):
            regrowth.ask(event.message)
        elif isinstance(event, Message) and isinstance(event.message, Release):
            regrowth.release(event.message.reason)
        elif isinstance(event, Message) and isinstance(event.message, Stream):
            relay.feed(event.message.id, event.message.data, event.message.end)
        elif isinstance(event, Message) and isinstance(event.message, Averaged):
            averager.deliver(event.message.model_dump(), event.blob)

    return on_event


async def supervise(
    ranks: Sequence[asyncio.Future[int]],
    abort: asyncio.Task[str],
    relay: StreamRelay,
    serving: bool,
    reform: asyncio.Event,
) -> list[int] | None:
    """The ranks' exit codes once all ended (the store, when ``serving`` it, kept up for the other
    hosts); None when the controller asked for a re-formation (``reform``) first; the link
    ending first cancels them and fails the attempt (transient)."""
    asked = asyncio.ensure_future(reform.wait())
    watched: set[asyncio.Future[Any]] = {abort, asked}
    pending: set[asyncio.Future[Any]] = {*watched, *ranks}
    try:
        while watched <= pending and pending - watched:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    finally:
        asked.cancel()
    if asked.done() and not asked.cancelled() and not abort.done():
        return None  # the ranks stop for the re-formation (the agent's _reform)
    if abort.done():
        for task in ranks:
            task.cancel()
        await asyncio.gather(*ranks, return_exceptions=True)
        raise Transient(abort.result())
    codes = [t.result() for t in ranks]
    if serving:
        # Other hosts' ranks may still talk to the store (a last barrier): serve it until
        # their connections close, the run ends, or the world re-forms (a fresh store).
        drained = asyncio.ensure_future(relay.drained())
        again = asyncio.ensure_future(reform.wait())
        await asyncio.wait({abort, drained, again}, return_when=asyncio.FIRST_COMPLETED)
        drained.cancel()
        again.cancel()
    return codes


async def reported(uplink: Uplink, kept: asyncio.Task[str]) -> None:
    """The ranks ended while the controller was away: their exits wait for its return (a
    restarted controller must learn them), or the grace's end fails the attempt."""
    back = asyncio.ensure_future(uplink.up.wait())
    await asyncio.wait({back, kept}, return_when=asyncio.FIRST_COMPLETED)
    back.cancel()
    if not uplink.up.is_set():
        raise Transient(f"{kept.result()}: this host's rank exits never reached a controller")

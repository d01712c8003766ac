"""The rendezvous store's road, and a process-group world's re-formation as a host lives it.

Rank 0's host serves torch's TCPStore; every other host relays its ranks' connections to it
over the link (``train.rendezvous``). When the controller re-forms a process-group world
to grow it (``Reform``), the agent stops its ranks (SIGTERM, then the kill), reports their
exits, keeps its link, and waits for the new world: its ranks start again under the same
launch with ``TORCHELASTIC_RESTART_COUNT`` one more. Rank 0's host serves a fresh store for
them: the stopped world's keys (gloo's addresses among them) must not meet the new one's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ..protocol import wire
from ..protocol.messages import Reform, WorldFormed
from ..retry import Transient
from ..train.rendezvous import StreamRelay, serve_store
from .uplink import Uplink


class Regrowth:
    """What the link says of a re-formation: the request to stop, then the new world."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()  # set from the Reform to the new world
        self.restart = 0
        self._worlds: asyncio.Queue[WorldFormed] = asyncio.Queue()

    def ask(self, reform: Reform) -> None:
        self.restart = reform.restart
        self.asked.set()

    def formed(self, world: WorldFormed) -> None:
        self._worlds.put_nowait(world)

    async def next_world(self, abort: asyncio.Task[str]) -> WorldFormed:
        """The re-formed world's share; the road ending first fails the attempt (transient)."""
        world = asyncio.ensure_future(self._worlds.get())
        await asyncio.wait({world, abort}, return_when=asyncio.FIRST_COMPLETED)
        if not world.done():
            world.cancel()
            raise Transient(f"{abort.result()} (while the world re-formed)")
        self.asked.clear()
        return world.result()


async def store(log: Callable[[str], None]) -> tuple[Any, int] | None:
    """A TCPStore on loopback and its port; None (said) where torch cannot serve one."""
    try:
        return await asyncio.get_running_loop().run_in_executor(None, serve_store)
    except (ImportError, RuntimeError, OSError) as exc:
        # Scripts that never rendezvous (no torch.distributed) still run.
        log(f"note: no rendezvous store on this host ({exc}); env:// rendezvous will fail")
        return None


async def rendezvous(
    first_rank: int, uplink: Uplink, log: Callable[[str], None]
) -> tuple[StreamRelay, Any, int]:
    """The store (on rank 0's host) or a relay to it: the relay, the store, the ranks' port."""

    def send(sid: int, data: bytes, end: bool) -> None:
        uplink.send(wire.Kind.STREAM, {"id": sid, "data": data, "end": end})

    served = await store(log) if first_rank == 0 else None
    if served is None:
        relay = StreamRelay(send)
        return relay, None, await relay.listen()
    return StreamRelay(send, store_port=served[1]), served[0], served[1]


async def fresh_store(relay: StreamRelay, log: Callable[[str], None]) -> tuple[Any, int]:
    """A new store for a re-formed world on rank 0's host, the streams opened from now on
    routed to it."""
    served = await store(log)
    if served is None:
        raise Transient("this host serves the world's rendezvous store, and torch could not start a new one")
    relay.serve(served[1])
    return served

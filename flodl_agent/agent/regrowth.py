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

from ..config.ranks import rank_span
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
        self.released = ""  # the controller's word that the world goes on without this host
        self._let_go = asyncio.Event()
        self._worlds: asyncio.Queue[WorldFormed] = asyncio.Queue()

    def ask(self, reform: Reform) -> None:
        self.restart = reform.restart
        self.asked.set()  # cleared when acted on (the agent's stop), not when the world comes

    def acted(self) -> None:
        """The ranks stop for this request: a Reform read after it (even in the same batch as
        the new world) is the next re-formation's."""
        self.asked.clear()

    def release(self, reason: str) -> None:
        self.released = reason or "the world goes on without this host's ranks"
        self._let_go.set()

    async def word(self, abort: asyncio.Task[str], uplink: Uplink, log: Callable[[str], None]) -> bool:
        """This host's ranks all ended and one failed, in an elastic world: the controller says
        whether they run again (True: ``Reform``, a process group re-forms) or the world goes
        on without them (``Release``). The controller going away ends the wait (False): the
        exits wait for its return as any host's do (``watch.reported``)."""
        if self.asked.is_set():
            return True
        log("a rank failed and the world is elastic: waiting for the controller's word")
        waits = {asyncio.ensure_future(e.wait()) for e in (self.asked, self._let_go, uplink.down)}
        await asyncio.wait({*waits, abort}, return_when=asyncio.FIRST_COMPLETED)
        for task in waits:
            task.cancel()
        if abort.done():
            raise Transient(abort.result())
        if self._let_go.is_set():
            log(f"released: {self.released}")
        return self.asked.is_set() and not self._let_go.is_set()

    def formed(self, world: WorldFormed) -> None:
        self._worlds.put_nowait(world)

    async def next_world(self, abort: asyncio.Task[str], uplink: Uplink) -> WorldFormed:
        """The re-formed world's share. The road ending first fails the attempt (transient), and
        so does the controller going away meanwhile: no ranks run here for a resume to claim,
        and the world it was forming died with it."""
        world = asyncio.ensure_future(self._worlds.get())
        lost = asyncio.ensure_future(uplink.down.wait())
        await asyncio.wait({world, abort, lost}, return_when=asyncio.FIRST_COMPLETED)
        lost.cancel()
        if world.done():
            return world.result()
        world.cancel()
        if abort.done():
            raise Transient(f"{abort.result()} (while the world re-formed)")
        raise Transient(
            "the controller went away while the world re-formed: this host's ranks had stopped "
            "and no new world came",
            "the run ends with it; a --persist unit re-dials into the next launch",
        )


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


async def reformed(
    world: WorldFormed,
    regrowth: Regrowth,
    abort: asyncio.Task[str],
    uplink: Uplink,
    log: Callable[[str], None],
) -> WorldFormed:
    """The re-formed world's share, on the same link: this host keeps its ranks."""
    again = await regrowth.next_world(abort, uplink)
    mine, now = world.host, again.host
    if (now.host, now.first_rank, now.count) != (mine.host, mine.first_rank, mine.count):
        raise Transient(f"the re-formed world moved this host's ranks (to {now.first_rank}+{now.count})")
    ranks = rank_span(range(mine.first_rank, mine.first_rank + mine.count), noun=True)
    size, restart = again.world_size, again.restart_count
    log(f"world re-formed (restart {restart}): {size} ranks; this host runs {ranks} again")
    return again

"""An agent's relays across a gap in its controller link (a controller killed and restarted).

The averaging relay runs on its own loop thread, as in the agent; its link is a queue of the
rounds it sent up, and the test plays the controller: it answers pieces the way the codec
hands them over (received straight into ``destination`` where it offers one).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import pytest

from flodl_agent.protocol import wire
from flodl_agent.train.averaging import Averager, AverageRelay
from flodl_agent.train.hub import CHUNK, to_bf16
from flodl_agent.train.rendezvous import StreamRelay

torch = pytest.importorskip("torch")

T = TypeVar("T")
Round = list[tuple[dict[str, Any], bytes]]
WAIT = 10.0  # seconds before a wait that should end at once fails the test


class Plane:
    """An AverageRelay on its own loop thread; what it sends up lands in ``up``."""

    def __init__(self, ranks: list[int]) -> None:
        self.loop = asyncio.new_event_loop()
        self.up: queue.Queue[Round] = queue.Queue()
        self.relay = AverageRelay(ranks, self._send)
        self.port = self.loop.run_until_complete(self.relay.listen())
        self.thread = threading.Thread(target=self.loop.run_forever)
        self.thread.start()

    def _send(self, made: Iterable[tuple[dict[str, Any], wire.Blob]]) -> None:
        # Copied as the link takes them: a lone rank of weight 1 sends its segment's own bytes.
        self.up.put([(body, bytes(blob)) for body, blob in made])

    def averager(self, bf16: bool = False) -> Averager:
        return Averager(self.port, self.relay.key, bf16_wire=bf16, directory=str(self.relay.directory))

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn`` on the relay's loop, as the link's callbacks run."""

        async def run() -> T:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(WAIT)

    def answer(self, head: dict[str, Any], offset: int, values: np.ndarray, **body: Any) -> bool:
        """A piece of the controller's average; True when it landed straight where it lands."""
        return self.call(answer, self.relay, {**head, "offset": offset, **body}, values)

    def pushed(self) -> threading.Event:
        """Set once the relay has taken a rank's next push in."""
        seen, fold = threading.Event(), self.relay._fold_ready

        def spy() -> None:
            fold()
            seen.set()

        self.relay._fold_ready = spy  # type: ignore[method-assign]
        return seen

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.run_until_complete(self.relay.close())
        self.loop.close()


def answer(relay: AverageRelay, body: dict[str, Any], values: np.ndarray) -> bool:
    """What the agent's link does with an AVERAGED frame: its bytes go where ``destination`` says
    (or to a staging buffer), then the frame is delivered."""
    data = bytes(to_bf16(values)) if body.get("bf16") else values.astype(np.float32).tobytes()
    view = relay.destination(wire.Kind.AVERAGED, body, len(data))
    if view is not None:
        view[:] = data
    relay.deliver(body, view if view is not None else data)
    return view is not None


@pytest.fixture
def rank() -> Iterable[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as pool:
        yield pool


@pytest.mark.parametrize("bf16", [False, True], ids=["received-in-place", "bf16-copied-in"])
def test_a_lost_link_abandons_a_lone_ranks_round_and_undoes_what_landed_in_its_tensors(
    rank: ThreadPoolExecutor, bf16: bool
) -> None:
    """One rank: the average lands in its own segment, where its adopted tensor lives. A round
    half answered when the link breaks is abandoned, and the tensor is as the rank pushed it."""
    plane = Plane([0])
    avg = plane.averager(bf16)
    tensor = torch.arange(float(2 * CHUNK))  # two pieces
    avg.adopt([tensor])
    before = tensor.clone()
    try:
        assert plane.relay.next_round == 0
        done = rank.submit(avg.average, [tensor], 1.0)
        (head, _), _ = plane.up.get(timeout=WAIT)
        landed = plane.answer(head, 0, np.full(CHUNK, 7.0), weight=1.0, last=False)
        assert landed is not bf16 and tensor[0].item() == 7.0  # half an average is in the tensor
        plane.call(plane.relay.link_lost)
        assert done.result(WAIT) == 0.0  # abandoned: weight 0, no error
        assert torch.equal(tensor, before) and avg.round == 1 and plane.relay.next_round == 1
        # The next round goes up on the next link from the parameters the rank kept, and lands.
        done = rank.submit(avg.average, [tensor], 1.0)
        plane.call(plane.relay.link_back)
        (head, data), (_, rest) = plane.up.get(timeout=WAIT)
        assert head["round"] == 1
        if not bf16:
            assert np.frombuffer(data + rest, np.float32).tolist() == before.tolist()
        plane.answer(head, 0, np.full(CHUNK, 5.0), weight=1.0, last=False)
        plane.answer(head, CHUNK, np.full(CHUNK, 6.0), weight=1.0, last=True)
        assert done.result(WAIT) == 1.0
        assert tensor[:CHUNK].eq(5.0).all() and tensor[CHUNK:].eq(6.0).all()
        assert plane.relay.next_round == 2
    finally:
        avg.close()
        plane.close()


def test_rounds_wait_out_the_gap_and_a_late_piece_of_an_abandoned_round_is_ignored(
    rank: ThreadPoolExecutor,
) -> None:
    plane = Plane([0])
    avg = plane.averager()
    tensor = torch.full((4,), 2.0)
    try:
        done = rank.submit(avg.average, [tensor], 1.0)
        ((head, _),) = plane.up.get(timeout=WAIT)
        plane.answer(head, 0, np.full(4, 3.0), weight=1.0, last=True)
        assert done.result(WAIT) == 1.0 and tensor.tolist() == [3.0] * 4
        assert plane.relay.next_round == 1
        done = rank.submit(avg.average, [tensor], 1.0)  # round 1 goes up; the link breaks
        ((late, _),) = plane.up.get(timeout=WAIT)
        plane.call(plane.relay.link_lost)
        assert done.result(WAIT) == 0.0 and tensor.tolist() == [3.0] * 4
        assert plane.relay.next_round == 2
        # The old link's last word on round 1: it lands nowhere, and no rank hears it.
        assert not plane.answer(late, 0, np.full(4, 9.0), weight=5.0, last=True)
        pushed = plane.pushed()
        done = rank.submit(avg.average, [tensor], 1.0)  # round 2 is ready with no link: held
        assert pushed.wait(WAIT)
        assert plane.up.empty() and not done.done() and plane.relay.next_round == 2
        plane.call(plane.relay.link_back)
        ((head, data),) = plane.up.get(timeout=WAIT)
        assert head["round"] == 2 and np.frombuffer(data, np.float32).tolist() == [3.0] * 4
        plane.answer(head, 0, np.full(4, 4.0), weight=1.0, last=True)
        assert done.result(WAIT) == 1.0 and tensor.tolist() == [4.0] * 4  # not the late 9s, weight 5
        assert plane.relay.next_round == 3
    finally:
        avg.close()
        plane.close()


def test_a_host_of_two_ranks_abandons_together_and_a_round_half_pushed_stays_next(
    rank: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    plane = Plane([0, 1])
    monkeypatch.setenv("RANK", "0")
    first = plane.averager()
    monkeypatch.setenv("RANK", "1")
    second = plane.averager()
    a, b = torch.full((4,), 1.0), torch.full((4,), 3.0)
    try:
        pushed = plane.pushed()
        done_a = rank.submit(first.average, [a], 1.0)
        assert pushed.wait(WAIT)
        plane.call(plane.relay.link_lost)  # rank 1 has not pushed round 0: nothing went up
        assert not done_a.done() and plane.relay.next_round == 0
        pushed = plane.pushed()
        done_b = rank.submit(second.average, [b], 1.0)
        assert pushed.wait(WAIT) and plane.up.empty()  # ready, and held
        plane.call(plane.relay.link_back)
        ((head, data),) = plane.up.get(timeout=WAIT)
        assert head["round"] == 0 and np.frombuffer(data, np.float32).tolist() == [4.0] * 4
        plane.answer(head, 0, np.full(2, 2.0), weight=2.0, last=False)  # half, then the loss
        plane.call(plane.relay.link_lost)
        assert done_a.result(WAIT) == done_b.result(WAIT) == 0.0
        assert a.tolist() == [1.0] * 4 and b.tolist() == [3.0] * 4 and plane.relay.next_round == 1
    finally:
        first.close()
        second.close()
        plane.close()


async def _eof(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.read(), WAIT)


def test_a_lost_link_ends_a_member_hosts_store_streams_until_the_link_is_back() -> None:
    async def scenario() -> None:
        sent: asyncio.Queue[tuple[int, bytes, bool]] = asyncio.Queue()
        relay = StreamRelay(lambda sid, data, end: sent.put_nowait((sid, data, end)))
        port = await relay.listen()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"get")
        assert await asyncio.wait_for(sent.get(), WAIT) == (0, b"get", False)
        relay.link_lost()
        assert await _eof(reader) == b"" and relay.open_streams == 0  # the rank's connection ended
        relay.feed(0, b"", True)  # the far end's word on it, after the loss: ignored
        late_reader, late_writer = await asyncio.open_connection("127.0.0.1", port)
        assert await _eof(late_reader) == b""  # no link: a new connection ends at once
        late_writer.close()
        relay.link_back()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"set")
        sid, data, end = await asyncio.wait_for(sent.get(), WAIT)
        assert (data, end) == (b"set", False) and sid != 0  # a stream of its own, routed as usual
        assert sent.empty()  # nothing of the cut streams went up
        writer.close()
        await relay.close()

    asyncio.run(scenario())


def test_a_lost_link_ends_the_store_hosts_streams_and_an_id_reused_after_it_is_a_new_stream() -> None:
    async def scenario() -> None:
        connections: asyncio.Queue[asyncio.StreamReader] = asyncio.Queue()
        writers: list[asyncio.StreamWriter] = []

        async def store(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writers.append(writer)
            connections.put_nowait(reader)

        server = await asyncio.start_server(store, "127.0.0.1", 0)
        sent: list[tuple[int, bytes, bool]] = []
        relay = StreamRelay(lambda *frame: sent.append(frame), store_port=server.sockets[0].getsockname()[1])
        relay.feed(0, b"old", False)
        old = await asyncio.wait_for(connections.get(), WAIT)
        assert await asyncio.wait_for(old.readexactly(3), WAIT) == b"old"
        pumps = set(relay._tasks)  # the stream's task: it ends with its store connection
        relay.link_lost()
        # A restarted controller numbers the store's streams from 0 again.
        relay.link_back()
        relay.feed(0, b"new", False)
        assert await _eof(old) == b""  # the cut stream's store connection closed
        await asyncio.wait(pumps, timeout=WAIT)
        fresh = await asyncio.wait_for(connections.get(), WAIT)
        relay.feed(0, b"more", False)
        assert await asyncio.wait_for(fresh.readexactly(7), WAIT) == b"newmore"
        assert relay.open_streams == 1 and sent == []  # the old stream's end took nothing with it
        await relay.close()
        for writer in writers:
            writer.close()
        server.close()

    asyncio.run(scenario())

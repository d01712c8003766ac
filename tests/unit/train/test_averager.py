"""A rank's Averager against an agent it cannot trust to weigh its parameters."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from flodl_agent.protocol import wire
from flodl_agent.train.averaging import LOOPBACK_MAX, Averager, AverageRelay, AveragingError
from flodl_agent.train.hub import CHUNK, CHUNKS_MAX

torch = pytest.importorskip("torch")


def older_agent(server: socket.socket, key: bytes) -> None:
    """Answers one push as an agent from before ``raw`` did: a weight, and nothing about who weighed."""
    conn, _ = server.accept()
    with conn:
        codec = wire.Codec(key, max_payload=LOOPBACK_MAX)
        while codec.next_frame() is None:
            codec.feed(conn.recv(65536))
        conn.sendall(codec.encode(wire.Kind.AVERAGED, {"round": 0, "weight": 2.0}))


def test_a_rank_refuses_an_average_from_an_agent_that_did_not_weigh_it(tmp_path: Path) -> None:
    key = os.urandom(wire.KEY_BYTES)
    with socket.create_server(("127.0.0.1", 0)) as server:
        agent = threading.Thread(target=older_agent, args=(server, key))
        agent.start()
        avg = Averager(server.getsockname()[1], key, directory=str(tmp_path))
        params = torch.full((4,), 3.0)
        with pytest.raises(AveragingError, match="older than this rank's"):
            avg.average([params], 2.0)
        agent.join()
        avg.close()
    assert params.tolist() == [3.0] * 4  # nothing read into it


def test_adopt_moves_float32_tensors_into_the_segment_and_leaves_the_rest(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        avg = Averager(server.getsockname()[1], os.urandom(wire.KEY_BYTES), directory=str(tmp_path))
        weights = torch.nn.Parameter(torch.arange(6.0).view(2, 3))
        counts = torch.arange(3, dtype=torch.float64)
        avg.adopt([weights, counts])
        base = avg._mine.array.ctypes.data
        assert weights.data_ptr() == base and isinstance(weights, torch.nn.Parameter)
        assert weights.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
        assert counts.data_ptr() != base + 4 * 6 and counts.tolist() == [0.0, 1.0, 2.0]
        segment = (tmp_path / "rank-0").read_bytes()
        assert len(segment) == 4 * 9 and segment[:24] == weights.detach().numpy().tobytes()
        avg.close()


def test_a_relay_sends_bigger_pieces_once_its_link_carried_a_round_fast(tmp_path: Path) -> None:
    """Pieces are sized to the link's pace in the last round: a slow link keeps the least
    (its pieces' store-and-forward is the round's tail), a fast one gets the most (each
    piece's frame is the cost there)."""
    params = 8 * CHUNK
    now = [0.0]
    seconds = iter([0.01, 10.0, 0.01, 0.01])  # the link's time each round: 3.4 GB/s, 3.4 MB/s, ...
    pieces: list[list[int]] = []
    loop = asyncio.new_event_loop()
    relay = AverageRelay([0], lambda made: answer(list(made)), clock=lambda: now[0])

    def answer(made: list[tuple[dict[str, Any], wire.Blob]]) -> None:  # the controller, at once
        pieces.append([len(blob) // 4 for _, blob in made])
        now[0] += next(seconds)
        head = made[0][0]
        total = b"".join(bytes(blob) for _, blob in made)
        relay.deliver({**head, "offset": 0, "weight": 1.0, "last": True}, total)

    port = loop.run_until_complete(relay.listen())
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    try:
        avg = Averager(port, relay.key, directory=str(relay.directory))
        tensor = torch.arange(float(params))
        for _ in range(4):
            assert avg.average([tensor], 1.0) == 1.0
        avg.close()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.run_until_complete(relay.close())
        loop.close()
    assert tensor[-1].item() == params - 1  # the average of one rank is its own parameters
    least, most = [CHUNK] * 8, [CHUNKS_MAX * CHUNK] * (8 // CHUNKS_MAX)
    assert pieces == [least, most, least, most]

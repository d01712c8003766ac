"""A rank's Averager against an agent it cannot trust to weigh its parameters."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from flodl_agent import wire
from flodl_agent.averaging import LOOPBACK_MAX, Averager, AveragingError

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

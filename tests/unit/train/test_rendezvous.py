"""The controller's stream routing table (pure)."""

from __future__ import annotations

import pytest

from flodl_agent.train.rendezvous import RouteError, StreamRouter


def test_member_streams_get_store_ids_and_route_back() -> None:
    router = StreamRouter("a")
    g1 = router.from_member("b", 0, end=False)
    g2 = router.from_member("c", 0, end=False)  # same local id on another host: its own stream
    assert g1 != g2 and router.from_member("b", 0, end=False) == g1
    assert router.from_store(g1, end=False) == ("b", 0)
    assert router.from_store(g2, end=True) == ("c", 0)
    with pytest.raises(RouteError):
        router.from_store(g2, end=False)  # closed: nothing routes there any more


def test_refusals_the_store_host_unknown_ends_and_the_per_host_cap() -> None:
    router = StreamRouter("a", max_streams=2)
    with pytest.raises(RouteError, match="directly"):
        router.from_member("a", 0, end=False)
    with pytest.raises(RouteError, match="never opened"):
        router.from_member("b", 7, end=True)
    router.from_member("b", 0, end=False)
    router.from_member("b", 1, end=False)
    with pytest.raises(RouteError, match="2 open streams"):
        router.from_member("b", 2, end=False)
    router.from_member("b", 0, end=True)  # closing one frees a slot
    router.from_member("b", 2, end=False)


def test_a_departed_host_hands_back_its_store_side_ids() -> None:
    router = StreamRouter("a")
    gids = {router.from_member("b", i, end=False) for i in range(3)}
    kept = router.from_member("c", 0, end=False)
    assert set(router.drop_host("b")) == gids
    assert router.from_store(kept, end=False) == ("c", 0)
    assert router.drop_host("b") == []


def test_frames_that_arrive_before_the_store_connection_opens_queue_on_one_connection() -> None:
    import asyncio

    from flodl_agent.train.rendezvous import StreamRelay

    async def scenario() -> tuple[int, bytes]:
        connections: list[bytes] = []
        got_all = asyncio.Event()

        async def store(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connections.append(b"")
            data = await reader.readexactly(9)
            connections[-1] = data
            got_all.set()
            writer.close()

        server = await asyncio.start_server(store, "127.0.0.1", 0)
        relay = StreamRelay(lambda sid, data, end: None, store_port=server.sockets[0].getsockname()[1])
        # three frames of one stream, fed back to back as one read of the link delivers them
        relay.feed(7, b"abc", False)
        relay.feed(7, b"def", False)
        relay.feed(7, b"ghi", False)
        await asyncio.wait_for(got_all.wait(), 10)
        await relay.close()
        server.close()
        return len(connections), connections[0]

    count, data = asyncio.run(scenario())
    assert (count, data) == (1, b"abcdefghi")

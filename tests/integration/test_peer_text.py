"""Peer-supplied text at a live controller on loopback: what a terminal would act on never gets in.

A hello whose host name or device text carries a bidi control or a C1 escape is refused at
admission (dropped unanswered, counted, never in the roster); the controller's log writes
whatever peer text still reaches a line with such code points escaped.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from flodl_agent.controller.controller import Controller
from flodl_agent.protocol.join_protocol import Accepted, Challenged, Closed, JoinClient, JoinError, JoinServer
from flodl_agent.protocol.streams import next_event
from flodl_agent.protocol.wire import OPEN_KEY
from tests.support.control_plane import run, settings

HOSTILE = [
    ("host", "ev\u202eil"),  # right-to-left override
    ("host", "box\x9b2J"),  # C1 CSI: erase the screen
    ("host", "box\u2028admitted root"),  # line separator: a forged log line
    ("host", "box\u2066x\u2069"),  # bidi isolate
    ("host", "box\u200e"),  # left-to-right mark
    ("host", "box\u061c"),  # Arabic letter mark
    ("host", "box\x7f"),
    ("device_labels", ["NVIDIA\u202e A100"]),
    ("devices", ["cpu:0\x9b"]),
    ("variant", "cu128\u202e"),
    ("data_path", "/data\u2029x"),
]


async def hello(port: int, fields: dict[str, Any]) -> object:
    """One hand-driven join on loopback (open admission): the controller's answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    client = JoinClient(None)
    try:
        writer.write(client.start())
        assert isinstance(await next_event(reader, client, 5.0), Challenged)
        body = {"host": "box", "devices": ["cpu:0"], **fields}
        writer.write(client.hello(body, check=False))  # sent as a hostile peer would
        return await next_event(reader, client, 5.0)
    finally:
        writer.close()


@pytest.mark.parametrize(("field", "value"), HOSTILE, ids=[repr(v) for _, v in HOSTILE])
def test_a_hello_with_terminal_control_text_is_refused_at_admission(field: str, value: Any) -> None:
    async def scenario() -> None:
        lines: list[str] = []
        ctl = Controller(settings(quorum=5, target=None), log=lines.append)
        await ctl.start()
        try:
            assert isinstance(await hello(ctl.port, {field: value}), Closed)  # dropped, no reply
            assert ctl.dropped["payload"] == 1 and ctl.admitted == 0 and not ctl.links
            assert isinstance(await hello(ctl.port, {"host": "honest"}), Accepted)  # the door still works
            state = json.dumps(ctl.view.state(), ensure_ascii=False)
            assert all(line.isprintable() for line in lines) and "honest" in state
            assert "ev\u202eil" not in state and "\x9b" not in state
        finally:
            await ctl.close()

    run(scenario)


def test_the_agent_is_told_before_it_sends_such_a_hello() -> None:
    client = JoinClient(None)
    client.receive_data(_challenge_bytes())
    assert isinstance(client.next_event(), Challenged)
    with pytest.raises(JoinError) as caught:
        client.hello({"host": "ev\u202eil", "devices": ["cpu:0"]})
    assert caught.value.permanent and "bidi" in caught.value.message


def _challenge_bytes() -> bytes:
    return JoinServer(None, salt=OPEN_KEY).start()


def test_the_controller_log_escapes_peer_text_that_reaches_it() -> None:
    """What still gets through (a fan-out session's ssh stderr in a failure, say) is escaped."""
    lines: list[str] = []
    ctl = Controller(settings(), log=lines.append)
    ctl.log("run failed: fan-out to box failed (ssh exit 255: \u202eevil\x9b2J)")
    assert lines == ["run failed: fan-out to box failed (ssh exit 255: \\u202eevil\\x9b2J)"]

"""A browser is a client too: the status surface refuses cross-site starts and rebound names."""

from __future__ import annotations

import asyncio

from flodl_agent.controller.controller import Controller
from tests.support.control_plane import agent, api, run, settings, until, walk_in


def test_a_page_on_another_origin_cannot_fire_a_manual_window() -> None:
    async def scenario() -> None:
        ctl = Controller(settings(start="manual", quorum=1, target=None))
        await ctl.start()
        walker = asyncio.ensure_future(walk_in(agent(ctl, "box-a")))
        await until(lambda: "box-a" in ctl.links)
        status, body = await api(ctl, "POST", "/start", headers={"Origin": "http://attacker.example"})
        assert status == 403 and "cross-site" in body["error"]
        status, body = await api(ctl, "POST", "/start", headers={"Host": "attacker.example:80"})
        assert status == 403 and "does not name this controller" in body["error"]
        assert ctl.window.phase == "staging"  # nothing fired
        # DNS rebinding: a page on the attacker's name reads nothing either.
        status, _ = await api(ctl, "GET", "/state.json", headers={"Host": "attacker.example"})
        assert status == 403
        status, body = await api(ctl, "PUT", "/start")
        assert status == 405 and "takes POST" in body["error"]
        # The page's own button: same origin.
        status, body = await api(ctl, "POST", "/start", headers={"Origin": f"http://127.0.0.1:{ctl.port}"})
        assert status == 202 and body["armed"], body
        assert await walker == 0
        await ctl.close()

    run(scenario)


def test_a_header_block_over_the_limit_is_431() -> None:
    async def scenario() -> None:
        ctl = Controller(settings(quorum=2, target=2))
        await ctl.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", ctl.port)
        writer.write(b"GET /state.json HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n")
        status_line = await reader.readline()
        assert status_line.startswith(b"HTTP/1.1 431 Request Header Fields Too Large")
        writer.close()
        await ctl.close()

    run(scenario)

"""The status surface's routes, pure: a request in, a response out."""

from __future__ import annotations

import json
from typing import Any

import h11
import pytest

from flodl_agent.http_surface import JSON, Response, render, route
from flodl_agent.metrics import PROMETHEUS_TEXT
from flodl_agent.status_page import HTML


class Routes:
    def __init__(self) -> None:
        self.starts: list[tuple[str, bytes]] = []

    def state_json(self) -> bytes:
        return b'{"phase": "waiting"}'

    def metrics(self) -> bytes:
        return b"flodl_up 1\n"

    def request_start(self, peer: str, body: bytes) -> tuple[int, dict[str, Any]]:
        self.starts.append((peer, body))
        return 409, {"armed": False, "error": "auto mode"}


@pytest.mark.parametrize(
    "method, target, status, content_type, head",
    [
        ("GET", "/state.json", 200, JSON, False),
        ("HEAD", "/state.json", 200, JSON, True),
        ("GET", "/state.json?x=1", 200, JSON, False),
        ("GET", "/", 200, HTML, False),
        ("GET", "/metrics", 200, PROMETHEUS_TEXT, False),
        ("HEAD", "/metrics", 200, PROMETHEUS_TEXT, True),
        ("POST", "/state.json", 404, JSON, False),
        ("GET", "/start", 404, JSON, False),
        ("GET", "/nope", 404, JSON, False),
    ],
)
def test_routes(method: str, target: str, status: int, content_type: str, head: bool) -> None:
    routes = Routes()
    response = route(method, target, b"", "127.0.0.1", routes)
    assert (response.status, response.content_type, response.head) == (status, content_type, head)
    assert routes.starts == []  # only POST /start acts


def test_start_is_the_only_action_and_gets_the_peer_and_body() -> None:
    routes = Routes()
    response = route("POST", "/start", b"token=abc", "10.0.0.9", routes)
    assert routes.starts == [("10.0.0.9", b"token=abc")]
    assert response.status == 409 and json.loads(response.body) == {"armed": False, "error": "auto mode"}


def test_a_404_names_the_route() -> None:
    assert json.loads(route("DELETE", "/x?y", b"", "::1", Routes()).body) == {"error": "no route DELETE /x"}


def test_a_head_response_has_the_length_but_no_body() -> None:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"HEAD /state.json HTTP/1.1\r\nHost: x\r\n\r\n")
    assert isinstance(conn.next_event(), h11.Request)
    out = render(conn, Response(200, b"12345", head=True))
    assert out.endswith(b"\r\n\r\n") and b"content-length: 5" in out and b"12345" not in out

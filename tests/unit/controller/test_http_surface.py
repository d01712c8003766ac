"""The status surface's routes, pure: a request in, a response out."""

from __future__ import annotations

import json
from typing import Any

import h11
import pytest

from flodl_agent.controller.http_surface import JSON, HostPolicy, Response, host_name, render, route
from flodl_agent.observe.metrics import PROMETHEUS_TEXT
from flodl_agent.observe.status_page import HTML


class Routes:
    def __init__(self) -> None:
        self.starts: list[tuple[str, bytes]] = []

    def state_json(self) -> bytes:
        return b'{"phase": "waiting"}'

    def history_json(self) -> bytes:
        return b'{"ranks": {}}'

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
        ("GET", "/history.json", 200, JSON, False),
        ("HEAD", "/history.json", 200, JSON, True),
        ("POST", "/history.json", 405, JSON, False),
        ("GET", "/", 200, HTML, False),
        ("GET", "/metrics", 200, PROMETHEUS_TEXT, False),
        ("HEAD", "/metrics", 200, PROMETHEUS_TEXT, True),
        ("POST", "/state.json", 405, JSON, False),
        ("GET", "/start", 405, JSON, False),
        ("PUT", "/metrics", 405, JSON, False),
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


def test_a_wrong_method_names_what_the_route_takes() -> None:
    response = route("GET", "/start", b"", "127.0.0.1", Routes())
    assert response.status == 405 and ("allow", "POST") in response.headers
    assert json.loads(response.body) == {"error": "/start takes POST, not GET"}


@pytest.mark.parametrize(
    "value, name",
    [
        ("127.0.0.1:1337", "127.0.0.1"),
        ("Ctrl.Example.com", "ctrl.example.com"),
        ("[::1]:80", "::1"),
        ("[::1]", "::1"),
        ("a:b", None),
        ("[::1]x", None),
        ("", None),
        (":80", None),
    ],
)
def test_host_names_are_read_from_the_header(value: str, name: str | None) -> None:
    assert host_name(value) == name


POLICY = HostPolicy(frozenset({"ctrl.example.com"}))


@pytest.mark.parametrize(
    "host, allowed",
    [
        ("127.0.0.1:1337", True),
        ("10.0.0.1:1337", True),  # an address is never a rebound name
        ("[::1]:1337", True),
        ("localhost:1337", True),
        ("ctrl.example.com:1337", True),
        ("CTRL.example.com", True),
        ("attacker.example:1337", False),  # DNS rebinding: the browser says the attacker's name
        ("", False),
        ("ctrl.example.com.evil:1", False),
    ],
)
def test_only_names_of_this_controller_are_served(host: str, allowed: bool) -> None:
    routes = Routes()
    response = route("GET", "/state.json", b"", "127.0.0.1", routes, {"host": host}, POLICY)
    assert (response.status == 200) is allowed
    if not allowed:
        assert (
            response.status == 403 and "does not name this controller" in json.loads(response.body)["error"]
        )


@pytest.mark.parametrize(
    "origin, fired",
    [
        (None, True),  # fdl start, curl: no Origin
        ("http://127.0.0.1:1337", True),  # the status page's own button
        ("http://attacker.example", False),
        ("http://127.0.0.1:9999", False),  # another port is another origin
        ("null", False),  # a sandboxed frame or a file:// page
        ("https://127.0.0.1:1337", False),  # another scheme is another site
    ],
)
def test_a_start_from_another_origin_is_refused(origin: str | None, fired: bool) -> None:
    routes = Routes()
    headers = {"host": "127.0.0.1:1337"} | ({"origin": origin} if origin is not None else {})
    response = route("POST", "/start", b"", "127.0.0.1", routes, headers, POLICY)
    assert (routes.starts != []) is fired
    if not fired:
        assert response.status == 403 and "cross-site" in json.loads(response.body)["error"]


def test_every_status_line_has_its_reason_phrase() -> None:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert isinstance(conn.next_event(), h11.Request)
    assert render(conn, Response(403, b"{}")).startswith(b"HTTP/1.1 403 Forbidden\r\n")

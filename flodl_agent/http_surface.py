"""The controller port's HTTP surface: ``/``, ``/state.json``, ``/start``, ``/metrics``.

Requests are parsed by h11, never by hand. ``route`` is the pure part (a request
in, a ``Response`` out, over whatever ``Routes`` the controller provides);
``serve`` is the thin shell that reads one request off a connection whose first
four bytes were an HTTP method, with one deadline for the whole request so a
slow client cannot hold the handler.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import h11

from .metrics import PROMETHEUS_TEXT
from .status_page import HTML, status_page

JSON = "application/json"


@dataclass(frozen=True)
class HttpLimits:
    timeout: float = 10.0  # seconds for the whole request (a slow-loris is cut at this deadline)
    max_body: int = 4096  # a POST body; /start takes a token, nothing more
    max_head: int = 16 * 1024


class Routes(Protocol):
    """What the controller serves."""

    def state_json(self) -> bytes: ...

    def metrics(self) -> bytes: ...

    def request_start(self, peer: str, body: bytes) -> tuple[int, dict[str, Any]]: ...


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str = JSON
    head: bool = False  # HEAD: the headers only

    @classmethod
    def json(cls, status: int, payload: dict[str, Any]) -> Response:
        return cls(status, json.dumps(payload).encode())


def route(method: str, target: str, body: bytes, peer: str, routes: Routes) -> Response:
    """One request's response (pure over ``routes``)."""
    path = target.split("?")[0]
    head = method == "HEAD"
    if path == "/state.json" and method in ("GET", "HEAD"):
        return Response(200, routes.state_json(), head=head)
    if path == "/start" and method == "POST":
        status, payload = routes.request_start(peer, body)
        return Response.json(status, payload)
    if path == "/" and method in ("GET", "HEAD"):
        return Response(200, status_page(), HTML, head)
    if path == "/metrics" and method in ("GET", "HEAD"):
        return Response(200, routes.metrics(), PROMETHEUS_TEXT, head)
    return Response.json(404, {"error": f"no route {method} {path}"})


def render(conn: h11.Connection, response: Response) -> bytes:
    headers = [
        ("content-type", response.content_type),
        ("content-length", str(len(response.body))),
        ("cache-control", "no-store"),
        ("connection", "close"),
    ]
    out = conn.send(h11.Response(status_code=response.status, headers=headers)) or b""
    if not response.head:
        out += conn.send(h11.Data(data=response.body)) or b""
    return out + (conn.send(h11.EndOfMessage()) or b"")


async def serve(
    preamble: bytes,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    peer: str,
    routes: Routes,
    *,
    limits: HttpLimits = HttpLimits(),
    bad: Callable[[str], None] = lambda cause: None,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Read one request (``preamble`` is its first bytes), answer it, and return.

    A malformed request is answered 400 and counted through ``bad("http")``; a request
    that does not complete by the deadline raises TimeoutError (the caller counts it)."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_head)
    conn.receive_data(preamble)
    request: h11.Request | None = None
    body = b""
    deadline = clock() + limits.timeout
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            bad("http")
            return await _send(writer, conn, Response.json(400, {"error": "malformed HTTP request"}))
        if event is h11.NEED_DATA:
            data = await asyncio.wait_for(reader.read(65536), max(0.1, deadline - clock()))
            conn.receive_data(data)
            continue
        if isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > limits.max_body:
                return await _send(writer, conn, Response.json(413, {"error": "request body too large"}))
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            break
    if request is None:
        return
    response = route(request.method.decode(), request.target.decode(), body, peer, routes)
    await _send(writer, conn, response)


async def _send(writer: asyncio.StreamWriter, conn: h11.Connection, response: Response) -> None:
    writer.write(render(conn, response))
    await writer.drain()

"""The controller port's HTTP surface: ``/``, ``/state.json``, ``/history.json``, ``/start``, ``/metrics``.

Requests are parsed by h11, never by hand. ``route`` is the pure part (a request
in, a ``Response`` out, over whatever ``Routes`` the controller provides);
``serve`` is the thin shell that reads one request off a connection whose first
four bytes were an HTTP method, with one deadline for the whole request so a
slow client cannot hold the handler.

A browser is a client too. Every request must name this controller in ``Host``
(an IP address, ``localhost``, or a name the controller answers to), so a page
on a rebound DNS name cannot read ``/state.json``; a state-changing request that
carries an ``Origin`` must come from the same origin, so a page open on the
controller box (or on a machine holding the tunnel) cannot fire a start. Clients
that are not browsers (``fdl start``, curl) send no ``Origin``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Protocol
from urllib.parse import urlsplit

import h11

from ..observe.metrics import PROMETHEUS_TEXT
from ..observe.status_page import HTML, status_page

JSON = "application/json"


@dataclass(frozen=True)
class HttpLimits:
    timeout: float = 10.0  # seconds for the whole request (a slow-loris is cut at this deadline)
    max_body: int = 4096  # a POST body; /start takes a token, nothing more
    max_head: int = 16 * 1024


class Routes(Protocol):
    """What the controller serves."""

    def state_json(self) -> bytes: ...

    def history_json(self) -> bytes: ...

    def metrics(self) -> bytes: ...

    def request_start(self, peer: str, body: bytes) -> tuple[int, dict[str, Any]]: ...


Headers = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str = JSON
    head: bool = False  # HEAD: the headers only
    headers: Headers = ()

    @classmethod
    def json(
        cls, status: int, payload: dict[str, Any], headers: tuple[tuple[str, str], ...] = ()
    ) -> Response:
        return cls(status, json.dumps(payload).encode(), headers=headers)


def host_name(value: str) -> str | None:
    """The host of a ``Host`` header (``name``, ``name:port``, ``[v6]:port``), lowercased;
    None when it is malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        rest = value[end + 1 :]
        if end < 0 or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
        return value[1:end]
    name, _, port = value.partition(":")
    if not name or (port and not port.isdigit()) or ":" in port:
        return None
    return name


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class HostPolicy:
    """Which ``Host`` values name this controller: any IP address (a rebound DNS name is
    never one), ``localhost``, and ``names`` (the bind name, this box's host names)."""

    names: frozenset[str] = field(default_factory=frozenset)

    def allows(self, host: str) -> bool:
        name = host_name(host)
        if name is None:
            return False
        return name == "localhost" or _is_ip(name) or name in self.names


ROUTES: dict[str, tuple[str, ...]] = {
    "/": ("GET", "HEAD"),
    "/state.json": ("GET", "HEAD"),
    "/history.json": ("GET", "HEAD"),
    "/metrics": ("GET", "HEAD"),
    "/start": ("POST",),
}


def _same_origin(origin: str, host: str) -> bool:
    parts = urlsplit(origin.strip())
    return parts.scheme in ("http", "https") and parts.netloc.lower() == host.strip().lower()


def route(
    method: str,
    target: str,
    body: bytes,
    peer: str,
    routes: Routes,
    headers: Mapping[str, str] | None = None,
    policy: HostPolicy | None = None,
) -> Response:
    """One request's response (pure over ``routes``); ``headers`` lowercased by name."""
    path = target.split("?")[0]
    if policy is not None:
        headers = headers or {}
        host = headers.get("host", "")
        if not policy.allows(host):
            return Response.json(
                403,
                {
                    "error": f"Host {host!r} does not name this controller: reach it by an IP address, "
                    "localhost, or the name it binds (cluster.controller.host)"
                },
            )
        origin = headers.get("origin")
        if method == "POST" and origin is not None and not _same_origin(origin, host):
            return Response.json(
                403, {"error": f"cross-site request refused (Origin {origin!r}, Host {host!r})"}
            )
    allowed = ROUTES.get(path)
    if allowed is None:
        return Response.json(404, {"error": f"no route {method} {path}"})
    if method not in allowed:
        return Response.json(
            405,
            {"error": f"{path} takes {', '.join(allowed)}, not {method}"},
            (("allow", ", ".join(allowed)),),
        )
    head = method == "HEAD"
    if path == "/state.json":
        return Response(200, routes.state_json(), head=head)
    if path == "/history.json":
        return Response(200, routes.history_json(), head=head)
    if path == "/start":
        status, payload = routes.request_start(peer, body)
        return Response.json(status, payload)
    if path == "/":
        return Response(200, status_page(), HTML, head)
    return Response(200, routes.metrics(), PROMETHEUS_TEXT, head)


def render(conn: h11.Connection, response: Response) -> bytes:
    headers = [
        ("content-type", response.content_type),
        ("content-length", str(len(response.body))),
        ("cache-control", "no-store"),
        ("connection", "close"),
        *response.headers,
    ]
    reason = HTTPStatus(response.status).phrase.encode()
    out = conn.send(h11.Response(status_code=response.status, headers=headers, reason=reason)) or b""
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
    policy: HostPolicy | None = None,
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
        except h11.RemoteProtocolError as exc:
            bad("http")
            status = exc.error_status_hint  # 431 for a header block over the limit
            error = "request headers too large" if status == 431 else "malformed HTTP request"
            return await _send(writer, conn, Response.json(status, {"error": error}))
        if event is h11.NEED_DATA:
            data = await asyncio.wait_for(reader.read(65536), max(0.1, deadline - clock()))
            conn.receive_data(data)
            continue
        if isinstance(event, h11.Request):
            request = event
            # h11 bounds a head still arriving; one that arrived whole in a read is measured here.
            head = len(event.target) + sum(len(name) + len(value) + 4 for name, value in event.headers)
            if head > limits.max_head:
                bad("http")
                return await _send(writer, conn, Response.json(431, {"error": "request headers too large"}))
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > limits.max_body:
                return await _send(writer, conn, Response.json(413, {"error": "request body too large"}))
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            break
    if request is None:
        return
    headers = {name.decode().lower(): value.decode("latin-1") for name, value in request.headers}
    method, target = request.method.decode(), request.target.decode("latin-1")
    await _send(writer, conn, route(method, target, body, peer, routes, headers, policy))


async def _send(writer: asyncio.StreamWriter, conn: h11.Connection, response: Response) -> None:
    writer.write(render(conn, response))
    await writer.drain()

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
controller box (or on a machine holding the tunnel) cannot fire a start: same
scheme (``http`` on a plain port, ``https`` on a TLS one), host and port. Clients
that are not browsers (``fdl start``, curl) send no ``Origin``.

Every response, refusals and errors included, carries the same security headers
(``security_headers``): a Content-Security-Policy with ``frame-ancestors 'none'``
(and ``X-Frame-Options: DENY`` for older browsers), so no other site can frame the
page and trick a click on its start button; ``nosniff``, so a JSON or metrics
body is never run as a script or style; no ``Referer`` leaving the page. The page's
policy allows only its own inline script and style (by hash) and fetches to its
origin; every other response's allows nothing and sandboxes what it shows.
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
from ..observe.status_page import HTML, LOCKED, page_policy, status_page

JSON = "application/json"
# A JSON, metrics or error body opened in a tab runs nothing and gets an opaque origin.
API_POLICY = f"{LOCKED}; sandbox"
# The methods HTTP defines: one of them on a route that does not take it is a 405 (with
# Allow); anything else is a method this surface does not implement at all, a 501.
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"})


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
    policy: str = API_POLICY  # its Content-Security-Policy

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


def security_headers(policy: str = API_POLICY) -> Headers:
    """What every response carries (see the module's docstring), with ``policy`` as its CSP."""
    return (
        ("content-security-policy", policy),
        ("x-frame-options", "DENY"),
        ("x-content-type-options", "nosniff"),
        ("referrer-policy", "no-referrer"),
        ("cross-origin-resource-policy", "same-origin"),  # no other site embeds a body (<img>, <script>)
    )


def _same_origin(origin: str, host: str, scheme: str) -> bool:
    """An origin is its scheme, host and port: https on a plain port (or http on a TLS one) is
    another site, however alike the rest reads."""
    parts = urlsplit(origin.strip())
    return parts.scheme == scheme and parts.netloc.lower() == host.strip().lower()


def _guard(method: str, headers: Mapping[str, str], policy: HostPolicy, scheme: str) -> Response | None:
    """A browser's request refused (a rebound name, a cross-site start); None when it may pass."""
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
    if method == "POST" and origin is not None and not _same_origin(origin, host, scheme):
        return Response.json(
            403,
            {
                "error": f"cross-site request refused (Origin {origin!r}, Host {host!r}; "
                f"this port speaks {scheme})"
            },
        )
    return None


def route(
    method: str,
    target: str,
    body: bytes,
    peer: str,
    routes: Routes,
    headers: Mapping[str, str] | None = None,
    policy: HostPolicy | None = None,
    scheme: str = "http",
) -> Response:
    """One request's response (pure over ``routes``); ``headers`` lowercased by name, ``scheme``
    the port's (``https`` on a TLS port)."""
    path = target.split("?")[0]
    refused = None if policy is None else _guard(method, headers or {}, policy, scheme)
    if refused is not None:
        return refused
    if method not in KNOWN_METHODS:
        return Response.json(501, {"error": f"method {method} is not implemented here (GET, HEAD, POST are)"})
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
        return Response(200, status_page(), HTML, head, policy=page_policy())
    return Response(200, routes.metrics(), PROMETHEUS_TEXT, head)


def render(conn: h11.Connection, response: Response) -> bytes:
    headers = [
        ("content-type", response.content_type),
        ("content-length", str(len(response.body))),
        ("cache-control", "no-store"),
        ("connection", "close"),
        *security_headers(response.policy),
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
            refused = _oversized(event, limits)
            if refused is not None:
                bad("http")  # like a malformed head: no client of this surface sends one
                return await _send(writer, conn, refused)
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
    scheme = "https" if writer.get_extra_info("ssl_object") is not None else "http"
    await _send(writer, conn, route(method, target, body, peer, routes, headers, policy, scheme))


def _oversized(request: h11.Request, limits: HttpLimits) -> Response | None:
    """A request refused on its head alone: one too large (h11 bounds a head still arriving;
    one that arrived whole in a read is measured here), or a ``Content-Length`` over the body
    limit, answered at once rather than after reading (or waiting for) a body it cannot have.
    h11 has already answered a malformed ``Content-Length`` 400, as RFC 9112 asks."""
    head = len(request.target) + sum(len(name) + len(value) + 4 for name, value in request.headers)
    if head > limits.max_head:
        return Response.json(431, {"error": "request headers too large"})
    length = dict(request.headers).get(b"content-length")
    if length is not None and int(length) > limits.max_body:
        return Response.json(
            413,
            {"error": f"request body too large: Content-Length {int(length)} over {limits.max_body} bytes"},
        )
    return None


async def _send(writer: asyncio.StreamWriter, conn: h11.Connection, response: Response) -> None:
    writer.write(render(conn, response))
    await writer.drain()

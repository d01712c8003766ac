"""A browser is a client too: the status surface refuses cross-site starts and rebound names,
and every answer it gives carries the headers that keep a browser from framing the page,
sniffing a body into a script, or leaking the page's address; methods it does not implement
and lengths it cannot take are refused on the head alone."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import ssl
from pathlib import Path

import pytest

from flodl_agent.controller.controller import Controller
from flodl_agent.controller.http_surface import HttpLimits
from flodl_agent.observe.status_page import inline_policy, page_policy, status_page
from flodl_agent.protocol.tls import generate
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


# --- security headers, methods and lengths, over the real port -------------------------------

MAX_BODY = HttpLimits().max_body


async def exchange(
    port: int, raw: bytes, tls: ssl.SSLContext | None = None, timeout: float = 5.0
) -> tuple[int, dict[str, str], bytes]:
    """Send ``raw`` as it is and read the answer up to the server's close, within ``timeout``:
    the status, the headers (lowercased names; each present once) and the body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=tls)
    writer.write(raw)
    await writer.drain()
    try:
        reply = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    names = [line.partition(":")[0].strip().lower() for line in lines]
    assert len(names) == len(set(names)), f"a header sent twice: {lines}"
    headers = {line.partition(":")[0].strip().lower(): line.partition(":")[2].strip() for line in lines}
    return int(status_line.split()[1]), headers, body


def req(method: str, path: str, *extra: str, host: str = "127.0.0.1", body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def directives(policy: str) -> dict[str, str]:
    parts = (d.strip().split(None, 1) for d in policy.split(";") if d.strip())
    return {p[0]: p[1] if len(p) > 1 else "" for p in parts}


# Every kind of answer the surface gives: (request, status). The page, JSON, metrics, a HEAD,
# the start, and each refusal and error the surface (or h11 under it) produces.
KINDS = [
    pytest.param(req("GET", "/"), 200, id="page"),
    pytest.param(req("HEAD", "/"), 200, id="page-head"),
    pytest.param(req("GET", "/state.json"), 200, id="state"),
    pytest.param(req("GET", "/history.json?x=1"), 200, id="history"),
    pytest.param(req("GET", "/metrics"), 200, id="metrics"),
    pytest.param(req("POST", "/start", "Content-Length: 0"), 409, id="start-refused-auto"),
    pytest.param(req("GET", "/nope"), 404, id="no-route"),
    pytest.param(req("PUT", "/start"), 405, id="wrong-method"),
    pytest.param(req("POSTX", "/start"), 501, id="unknown-method"),
    pytest.param(req("GET", "/state.json", host="attacker.example"), 403, id="rebound-host"),
    pytest.param(req("POST", "/start", "Origin: http://attacker.example"), 403, id="cross-site"),
    pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", 400, id="malformed"),
    pytest.param(req("GET", "/", "X-Big: " + "a" * 20000), 431, id="head-too-large"),
    pytest.param(req("POST", "/start", f"Content-Length: {MAX_BODY + 1}"), 413, id="length-too-large"),
    pytest.param(req("POST", "/start", "Content-Length: -1"), 400, id="length-malformed"),
    pytest.param(
        req(
            "POST",
            "/start",
            "Transfer-Encoding: chunked",
            body=b"%x\r\n" % (MAX_BODY + 1) + b"a" * (MAX_BODY + 1),
        ),
        413,
        id="chunked-body-too-large",
    ),
]


@pytest.mark.parametrize("raw, status", KINDS)
def test_every_response_carries_the_security_headers(raw: bytes, status: int) -> None:
    async def scenario() -> None:
        ctl = Controller(settings())
        await ctl.start()
        got, headers, body = await exchange(ctl.port, raw)
        assert got == status, body
        assert headers.get("x-frame-options") == "DENY"
        assert headers.get("x-content-type-options") == "nosniff"
        assert headers.get("referrer-policy") == "no-referrer"
        assert headers.get("cross-origin-resource-policy") == "same-origin"
        csp = directives(headers.get("content-security-policy", ""))
        assert csp["frame-ancestors"] == "'none'" and csp["default-src"] == "'none'", csp
        assert csp["base-uri"] == "'none'" and csp["form-action"] == "'none'", csp
        if headers["content-type"].startswith("text/html"):
            # The page: its own inline script and style by hash, fetches to its origin, nothing more.
            assert csp["connect-src"] == "'self'"
            assert csp["script-src"].startswith("'sha256-") and csp["style-src"].startswith("'sha256-")
            assert " " not in csp["script-src"] and " " not in csp["style-src"]  # one of each
            assert "sandbox" not in csp
        else:
            # A JSON, metrics or error body runs nothing, even opened in a tab.
            assert "sandbox" in csp and "script-src" not in csp and "connect-src" not in csp
        await ctl.close()

    run(scenario)


def test_the_page_policy_hashes_exactly_the_inline_script_and_style() -> None:
    page = status_page().decode()
    csp = directives(page_policy())
    script = page.split("<script>", 1)[1].split("</script>", 1)[0]
    style = page.split("<style>", 1)[1].split("</style>", 1)[0]

    def source(text: str) -> str:
        return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"

    assert csp["script-src"] == source(script) and csp["style-src"] == source(style)
    # What no hash can allow (the policy would block it): a second script or style, a script
    # from a file, an inline handler (onclick=) or a style attribute in the markup.
    markup = page.split("<script>")[0]
    assert page.count("<script") == 1 and page.count("<style") == 1
    assert not re.search(r"\s(on[a-z]+|style)\s*=", markup), re.findall(
        r"\s(?:on[a-z]+|style)\s*=[^>]*", markup
    )
    assert inline_policy(page.replace("poll();", "poll(); ")) != page_policy()


def test_an_impossible_length_is_refused_before_any_body() -> None:
    """The head alone: a server that waited for the body would answer only at its deadline
    (10 s), long after the short read below gave up (a TimeoutError, not a 413)."""

    async def scenario() -> None:
        ctl = Controller(settings())
        await ctl.start()
        for length, status in ((str(MAX_BODY + 1), 413), ("9" * 20, 413), ("1" * 21, 400), ("12abc", 400)):
            raw = req("POST", "/start", f"Content-Length: {length}", "Content-Type: text/plain")
            got, _, body = await exchange(ctl.port, raw, timeout=1.0)  # headers only, never a body
            assert got == status, (length, body)
        got, _, body = await exchange(ctl.port, req("POST", "/start", f"Content-Length: {MAX_BODY + 1}"))
        assert (
            json.loads(body)["error"]
            == f"request body too large: Content-Length {MAX_BODY + 1} over {MAX_BODY} bytes"
        )
        assert ctl.window.phase == "waiting"
        await ctl.close()

    run(scenario)


def test_an_unknown_method_is_501_and_a_known_one_on_the_wrong_route_405() -> None:
    async def scenario() -> None:
        ctl = Controller(settings())
        await ctl.start()
        status, headers, body = await exchange(ctl.port, req("POSTX", "/start"))
        assert status == 501 and "allow" not in headers
        assert json.loads(body)["error"] == "method POSTX is not implemented here (GET, HEAD, POST are)"
        # a method whose first four letters are no known method's reaches the surface too
        status, headers, _ = await exchange(ctl.port, req("BREW", "/"))
        assert status == 501 and headers["x-frame-options"] == "DENY"
        status, headers, _ = await exchange(ctl.port, req("DELETE", "/start"))
        assert status == 405 and headers["allow"] == "POST"
        await ctl.close()

    run(scenario)


def test_an_origin_of_another_scheme_is_another_site_on_a_plain_port() -> None:
    async def scenario() -> None:
        ctl = Controller(settings(start="manual", quorum=1, target=None))
        await ctl.start()
        walker = asyncio.ensure_future(walk_in(agent(ctl, "box-a")))
        await until(lambda: "box-a" in ctl.links)
        # Same host and port, but https: not the page this plain port served.
        status, body = await api(ctl, "POST", "/start", headers={"Origin": f"https://127.0.0.1:{ctl.port}"})
        assert status == 403 and "cross-site" in body["error"] and "this port speaks http)" in body["error"]
        assert ctl.window.phase == "staging"  # nothing fired
        status, body = await api(ctl, "POST", "/start", headers={"Origin": f"http://127.0.0.1:{ctl.port}"})
        assert status == 202 and body["armed"], body
        assert await walker == 0
        await ctl.close()

    run(scenario)


def test_an_origin_of_another_scheme_is_another_site_on_a_tls_port(tmp_path: Path) -> None:
    cert, key = tmp_path / "controller.pem", tmp_path / "controller.key"
    generate(cert, key, ["127.0.0.1"])
    tls = ssl.create_default_context(cafile=str(cert))  # the pinned certificate, verified

    async def scenario() -> None:
        ctl = Controller(settings(tls=(str(cert), str(key)), start="manual", quorum=1, target=None))
        await ctl.start()
        port = ctl.port
        start = ("Content-Length: 0",)
        status, headers, body = await exchange(
            port,
            req("POST", "/start", *start, f"Origin: http://127.0.0.1:{port}", host=f"127.0.0.1:{port}"),
            tls,
        )
        assert status == 403 and "this port speaks https)" in json.loads(body)["error"]
        assert headers["x-frame-options"] == "DENY"  # over TLS too
        # The page's own origin on this port passes the check and reaches the window's rule.
        status, _, body = await exchange(
            port,
            req("POST", "/start", *start, f"Origin: https://127.0.0.1:{port}", host=f"127.0.0.1:{port}"),
            tls,
        )
        assert (status, json.loads(body)["error"]) == (409, "quorum not met: 0 of 1 ranks joined")
        await ctl.close()

    run(scenario)

"""The controller's status page (``GET /``): one self-contained HTML file.

No external assets (a fleet may be air-gapped): the page's script polls
``/state.json`` once a second, ticks the countdowns down between polls, and
shows the start button only while ``POST /start`` would be accepted.

``page_policy`` is the page's Content-Security-Policy: nothing may load but the
page's own inline script and style, each allowed by the SHA-256 of its text (the
page is a static file, so a hash pins exactly these bytes and, unlike a nonce,
needs no per-response rewrite), and fetches to its own origin.
"""

from __future__ import annotations

import base64
import hashlib
from functools import cache
from html.parser import HTMLParser
from importlib.resources import files

HTML = "text/html; charset=utf-8"

# What every response's policy says, the page's and the API's alike: load nothing by
# default, never inside a frame (clickjacking), no <base> to redirect relative URLs,
# no form that submits anywhere (the page's form posts through fetch).
LOCKED = "default-src 'none'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"


@cache
def status_page() -> bytes:
    return files("flodl_agent.observe").joinpath("static/status.html").read_bytes()


class _Inline(HTMLParser):
    """The text of each inline ``<script>`` and ``<style>`` element, as the browser hashes it."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=False)
        self.open: str | None = None
        self.text: dict[str, list[str]] = {"script": [], "style": []}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.text:
            self.open = tag
            self.text[tag].append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == self.open:
            self.open = None

    def handle_data(self, data: str) -> None:
        if self.open is not None:  # the parser may hand a raw-text element over in pieces
            self.text[self.open][-1] += data


def _sources(texts: list[str]) -> str:
    digests = (base64.b64encode(hashlib.sha256(t.encode()).digest()).decode() for t in texts)
    return " ".join(f"'sha256-{d}'" for d in digests) or "'none'"


def inline_policy(html: str) -> str:
    """The Content-Security-Policy for ``html``: its inline scripts and styles by hash, fetches
    (``connect-src``) to its own origin, and DOM sinks (``innerHTML``) closed by Trusted Types."""
    inline = _Inline()
    inline.feed(html)
    inline.close()
    scripts, styles = _sources(inline.text["script"]), _sources(inline.text["style"])
    return (
        f"{LOCKED}; script-src {scripts}; style-src {styles}; "
        "connect-src 'self'; require-trusted-types-for 'script'"
    )


@cache
def page_policy() -> str:
    return inline_policy(status_page().decode())

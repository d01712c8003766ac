"""The controller's status page (``GET /``): one self-contained HTML file.

No external assets (a fleet may be air-gapped): the page's script polls
``/state.json`` once a second, ticks the countdowns down between polls, and
shows the start button only while ``POST /start`` would be accepted.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

HTML = "text/html; charset=utf-8"


@cache
def status_page() -> bytes:
    return files("flodl_agent.observe").joinpath("static/status.html").read_bytes()

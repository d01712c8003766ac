"""The operator's side of the status surface: `fdl status` and `fdl start`.

A small HTTP client (the standard library's; the server side parses with h11)
and the rendering of ``/state.json``. Which address and pin to use is
``options.resolve_addr`` / ``resolve_pin``; the token is ``credentials``'.
"""

from __future__ import annotations

import http.client
import json
import math
import ssl
from collections import Counter
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from rich.table import Table
from rich.text import Text

from .address import join_address, split_address
from .names import printable
from .pin import PinMismatch, check_pin
from .tls import client_context

PHASE_STYLE = {
    "waiting": "yellow",
    "staging": "bold yellow",
    "forming": "cyan",
    "training": "bold cyan",
    "done": "bold green",
    "failed": "bold red",
}


class Unreachable(Exception):
    pass


@dataclass(frozen=True)
class Reply:
    status: int
    body: dict[str, Any]


def request(
    addr: str,
    method: str,
    path: str,
    form: dict[str, str] | None = None,
    timeout: float = 5.0,
    pin: str | None = None,
) -> Reply:
    """One HTTP exchange with the controller; over TLS with its certificate pinned when ``pin``."""
    try:
        host, port = split_address(addr)
    except ValueError as exc:
        raise Unreachable(str(exc)) from None
    conn: http.client.HTTPConnection = (
        http.client.HTTPSConnection(host, port, timeout=timeout, context=client_context())
        if pin
        else http.client.HTTPConnection(host, port, timeout=timeout)
    )
    body = urlencode(form).encode() if form else None
    headers = {"content-type": "application/x-www-form-urlencoded"} if body else {}
    try:
        conn.connect()
        sock = conn.sock
        if pin:
            der = sock.getpeercert(binary_form=True) if isinstance(sock, ssl.SSLSocket) else None
            check_pin(der, pin, f"the controller at {addr}")
        # Name the controller by the address we reached: the status surface answers only
        # names it knows (a browser's rebound DNS name must not read it), and fdl is no browser.
        headers["host"] = join_address(str(sock.getpeername()[0]), port)
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        raw = response.read()
    except PinMismatch as exc:
        raise Unreachable(exc.render()) from None
    except (OSError, http.client.HTTPException) as exc:
        raise Unreachable(f"no controller answers at {addr} ({exc})") from None
    finally:
        conn.close()
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than json can follow
        raise Unreachable(
            f"{addr} answered, but not with flodl's state (is this the controller port?)"
        ) from None
    return Reply(response.status, data if isinstance(data, dict) else {})


def _clock(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds):  # None, or no number
        return "-"
    s = max(0, int(seconds))
    return f"{s // 60}m{s % 60:02d}s"


def _ago(state: dict[str, Any], host: dict[str, Any]) -> float | None:
    # Both times are the controller's: no clock skew between it and this terminal.
    now, joined = state.get("now"), host.get("joined_at")
    return now - joined if isinstance(now, (int, float)) and isinstance(joined, (int, float)) else None


def peer(value: Any) -> str:
    """Text from the state (host names, labels, reasons: a peer's words) as a terminal may show it."""
    return printable(str(value))


def _hosts(state: dict[str, Any]) -> list[dict[str, Any]]:
    hosts = state.get("hosts")
    return [h for h in hosts if isinstance(h, dict)] if isinstance(hosts, list) else []


def _ranks(ranks: Any) -> str:
    ok = isinstance(ranks, list) and len(ranks) == 2
    return f"[{peer(ranks[0])}..{peer(ranks[1])})" if ok else "-"


def group_devices(labels: Any) -> str:
    counts = Counter(map(peer, labels if isinstance(labels, list) else []))
    return ", ".join(f"{n}x {name}" for name, n in counts.items()) or "-"


def one_line(state: dict[str, Any]) -> str:
    """The roster in a line: for a spinner while the window is open."""
    target = state.get("target")
    hosts = ", ".join(peer(h.get("host")) for h in _hosts(state)) or "nobody yet"
    return peer(
        f"{state.get('phase')}: {state.get('joined_ranks', 0)} ranks (quorum {state.get('quorum')}"
        f"{f', target {target}' if target is not None else ''}) from {hosts}; "
        f"window {_clock(state.get('window_left_s'))}, hard cap {_clock(state.get('cap_left_s'))}"
    )


def render(state: dict[str, Any]) -> list[Text | Table]:
    phase = peer(state.get("phase", "?"))
    head = Text()
    head.append(phase, style=PHASE_STYLE.get(phase, ""))
    target = state.get("target")
    head.append(
        peer(
            f"  {state.get('joined_ranks', 0)} ranks on {state.get('joined_hosts', 0)} hosts"
            f" (quorum {state.get('quorum')}, target {target if target is not None else 'none'})"
        )
    )
    head.append(
        peer(
            f"  start {state.get('start')}{' (armed)' if state.get('armed') else ''}"
            f"  window {_clock(state.get('window_left_s'))}  hard cap {_clock(state.get('cap_left_s'))}"
        )
    )
    out: list[Text | Table] = [head]
    if state.get("failure"):
        out.append(Text(f"failure: {peer(state['failure'])}", style="red"))
    table = Table("host", "ranks", "devices", "torch", "joined")
    for host in _hosts(state):
        cells = (
            peer(host.get("host")),
            _ranks(host.get("ranks")),
            group_devices(host.get("device_labels") or host.get("devices") or []),
            peer(host.get("variant", "-")),
            f"{_clock(_ago(state, host))} ago",
        )
        table.add_row(*map(Text, cells))  # Text: a peer's `[red]` is not markup
    if _hosts(state):
        out.append(table)
    return out

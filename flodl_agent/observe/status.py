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

from ..address import join_address, split_address
from ..config.ranks import rank_span
from ..names import printable
from ..pin import PinMismatch, check_pin
from ..protocol import preamble
from ..protocol.tls import client_context, turned_away

PHASE_STYLE = {
    "waiting": "yellow",
    "staging": "bold yellow",
    "forming": "cyan",
    "training": "bold cyan",
    "done": "bold green",
    "failed": "bold red",
}


class Unreachable(Exception):
    """No controller's state came back; ``nobody``: nothing listens at the address (yet)."""

    def __init__(self, message: str, nobody: bool = False) -> None:
        super().__init__(message)
        self.nobody = nobody


TLS_HOW = "--tls-fingerprint or FDL_TLS_FINGERPRINT; `fdl tls fingerprint CERT` on the controller prints it"


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
        rate_limited = (
            isinstance(exc, http.client.BadStatusLine) and str(exc).encode() == preamble.RATE_LIMITED
        )
        if rate_limited or turned_away(exc):
            raise Unreachable(
                f"the controller at {addr} rate-limits this address after bad requests (a wrong token?): wait"
            ) from None
        raise Unreachable(
            f"no controller answers at {addr} ({exc})", nobody=isinstance(exc, ConnectionRefusedError)
        ) from None
    finally:
        conn.close()
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than json can follow
        raise Unreachable(
            f"{addr} answered, but not with flodl's state (is this the controller port?)"
        ) from None
    if response.status == 400 and isinstance(data, dict) and data.get("tls") is True:
        raise Unreachable(f"the controller at {addr} speaks TLS: pin its certificate ({TLS_HOW})")
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


def _midrun(host: dict[str, Any]) -> str:
    """An elastic launch's walk-in into the training world: the step it joined at."""
    step = host.get("midrun_step")
    return f" (mid-run, step {step})" if isinstance(step, int) and not isinstance(step, bool) else ""


def peer(value: Any) -> str:
    """Text from the state (host names, labels, reasons: a peer's words) as a terminal may show it."""
    return printable(str(value))


def _hosts(state: dict[str, Any]) -> list[dict[str, Any]]:
    hosts = state.get("hosts")
    return [h for h in hosts if isinstance(h, dict)] if isinstance(hosts, list) else []


def _row(*cells: str) -> list[Text]:
    return [Text(peer(cell)) for cell in cells]  # Text: a peer's `[red]` is not markup


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


RANK_ROWS = 64  # the terminal's ranks table; the rest are in --json and on the page


def _age(seconds: Any) -> str:
    return f"{_clock(seconds)} ago" if isinstance(seconds, (int, float)) else "-"


def _map(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _number(value: Any, digits: str) -> str:
    return format(value, digits) if isinstance(value, (int, float)) else "-"


def _seconds(value: Any) -> str:
    """A duration as people read it: 0.5 ms, 42.1 ms, 1.25 s."""
    if not isinstance(value, (int, float)):
        return "-"
    return f"{value * 1000:.3g} ms" if value < 1 else f"{value:.3g} s"


def _span(ranks: Any) -> str:
    ok = isinstance(ranks, list) and len(ranks) == 2 and all(type(r) is int for r in ranks)
    return rank_span(range(ranks[0], ranks[1])) if ok else "-"


def _head(phase: Any, summary: str, failure: Any) -> list[Text | Table]:
    """The phase in its colour and a summary; the failure's reason, when there is one, below."""
    head = Text()
    head.append(peer(phase or "?"), style=PHASE_STYLE.get(str(phase), ""))
    head.append(peer(summary))
    return [head, Text(f"failure: {peer(failure)}", style="red")] if failure else [head]


def refusal_counts(state: dict[str, Any]) -> str:
    """Refused hellos and dropped dials by reason, most first (``refused: bad_key 3 · dropped: …``)."""
    parts = []
    for field in ("refused", "dropped"):
        counts = state.get(field)
        if isinstance(counts, dict) and counts:
            ranked = sorted(counts.items(), key=lambda kv: (-kv[1] if isinstance(kv[1], int) else 0, kv[0]))
            parts.append(f"{field}: " + ", ".join(f"{reason} {n}" for reason, n in ranked))
    return " \u00b7 ".join(parts)


def _lost(state: dict[str, Any]) -> str:
    """After losses the counts are the survivors': say who is missing (", rank 2 lost")."""
    lost = state.get("lost_ranks")
    if not isinstance(lost, list) or not lost:
        return ""
    return f", {'ranks' if len(lost) > 1 else 'rank'} {', '.join(map(str, lost))} lost"


def _elastic(state: dict[str, Any]) -> str:
    """An elastic launch's ceiling (walk-ins join the training world up to it)."""
    ceiling = _map(state.get("elastic")).get("max_ranks")
    return f", elastic to {ceiling}" if isinstance(ceiling, int) and not isinstance(ceiling, bool) else ""


def render(state: dict[str, Any]) -> list[Text | Table]:
    target = state.get("target")
    out = _head(
        state.get("phase"),
        f"  {state.get('joined_ranks', 0)} ranks on {state.get('joined_hosts', 0)} hosts{_lost(state)}"
        f" (quorum {state.get('quorum')}, target {target if target is not None else 'none'}{_elastic(state)})"
        f"  start {state.get('start')}{' (armed)' if state.get('armed') else ''}"
        f"  window {_clock(state.get('window_left_s'))}  hard cap {_clock(state.get('cap_left_s'))}",
        state.get("failure"),
    )
    averaging = _map(state.get("averaging"))
    if averaging.get("rounds"):
        last = _seconds(averaging.get("round_s"))
        out.append(Text(peer(f"averaging: {averaging['rounds']} rounds, the last in {last}")))
    beats = _map(state.get("heartbeats"))
    table = Table("host", "ranks", "devices", "torch", "joined", "heartbeat")
    for host in _hosts(state):
        table.add_row(
            *_row(
                str(host.get("host")),
                _span(host.get("ranks")),
                group_devices(host.get("device_labels") or host.get("devices") or []),
                str(host.get("variant", "-")),
                f"{_clock(_ago(state, host))} ago{_midrun(host)}",
                _age(beats.get(str(host.get("host")))),
            )
        )
    turned = refusal_counts(state)
    if turned:
        out.append(Text(peer(turned), style="yellow"))
    if _hosts(state):
        out.append(table)
    ranks = [(rank, r) for rank, r in _map(state.get("ranks")).items() if isinstance(r, dict)]
    if ranks:
        board = Table("rank", "host", "steps", "steps/s", "loss", "last report")
        for rank, r in ranks[:RANK_ROWS]:
            board.add_row(
                *_row(
                    rank,
                    str(r.get("host")),
                    str(r.get("step", "-")),
                    _number(r.get("step_rate"), ".2f"),
                    _number(r.get("loss"), ".4g"),
                    _age(r.get("age")),
                )
            )
        out.append(board)
        if len(ranks) > RANK_ROWS:
            out.append(Text(f"... and {len(ranks) - RANK_ROWS} more ranks (fdl status --json)", style="dim"))
    return out


def render_verdict(verdict: dict[str, Any], now: float) -> list[Text | Table]:
    """A kept verdict (nobody answers any more): how the last launch on that port ended."""
    ended = verdict.get("ended_at")
    ago = _clock(now - ended) if isinstance(ended, (int, float)) else "?"
    out = _head(
        verdict.get("phase"),
        f"  the last launch on port {verdict.get('port')} (launch {verdict.get('launch') or '?'}) "
        f"ended {ago} ago: {verdict.get('world_size', 0)} ranks on {len(verdict.get('hosts', []))} hosts",
        verdict.get("reason"),
    )
    if not verdict.get("reason") and verdict.get("phase") not in ("done", "failed"):
        out.append(Text("the controller stopped before a verdict", style="yellow"))
    table = Table("host", "ranks", "devices", "exits")
    for host in _hosts(verdict):
        exits = _map(host.get("exits"))
        table.add_row(
            *_row(
                str(host.get("host")),
                _span(host.get("ranks")),
                group_devices(host.get("device_labels") or host.get("devices") or []),
                ", ".join(f"rank {rank}: exit {code}" for rank, code in exits.items()) or "-",
            )
        )
    if _hosts(verdict):
        out.append(table)
    return out

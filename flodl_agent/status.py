"""The operator's side of the status surface: `fdl status` and `fdl start`.

A small HTTP client (the standard library's; the server side parses with h11)
and the rendering of ``/state.json``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import ssl
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from rich.table import Table
from rich.text import Text

from .net import join_address, local_address, split_address
from .tls import PinMismatch, check_pin, client_context

DEFAULT_ADDR = "127.0.0.1:1337"
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


def resolve_pin(pin: str | None, cwd: Path) -> str | None:
    """--tls-fingerprint, then FDL_TLS_FINGERPRINT, then the certificate ./fdl.cluster.yml serves."""
    from .tls import cert_fingerprint, normalize

    text = pin or os.environ.get("FDL_TLS_FINGERPRINT", "")
    if text:
        return normalize(text)
    cluster_file = cwd / "fdl.cluster.yml"
    if cluster_file.is_file():
        from .config import ConfigError, load_config

        with contextlib.suppress(ConfigError, OSError, ValueError):
            cluster = load_config(cluster_file).config.cluster
            if cluster is not None and cluster.controller.tls is not None:
                return cert_fingerprint(Path(cluster.controller.tls.cert))
    return None


def resolve_addr(addr: str | None, cwd: Path) -> tuple[str, str | None]:
    """--addr, then the active cluster file, then the default (with a note saying so)."""
    if addr:
        return addr, None
    cluster_file = cwd / "fdl.cluster.yml"
    if cluster_file.is_file():
        from .config import ConfigError, load_config

        try:
            cluster = load_config(cluster_file).config.cluster
        except ConfigError:
            cluster = None
        if cluster is not None:
            host = local_address(cluster.controller.host)
            return join_address(host, cluster.controller.port), f"controller from {cluster_file}"
    return DEFAULT_ADDR, f"no --addr and no ./fdl.cluster.yml: trying {DEFAULT_ADDR}"


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
        if pin:
            conn.connect()
            sock = conn.sock
            der = sock.getpeercert(binary_form=True) if isinstance(sock, ssl.SSLSocket) else None
            check_pin(der, pin, f"the controller at {addr}")
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
    except ValueError:
        raise Unreachable(
            f"{addr} answered, but not with flodl's state (is this the controller port?)"
        ) from None
    return Reply(response.status, data if isinstance(data, dict) else {})


def read_token(option: str | None) -> str | None:
    """Credentials come from the environment or stdin, never argv."""
    if option == "-":
        token, source = sys.stdin.readline().strip(), "stdin"
    elif option is not None:
        raise ValueError(
            "--token takes `-` (read the token from stdin); a token in argv is visible to every "
            "user of this box. Or set FDL_TOKEN."
        )
    else:
        token, source = os.environ.get("FDL_TOKEN", "").strip(), "FDL_TOKEN"
    if token and not re.fullmatch(r"[0-9a-fA-F]{32}", token):
        raise ValueError(f"the token from {source} is not 32 hex characters: pass the run's join.token")
    return token or None


def _clock(seconds: Any) -> str:
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    return f"{s // 60}m{s % 60:02d}s"


def _ago(state: dict[str, Any], host: dict[str, Any]) -> float | None:
    # Both times are the controller's: no clock skew between it and this terminal.
    now, joined = state.get("now"), host.get("joined_at")
    return now - joined if isinstance(now, (int, float)) and isinstance(joined, (int, float)) else None


def group_devices(labels: list[str]) -> str:
    counts = Counter(labels)
    return ", ".join(f"{n}x {name}" for name, n in counts.items()) or "-"


def one_line(state: dict[str, Any]) -> str:
    """The roster in a line: for a spinner while the window is open."""
    target = state.get("target")
    hosts = ", ".join(str(h.get("host")) for h in state.get("hosts", [])) or "nobody yet"
    return (
        f"{state.get('phase')}: {state.get('joined_ranks', 0)} ranks (quorum {state.get('quorum')}"
        f"{f', target {target}' if target is not None else ''}) from {hosts}; "
        f"window {_clock(state.get('window_left_s'))}, hard cap {_clock(state.get('cap_left_s'))}"
    )


def render(state: dict[str, Any]) -> list[Text | Table]:
    phase = str(state.get("phase", "?"))
    head = Text()
    head.append(phase, style=PHASE_STYLE.get(phase, ""))
    target = state.get("target")
    head.append(
        f"  {state.get('joined_ranks', 0)} ranks on {state.get('joined_hosts', 0)} hosts"
        f" (quorum {state.get('quorum')}, target {target if target is not None else 'none'})"
    )
    head.append(
        f"  start {state.get('start')}{' (armed)' if state.get('armed') else ''}"
        f"  window {_clock(state.get('window_left_s'))}  hard cap {_clock(state.get('cap_left_s'))}"
    )
    out: list[Text | Table] = [head]
    if state.get("failure"):
        out.append(Text(f"failure: {state['failure']}", style="red"))
    table = Table("host", "ranks", "devices", "torch", "joined")
    for host in state.get("hosts", []):
        ranks = host.get("ranks")
        table.add_row(
            str(host.get("host")),
            f"[{ranks[0]}..{ranks[1]})" if ranks else "-",
            group_devices(host.get("device_labels") or host.get("devices") or []),
            str(host.get("variant", "-")),
            f"{_clock(_ago(state, host))} ago",
        )
    if state.get("hosts"):
        out.append(table)
    return out

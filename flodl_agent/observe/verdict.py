"""How the last launch on a port ended, kept on the controller box after its controller exits.

``fdl launch`` writes the run's report (the verdict, the world as formed, every
rank's exit) to ``~/.flodl/controller/verdict-PORT.json`` of the user running
it, atomically, as its port closes; ``fdl status`` reads it when nobody answers
at an address of this box. One file per port: a box holds one controller per
port, and the newest launch on it is the one an operator asks about.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from ..address import is_loopback

DIRECTORY = Path("~/.flodl/controller")


def verdict_path(port: int, directory: Path = DIRECTORY) -> Path:
    return directory.expanduser() / f"verdict-{port}.json"


def keep_verdict(report: dict[str, Any], bind: str, port: int, directory: Path = DIRECTORY) -> Path | None:
    """Write the launch's report for ``fdl status``; None when the home cannot take it (it is a
    courtesy: a controller whose service user has no home still ends its run)."""
    path = verdict_path(port, directory)
    body = report | {"bind": bind, "port": port, "ended_at": round(time.time(), 1)}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp.write_text(json.dumps(body))
        tmp.replace(path)  # a reader sees the whole verdict or the one before
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        return None
    return path


def _bindable(address: str) -> bool:
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError as exc:
            return exc.errno != errno.EADDRNOTAVAIL
    return True


def on_this_box(host: str) -> bool:
    """``host`` is this box: loopback, or (a name for) an address a socket can bind here."""
    if is_loopback(host):
        return True
    try:
        ipaddress.ip_address(host)
        addresses = {host}
    except ValueError:
        try:
            addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)}
        except (OSError, UnicodeError):
            return False
    return any(is_loopback(a) or _bindable(a.split("%")[0]) for a in addresses)


def last_verdict(host: str, port: int, directory: Path = DIRECTORY) -> dict[str, Any] | None:
    """The verdict the last launch on ``port`` of this box kept; None when ``host`` is another
    box's, or none was kept (another user's controller, or a home it could not write)."""
    if not on_this_box(host):
        return None
    try:
        body = json.loads(verdict_path(port, directory).read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) and "phase" in body else None

"""Sockets, interfaces and ssh command lines, shared by the controller, the agent
and the operator's client. Addresses as text live in the pure :mod:`.address`."""

from __future__ import annotations

import errno
import socket
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio


# A peer that vanishes without a FIN (power cut, pulled cable, dead VM) is
# noticed after about a minute instead of never.
KEEPALIVE = {"TCP_KEEPIDLE": 30, "TCP_KEEPINTVL": 10, "TCP_KEEPCNT": 3}

# A FUSE mount whose daemon died answers one of these (which one depends on timing).
DEAD_MOUNT = frozenset({errno.ENOTCONN, errno.ECONNABORTED})


def ssh_argv(
    target: str | None,
    *,
    user: str | None = None,
    port: int | None = None,
    identity_file: str | None = None,
    options: list[str] | tuple[str, ...] = (),
    extra: list[str] | tuple[str, ...] = (),
) -> list[str]:
    """An OpenSSH command line from an ``ssh:`` block: never a password prompt,
    dead links noticed, host keys as the user's known_hosts pins them. ``target``
    None: no destination (a transport's ``-e`` command, rsync adds it)."""
    argv = [
        "ssh",
        "-o",
        "BatchMode=yes",
        "-o",
        "ServerAliveInterval=15",
        "-o",
        "ServerAliveCountMax=3",
        *extra,
    ]
    if port is not None:
        argv += ["-p", str(port)]
    if identity_file:
        argv += ["-i", identity_file, "-o", "IdentitiesOnly=yes"]
    for option in options:
        argv += ["-o", option]
    if target is None:
        return argv
    return [*argv, f"{user}@{target}" if user else target]


def keepalive(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in KEEPALIVE.items():
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError:
        pass  # a socket type without keepalive (a test double, a unix socket): nothing to tune


def socket_ifnames(nccl: str, interfaces: list[str] | None = None) -> dict[str, str]:
    """The rank environment for a worker's ``nccl_socket_ifname``.

    NCCL takes its own syntax (prefixes, ``=exact``, ``^excluded``); gloo needs
    concrete interface names, so one is picked from this box's ``interfaces``
    (default: ``/sys/class/net``). Nothing concrete matches: gloo is left alone.
    """
    if not nccl:
        return {}
    if interfaces is None:
        try:
            interfaces = sorted(p.name for p in Path("/sys/class/net").iterdir())
        except OSError:
            interfaces = []
    env = {"NCCL_SOCKET_IFNAME": nccl}
    exclude = nccl.startswith("^")
    exact = nccl.lstrip("^").startswith("=")
    wanted = [w for w in nccl.lstrip("^").lstrip("=").split(",") if w]

    def matches(name: str) -> bool:
        return any(name == w or (not exact and name.startswith(w)) for w in wanted)

    if exclude:
        picked = [i for i in interfaces if i != "lo" and not matches(i)][:1]
    else:
        picked = [w for w in wanted if w in interfaces] or [i for i in interfaces if matches(i)][:1]
    if picked:
        env["GLOO_SOCKET_IFNAME"] = ",".join(picked)
    return env

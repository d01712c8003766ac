"""Host addresses as text: ``host[:port]``, IPv6 brackets, loopback and bind-all.

Pure ``ipaddress`` work, no sockets: the config schema validates controller
addresses with it, so it must stay importable without any IO module.
"""

from __future__ import annotations

import functools
import ipaddress


@functools.lru_cache(maxsize=4096)  # asked of every connection's peer: a storm parses the same few
def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0].strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


BIND_ALL = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def is_bind_all(host: str) -> bool:
    return host in BIND_ALL


def local_address(host: str) -> str:
    """Where this box reaches a server bound to ``host``: a bind-all address is
    reached on the loopback of the same family, anything else as it is."""
    return BIND_ALL.get(host, host)


def join_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class AddressError(ValueError):
    pass


def split_address(text: str, default_port: int = 1337) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port``."""
    host, port_text = text, ""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":")
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    if not host or (port_text and not (port_text.isdigit() and 0 < int(port_text) < 65536)):
        raise AddressError(
            f"`{text}` is not an address: write host[:port], e.g. 10.0.0.1:1337 or [fd00::1]:1337"
        )
    return host, int(port_text) if port_text else default_port

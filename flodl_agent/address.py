"""Host addresses as text: ``host[:port]``, IPv6 brackets, loopback and bind-all.

One parser for every address fdl takes (join's ADDRESS, join.controller, --addr,
--ssh, --bind, cluster.controller.host): no schemes, IPv6 in brackets when a port
may follow, ports 1-65535, host names as DNS spells them.

Pure ``ipaddress`` work, no sockets: the config schema validates controller
addresses with it, so it must stay importable without any IO module.
"""

from __future__ import annotations

import functools
import ipaddress
import re

from .names import HOST_NAME_MAX, shown


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


EXAMPLE = "write host[:port], e.g. 10.0.0.1:1337, ctrl.example.com or [fd00::1]:1337"
_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_PORT = re.compile(r"[0-9]{1,5}")


class AddressError(ValueError):
    """Text that is not an address: what is wrong with it, and how to write one."""

    def __init__(self, message: str, fix: str = EXAMPLE) -> None:
        super().__init__(message)
        self.message, self.fix = message, fix

    def render(self) -> str:
        return f"{self.message}; {self.fix}"


def _host_problem(host: str) -> str | None:
    """Why ``host`` is neither an IP address nor a DNS name, or ``None``."""
    if len(host) > HOST_NAME_MAX:
        return f"is {len(host)} characters long: a host name has at most {HOST_NAME_MAX}"
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    labels = host.removesuffix(".").split(".")
    # A name whose last label is a number is a mistyped IP address (or a bare port).
    if all(_LABEL.fullmatch(label) for label in labels) and not labels[-1].isdigit():
        return None
    return "is neither an IP address nor a host name (letters, digits, `-`, `_` and dots)"


def check_host(text: str, fix: str = "write a host name or an IP address, e.g. 10.0.0.1") -> str:
    """A bare host (a bind address, cluster.controller.host, an ssh target): an IPv4 or an
    unbracketed IPv6 address, or a DNS name; raises :class:`AddressError`."""
    if not text:
        raise AddressError("the address is empty", fix)
    if "://" in text:
        raise AddressError(
            f"`{shown(text)}` is not a host: drop the `{shown(text.partition('://')[0], 20)}://`", fix
        )
    if text.startswith("[") or text.count(":") == 1:
        raise AddressError(f"`{shown(text)}` is not a bare host: it carries brackets or a port", fix)
    problem = _host_problem(text)
    if problem is not None:
        raise AddressError(f"`{shown(text)}` {problem}", fix)
    return text


def split_address(text: str, default_port: int = 1337) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port``: parsed once, everything else refused
    (a scheme, an IPv6 address without brackets, a port outside 1-65535)."""
    said = f"`{shown(text)}`"
    if "://" in text:
        scheme = text.partition("://")[0]
        raise AddressError(f"{said} is not an address: drop the `{shown(scheme, 20)}://`", EXAMPLE)
    host, port_text, has_port = text, "", False
    if text.startswith("["):
        host, closed, rest = text[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")) or ":" not in host:
            raise AddressError(f"{said} is not an address: brackets hold an IPv6 address, then :port")
        port_text, has_port = rest[1:], bool(rest)
    elif text.count(":") > 1:
        raise AddressError(
            f"{said} is not an address: an IPv6 address goes in brackets",
            "put the address in brackets, then the port: [fd00::1]:1337",
        )
    elif ":" in text:
        host, _, port_text = text.partition(":")
        has_port = True
    if not host:
        raise AddressError(f"{said} is not an address: it names no host")
    problem = _host_problem(host)
    if problem is not None:
        raise AddressError(f"{said} {problem}" if host == text else f"{said}: `{shown(host)}` {problem}")
    if has_port and not (_PORT.fullmatch(port_text) and 0 < int(port_text) < 65536):
        raise AddressError(f"{said} is not an address: `{shown(port_text, 20)}` is not a port (1-65535)")
    return host, int(port_text) if has_port else default_port

"""Helpers shared by the tests: test modules import from here, never from each other.

This module: cluster files to problems or configs, free ports, this box's non-loopback
address. By topic beside it: control_plane (a controller and walk-ins over loopback), sshd
(a private OpenSSH server), lab (the podman lab's names and commands). Fixtures live in
tests/conftest.py."""

from __future__ import annotations

import contextlib
import socket
import textwrap

from flodl_agent.config import ConfigError, FdlConfig, Problem, parse_yaml, validate_document

# Begins the reason of every skip for want of a GPU: the one skip CI allows (tests/conftest.py),
# and only in a test marked `gpu`.
NO_GPU = "no GPU:"


def problems_of(text: str, name: str = "fdl.cluster.yml") -> list[Problem]:
    """The problems a document raises (empty when it is valid)."""
    try:
        validate_document(parse_yaml(textwrap.dedent(text), name))
    except ConfigError as exc:
        return list(exc.problems)
    return []


def load(text: str) -> FdlConfig:
    return validate_document(parse_yaml(textwrap.dedent(text), "fdl.cluster.yml"))


def free_port() -> int:
    """A port nobody listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def remote_address() -> str | None:
    """An address of this box that is not loopback: dialled from here, the controller sees a
    remote peer (the dial guard and the per-peer cap apply, as they do to any real box)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.254", 9))  # no packet is sent: this only picks the outgoing interface
        address = str(s.getsockname()[0])
        if not address.startswith("127."):
            return address
    return None

"""Helpers shared by the tests: test modules import from here, never from each other.

This module: cluster files to problems or configs, free ports. By topic beside it:
control_plane (a controller and walk-ins over loopback), sshd (a private OpenSSH server),
lab (the podman lab's names and commands). Fixtures live in tests/conftest.py."""

from __future__ import annotations

import socket
import textwrap

from flodl_agent.config import ConfigError, FdlConfig, Problem, parse_yaml, validate_document


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

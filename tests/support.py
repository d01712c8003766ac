"""Helpers shared by the tests."""

from __future__ import annotations

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

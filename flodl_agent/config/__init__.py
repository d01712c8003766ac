"""The cluster schema: ``fdl.yml`` and its ``fdl.cluster.yml`` overlay.

``load_config`` is the IO shell (files, YAML, line numbers); everything it
calls is pure and importable on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .builder import ClusterBuilder
from .devices import DeviceOffer, parse_devices
from .models import Cluster, Controller, FdlConfig, Join, JoinWindow, Publish, Ssh, Worker
from .problems import ConfigError, Problem, format_path
from .source import STDIN, Document, deep_merge, overlay, parse_yaml, read_yaml, shown_name
from .validate import validate_data, validate_document, warnings_for


@dataclass(frozen=True)
class Loaded:
    config: FdlConfig
    warnings: list[Problem]
    files: list[str]


def load_document(path: Path, base: Path | None = None) -> Document:
    if base is not None and STDIN == str(path) == str(base):
        fix = "pipe in one of them; name the other by path"
        raise ConfigError([Problem((), "FILE and --base both name stdin (-)", fix)])
    doc = read_yaml(path)
    if base is not None:
        doc = overlay(read_yaml(base), doc)
    return doc


def load_config(path: Path, base: Path | None = None) -> Loaded:
    """Load ``path`` (deep-merged onto ``base`` when given) and validate it.

    Raises :class:`ConfigError` naming every problem; warnings come back.
    """
    doc = load_document(path, base)
    config = validate_document(doc)
    files = [shown_name(p) for p in (base, path) if p is not None]
    return Loaded(config, [doc.locate(w) for w in warnings_for(config)], files)


def to_data(config: FdlConfig) -> dict[str, Any]:
    """The shortest document that loads back to ``config`` (defaults left out)."""
    return config.model_dump(mode="json", by_alias=True, exclude_defaults=True)


def to_yaml(config: FdlConfig) -> str:
    return yaml.safe_dump(to_data(config), sort_keys=False)


__all__ = [
    "Cluster",
    "ClusterBuilder",
    "ConfigError",
    "Controller",
    "DeviceOffer",
    "Document",
    "FdlConfig",
    "Join",
    "JoinWindow",
    "Loaded",
    "Problem",
    "Publish",
    "Ssh",
    "Worker",
    "deep_merge",
    "format_path",
    "load_config",
    "load_document",
    "overlay",
    "parse_devices",
    "parse_yaml",
    "to_data",
    "to_yaml",
    "validate_data",
    "validate_document",
    "warnings_for",
]

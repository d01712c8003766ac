"""Turning pydantic's errors into :class:`Problem`s, and the warnings.

Pure: data and marks in, a model and problems out.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from ..names import shown
from .join_window import LOCKED_OUT_FIX, locked_out_message, locks_walk_ins_out
from .models import LEGACY_KEYS, Cluster, FdlConfig
from .problems import ConfigError, Loc, Problem, format_path
from .source import Document

_TYPE_WORDS = {
    "model_type": "expected a mapping of keys",
    "model_attributes_type": "expected a mapping of keys",
    "dict_type": "expected a mapping of keys",
    "list_type": "expected a list",
    "string_type": "expected a string",
    "int_type": "expected a whole number",
    "float_type": "expected a number",
    "bool_type": "expected true or false",
}


def _unwrap(tp: Any) -> Any:
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            members = [a for a in typing.get_args(tp) if a is not type(None)]
            models = [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]
            tp = models[0] if models else members[0]
        else:
            return tp


def _field(model: type[BaseModel], key: str) -> tuple[str, FieldInfo] | None:
    for name, info in model.model_fields.items():
        if key in (name, info.alias):
            return name, info
    return None


def _walk(root: type[BaseModel], loc: Loc) -> Any:
    """The type found at ``loc`` under ``root`` (``None`` when it cannot be followed)."""
    tp: Any = root
    for part in loc:
        tp = _unwrap(tp)
        origin = typing.get_origin(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel) and isinstance(part, str):
            found = _field(tp, part)
            if found is None:
                return None
            tp = found[1].annotation
        elif origin is list and isinstance(part, int):
            tp = typing.get_args(tp)[0]
        elif origin is dict:
            tp = typing.get_args(tp)[1]
        else:
            return None
    return _unwrap(tp)


def _keys_of(model: type[BaseModel]) -> list[str]:
    return [info.alias or name for name, info in model.model_fields.items()]


def _description(root: type[BaseModel], loc: Loc) -> str | None:
    if not loc or not isinstance(loc[-1], str):
        return None
    parent = _walk(root, loc[:-1])
    if isinstance(parent, type) and issubclass(parent, BaseModel):
        found = _field(parent, loc[-1])
        if found is not None:
            return found[1].description
    return None


def _unknown_key(root: type[BaseModel], loc: Loc) -> Problem:
    key = str(loc[-1])
    if key in LEGACY_KEYS:
        new = LEGACY_KEYS[key]
        return Problem(loc, f"`{key}` is a stale key from an older schema", f"use `{new}` instead")
    parent = _walk(root, loc[:-1])
    allowed = _keys_of(parent) if isinstance(parent, type) and issubclass(parent, BaseModel) else []
    close = difflib.get_close_matches(key[:100], allowed, n=1, cutoff=0.6)
    hint = f"did you mean `{close[0]}`?" if close else f"allowed keys here: {', '.join(allowed)}"
    return Problem(loc, f"unknown key `{shown(key)}`", hint)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _problems(exc: ValidationError, root: type[BaseModel]) -> Iterator[Problem]:
    for err in exc.errors():
        loc: Loc = tuple(p for p in err["loc"] if p != "[key]")
        kind = err["type"]
        ctx = err.get("ctx") or {}
        if kind == "flodl":
            for rel, message, hint in ctx["rules"]:
                yield Problem((*loc, *rel), message, hint)
        elif kind == "extra_forbidden":
            yield _unknown_key(root, loc)
        elif kind == "missing":
            described = _description(root, loc)
            hint = f"add `{loc[-1]}:`" + (f" ({described})" if described else "")
            yield Problem(loc, "is required", hint)
        elif kind == "literal_error":
            choices = [str(c) for c in typing.get_args(_walk(root, loc))]
            got = str(err.get("input"))
            close = difflib.get_close_matches(got[:100], choices, n=1, cutoff=0.6)
            hint = f"did you mean `{close[0]}`?" if close else f"use one of: {', '.join(choices)}"
            yield Problem(loc, f"`{shown(got)}` is not one of {', '.join(choices)}", hint)
        else:
            word = _TYPE_WORDS.get(kind, err["msg"][0].lower() + err["msg"][1:])
            described = _description(root, loc)
            hint = f"{loc[-1]}: {described}" if described else None
            yield Problem(loc, f"{word} (got {_short(err.get('input'))})", hint)


def validate_data(data: Any, root: type[FdlConfig] = FdlConfig) -> FdlConfig:
    """Validate plain data; raises :class:`ConfigError` with unlocated problems."""
    return validate_document(Document(data), root)


def validate_document(doc: Document, root: type[FdlConfig] = FdlConfig) -> FdlConfig:
    if doc.data is None:
        raise ConfigError([doc.locate(Problem((), "is empty", "add a cluster:, join: or publish: block"))])
    if not isinstance(doc.data, dict):
        raise ConfigError(
            [doc.locate(Problem((), "expected a mapping at the top level", "start with `cluster:`"))]
        )
    try:
        return root.model_validate(doc.data)
    except ValidationError as exc:
        raise ConfigError([doc.locate(p) for p in _problems(exc, root)]) from None


# --- warnings ----------------------------------------------------------------

# Options that trust whatever key a host presents (or any new host): pinning is off.
_UNPINNED = {
    "stricthostkeychecking": {"no", "off", "false", "accept-new"},
    "userknownhostsfile": {"/dev/null"},
    "globalknownhostsfile": {"/dev/null"},
}


def downgrades_host_keys(option: str) -> bool:
    """Does this ``ssh -o`` option turn host key pinning off? (``Name=value`` or ``Name value``)"""
    name, _, value = option.strip().replace("=", " ", 1).partition(" ")
    return value.strip().lower() in _UNPINNED.get(name.lower(), set())


def _ssh_warnings(loc: Loc, options: list[str]) -> Iterator[Problem]:
    for i, option in enumerate(options):
        if downgrades_host_keys(option):
            yield Problem(
                (*loc, i),
                f"`{option}` turns off host key pinning",
                "pin the host key in known_hosts instead (the worker role does this)",
                severity="warning",
            )


def cluster_warnings(cluster: Cluster) -> Iterator[Problem]:
    join = cluster.controller.join
    base: Loc = ("cluster",)
    if join.open_admission:
        yield Problem(
            (*base, "controller", "join", "open_admission"),
            f"any peer that reaches {cluster.controller.host}:{cluster.controller.port} can join "
            "and influence the run",
            "sound only on a fully trusted segment; otherwise bind 127.0.0.1 and tunnel workers "
            "through the join door, or set a token",
            severity="warning",
        )
    if cluster.workers and locks_walk_ins_out(join, cluster.controller.host):
        yield Problem(
            (*base, "controller", "join", "discovery"),
            locked_out_message(cluster.controller.host, len(cluster.workers)),
            LOCKED_OUT_FIX,
            severity="warning",
        )
    capacity = cluster.capacity
    if (
        join.min_rank_start is not None
        and capacity is not None
        and join.min_rank_start > capacity
        and not join.discovery
    ):
        yield Problem(
            (*base, "controller", "join", "min_rank_start"),
            f"({join.min_rank_start}) exceeds the configured capacity ({capacity} ranks): "
            "the run starts only once walk-ins make up the difference",
            "intended for walk-ins; otherwise lower it or list more devices",
            severity="warning",
        )
    for i, worker in enumerate(cluster.workers):
        if worker.ssh is not None:
            yield from _ssh_warnings((*base, "workers", i, "ssh", "options"), worker.ssh.options)


def warnings_for(config: FdlConfig) -> list[Problem]:
    found: list[Problem] = []
    if config.cluster is not None:
        found.extend(cluster_warnings(config.cluster))
    if config.join is not None and config.join.ssh is not None:
        found.extend(_ssh_warnings(("join", "ssh", "options"), config.join.ssh.options))
    return found


__all__ = ["format_path", "validate_data", "validate_document", "warnings_for"]

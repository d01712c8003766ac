"""`fdl config`: check, show and describe fdl.yml / fdl.cluster.yml."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from ..config import FdlConfig
from ..config.ranks import known_ranks, plan_window, rank_span
from .common import base_opt, emit_json, file_arg, json_opt, load, out, print_problems

EXAMPLES = ("lab", "local", "gpu", "reference", "project")


@click.group()
def config() -> None:
    """Check, show and describe fdl.yml / fdl.cluster.yml."""


@config.command("check")
@file_arg
@base_opt
@json_opt
def config_check(file: Path, base: Path | None, as_json: bool) -> None:
    """Validate FILE (- reads stdin). Exit 0 valid, 1 invalid; warnings go to stderr."""
    loaded = load(file, base, as_json)
    if as_json:
        emit_json({"valid": True, "errors": [], "warnings": [w.as_dict() for w in loaded.warnings]})
        return
    print_problems(loaded.warnings)
    out.print(f"ok: {' + '.join(loaded.files)}: {summary(loaded.config)}", markup=False)


def summary(config: FdlConfig) -> str:
    parts = []
    cluster = config.cluster
    if cluster is not None:
        n, capacity = len(cluster.workers), cluster.capacity
        ranks = "ranks known at dispatch" if capacity is None else f"{capacity} rank{'s' * (capacity != 1)}"
        walk_ins = cluster.controller.join.discovery
        if n == 0:
            parts.append("cluster with no roster: the world is whoever walks in")
        else:
            parts.append(f"cluster with {n} worker{'s' * (n != 1)}, {ranks}{' and walk-ins' * walk_ins}")
    if config.join is not None:
        parts.append("join block")
    if config.publish is not None:
        parts.append("publish block")
    return ", ".join(parts) or "nothing configured"


def redacted(config: FdlConfig) -> dict[str, Any]:
    """Secrets never reach a terminal or a log: show that a token is set, not what it is."""
    data = config.model_dump(mode="json", by_alias=True)
    blocks = [data["join"]]
    if config.cluster is not None:
        blocks.append(data["cluster"]["controller"]["join"])
    for block in blocks:
        for secret in ("token", "host_key"):
            if block and block.get(secret):
                block[secret] = "<redacted>"
    return data


def show_payload(config: FdlConfig) -> dict[str, Any]:
    payload: dict[str, Any] = {"config": redacted(config)}
    cluster = config.cluster
    if cluster is not None:
        starts = {r.host: (r.start, r.stop) for r in known_ranks(cluster)}
        payload["capacity"] = cluster.capacity
        payload["workers"] = [
            {
                "host": w.host,
                "devices": w.local_devices.to_data(),
                "capacity": w.capacity,
                "ranks": list(starts[w.host]) if w.host in starts else None,
            }
            for w in cluster.workers
        ]
        plan = plan_window(cluster.controller.join, cluster.capacity)
        payload["window"] = {
            "quorum": plan.quorum,
            "target": plan.target,
            "join_timeout": plan.join_timeout,
            "max_join_timeout": plan.max_join_timeout,
            "start": plan.start,
        }
    return payload


@config.command("show")
@file_arg
@base_opt
@json_opt
def config_show(file: Path, base: Path | None, as_json: bool) -> None:
    """Print FILE normalized, with rank capacity, rank ranges and the window plan."""
    loaded = load(file, base, as_json)
    payload = show_payload(loaded.config)
    if as_json:
        emit_json(payload)
        return
    print_problems(loaded.warnings)
    cluster = loaded.config.cluster
    if cluster is None:
        out.print_json(json.dumps(payload["config"]))
        return
    ctl = cluster.controller
    out.print(f"controller {ctl.host}:{ctl.port}", markup=False)
    if not cluster.workers:
        out.print("no roster (discovery): the world is whoever walks in", markup=False)
    table = Table("host", "devices", "ranks", "nccl_socket_ifname", "path", "arch")
    for worker, row in zip(cluster.workers, payload["workers"], strict=True):
        ranks = "at dispatch" if row["ranks"] is None else rank_span(range(*row["ranks"]))
        table.add_row(
            worker.host,
            str(worker.local_devices),
            ranks,
            worker.nccl_socket_ifname or "-",
            worker.path or ctl.path or "-",
            worker.arch or "-",
        )
    if cluster.workers:
        out.print(table)
    w = payload["window"]
    quorum = "at dispatch" if w["quorum"] is None else w["quorum"]
    target = "none (holds for the window)" if w["target"] is None else w["target"]
    out.print(
        f"window: start {w['start']}, quorum {quorum}, target {target}, "
        f"join_timeout {w['join_timeout']}s, hard cap {w['max_join_timeout']}s",
        markup=False,
    )
    if (grows := ctl.join.elastic) is not None:
        out.print(
            f"elastic: walk-ins join the training world up to {grows.max_ranks} ranks "
            f"(planes {', '.join(grows.planes)}; a process group re-forms at most every "
            f"{grows.reform_interval}s, and waits {grows.replace_timeout}s for a lost host's replacement)",
            markup=False,
        )


@config.command("schema")
def config_schema() -> None:
    """Print the JSON Schema of fdl.yml / fdl.cluster.yml (for editors and CI)."""
    schema = FdlConfig.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "flodl fleet configuration (fdl.yml, fdl.cluster.yml)"
    emit_json(schema)


@config.command("example")
@click.argument("name", type=click.Choice(EXAMPLES), default="reference")
def config_example(name: str) -> None:
    """Print an example cluster file: `reference` (every field), `lab` (the podman lab fleet),
    `local` (one machine: a controller on loopback and walk-ins from other terminals) or `gpu`
    (two 8-GPU boxes, NCCL: what `fdl plan --config` counts); or `project`, a project's fdl.yml
    (join:, publish: and commands: defaults) to lay one over."""
    file = "project.fdl.yml" if name == "project" else f"{name}.fdl.cluster.yml"
    text = resources.files("flodl_agent").joinpath(f"examples/{file}").read_text()
    click.echo(text, nl=False)

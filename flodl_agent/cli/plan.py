"""`fdl plan` (a parallelism request against a fleet) and `fdl placement` (Ray nodes)."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.markup import escape

from ..address import AddressError, join_address, split_address
from ..config import Cluster, Worker
from .common import FilePath, emit_json, err, json_opt, load, out

if TYPE_CHECKING:
    from ..placement import FleetSpec, ParallelismSpec, PlacementError, Plan


def fleet_of_cluster(
    cluster: Cluster | None, path: Path, role: str, nodes: int | None = None, per_node: int | None = None
) -> tuple[int, int, list[str]]:
    """(nodes, devices per node, notes) of a cluster file's workers, the flags beating the file
    field by field (``nodes``: --nodes, ``per_node``: --gpus-per-node). A worker's devices are
    its listed GPUs, or its ``cpu:N`` ranks (the world `fdl launch --parallelism` checks);
    ``all`` is known only once probed: --gpus-per-node says it."""
    from ..placement import PlacementError

    workers = cluster.workers if cluster is not None else []
    if not workers and (nodes is None or per_node is None):
        raise PlacementError(
            f"{path} lists no workers: its walk-ins are counted only as they join",
            "give the fleet to expect: --nodes N --gpus-per-node G",
        )
    notes: list[str] = []
    if per_node is None:
        per_node = _per_node(workers, role)
        if role != "sandbox" and any(w.local_devices.kind == "cpu" for w in workers):
            notes.append(
                f"the workers offer CPU ranks: {per_node} per node counted as its devices, "
                "as `fdl launch --parallelism` counts a CPU world"
            )
    return (nodes if nodes is not None else len(workers)), per_node, notes


def _per_node(workers: list[Worker], role: str) -> int:
    """The one device count every worker has; a sandbox fleet claims no GPU."""
    from ..placement import PlacementError

    counts = []
    for i, worker in enumerate(workers):
        offer = worker.local_devices
        if offer.capacity is None:
            raise PlacementError(
                f"cluster.workers[{i}] ({worker.host}) offers `{offer}`: its GPUs are counted "
                "only when the box is probed",
                "pass --gpus-per-node, or list its GPUs (local_devices: [0, 1, ...])",
            )
        counts.append(0 if role == "sandbox" and offer.kind == "cpu" else offer.capacity)
    if len(set(counts)) > 1:
        odd = next(i for i, c in enumerate(counts) if c != counts[0])
        raise PlacementError(
            f"cluster.workers[{odd}] ({workers[odd].host}) has {_devices(workers[odd], counts[odd])}, "
            f"cluster.workers[0] ({workers[0].host}) {_devices(workers[0], counts[0])}: "
            "placement needs nodes of one size",
            "plan the nodes of each size as their own fleet, or pass --gpus-per-node N to use N on each",
        )
    return counts[0]


def _devices(worker: Worker, count: int) -> str:
    kind = "CPU rank" if worker.local_devices.kind == "cpu" else "GPU"
    return f"{count} {kind}{'' if count == 1 else 's'}"


def _fleet_from_ray(address: str, wanted: int | None, segment_size: int | None) -> tuple[int, int, list[str]]:
    """(nodes, GPUs per node, the segment selection) read from a live Ray cluster; ``wanted``
    nodes of it (default: every GPU node)."""
    from ..placement import PlacementError
    from ..placement.ray_cluster import live_fleet, ray_module
    from ..placement.segments import decode_topology, select_segment_nodes

    ray = ray_module()
    if not ray.is_initialized():
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    live = ray.nodes()
    nodes, gpus = live_fleet(live)
    if wanted is not None and wanted > nodes:
        raise PlacementError(
            f"--nodes {wanted}: the Ray cluster has {nodes} alive GPU nodes", "ask for at most that many"
        )
    nodes = wanted or nodes
    chosen: list[str] = []
    if segment_size is not None:
        chosen, _ = select_segment_nodes(decode_topology(live), segment_size, nodes)
    return nodes, gpus, chosen


@click.command()
@click.option(
    "--tensor", type=click.IntRange(min=1), default=1, show_default=True, help="Tensor-parallel size."
)
@click.option("--pipeline", type=click.IntRange(min=1), default=1, show_default=True, help="Pipeline stages.")
@click.option(
    "--data", type=click.IntRange(min=1), help="Data-parallel size (default: whatever uses every GPU)."
)
@click.option(
    "--expert", type=click.IntRange(min=1), default=1, show_default=True, help="Expert-parallel size."
)
@click.option(
    "--role",
    type=click.Choice(["trainer", "inference", "sandbox"]),
    help="Fleet role (default: DOCKYARD_FLEET_ROLE, else trainer for a fleet given by flags).",
)
@click.option("--nodes", type=click.IntRange(min=1), help="Node count.")
@click.option("--gpus-per-node", type=click.IntRange(min=0), help="GPUs per node.")
@click.option("--segment-size", type=click.IntRange(min=1), help="Nodes per NVLink segment.")
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Count nodes and GPUs from this cluster file's workers.",
)
@click.option(
    "--ray",
    "ray_address",
    help="Count nodes and GPUs on this live Ray cluster (`auto`: RAY_ADDRESS or the local one); "
    "with --segment-size, also pick the segments from its NVLink topology.",
)
@json_opt
def plan(
    tensor: int,
    pipeline: int,
    data: int | None,
    expert: int,
    role: str | None,
    nodes: int | None,
    gpus_per_node: int | None,
    segment_size: int | None,
    config_file: Path | None,
    ray_address: str | None,
    as_json: bool,
) -> None:
    """Check a parallelism request against a fleet before anything is claimed.

    The fleet comes from flags, a cluster file's workers (--config), a live Ray
    cluster (--ray), or else the DOCKYARD_* environment a container declares. A
    fleet given so is a trainer fleet unless --role (or DOCKYARD_FLEET_ROLE) says
    otherwise. Exit 0 when it can be placed, 1 with the arithmetic when it cannot.
    """
    from dataclasses import replace

    from ..placement import FleetSpec, ParallelismSpec, PlacementError, preflight

    try:
        env, segments, flags, notes = _fleet_env(
            role, nodes, gpus_per_node, segment_size, config_file, ray_address, as_json
        )
        try:
            fleet = FleetSpec.from_env(env)
        except PlacementError as exc:
            raise _worded(exc, flags) from None
        spec = ParallelismSpec(tensor, pipeline, 1, expert)
        data = _default_data(data, spec, fleet)
        result = preflight(replace(spec, data=data or 1), fleet)
        result = replace(result, notes=[*notes, *result.notes])
    except PlacementError as exc:
        if as_json:
            emit_json({"ok": False, "error": exc.message, "fix": exc.fix})
        else:
            err.print(f"fdl plan: {exc.render()}", style="red", markup=False)
        raise SystemExit(1) from None
    if as_json:
        emit_json(_payload(fleet, spec, data, result, segments))
        return
    _show(fleet, spec, data, result, segments)


FLEET_FLAGS = {
    "DOCKYARD_FLEET_ROLE": "--role",
    "DOCKYARD_NUM_NODES": "--nodes",
    "DOCKYARD_GPUS_PER_NODE": "--gpus-per-node",
    "DOCKYARD_SEGMENT_SIZE": "--segment-size",
}
DESCRIBE = "or describe the fleet: --nodes N --gpus-per-node G (or --config FILE, --ray auto)"


def _fleet_env(
    role: str | None,
    nodes: int | None,
    gpus_per_node: int | None,
    segment_size: int | None,
    config_file: Path | None,
    ray_address: str | None,
    as_json: bool,
) -> tuple[dict[str, str], list[str], dict[str, str] | None, list[str]]:
    """The DOCKYARD_* environment the fleet is read from (this one's, under the flags and the
    cluster file's or Ray's counts), the segment nodes Ray picked, the flags that stand for
    the variables when flags, a cluster file or Ray describe the fleet (None: the env alone),
    and what the count from a cluster file notes."""
    env = dict(os.environ)
    given = {
        "--role": role,
        "--nodes": nodes,
        "--gpus-per-node": gpus_per_node,
        "--segment-size": segment_size,
    }
    described = any(v is not None for v in (nodes, gpus_per_node, config_file, ray_address))
    if role:
        env["DOCKYARD_FLEET_ROLE"] = role
    if described:
        env.setdefault("DOCKYARD_FLEET_ROLE", "trainer")  # the fleet a parallelism plan is for
    segments: list[str] = []
    notes: list[str] = []
    if config_file is not None:
        cluster = load(config_file, None, as_json).config.cluster
        nodes, gpus_per_node, notes = fleet_of_cluster(
            cluster, config_file, env["DOCKYARD_FLEET_ROLE"], nodes, gpus_per_node
        )
    if ray_address is not None:
        nodes, gpus_per_node, segments = _fleet_from_ray(ray_address, nodes, segment_size)
    for name, value in (
        ("DOCKYARD_NUM_NODES", nodes),
        ("DOCKYARD_GPUS_PER_NODE", gpus_per_node),
        ("DOCKYARD_SEGMENT_SIZE", segment_size),
    ):
        if value is not None:
            env[name] = str(value)
    if not described:
        return env, segments, None, notes
    # A variable a flag set, or one the flags left unset: its flag is the name to say.
    flags = {
        var: flag for var, flag in FLEET_FLAGS.items() if given[flag] is not None or var not in os.environ
    }
    return env, segments, flags, notes


def _worded(exc: PlacementError, flags: dict[str, str] | None) -> PlacementError:
    """The fleet's error in the words the user gave it: flags where flags describe the fleet,
    the container's variables (and how to use flags instead) where they alone do."""
    from ..placement import PlacementError

    if flags is None:
        return PlacementError(exc.message, f"{exc.fix}; {DESCRIBE}")
    message, fix = exc.message, exc.fix
    for var, flag in flags.items():
        message = message.replace(f"{var} is not set", f"{flag} is not given").replace(var, flag)
        fix = fix.replace(f"set {var} to", f"give {flag}").replace(var, flag)
    return PlacementError(message, fix)


def _default_data(data: int | None, spec: ParallelismSpec, fleet: FleetSpec) -> int | None:
    """--data, else the size that uses every GPU; None when no whole number of replicas does."""
    if data is None and fleet.total_gpus and fleet.total_gpus % spec.replica == 0:
        return fleet.total_gpus // spec.replica
    return data


def _payload(
    fleet: FleetSpec, spec: ParallelismSpec, data: int | None, result: Plan, segments: list[str]
) -> dict[str, Any]:
    """What `fdl plan --json` prints for a placeable request."""
    return {
        "ok": True,
        "fleet": {
            "role": fleet.role,
            "nodes": fleet.num_nodes,
            "gpus_per_node": fleet.gpus_per_node,
            "strategy": fleet.placement_strategy,
            "segment_size": fleet.segment_size,
        },
        "parallelism": {
            "tensor": spec.tensor,
            "pipeline": spec.pipeline,
            "data": data,
            "expert": spec.expert,
        },
        "replica_gpus": result.replica_gpus,
        "replicas": result.replicas,
        "unified": result.unified,
        "notes": result.notes,
        "segment_nodes": segments,
    }


def _show(
    fleet: FleetSpec, spec: ParallelismSpec, data: int | None, result: Plan, segments: list[str]
) -> None:
    """What `fdl plan` prints for a placeable request."""
    out.print(
        f"[green]placeable[/]: {fleet.role} fleet, {fleet.num_nodes} nodes x {fleet.gpus_per_node} GPUs "
        f"({fleet.placement_strategy}); tensor {spec.tensor} x pipeline {spec.pipeline} x data {data} "
        f"(expert {spec.expert})"
    )
    replicas = f"{result.replicas} replica{'s' * (result.replicas != 1)} of {result.replica_gpus} GPUs"
    if result.unified:
        nodes = result.replica_gpus // fleet.gpus_per_node
        out.print(f"  {replicas} across {nodes} nodes: one unified cross-node placement group per replica")
    else:
        out.print(f"  {replicas}, placed in per-node STRICT_PACK groups (each replica within one node)")
    for note in result.notes:
        out.print(f"  note: {escape(note)}")
    if segments:
        out.print(f"  segments: {escape(', '.join(segments))}")


@click.group()
def placement() -> None:
    """Fleet placement on Ray: a node per worker, its NVLink domain and topological rank."""


def _resources(smi: Path | None) -> dict[str, float]:
    from ..placement.node import node_resources

    try:
        return node_resources(smi, os.environ)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--smi") from None


smi_opt = click.option(
    "--smi",
    type=FilePath(path_type=Path, dir_okay=False, exists=True),
    help="Read this `nvidia-smi -q` output instead of running nvidia-smi.",
)


@placement.command("resources")
@smi_opt
def placement_resources(smi: Path | None) -> None:
    """Print this node's topology resources as JSON, for `ray start --resources=...`.

    nvlink_domain_<fabric> from nvidia-smi -q and topo_rank from FLODL_TOPO_RANK,
    else SLURM_NODEID (encoded rank + 1: a resource of quantity 0 vanishes from
    Ray). A node without an NVLink fabric prints {} and is never chosen for a
    segment.
    """
    click.echo(json.dumps(_resources(smi), sort_keys=True))


@placement.command("node")
@click.option("--address", metavar="HOST:PORT", help="The head to join (default: start a head here).")
@click.option("--port", type=click.IntRange(1, 65535), default=6379, show_default=True, help="A head's port.")
@click.option("--temp-dir", help="Ray's session directory (default: Ray's own).")
@smi_opt
@click.option("--dry-run", is_flag=True, help="Print the ray start command instead of running it.")
def placement_node(
    address: str | None, port: int, temp_dir: str | None, smi: Path | None, dry_run: bool
) -> None:
    """Run this box as a Ray node of the fleet, with its topology resources (what the
    worker role's flodl-ray.service runs): `ray start --block`, replacing this process.
    """
    from ..placement.ray_cluster import node_argv

    if address is not None:
        try:
            host, node_port = split_address(address, default_port=6379)
        except AddressError as exc:
            raise click.BadParameter(exc.render(), param_hint="--address") from None
        address = join_address(host, node_port)
    argv = node_argv(_resources(smi), address=address, port=port, temp_dir=temp_dir)
    if dry_run:
        click.echo(shlex.join(argv))
        return
    if not Path(argv[0]).is_file():
        err.print(
            f"fdl placement node: Ray is not installed in this venv ({argv[0]} is missing)\n"
            "    fix: pip install 'flodl-fleet[ray]' (the worker role does with flodl_worker_ray_address)",
            style="red",
            markup=False,
        )
        raise SystemExit(2)
    sys.stdout.flush()
    os.execv(argv[0], argv)

"""Pre-flight: a ParallelismSpec against a FleetSpec, before any placement group exists.

Pure arithmetic (the seed's cluster/placement): it creates no Ray objects and
runs before ``init_ray()``, so an impossible request fails at launch with the
arithmetic in the message, not mid-run with a placement group pending forever.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .fleet import FleetSpec, PlacementError, Strategy


@dataclass(frozen=True)
class ParallelismSpec:
    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    expert: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor", "pipeline", "data", "expert"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise PlacementError(
                    f"{name}-parallel size is {value!r}", "parallel sizes are whole numbers >= 1"
                )

    @property
    def replica(self) -> int:
        """GPUs one model replica takes: tensor x pipeline."""
        return self.tensor * self.pipeline

    @property
    def world(self) -> int:
        return self.replica * self.data


@dataclass(frozen=True)
class Plan:
    """How the request lands: per-node groups, or one unified cross-node group per replica."""

    replica_gpus: int
    replicas: int
    unified: bool  # a replica spans nodes: a unified cross-node placement group, not per-node groups
    strategy: Strategy
    bundles_per_node: list[int]
    notes: list[str] = field(default_factory=list)


def preflight(spec: ParallelismSpec, fleet: FleetSpec) -> Plan:
    """Validate ``spec`` on ``fleet``; the plan, or PlacementError showing the arithmetic."""
    t, p, d, e = spec.tensor, spec.pipeline, spec.data, spec.expert
    g, n = fleet.gpus_per_node, fleet.num_nodes
    if fleet.role == "sandbox":
        raise PlacementError(
            "a sandbox fleet has no GPUs: parallel sizes apply to trainer and inference fleets",
            "run model-parallel work on a trainer or inference fleet",
        )
    if e > 1 and e % t:  # expert 1: no expert parallelism
        raise PlacementError(
            f"expert-parallel size {e} is not a multiple of tensor-parallel size {t} ({e} % {t} = {e % t})",
            f"use an expert-parallel size that is a multiple of {t}",
        )
    if spec.world != fleet.total_gpus:
        fix = (
            f"set data = {fleet.total_gpus // spec.replica} to use every GPU"
            if fleet.total_gpus % spec.replica == 0
            else f"choose tensor x pipeline dividing the fleet's {fleet.total_gpus} GPUs"
        )
        raise PlacementError(
            f"tensor x pipeline x data = {t} x {p} x {d} = {spec.world} GPUs, but the fleet has "
            f"{n} nodes x {g} GPUs = {fleet.total_gpus}",
            fix,
        )
    replica = spec.replica
    notes: list[str] = []
    if replica <= g:
        if g % replica:
            raise PlacementError(
                f"replicas of tensor x pipeline = {t} x {p} = {replica} GPUs do not tile a {g}-GPU node "
                f"({g} % {replica} = {g % replica})",
                f"choose tensor x pipeline dividing {g}",
            )
        return Plan(replica, d, False, fleet.placement_strategy, [g] * n, notes)
    if replica % g:
        raise PlacementError(
            f"a replica of tensor x pipeline = {t} x {p} = {replica} GPUs spans {replica / g:g} nodes "
            f"of {g}: a cross-node replica must take whole nodes ({replica} % {g} = {replica % g})",
            f"make tensor x pipeline a multiple of {g}",
        )
    if t > g and fleet.role == "trainer":
        raise PlacementError(
            f"tensor-parallel size {t} exceeds a node's {g} GPUs: a trainer's tensor-parallel traffic "
            "needs the node's NVLink",
            f"keep tensor <= {g} and span nodes with pipeline stages, or serve it on an inference fleet",
        )
    nodes = replica // g
    if fleet.segment_size is not None and nodes > fleet.segment_size:
        raise PlacementError(
            f"a replica spans {replica} / {g} = {nodes} nodes, an NVLink segment has {fleet.segment_size}: "
            "it would cross fabrics",
            f"set the segment size to a multiple of {nodes}, or shrink the replica",
        )
    notes.append(
        f"a model replica needs tensor x pipeline = {t} x {p} = {replica} GPUs, more than a node's {g}: "
        f"it must use a unified cross-node placement group ({nodes} nodes per replica)"
    )
    if fleet.role == "inference":
        notes.append("the inference fleet promotes its engines to a unified group automatically")
    return Plan(replica, d, True, fleet.placement_strategy, [g] * n, notes)


SIZES = ("tensor", "pipeline", "data", "expert")


def parse_parallelism(text: str) -> dict[str, int]:
    """``tensor=2,pipeline=2[,data=N][,expert=N]`` -> sizes (data left out: whatever fills the world)."""
    sizes: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in SIZES:
            raise PlacementError(
                f"`{item}` is not a parallel size", f"write name=N with name one of {', '.join(SIZES)}"
            )
        if not value.isdigit() or int(value) < 1:
            raise PlacementError(f"{name}={value}: sizes are whole numbers >= 1", f"e.g. {name}=2")
        sizes[name] = int(value)
    if not sizes:
        raise PlacementError("no parallel sizes given", "e.g. tensor=2,pipeline=2")
    return sizes


def check_world(sizes: dict[str, int], ranks_per_host: list[int]) -> Plan:
    """A formed world (ranks per host, as nodes of a trainer fleet) against requested sizes."""
    from .fleet import FleetSpec

    if not ranks_per_host:
        raise PlacementError("no host joined", "")
    if len(set(ranks_per_host)) > 1:
        raise PlacementError(
            f"the hosts carry {', '.join(map(str, sorted(set(ranks_per_host))))} ranks: "
            "a parallelism request needs hosts of one size",
            "offer the same number of devices on every host",
        )
    fleet = FleetSpec("trainer", len(ranks_per_host), ranks_per_host[0])
    spec = ParallelismSpec(**{k: v for k, v in sizes.items() if k != "data"})
    data = sizes.get("data")
    if data is None:
        data = max(1, fleet.total_gpus // spec.replica)
    return preflight(ParallelismSpec(spec.tensor, spec.pipeline, data, spec.expert), fleet)

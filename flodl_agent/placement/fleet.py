"""Fleet roles and the immutable FleetSpec, from the environment a container declares."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, cast

from ..errors import Failure

Role = Literal["trainer", "inference", "sandbox"]
Strategy = Literal["SPREAD", "PACK", "STRICT_PACK"]
ROLES: tuple[Role, ...] = ("trainer", "inference", "sandbox")
STRATEGIES: tuple[Strategy, ...] = ("SPREAD", "PACK", "STRICT_PACK")
# trainer: a group per node keeps NVLink for tensor parallelism, RDMA carries the rest;
# inference: an engine's tensor-parallel ranks together; sandbox: episodes spread over CPU nodes.
DEFAULT_STRATEGY: dict[Role, Strategy] = {"trainer": "SPREAD", "inference": "PACK", "sandbox": "SPREAD"}

ROLE_VAR = "DOCKYARD_FLEET_ROLE"
NODES_VAR = "DOCKYARD_NUM_NODES"
GPUS_VAR = "DOCKYARD_GPUS_PER_NODE"
STRATEGY_VAR = "DOCKYARD_PG_STRATEGY"
COLOCATED_VAR = "DOCKYARD_MAX_COLOCATED_WORKER_GROUPS"
SEGMENT_VAR = "DOCKYARD_SEGMENT_SIZE"


class PlacementError(Failure, ValueError):
    """A fleet or parallelism request that cannot be placed; the message shows why."""


def get_fleet_role(env: Mapping[str, str] | None = None) -> Role:
    """The container's declared fleet role (``DOCKYARD_FLEET_ROLE``)."""
    value = (os.environ if env is None else env).get(ROLE_VAR, "")
    if value not in ROLES:
        said = f"is `{value}`" if value else "is not set"
        raise PlacementError(f"{ROLE_VAR} {said}", f"set it to one of: {', '.join(ROLES)}")
    return value


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name, "")
    if raw == "":
        if default is None:
            raise PlacementError(f"{name} is not set", f"set {name} to a whole number")
        return default
    try:
        return int(raw)
    except ValueError:
        raise PlacementError(
            f"{name} is `{raw}`, not a whole number", f"set {name} to a whole number"
        ) from None


@dataclass(frozen=True)
class FleetSpec:
    """A fleet's topology. ``num_nodes`` is the node count (a sandbox's: concurrent episode slots)."""

    role: Role
    num_nodes: int
    gpus_per_node: int
    strategy: Strategy | None = None  # None: the role's default
    max_colocated_worker_groups: int = 1  # CPUs per bundle
    segment_size: int | None = None  # nodes per NVLink segment; None: topology-agnostic

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise PlacementError(f"{ROLE_VAR}: unknown role `{self.role}`", f"use one of: {', '.join(ROLES)}")
        if self.num_nodes < 1:
            raise PlacementError(f"{NODES_VAR} is {self.num_nodes}", "a fleet has at least one node")
        if self.role == "sandbox" and self.gpus_per_node != 0:
            raise PlacementError(
                f"{GPUS_VAR} is {self.gpus_per_node} for a sandbox fleet",
                "sandbox fleets are CPU-only: set it to 0 (they must never compete for GPUs)",
            )
        if self.role != "sandbox" and self.gpus_per_node <= 0:
            raise PlacementError(
                f"{GPUS_VAR} is {self.gpus_per_node} for a {self.role} fleet",
                f"a {self.role} fleet needs GPUs: set it to the GPUs each node has",
            )
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise PlacementError(
                f"{STRATEGY_VAR} is `{self.strategy}`", f"use one of: {', '.join(STRATEGIES)}"
            )
        if self.max_colocated_worker_groups < 1:
            raise PlacementError(
                f"{COLOCATED_VAR} is {self.max_colocated_worker_groups}", "a bundle needs at least one CPU"
            )
        if self.segment_size is not None:
            if self.segment_size < 1:
                raise PlacementError(
                    f"{SEGMENT_VAR} is {self.segment_size}", "a segment has at least one node"
                )
            if self.num_nodes % self.segment_size:
                raise PlacementError(
                    f"{SEGMENT_VAR} {self.segment_size} does not divide {NODES_VAR} {self.num_nodes} "
                    f"({self.num_nodes} % {self.segment_size} = {self.num_nodes % self.segment_size})",
                    "choose a segment size that divides the node count",
                )

    @property
    def placement_strategy(self) -> Strategy:
        return self.strategy or DEFAULT_STRATEGY[self.role]

    @property
    def total_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> FleetSpec:
        env = os.environ if env is None else env
        strategy = env.get(STRATEGY_VAR, "").upper() or None
        segment = env.get(SEGMENT_VAR, "")
        return cls(
            role=get_fleet_role(env),
            num_nodes=_int(env, NODES_VAR),
            gpus_per_node=_int(env, GPUS_VAR, 0 if env.get(ROLE_VAR) == "sandbox" else None),
            strategy=cast(Strategy | None, strategy),
            max_colocated_worker_groups=_int(env, COLOCATED_VAR, 1),
            segment_size=_int(env, SEGMENT_VAR) if segment else None,
        )

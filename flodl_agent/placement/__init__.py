"""Fleet placement (seed 001): fleet roles, pre-flight parallelism checks and
NVLink-segment node selection — pure, runnable before any Ray object exists.
The Ray side (bootstrap, the virtual cluster) needs the ``[ray]`` extra."""

from .fleet import DEFAULT_STRATEGY, ROLES, STRATEGIES, FleetSpec, PlacementError, get_fleet_role
from .parallel import ParallelismSpec, Plan, preflight
from .segments import UNKNOWN, decode_topology, select_segment_nodes, topology_resources

__all__ = [
    "DEFAULT_STRATEGY",
    "ROLES",
    "STRATEGIES",
    "UNKNOWN",
    "FleetSpec",
    "ParallelismSpec",
    "PlacementError",
    "Plan",
    "decode_topology",
    "get_fleet_role",
    "preflight",
    "select_segment_nodes",
    "topology_resources",
]

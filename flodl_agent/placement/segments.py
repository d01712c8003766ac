"""NVLink segments: which nodes a multi-node group may take without crossing fabrics.

Each node carries two custom Ray resources, registered when Ray starts there
(the seed's ``ray.sub``): ``nvlink_domain_<UUID>`` (its NVLink fabric) and
``topo_rank`` (its place in the scheduler's topology). A resource of
quantity 0 vanishes from Ray, so the rank travels as ``rank + 1``. Nodes
without them fall into the unknown pseudo-domain and are never selected: a
constraint naming a resource nobody registered could never schedule.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping

from .fleet import PlacementError

UNKNOWN = "unknown"
DOMAIN_PREFIX = "nvlink_domain_"
RANK_RESOURCE = "topo_rank"
Topology = Mapping[str, tuple[str, int]]  # node id -> (NVLink domain, topological rank)


def decode_topology(nodes: Iterable[Mapping[str, object]]) -> dict[str, tuple[str, int]]:
    """``ray.nodes()`` -> node id -> (domain, rank); dead nodes left out, unregistered ones unknown."""
    topology: dict[str, tuple[str, int]] = {}
    for node in nodes:
        if not node.get("Alive", True):
            continue
        resources = node.get("Resources") or {}
        assert isinstance(resources, Mapping)
        domains = sorted(k.removeprefix(DOMAIN_PREFIX) for k in resources if k.startswith(DOMAIN_PREFIX))
        encoded = resources.get(RANK_RESOURCE)
        rank = int(encoded) - 1 if isinstance(encoded, int | float) and encoded >= 1 else -1
        domain = domains[0] if len(domains) == 1 and rank >= 0 else UNKNOWN
        topology[str(node["NodeID"])] = (domain, rank)
    return topology


def topology_resources(nvidia_smi_q: str, env: Mapping[str, str]) -> dict[str, float]:
    """The resources a node registers when Ray starts there (empty when it knows no fabric).

    The domain is the GPUs' NVLink fabric (``ClusterUUID`` and ``CliqueId`` in
    ``nvidia-smi -q``); the rank is ``FLODL_TOPO_RANK`` (the worker role sets it from
    the inventory's order), else the scheduler's (``SLURM_NODEID``), else 0.
    """
    uuids = set(re.findall(r"ClusterUUID\s*:\s*([0-9A-Fa-f-]{8,})", nvidia_smi_q))
    cliques = set(re.findall(r"CliqueId\s*:\s*(\d+)", nvidia_smi_q))
    uuids.discard("00000000-0000-0000-0000-000000000000")  # no fabric
    if len(uuids) != 1:
        return {}  # no fabric, or GPUs on several: not one domain
    domain = uuids.pop().lower().replace("-", "")
    if len(cliques) == 1:
        domain += f"_{cliques.pop()}"
    named = next((env[k] for k in ("FLODL_TOPO_RANK", "SLURM_NODEID") if env.get(k, "").isdigit()), "0")
    rank = int(named)
    return {f"{DOMAIN_PREFIX}{domain}": 1.0, RANK_RESOURCE: float(rank + 1)}


def select_segment_nodes(
    topology: Topology, segment_size: int, num_nodes: int
) -> tuple[list[str], list[str]]:
    """Take ``num_nodes`` nodes as complete ``segment_size`` segments, each within one NVLink
    domain, in topological order; (selected, remainder). Raises rather than spill a segment."""
    if segment_size < 1 or num_nodes < 0 or num_nodes % segment_size:
        raise PlacementError(
            f"segment size {segment_size} does not divide {num_nodes} nodes"
            + (f" ({num_nodes} % {segment_size} = {num_nodes % segment_size})" if segment_size >= 1 else ""),
            "choose a segment size that divides the node count",
        )
    by_domain: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for node, (domain, rank) in topology.items():
        if domain != UNKNOWN:
            by_domain[domain].append((rank, node))
    for members in by_domain.values():
        members.sort()
    # Domains in topological order (the lowest rank first), so segments follow the scheduler's layout.
    order = sorted(by_domain, key=lambda d: (by_domain[d][0], d))
    selected: list[str] = []
    for domain in order:
        nodes = [node for _, node in by_domain[domain]]
        whole = len(nodes) // segment_size * segment_size
        take = min(whole, num_nodes - len(selected))
        selected += nodes[:take]
        if len(selected) == num_nodes:
            break
    if len(selected) < num_nodes:
        counts = ", ".join(f"{d}: {len(by_domain[d])}" for d in order) or "none registered"
        unknown = sum(1 for domain, _ in topology.values() if domain == UNKNOWN)
        raise PlacementError(
            f"{num_nodes} nodes in segments of {segment_size} need {num_nodes // segment_size} complete "
            f"segments; the NVLink domains hold {len(selected) // segment_size} ({counts}"
            + (f"; {unknown} nodes without topology resources" if unknown else "")
            + ")",
            "add nodes to a domain, lower the node count, or choose a smaller segment size",
        )
    chosen = set(selected)
    return selected, sorted(node for node in topology if node not in chosen)

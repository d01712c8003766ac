"""The Ray side of placement (the ``[ray]`` extra): bootstrap, topology, the virtual cluster.

``init_ray`` attaches to ``RAY_ADDRESS`` when it is set (data-centre mode);
otherwise it reuses or starts a local head keyed by ``CUDA_VISIBLE_DEVICES``
(local-dev mode), so a second process on the same device set attaches
without a cold start. Either way the whole process environment reaches Ray's
workers. ``RayVirtualCluster`` owns the placement groups the worker-group
builders consume: one STRICT_PACK group per logical node (every bundle of a
group on one physical node, NVLink locality kept), or one unified cross-node
group when a replica spans nodes. Waiting for a group is bounded: an
infeasible group otherwise pends forever, so it is removed and the error
names what the cluster lacks.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .fleet import FleetSpec, PlacementError, Strategy
from .parallel import ParallelismSpec, preflight
from .segments import DOMAIN_PREFIX, decode_topology, select_segment_nodes

READY_TIMEOUT = 60.0
DOMAIN_SHARE = 0.001  # a bundle asks this much of its node's domain resource: pinned, not exclusive
STATE = Path("~/.flodl/ray")


def ray_module() -> Any:
    try:
        import ray
    except ImportError:
        raise PlacementError(
            "Ray is not installed", "pip install 'flodl-fleet[ray]' (placement on Ray is optional)"
        ) from None
    return ray


def local_key(env: Mapping[str, str]) -> str:
    """The local cluster a process reuses: one per device set."""
    devices = env.get("CUDA_VISIBLE_DEVICES", "all")
    return hashlib.sha256(devices.encode()).hexdigest()[:12]


def _runtime_env(env: Mapping[str, str]) -> dict[str, Any]:
    # Image-level settings (fleet role, NCCL_SOCKET_IFNAME, CUDA_DEVICE_ORDER, ...) reach remote actors.
    return {"env_vars": {k: v for k, v in env.items() if not k.startswith("RAY_")}}


def node_argv(
    resources: Mapping[str, float],
    *,
    address: str | None = None,
    port: int = 6379,
    temp_dir: str | None = None,
    ray_bin: str | None = None,
) -> list[str]:
    """``ray start --block`` for a fleet node: a head on ``port`` (``address`` None) or a
    node joining ``address``, registering this node's topology resources."""
    argv = [
        ray_bin or str(Path(sys.executable).with_name("ray")),
        "start",
        "--block",
        "--disable-usage-stats",
    ]
    argv += [f"--address={address}"] if address else ["--head", f"--port={port}", "--include-dashboard=false"]
    if resources:
        argv.append(f"--resources={json.dumps(dict(resources), sort_keys=True)}")
    if temp_dir:
        argv.append(f"--temp-dir={temp_dir}")
    return argv


def _start_head(key: str, env: Mapping[str, str], state: Path) -> str:
    """Start a persistent local head for this device set; its address (kept in ``state``)."""
    temp = Path(f"/tmp/flodl-ray-{key}")
    ray_bin = Path(sys.executable).with_name("ray")
    argv = [str(ray_bin), "start", "--head", "--port=0", f"--temp-dir={temp}", "--disable-usage-stats"]
    gpus = env.get("CUDA_VISIBLE_DEVICES")
    if gpus is not None:
        argv.append(f"--num-gpus={len([g for g in gpus.split(',') if g.strip()])}")
    proc = subprocess.run(argv, capture_output=True, text=True, env=dict(env), check=False)
    if proc.returncode != 0:
        raise PlacementError(
            f"ray start failed: {proc.stderr.strip()[-300:]}", "see `ray status`; is a port free?"
        )
    address_file = temp / "ray_current_cluster"
    address = address_file.read_text().strip() if address_file.exists() else ""
    if not address:
        raise PlacementError("ray start did not say where the head is", f"look in {temp}")
    state.mkdir(parents=True, exist_ok=True)
    (state / f"{key}.json").write_text(json.dumps({"address": address, "devices": gpus}))
    return address


def _answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except (OSError, ValueError):
        return False
    return True


def init_ray(env: Mapping[str, str] | None = None, state: Path | None = None) -> str:
    """Connect this process to Ray; the address it attached to."""
    ray = ray_module()
    env = dict(os.environ if env is None else env)
    runtime_env = _runtime_env(env)
    if env.get("RAY_ADDRESS"):
        ray.init(address=env["RAY_ADDRESS"], runtime_env=runtime_env, ignore_reinit_error=True)
        return env["RAY_ADDRESS"]
    state = (state or STATE).expanduser()
    key = local_key(env)
    recorded = state / f"{key}.json"
    if recorded.exists():
        address = str(json.loads(recorded.read_text())["address"])
        # ray.init retries a dead address for minutes: ask its port first.
        if _answers(address):
            try:
                ray.init(address=address, runtime_env=runtime_env, ignore_reinit_error=True)
                return address
            except (ConnectionError, RuntimeError, ValueError):
                pass
        recorded.unlink()  # that head is gone: start a fresh one
    address = _start_head(key, env, state)
    ray.init(address=address, runtime_env=runtime_env, ignore_reinit_error=True)
    return address


def get_ray_cluster_topology() -> dict[str, tuple[str, int]]:
    """node id -> (NVLink domain, topological rank), read from the live cluster."""
    return decode_topology(ray_module().nodes())


class RayVirtualCluster:
    """Placement groups for a worker group: per-node STRICT_PACK, or one unified cross-node group."""

    def __init__(
        self,
        bundle_ct_per_node_list: Sequence[int],
        use_gpus: bool = True,
        num_gpus_per_node: int = 8,
        placement_group_strategy: Strategy = "SPREAD",
        max_colocated_worker_groups: int = 1,
        unified: bool = False,
        name: str = "flodl",
        node_domains: Sequence[str] | None = None,
    ) -> None:
        """``node_domains``: per logical node, the NVLink domain its bundles are pinned to
        (from a segment selection); ``unified``: one group over every bundle."""
        if any(count < 1 for count in bundle_ct_per_node_list):
            raise PlacementError(
                f"bundle counts {list(bundle_ct_per_node_list)}: every node needs a bundle", ""
            )
        if use_gpus and any(count > num_gpus_per_node for count in bundle_ct_per_node_list):
            raise PlacementError(
                f"bundle counts {list(bundle_ct_per_node_list)} exceed {num_gpus_per_node} GPUs per node",
                "one bundle per GPU: at most num_gpus_per_node bundles a node",
            )
        if node_domains is not None and len(node_domains) != len(bundle_ct_per_node_list):
            raise PlacementError("node_domains must name one domain per logical node", "")
        self.bundle_ct_per_node_list = list(bundle_ct_per_node_list)
        self.use_gpus = use_gpus
        self.num_gpus_per_node = num_gpus_per_node
        self.placement_group_strategy = placement_group_strategy
        self.max_colocated_worker_groups = max_colocated_worker_groups
        self.unified = unified
        self.name = name
        self.node_domains = list(node_domains) if node_domains is not None else None
        self._groups: list[Any] = []

    def _bundle(self, node: int) -> dict[str, float]:
        bundle = {"CPU": float(self.max_colocated_worker_groups)}
        if self.use_gpus:
            bundle["GPU"] = 1.0
        if self.node_domains is not None:
            bundle[f"{DOMAIN_PREFIX}{self.node_domains[node]}"] = DOMAIN_SHARE
        return bundle

    def bundles(self) -> list[list[dict[str, float]]]:
        """Per group, its bundles (one group per node, or one for all)."""
        per_node = [[self._bundle(i)] * count for i, count in enumerate(self.bundle_ct_per_node_list)]
        return [[b for node in per_node for b in node]] if self.unified else per_node

    def _init_placement_groups(self, timeout: float = READY_TIMEOUT) -> list[Any]:
        """Create the groups and wait (bounded) until Ray placed them; call before any worker."""
        if self._groups:
            return self._groups
        ray = ray_module()
        from ray.util.placement_group import placement_group, remove_placement_group

        strategy = self.placement_group_strategy if self.unified else "STRICT_PACK"
        groups = [
            placement_group(bundles, strategy=strategy, name=f"{self.name}-{i}")
            for i, bundles in enumerate(self.bundles())
        ]
        try:
            ray.get([g.ready() for g in groups], timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            for group in groups:
                remove_placement_group(group)
            raise PlacementError(
                self._unplaceable(ray, strategy, timeout),
                "add nodes with those resources, or ask for fewer (fdl plan checks a request first)",
            ) from None
        self._groups = groups
        return groups

    def _unplaceable(self, ray: Any, strategy: str, timeout: float) -> str:
        wanted: dict[str, float] = {}
        for bundles in self.bundles():
            for bundle in bundles:
                for resource, amount in bundle.items():
                    wanted[resource] = wanted.get(resource, 0.0) + amount
        have = ray.cluster_resources()
        short = [
            f"{resource} {amount:g} (the cluster has {have.get(resource, 0):g})"
            for resource, amount in sorted(wanted.items())
            if have.get(resource, 0.0) < amount
        ]
        groups = self.bundles()

        def shown(bundle: dict[str, float]) -> str:
            return "{" + ", ".join(f"{k} {v:g}" for k, v in bundle.items()) + "}"

        per_node = [f"{len(b)} x {shown(b[0])}" for b in groups]
        missing = "; missing " + ", ".join(short) if short else "; no node has that much free in one place"
        return (
            f"placement groups not ready after {timeout:g}s ({strategy}: {', '.join(per_node[:4])}"
            + (", ..." if len(per_node) > 4 else "")
            + f"){missing}"
        )

    def get_placement_groups(self) -> list[Any]:
        return self._init_placement_groups()

    def shutdown(self) -> None:
        if not self._groups:
            return
        from ray.util.placement_group import remove_placement_group

        for group in self._groups:
            remove_placement_group(group)
        self._groups = []


def build_cluster(
    spec: FleetSpec,
    parallelism: ParallelismSpec | None = None,
    topology: Mapping[str, tuple[str, int]] | None = None,
) -> RayVirtualCluster:
    """The virtual cluster for a fleet role (pre-flight checked; segment-pinned when asked)."""
    if spec.role == "sandbox":
        # Episode slots over CPU nodes: no GPU claimed, never competing with the GPU fleets.
        return RayVirtualCluster(
            [1] * spec.num_nodes,
            use_gpus=False,
            num_gpus_per_node=0,
            placement_group_strategy=spec.placement_strategy,
            max_colocated_worker_groups=spec.max_colocated_worker_groups,
            name=f"flodl-{spec.role}",
        )
    plan = preflight(parallelism or ParallelismSpec(data=spec.total_gpus), spec)
    domains: list[str] | None = None
    if spec.segment_size is not None:
        known = topology if topology is not None else get_ray_cluster_topology()
        chosen, _ = select_segment_nodes(known, spec.segment_size, spec.num_nodes)
        domains = [known[node][0] for node in chosen]
    return RayVirtualCluster(
        plan.bundles_per_node,
        use_gpus=True,
        num_gpus_per_node=spec.gpus_per_node,
        placement_group_strategy=spec.placement_strategy,
        max_colocated_worker_groups=spec.max_colocated_worker_groups,
        unified=plan.unified,
        name=f"flodl-{spec.role}",
        node_domains=domains,
    )


def live_fleet(nodes: list[Mapping[str, Any]]) -> tuple[int, int]:
    """(nodes, GPUs per node) of a live cluster's alive GPU nodes (``ray.nodes()``)."""
    counts = {
        str(n["NodeID"]): int(float((n.get("Resources") or {}).get("GPU", 0)))
        for n in nodes
        if n.get("Alive", True) and float((n.get("Resources") or {}).get("GPU", 0)) > 0
    }
    if not counts:
        raise PlacementError(
            "the Ray cluster has no alive node with GPUs", "start Ray on the GPU nodes first"
        )
    sizes = sorted(set(counts.values()))
    if len(sizes) > 1:
        raise PlacementError(
            f"the Ray cluster's GPU nodes hold {', '.join(map(str, sizes))} GPUs: "
            "placement needs nodes of one size",
            "plan the nodes of each size as their own fleet",
        )
    return len(counts), sizes[0]

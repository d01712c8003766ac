"""``ClusterBuilder``: the cluster file, built in code.

It mirrors ``fdl.cluster.yml`` one to one — each method fills the block of the
same name with the same keys — and validates through the same path as a file,
so a mistake gets the same message either way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .models import Cluster, FdlConfig
from .problems import ConfigError, Problem
from .validate import validate_data


class ClusterBuilder:
    def __init__(self) -> None:
        self._controller: dict[str, Any] | None = None
        self._join: dict[str, Any] = {}
        self._workers: list[dict[str, Any]] = []
        self._env: dict[str, Any] = {}
        self._gpu_ram_share: float | None = None
        self._plane: str | None = None

    def controller(self, host: str, **fields: Any) -> ClusterBuilder:
        """``cluster.controller``: host plus port, path, docker, arch."""
        self._controller = {"host": host, **fields}
        return self

    def join(self, **knobs: Any) -> ClusterBuilder:
        """``cluster.controller.join``: min_rank_start, join_timeout, target_ranks, …"""
        self._join.update(knobs)
        return self

    def elastic(
        self,
        max_ranks: int,
        planes: Iterable[str] = ("cpu",),
        reform_interval: int | None = None,
        replace_timeout: int | None = None,
    ) -> ClusterBuilder:
        """``cluster.controller.join.elastic``: walk-ins join the training world up to
        ``max_ranks``, on these launch planes (a process group re-forming at most every
        ``reform_interval`` seconds, and waiting ``replace_timeout`` seconds for a lost
        host's replacement; None: the defaults)."""
        block: dict[str, object] = {"max_ranks": max_ranks, "planes": list(planes)}
        if reform_interval is not None:
            block["reform_interval"] = reform_interval
        if replace_timeout is not None:
            block["replace_timeout"] = replace_timeout
        self._join["elastic"] = block
        return self

    def worker(self, host: str, **fields: Any) -> ClusterBuilder:
        """One ``cluster.workers`` entry; workers take ranks in the order added."""
        self._workers.append({"host": host, **fields})
        return self

    def env(self, **variables: Any) -> ClusterBuilder:
        """Cluster-scope ``env``, applied to every rank."""
        self._env.update(variables)
        return self

    def gpu_ram_share(self, share: float) -> ClusterBuilder:
        self._gpu_ram_share = share
        return self

    def plane(self, plane: str) -> ClusterBuilder:
        """Cluster-scope ``plane``: ``cpu`` or ``nccl``."""
        self._plane = plane
        return self

    def to_data(self) -> dict[str, Any]:
        """The document a file would hold: ``{"cluster": {...}}``."""
        if self._controller is None:
            raise ConfigError(
                [Problem(("cluster", "controller"), "is required", "call .controller(host=...) first")]
            )
        controller = dict(self._controller)
        if self._join:
            controller["join"] = {**controller.get("join", {}), **self._join}
        cluster: dict[str, Any] = {"controller": controller, "workers": list(self._workers)}
        if self._env:
            cluster["env"] = dict(self._env)
        if self._gpu_ram_share is not None:
            cluster["gpu_ram_share"] = self._gpu_ram_share
        if self._plane is not None:
            cluster["plane"] = self._plane
        return {"cluster": cluster}

    def build(self) -> Cluster:
        config: FdlConfig = validate_data(self.to_data())
        assert config.cluster is not None  # to_data always writes one
        return config.cluster

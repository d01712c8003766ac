"""Filters the flodl roles need: the inventory seen as a cluster file."""

from __future__ import annotations

from typing import Any

DOCUMENTATION = r"""
name: cluster_workers
short_description: Describe inventory hosts as cluster.workers entries
description:
  - Turns the hosts of a group into the C(cluster.workers) list of C(fdl.cluster.yml),
    reading each host's C(flodl_worker_*) variables and, where a value is unset,
    the host's facts (C(nccl_socket_ifname) defaults to the interface of the default route;
    C(local_devices=all) becomes the GPU indices that C(flodl.cluster.gpu_facts) found).
positional: _input, hostvars
options:
  _input:
    description: The host names, in rank order.
    type: list
    elements: str
    required: true
  hostvars:
    description: The play's C(hostvars).
    type: dict
    required: true
"""

EXAMPLES = r"""
- ansible.builtin.set_fact:
    workers: "{{ groups['flodl_workers'] | flodl.cluster.cluster_workers(hostvars) }}"
"""

RETURN = r"""
_value:
  description: One mapping per host, with the keys of a cluster.workers entry.
  type: list
  elements: dict
"""

_OPTIONAL = {
    "flodl_worker_home": "path",
    "flodl_worker_data_path": "data_path",
    "flodl_worker_env": "env",
    "flodl_worker_gpu_ram_share": "gpu_ram_share",
}


def cluster_workers(hosts: list[str], hostvars: Any) -> list[dict[str, Any]]:
    workers = []
    for host in hosts:
        hv = hostvars[host]
        facts = hv.get("ansible_facts") or {}
        devices = hv.get("flodl_worker_local_devices", "all")
        gpus = facts.get("flodl_gpu_count") or 0
        if devices == "all" and gpus:
            devices = list(range(gpus))  # probed: the cluster file carries the real count
        entry: dict[str, Any] = {"host": hv.get("flodl_worker_host_name") or host, "local_devices": devices}
        ifname = hv.get("flodl_worker_nccl_socket_ifname") or (facts.get("default_ipv4") or {}).get(
            "interface"
        )
        if ifname:
            entry["nccl_socket_ifname"] = ifname
        variant = hv.get("flodl_worker_libtorch", "cpu")
        if variant and variant != "auto":
            entry["arch"] = variant
        for var, key in _OPTIONAL.items():
            value = hv.get(var)
            if value not in (None, "", {}, []):
                entry[key] = value
        entry["ssh"] = {"target": str(hv.get("ansible_host") or host)}
        workers.append(entry)
    return workers


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"cluster_workers": cluster_workers}

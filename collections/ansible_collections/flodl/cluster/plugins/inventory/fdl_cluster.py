"""Read an fdl.cluster.yml as an Ansible inventory (the roles' template, in reverse)."""

from __future__ import annotations

DOCUMENTATION = r"""
name: fdl_cluster
short_description: Use an fdl.cluster.yml as an inventory
description:
  - Reads a flodl cluster file (validated by flodl itself, so a broken file is reported with
    its line and the fix) and turns it into an inventory - the controller in the
    C(flodl_controllers) group, the workers in C(flodl_workers), in rank order, with the
    C(flodl_controller_*) and C(flodl_worker_*) variables the roles take.
  - The round trip of C(flodl_controller)'s template - inventory to cluster file and back.
  - ssh options that turn off host key checking are dropped (with a warning), never passed on.
  - A worker's C(arch) becomes C(flodl_worker_libtorch) when it is a variant the worker role
    installs (C(cpu), C(cuNNN), C(rocmX.Y)); a sub-path such as C(precompiled/cu128) has no role
    equivalent and is left out, with a warning.
  - A worker's C(docker) (the compose service its ranks run in) becomes C(flodl_worker_docker) and
    a true C(tunnel) becomes C(flodl_worker_tunnel). Both are only carried as host facts for now -
    no role reads them yet.
options:
  plugin:
    description: The name of this plugin.
    required: true
    choices: [flodl.cluster.fdl_cluster]
  path:
    description: The cluster file, relative to this configuration file or absolute.
    required: true
    type: str
  controller_name:
    description: Inventory name of the controller (the cluster file names only its bind address).
    type: str
    default: controller
"""

EXAMPLES = r"""
# fleet.fdl_cluster.yml, then: ansible-inventory -i fleet.fdl_cluster.yml --graph
plugin: flodl.cluster.fdl_cluster
path: fdl.cluster.yml
"""

import re
import shlex
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleParserError
from ansible.plugins.inventory import BaseInventoryPlugin
from ansible.utils.display import Display

display = Display()
_VARIANT = re.compile(r"^(cpu|cu\d{3}|rocm[\d.]+)$")
# Host variables this plugin sets that no role reads (nor declares) yet: carried as facts for
# what comes next. tests/unit/test_role_specs.py lets exactly these stay out of the argument
# specs, and fails once a role declares one (then it leaves this list).
CARRIED_ONLY = ("flodl_worker_docker", "flodl_worker_tunnel")


def _libtorch(name: str, arch: str | None) -> str | None:
    """cluster.workers[].arch as the role's flodl_worker_libtorch, when the role can install it."""
    if arch is None or _VARIANT.match(arch):
        return arch
    display.warning(
        f"fdl_cluster: {name}: arch `{arch}` is not a variant the worker role installs "
        "(cpu, cuNNN, rocmX.Y); flodl_worker_libtorch left unset"
    )
    return None


class InventoryModule(BaseInventoryPlugin):
    NAME = "flodl.cluster.fdl_cluster"

    def verify_file(self, path: str) -> bool:
        return super().verify_file(path) and path.endswith(("fdl_cluster.yml", "fdl_cluster.yaml"))

    def parse(self, inventory: Any, loader: Any, path: str, cache: bool = True) -> None:
        super().parse(inventory, loader, path, cache)
        self._read_config_data(path)
        cluster_file = Path(self.get_option("path")).expanduser()
        if not cluster_file.is_absolute():
            cluster_file = Path(path).parent / cluster_file
        try:
            from flodl_agent.config import ConfigError, load_config
        except ImportError as exc:
            raise AnsibleParserError(
                f"fdl_cluster needs flodl-fleet where Ansible runs (pip install flodl-fleet): {exc}"
            ) from None
        try:
            cluster = load_config(cluster_file).config.cluster
        except ConfigError as exc:
            raise AnsibleParserError(f"{cluster_file} is not a valid cluster file:\n{exc.render()}") from None
        if cluster is None:
            raise AnsibleParserError(f"{cluster_file} has no cluster: block")
        self._add_controller(cluster)
        self.inventory.add_group("flodl_workers")
        for worker in cluster.workers:
            self._add_worker(worker)

    def _add_controller(self, cluster: Any) -> None:
        ctl = cluster.controller
        name = self.get_option("controller_name")
        self.inventory.add_group("flodl_controllers")
        self.inventory.add_host(name, group="flodl_controllers")
        from flodl_agent.address import is_bind_all, is_loopback

        if not (is_loopback(ctl.host) or is_bind_all(ctl.host)):  # a bind address, not a way in
            self.inventory.set_variable(name, "ansible_host", ctl.host)
        values = {
            "flodl_controller_bind": ctl.host,
            "flodl_controller_port": ctl.port,
            "flodl_controller_home": ctl.path,
            "flodl_controller_join": ctl.join.model_dump(exclude_defaults=True),
            "flodl_controller_cluster_env": dict(cluster.env),
            "flodl_controller_gpu_ram_share": cluster.gpu_ram_share,
        }
        for key, value in values.items():
            if value not in (None, {}, ""):
                self.inventory.set_variable(name, key, value)

    def _add_worker(self, worker: Any) -> None:
        name = worker.host
        self.inventory.add_host(name, group="flodl_workers")
        ssh = worker.ssh
        values: dict[str, Any] = {
            "ansible_host": ssh.target if ssh and ssh.target else None,
            "ansible_port": ssh.port if ssh else None,
            "ansible_user": ssh.user if ssh else None,
            "ansible_ssh_private_key_file": ssh.identity_file if ssh else None,
            "flodl_worker_local_devices": worker.local_devices.to_data(),
            "flodl_worker_nccl_socket_ifname": worker.nccl_socket_ifname,
            "flodl_worker_home": worker.path,
            "flodl_worker_libtorch": _libtorch(name, worker.arch),
            "flodl_worker_docker": worker.docker,
            "flodl_worker_tunnel": True if worker.tunnel else None,
            "flodl_worker_data_path": worker.data_path,
            "flodl_worker_env": dict(worker.env) or None,
            "flodl_worker_gpu_ram_share": worker.gpu_ram_share,
        }
        if ssh and ssh.options:
            from flodl_agent.config.validate import downgrades_host_keys  # one rule for both

            kept = [o for o in ssh.options if not downgrades_host_keys(o)]
            for dropped in set(ssh.options) - set(kept):
                display.warning(f"fdl_cluster: {name}: dropped `{dropped}`: host keys stay pinned")
            if kept:
                values["ansible_ssh_common_args"] = " ".join(f"-o {shlex.quote(o)}" for o in kept)
        for key, value in values.items():
            if value is not None:
                self.inventory.set_variable(name, key, value)

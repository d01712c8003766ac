"""The cluster file's blocks: the controller, its workers, and how ssh reaches a host."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .devices import DeviceOffer
from .fields import (
    DEFAULT_PORT,
    AbsPath,
    Address,
    Devices,
    Env,
    HostName,
    IfName,
    Model,
    Name,
    OsText,
    Port,
    Service,
    Share,
    SshOption,
    Variant,
    check,
)
from .join_window import LOCKED_OUT_FIX, JoinWindow, locked_out_message, locks_walk_ins_out
from .problems import Rule


class Ssh(Model):
    """How to reach a host over ssh; every key optional."""

    target: Address | None = Field(None, description="ssh destination host (default: the worker's host)")
    port: Port | None = Field(None, description="sshd port (1-65535)")
    user: Name | None = Field(None, description="remote user name")
    identity_file: OsText | None = Field(None, description="private key file")
    options: list[SshOption] = Field(
        default_factory=list, description="extra `ssh -o` options as Name=value strings"
    )


class Tls(Model):
    """cluster.controller.tls: serve the controller port over TLS with this certificate."""

    cert: AbsPath = Field(description="PEM certificate (self-signed is the norm: clients pin it)")
    key: AbsPath = Field(description="its PEM private key")


class Controller(Model):
    """cluster.controller: the host that runs the window; never a rank itself."""

    host: Address = Field(description="bind address of the controller port")
    port: Port = Field(DEFAULT_PORT, description="the single controller port")
    path: AbsPath | None = Field(None, description="the controller's view of the project root")
    docker: Service | None = Field(None, description="compose service the publish gate builds in")
    arch: Variant | None = Field(
        None, description="torch variant the publish gate builds with (<path>/libtorch/<arch>)"
    )
    join: JoinWindow = Field(default_factory=JoinWindow, description="membership-window knobs")
    tls: Tls | None = Field(None, description="TLS on the controller port (clients pin the certificate)")


class Worker(Model):
    """One entry of cluster.workers: a rank-carrying host."""

    host: HostName = Field(description="worker identifier in the roster; default ssh target")
    ssh: Ssh | None = Field(None, description="how to reach this host over ssh")
    tunnel: bool = Field(False, description="route training traffic through the ssh session (CPU modes only)")
    local_devices: Devices = Field(DeviceOffer("all"), description="devices offered, one rank each")
    nccl_socket_ifname: IfName | None = Field(
        None, description="network interface for NCCL/gloo; required when the cluster spans hosts"
    )
    path: AbsPath | None = Field(None, description="project checkout dir on this host")
    arch: Variant | None = Field(None, description="torch variant sub-path under <path>/libtorch/")
    docker: Service | None = Field(None, description="compose service this host's ranks run in")
    data_path: AbsPath | None = Field(None, description="dataset root on this host")
    env: Env = Field(default_factory=dict, description="environment for this host's ranks")
    gpu_ram_share: Share | None = Field(
        None, description="APU hosts: fraction of RAM the integrated GPU claims"
    )

    @property
    def capacity(self) -> int | None:
        return self.local_devices.capacity


class Cluster(Model):
    """The cluster block: the controller and its configured workers."""

    controller: Controller = Field(description="the controller host")
    workers: list[Worker] = Field(default_factory=list, description="rank-carrying hosts, in rank order")
    env: Env = Field(default_factory=dict, description="environment for every rank")
    gpu_ram_share: Share | None = Field(None, description="fleet default for APU hosts")
    plane: Literal["cpu", "nccl"] | None = Field(
        None, description="data plane: cpu (through the controller; tunnels too) or nccl (default: cpu)"
    )

    @model_validator(mode="after")
    def _rules(self) -> Cluster:
        rules: list[Rule] = self.plane_rules(self.plane or "cpu")
        if not self.workers and not self.controller.join.discovery:
            rules.append(
                (
                    ("workers",),
                    "lists no worker",
                    "add a worker, or set cluster.controller.join.discovery: true to let workers walk in",
                )
            )
        if not self.workers and locks_walk_ins_out(self.controller.join, self.controller.host):
            # Nothing could ever be admitted: a file that cannot work is an error, not a warning.
            rules.append(
                (
                    ("controller", "join", "discovery"),
                    locked_out_message(self.controller.host, 0),
                    LOCKED_OUT_FIX,
                )
            )
        first: dict[str, int] = {}
        for i, worker in enumerate(self.workers):
            if worker.host in first:
                rules.append(
                    (
                        ("workers", i, "host"),
                        f"`{worker.host}` is already cluster.workers[{first[worker.host]}].host",
                        "worker host names identify roster entries; make each unique",
                    )
                )
            first.setdefault(worker.host, i)
        if len(self.workers) > 1:
            for i, worker in enumerate(self.workers):
                if worker.nccl_socket_ifname is None:
                    rules.append(
                        (
                            ("workers", i, "nccl_socket_ifname"),
                            f"is required when the cluster spans hosts ({len(self.workers)} workers)",
                            "name the interface this host reaches the others on, e.g. eth0 "
                            "(see `ip -br addr`)",
                        )
                    )
        check(rules)
        return self

    def plane_rules(self, plane: str) -> list[Rule]:
        """What an NCCL plane cannot carry (empty for cpu): tunnels, which forward the
        hub-and-spoke CPU plane but no mesh, and CPU ranks, which admission would refuse."""
        if plane != "nccl":
            return []
        cpu_mode = "or run a CPU mode (plane: cpu, or fdl launch --plane cpu)"
        rules: list[Rule] = []
        if self.controller.join.tunnel_only:
            rules.append(
                (
                    ("controller", "join", "tunnel_only"),
                    "admits through the ssh door alone, and a tunnel carries only the CPU plane: "
                    "`plane: nccl` needs a mesh between the hosts",
                    f"drop tunnel_only (walk-ins then dial the controller directly), {cpu_mode}",
                )
            )
        for i, worker in enumerate(self.workers):
            if worker.tunnel:
                rules.append(
                    (
                        ("workers", i, "tunnel"),
                        "a tunnel carries only the CPU plane: `plane: nccl` needs a mesh between the "
                        "hosts, which a port forward cannot carry",
                        f"drop tunnel (the host reaches the others directly), {cpu_mode}",
                    )
                )
            if worker.local_devices.kind == "cpu":
                rules.append(
                    (
                        ("workers", i, "local_devices"),
                        f"offers CPU ranks ({worker.local_devices}), which an NCCL plane refuses",
                        f"offer GPUs (all, or a list of indices), {cpu_mode}",
                    )
                )
        return rules

    def host_facts(self, host: str | None) -> dict[str, object]:
        """What this file says of one host, for its envelope: a roster worker's own entry
        over the cluster's defaults (a name in no entry, or ``None``: a walk-in's defaults)."""
        worker = next((w for w in self.workers if w.host == host), None)
        facts: dict[str, object] = {}
        if worker is not None and worker.docker:
            facts["docker"] = worker.docker
        share = worker.gpu_ram_share if worker is not None else None
        if share is None:
            share = self.gpu_ram_share
        if share is not None:
            facts["gpu_ram_share"] = share
        return facts

    @property
    def capacity(self) -> int | None:
        """Configured ranks, or ``None`` while a worker offers ``all`` unprobed."""
        total = 0
        for worker in self.workers:
            if worker.capacity is None:
                return None
            total += worker.capacity
        return total

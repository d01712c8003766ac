"""The join block of fdl.yml: the defaults of every `fdl join` flag, and join.source."""

from __future__ import annotations

from pydantic import Field, model_validator

from .cluster import Ssh
from .fields import (
    AbsPath,
    ControllerAddress,
    DataSourceText,
    Devices,
    Env,
    Fingerprint,
    HostKey,
    HostName,
    IfName,
    Libtorch,
    Model,
    OsText,
    Service,
    Share,
    SourceSpecText,
    Token,
    TorchSources,
    check,
)
from .problems import Rule


class Source(Model):
    """join.source: fetch a tree and build the entry point on this box."""

    from_: SourceSpecText = Field(alias="from", description="source spec (file://, rsync://, git+…#ref)")
    cwd: OsText | None = Field(None, description="project dir inside the tree; governs build and run")
    build: OsText | None = Field(None, description="shell line that builds the entry point")
    bin: OsText | None = Field(None, description="entry point, relative to cwd")


class Join(Model):
    """The join block of fdl.yml: the defaults of every `fdl join` flag."""

    controller: ControllerAddress | None = Field(
        None, description="controller address host[:port] (as seen from the ssh host under ssh:)"
    )
    token: Token | None = Field(None, description="the run's join.token")
    host_key: HostKey | None = Field(
        None, description="this box's own key, derived from the run's token for join.host (site.yml)"
    )
    ssh: Ssh | None = Field(None, description="dial through this sshd with a local forward")
    host: HostName | None = Field(None, description="this box's name in the roster (default: hostname)")
    devices: Devices | None = Field(None, description="devices offered (default: every GPU)")
    bin: OsText | None = Field(
        None, description="this box's own entry point: with args, its ranks' command (not the launch's)"
    )
    args: list[OsText] = Field(
        default_factory=list, description="arguments for bin (or source's entry), verbatim"
    )
    persist: bool = Field(False, description="re-dial with backoff whenever the agent exits")
    controller_grace: int | None = Field(
        None,
        ge=0,
        le=86400,
        description="seconds this box's ranks train on when the controller goes away, re-dialling "
        "to resume (default: the launch's; 0: they stop at once)",
    )
    model_probe: bool = Field(
        True, description="before each dial, probe the model this box's own entry builds (bin, source)"
    )
    data_path: AbsPath | None = Field(None, description="the local data root this box's ranks read")
    data_source: DataSourceText | None = Field(
        None, description="mount data_path read-only from here when it is not there"
    )
    gpu_ram_share: Share | None = Field(None, description="APU boxes: RAM fraction the GPU claims")
    libtorch: Libtorch | None = Field(
        None, description="torch variant: auto, cpu, cu126, rocm6.4…; picked (and acquired) at join"
    )
    torch_sources: TorchSources = Field(
        default_factory=dict,
        description="where join acquires a variant: variant -> pip index URL or wheelhouse dir",
    )
    source: Source | None = Field(None, description="fetch and build the entry point here")
    nccl_socket_ifname: IfName | None = Field(None, description="network interface for NCCL/gloo")
    env: Env = Field(default_factory=dict, description="environment for this box's ranks")
    docker: Service | None = Field(
        None, description="compose service this box's ranks run in (beats the cluster file's)"
    )
    tls_fingerprint: Fingerprint | None = Field(
        None, description="the controller port speaks TLS: pin its certificate (sha256:<hex>)"
    )

    @model_validator(mode="after")
    def _rules(self) -> Join:
        rules: list[Rule] = []
        if self.bin is not None and self.source is not None:
            rules.append(
                (
                    ("bin",),
                    "`bin` and `source` are alternatives: bin runs an entry point as given, "
                    "source fetches and builds one",
                    "keep one; the built entry point is named by source.bin or the run manifest",
                )
            )
        if self.args and self.bin is None and self.source is None:
            rules.append(
                (
                    ("args",),
                    "are arguments for this box's own entry point, and none is named",
                    "set join.bin (or join.source), or drop args to run the launch command",
                )
            )
        if self.data_source is not None and self.data_path is None:
            rules.append(
                (
                    ("data_path",),
                    "is required with data_source: it is where the mount goes up",
                    "set data_path to the local mount point, e.g. /flodl/data",
                )
            )
        if self.host_key is not None and self.token is not None:
            rules.append(
                (
                    ("host_key",),
                    "and `token` are alternatives: the token proves any name, a host key one",
                    "keep host_key on a provisioned worker (site.yml writes it), or token alone",
                )
            )
        if self.host_key is not None and self.host is None:
            rules.append(
                (
                    ("host_key",),
                    "is the key of one host name, and join.host does not say which",
                    "set join.host to the name the key was derived for (site.yml writes both)",
                )
            )
        if self.ssh is not None and self.ssh.target is None:
            rules.append(
                (
                    ("ssh", "target"),
                    "is required: it is the box whose sshd forwards to the controller",
                    "set join.ssh.target to the controller box, e.g. ctrl.example.com",
                )
            )
        check(rules)
        return self

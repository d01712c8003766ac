"""The typed schema of ``fdl.yml`` and ``fdl.cluster.yml``.

Field-level checks live on the types; rules that tie fields together live in
``model_validator``s and report the exact field they blame. Every failure is a
``PydanticCustomError`` of type ``flodl`` whose context carries the message,
the fix and, for rules, the path relative to the model that raised it — the
translation in :mod:`.validate` turns those into :class:`Problem`s.
"""

from __future__ import annotations

import re
import shlex
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    WithJsonSchema,
    model_validator,
)

from ..net import AddressError, split_address
from ..sources import SpecError, parse_data_source, parse_source
from .devices import DEVICES_JSON_SCHEMA, DeviceOffer, dump_devices, parse_devices
from .problems import Rule, fail

DEFAULT_PORT = 1337
DEFAULT_JOIN_TIMEOUT = 300
DEFAULT_MAX_JOIN_TIMEOUT = 600

# The agent sets these per rank; a user value would silently break device
# scoping or rank identity, so they are refused rather than overwritten.
VISIBILITY_MASKS = frozenset(
    {"CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL"}
)
RANK_IDENTITY = frozenset(
    {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}
)
RESERVED_PREFIX = "FLODL_INTERNAL_"


def _check(rules: list[Rule]) -> None:
    if rules:
        raise fail(*rules)


# --- field types -------------------------------------------------------------

_NAME = re.compile(r"^[^\s/\\:@]+$")


def _name(value: str) -> str:
    if not value:
        raise fail(((), "is empty", "give it a name"))
    if not _NAME.match(value):
        raise fail(((), f"`{value}` is not a host name", "use a name without spaces, `/`, `:` or `@`"))
    return value


def _address(value: str) -> str:
    if not value or any(c.isspace() for c in value):
        raise fail(((), f"`{value}` is not an address", "write a host name or IP address"))
    return value


def _abs_path(value: str) -> str:
    if not value.startswith("/"):
        raise fail(((), f"`{value}` is not an absolute path", "write the full path from /"))
    return value


def _variant(value: str) -> str:
    parts = value.split("/")
    if not value or value.startswith("/") or ".." in parts or "" in parts:
        raise fail(
            (
                (),
                f"`{value}` is not a variant sub-path",
                "name a path under <path>/libtorch/, e.g. precompiled/cu128",
            )
        )
    return value


def _token(value: str) -> str:
    if not re.fullmatch(r"[0-9a-fA-F]{32}", value):
        raise fail(
            (
                (),
                f"must be 32 hex characters (got {len(value)} characters)",
                "generate one with: python3 -c 'import secrets; print(secrets.token_hex(16))'",
            )
        )
    return value.lower()


def _fingerprint(value: str) -> str:
    from ..tls import normalize

    try:
        return normalize(value)
    except ValueError:
        raise fail(
            (
                (),
                "is not a SHA-256 certificate fingerprint",
                "write sha256:<64 hex> (fdl tls fingerprint CERT prints it) or AB:CD:… as openssl prints",
            )
        ) from None


_IFNAME = re.compile(r"^[A-Za-z0-9_.@-]{1,15}$")


def _ifname(value: str) -> str:
    # NCCL's syntax: a comma list, optionally prefixed `^` (exclude) or `=` (exact).
    body = value[1:] if value[:1] in ("^", "=") else value
    items = body.split(",")
    if not body or not all(_IFNAME.match(i) for i in items):
        raise fail(
            (
                (),
                f"`{value}` is not a network interface name",
                "name the interface as `ip -br link` shows it, e.g. eth0 (NCCL also takes "
                "`^lo,docker0` to exclude or `=eth0` for an exact match)",
            )
        )
    return value


def _coerce_env(value: Any) -> Any:
    # `NCCL_SOCKET_NTHREADS: 2` is meant as the string "2"; booleans are
    # ambiguous (True? 1? yes?) and must be quoted.
    if isinstance(value, dict):
        return {
            k: str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
            for k, v in value.items()
        }
    return value


_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _env(value: dict[str, str]) -> dict[str, str]:
    rules: list[Rule] = []
    for key in value:
        if not _ENV_KEY.match(key):
            rules.append(
                ((key,), f"`{key}` is not an environment variable name", "use letters, digits and _")
            )
        elif key in VISIBILITY_MASKS:
            rules.append(
                (
                    (key,),
                    f"`{key}` is reserved: the agent scopes each rank to its own device",
                    "drop it; choose devices with local_devices (or join.devices / --devices)",
                )
            )
        elif key in RANK_IDENTITY:
            rules.append(((key,), f"`{key}` is reserved: the agent sets it for every rank", "drop it"))
        elif key.startswith(RESERVED_PREFIX):
            rules.append(((key,), f"`{key}` is reserved for flodl's own plumbing", "drop it"))
    _check(rules)
    return value


def _share(value: float) -> float:
    if not value > 0:
        raise fail(
            (
                (),
                f"must be positive (got {value})",
                "give the fraction of RAM the integrated GPU claims, e.g. 0.5",
            )
        )
    return value


def _ssh_option(value: str) -> str:
    if not re.match(r"^[A-Za-z][A-Za-z0-9]*(=|\s+)\S", value):
        raise fail(((), f"`{value}` is not an ssh option", "write Name=value, e.g. ProxyJump=bastion"))
    return value


def _libtorch(value: str) -> str:
    if not re.fullmatch(r"auto|cpu|cu\d{3}|rocm\d+(\.\d+)*", value):
        raise fail(
            (
                (),
                f"`{value}` is not a torch variant",
                "use auto, cpu, a CUDA variant like cu126 or cu128, or a ROCm one like rocm6.4",
            )
        )
    return value


def _spec(parse: Any) -> Any:
    def check(value: str) -> str:
        try:
            parse(value)
        except SpecError as exc:
            raise fail(((), exc.message, exc.fix)) from None
        return value

    return check


def _command_name(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", value):
        raise fail(((), f"`{value}` is not a command name", "use letters, digits, - and _"))
    return value


def _split_command(value: Any) -> Any:
    # A string is split the way a shell would; a list is taken as argv.
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as exc:
            raise fail(((), f"cannot split `{value}`: {exc}", "balance the quotes")) from None
    return value


def _command_line(value: list[str]) -> list[str]:
    if not value:
        raise fail(((), "is empty", "give the entry point and its arguments, e.g. python train.py"))
    return value


def _controller_address(value: str) -> str:
    try:
        split_address(value)
    except AddressError as exc:
        raise fail(
            (
                (),
                str(exc).split(":")[0] + " is not a controller address",
                "write host[:port], e.g. 10.0.0.1:1337",
            )
        ) from None
    return value


Name = Annotated[str, AfterValidator(_name)]
Address = Annotated[str, AfterValidator(_address)]
AbsPath = Annotated[str, AfterValidator(_abs_path)]
Variant = Annotated[str, AfterValidator(_variant)]
Token = Annotated[str, AfterValidator(_token)]
Fingerprint = Annotated[str, AfterValidator(_fingerprint)]
IfName = Annotated[str, AfterValidator(_ifname)]
Env = Annotated[dict[str, str], BeforeValidator(_coerce_env), AfterValidator(_env)]
Share = Annotated[float, AfterValidator(_share)]
Port = Annotated[int, Field(ge=1, le=65535)]
Seconds = Annotated[int, Field(gt=0)]
Ranks = Annotated[int, Field(ge=1)]
SshOption = Annotated[str, AfterValidator(_ssh_option)]
Libtorch = Annotated[str, AfterValidator(_libtorch)]
SourceSpecText = Annotated[str, AfterValidator(_spec(parse_source))]
DataSourceText = Annotated[str, AfterValidator(_spec(parse_data_source))]
ControllerAddress = Annotated[str, AfterValidator(_controller_address)]
CommandName = Annotated[str, AfterValidator(_command_name)]
CommandLine = Annotated[list[str], BeforeValidator(_split_command), AfterValidator(_command_line)]
Devices = Annotated[
    DeviceOffer,
    PlainValidator(parse_devices),
    PlainSerializer(dump_devices, return_type=list[int] | str),
    WithJsonSchema(DEVICES_JSON_SCHEMA),
]


class _Model(BaseModel):
    model_config = ConfigDict(
        strict=True, extra="forbid", frozen=True, populate_by_name=True, validate_default=False
    )


# --- cluster file ------------------------------------------------------------


class Ssh(_Model):
    """How to reach a host over ssh; every key optional."""

    target: Address | None = Field(None, description="ssh destination host (default: the worker's host)")
    port: Port | None = Field(None, description="sshd port (1-65535)")
    user: Name | None = Field(None, description="remote user name")
    identity_file: str | None = Field(None, description="private key file")
    options: list[SshOption] = Field(
        default_factory=list, description="extra `ssh -o` options as Name=value strings"
    )


class JoinWindow(_Model):
    """cluster.controller.join: how the membership window admits and closes."""

    min_rank_start: Ranks | None = Field(
        None, description="quorum, in ranks (default: the configured capacity)"
    )
    join_timeout: Seconds = Field(DEFAULT_JOIN_TIMEOUT, description="window length in seconds")
    target_ranks: Ranks | None = Field(
        None, description="close early once this many ranks joined (default: the configured capacity)"
    )
    max_join_timeout: Seconds = Field(
        DEFAULT_MAX_JOIN_TIMEOUT, description="hard cap in seconds on waiting and on the staging hold"
    )
    open_admission: bool = Field(
        False, description="hand the session salt to any peer that reaches a network bind"
    )
    start: Literal["auto", "manual", "hybrid"] = Field(
        "auto", description="auto: the clock forms the world; manual: `fdl start` does; hybrid: either"
    )
    discovery: bool = Field(False, description="no roster: the world is whoever walked in")
    tunnel_only: bool = Field(
        False, description="under discovery, admit only through the guardrailed sshd (loopback bind)"
    )
    token: Token | None = Field(
        None, description="32 hex characters; replaces the per-run session salt as the join key"
    )

    @model_validator(mode="after")
    def _rules(self) -> JoinWindow:
        rules: list[Rule] = []
        if self.token is not None and self.open_admission:
            rules.append(
                (
                    ("open_admission",),
                    "contradicts `token`: a configured token always forces credential-checked admission",
                    "drop open_admission, or drop token to admit without credentials",
                )
            )
        if self.start == "manual" and self.target_ranks is not None:
            rules.append(
                (
                    ("target_ranks",),
                    "is refused under `start: manual`: only `fdl start` or max_join_timeout ends the hold",
                    "drop target_ranks, or use `start: hybrid` to let the target fire the start too",
                )
            )
        if (
            self.target_ranks is not None
            and self.min_rank_start is not None
            and self.target_ranks < self.min_rank_start
        ):
            rules.append(
                (
                    ("target_ranks",),
                    f"({self.target_ranks}) is below min_rank_start ({self.min_rank_start}): "
                    "the window would aim to close before quorum",
                    f"set target_ranks to at least {self.min_rank_start}",
                )
            )
        if self.max_join_timeout < self.join_timeout:
            rules.append(
                (
                    ("max_join_timeout",),
                    f"({self.max_join_timeout}s) is below join_timeout ({self.join_timeout}s): "
                    "the hard cap would cut the window short",
                    f"set max_join_timeout to at least {self.join_timeout}",
                )
            )
        if self.discovery and self.min_rank_start is None:
            rules.append(
                (
                    ("min_rank_start",),
                    "is required under `discovery: true`: with no roster there is no capacity to "
                    "default the quorum to",
                    "set min_rank_start to the fewest ranks worth starting",
                )
            )
        if self.tunnel_only and not self.discovery:
            rules.append(
                (
                    ("tunnel_only",),
                    "only applies under `discovery: true`",
                    "set discovery: true, or drop tunnel_only",
                )
            )
        _check(rules)
        return self


class Tls(_Model):
    """cluster.controller.tls: serve the controller port over TLS with this certificate."""

    cert: AbsPath = Field(description="PEM certificate (self-signed is the norm: clients pin it)")
    key: AbsPath = Field(description="its PEM private key")


class Controller(_Model):
    """cluster.controller: the host that runs the window; never a rank itself."""

    host: Address = Field(description="bind address of the controller port")
    port: Port = Field(DEFAULT_PORT, description="the single controller port")
    path: AbsPath | None = Field(None, description="the controller's view of the project root")
    docker: Name | None = Field(None, description="compose service for the pre-flight build")
    arch: Variant | None = Field(None, description="torch variant for the pre-flight build")
    join: JoinWindow = Field(default_factory=JoinWindow, description="membership-window knobs")
    tls: Tls | None = Field(None, description="TLS on the controller port (clients pin the certificate)")


class Worker(_Model):
    """One entry of cluster.workers: a rank-carrying host."""

    host: Name = Field(description="worker identifier in the roster; default ssh target")
    ssh: Ssh | None = Field(None, description="how to reach this host over ssh")
    tunnel: bool = Field(False, description="route training traffic through the ssh session (CPU modes only)")
    local_devices: Devices = Field(DeviceOffer("all"), description="devices offered, one rank each")
    nccl_socket_ifname: IfName | None = Field(
        None, description="network interface for NCCL/gloo; required when the cluster spans hosts"
    )
    path: AbsPath | None = Field(None, description="project checkout dir on this host")
    arch: Variant | None = Field(None, description="torch variant sub-path under <path>/libtorch/")
    docker: Name | None = Field(None, description="compose service the ranks run in")
    data_path: AbsPath | None = Field(None, description="dataset root on this host")
    env: Env = Field(default_factory=dict, description="environment for this host's ranks")
    gpu_ram_share: Share | None = Field(
        None, description="APU hosts: fraction of RAM the integrated GPU claims"
    )

    @property
    def capacity(self) -> int | None:
        return self.local_devices.capacity


class Cluster(_Model):
    """The cluster block: the controller and its configured workers."""

    controller: Controller = Field(description="the controller host")
    workers: list[Worker] = Field(default_factory=list, description="rank-carrying hosts, in rank order")
    env: Env = Field(default_factory=dict, description="environment for every rank")
    gpu_ram_share: Share | None = Field(None, description="fleet default for APU hosts")

    @model_validator(mode="after")
    def _rules(self) -> Cluster:
        rules: list[Rule] = []
        if not self.workers and not self.controller.join.discovery:
            rules.append(
                (
                    ("workers",),
                    "lists no worker",
                    "add a worker, or set cluster.controller.join.discovery: true to let workers walk in",
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
        _check(rules)
        return self

    @property
    def capacity(self) -> int | None:
        """Configured ranks, or ``None`` while a worker offers ``all`` unprobed."""
        total = 0
        for worker in self.workers:
            if worker.capacity is None:
                return None
            total += worker.capacity
        return total


# --- fdl.yml blocks ----------------------------------------------------------


class Source(_Model):
    """join.source: fetch a tree and build the entry point on this box."""

    from_: SourceSpecText = Field(alias="from", description="source spec (file://, rsync://, git+…#ref)")
    cwd: str | None = Field(None, description="project dir inside the tree; governs build and run")
    build: str | None = Field(None, description="shell line that builds the entry point")
    bin: str | None = Field(None, description="entry point, relative to cwd")


class Join(_Model):
    """The join block of fdl.yml: the defaults of every `fdl join` flag."""

    controller: ControllerAddress | None = Field(
        None, description="controller address host[:port] (as seen from the ssh host under ssh:)"
    )
    token: Token | None = Field(None, description="the run's join.token")
    ssh: Ssh | None = Field(None, description="dial through this sshd with a local forward")
    host: Name | None = Field(None, description="this box's name in the roster (default: hostname)")
    devices: Devices | None = Field(None, description="devices offered (default: every GPU)")
    bin: str | None = Field(None, description="entry point to run as given")
    args: list[str] = Field(default_factory=list, description="arguments for the entry point")
    persist: bool = Field(False, description="re-dial with backoff whenever the agent exits")
    data_path: AbsPath | None = Field(None, description="the local data root this box's ranks read")
    data_source: DataSourceText | None = Field(
        None, description="mount data_path read-only from here when it is not there"
    )
    gpu_ram_share: Share | None = Field(None, description="APU boxes: RAM fraction the GPU claims")
    libtorch: Libtorch | None = Field(None, description="torch variant: auto, cpu, cu126, rocm6.4…")
    source: Source | None = Field(None, description="fetch and build the entry point here")
    nccl_socket_ifname: IfName | None = Field(None, description="network interface for NCCL/gloo")
    env: Env = Field(default_factory=dict, description="environment for this box's ranks")
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
        if self.data_source is not None and self.data_path is None:
            rules.append(
                (
                    ("data_path",),
                    "is required with data_source: it is where the mount goes up",
                    "set data_path to the local mount point, e.g. /flodl/data",
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
        _check(rules)
        return self


class Publish(_Model):
    """The publish block of fdl.yml: the defaults of every `fdl publish` flag."""

    source: SourceSpecText | None = Field(None, description="source spec to publish")
    bin: str | None = Field(None, description="entry point, relative to cwd")
    cwd: str | None = Field(None, description="project dir inside the tree")
    build: str | None = Field(None, description="build line run once as the gate")
    to: str | None = Field(None, description="served directory (default ~/.flodl/run)")
    identity: str | None = Field(None, description="ssh key for rsync:// and git+ssh:// sources")
    args: list[str] = Field(default_factory=list, description="arguments every rank gets")
    model_probe: bool = Field(False, description="probe the entry's model at publish and on every box")


class FdlConfig(_Model):
    """A whole fdl.yml (optionally with a cluster file overlaid)."""

    cluster: Cluster | None = Field(None, description="the cluster: controller and workers")
    join: Join | None = Field(None, description="walk-in defaults for `fdl join`")
    publish: Publish | None = Field(None, description="defaults for `fdl publish`")
    commands: dict[CommandName, CommandLine] = Field(
        default_factory=dict, description="named run commands for `fdl @<cluster> <name>`"
    )


# Keys of older schemas, with what replaced them.
LEGACY_KEYS: dict[str, str] = {
    "master_addr": "cluster.controller.host",
    "master_port": "cluster.controller.port",
    "ssh_target": "ssh.target",
    "ssh_host": "ssh.target",
    "ssh_port": "ssh.port",
    "ssh_user": "ssh.user",
    "ssh_key": "ssh.identity_file",
    "ssh_identity": "ssh.identity_file",
    "ssh_identity_file": "ssh.identity_file",
    "ssh_options": "ssh.options",
    "ssh_opts": "ssh.options",
}

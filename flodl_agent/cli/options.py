"""Option resolution per command: flags > env > the fdl.yml block > defaults.

Pure: the ``cli`` shell reads files, the environment and stdin and passes the
values in; nothing here touches them (nor click, nor asyncio). A value that
cannot be used raises ``OptionError`` naming the flag and the fix; the shell
turns it into exit 2.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError
from pydantic_core import PydanticCustomError

from ..address import AddressError, join_address, local_address, split_address
from ..agent.spec import AgentSpec
from ..config import Controller, DeviceOffer, Join, Publish, Ssh, parse_devices
from ..config.models import Source
from ..hardware.variants import variant_venv
from ..names import name_problem, shown
from ..pin import normalize
from ..protocol import wire
from ..sources.spec import SourceSpec, SpecError, parse_source
from .precedence import Precedence, none

DEFAULT_ADDR = "127.0.0.1:1337"  # where `fdl status` looks with no --addr and no cluster file
TUNNEL_ADDR = "127.0.0.1:1337"  # the controller's end of an ssh forward, as seen from this box
DEFAULT_SERVED = "~/.flodl/run"


class OptionError(ValueError):
    """``param`` (a flag or argument) cannot be used; exit 2 whichever way it prints:
    ``param``: click's `Invalid value for '--ssh': ...`; ``usage``: click's usage error;
    ``refusal``: `fdl CMD: message` and a fix line."""

    def __init__(
        self,
        param: str,
        message: str,
        fix: str | None = None,
        kind: Literal["param", "usage", "refusal"] = "param",
    ) -> None:
        super().__init__(message)
        self.param, self.message, self.fix, self.kind = param, message, fix, kind


def first_error(exc: Exception) -> str:
    """The first message of a pydantic error (the rest repeat it for other union members)."""
    if isinstance(exc, ValidationError):
        return str(exc.errors()[0]["msg"])
    return str(exc)


# --- fdl join --------------------------------------------------------------------------------


@dataclass(frozen=True)
class JoinFlags:
    """`fdl join`'s flags as typed; ``token`` is already `--token -` or FDL_TOKEN (credentials)."""

    address: str | None = None
    token: str | None = None
    ssh: str | None = None
    identity: Path | None = None
    pin: str | None = None
    env_pin: str | None = None  # FDL_TLS_FINGERPRINT, under --tls-fingerprint
    host: str | None = None
    devices: str | None = None
    persist: bool | None = None
    bin: str | None = None
    args: tuple[str, ...] = ()
    docker: str | None = None
    model_probe: bool | None = None
    controller_grace: int | None = None


@dataclass(frozen=True)
class JoinSettings:
    """What the agent runs with (AgentOptions' fields), whether to re-dial, and notes to log."""

    controller_host: str
    controller_port: int
    key: bytes | None  # this box's host key (join_key); None: open admission
    host: str
    devices: DeviceOffer
    bin: str | None
    ssh: Ssh | None
    tunnel: bool  # through an ssh forward: --ssh / join.ssh, or the launcher's ssh -R
    data_path: str
    env: dict[str, str]
    socket_ifname: str
    source: Source | None
    data_source: str
    args: list[str]
    tls_fingerprint: str
    persist: bool
    notes: tuple[str, ...] = ()
    gpu_ram_share: float | None = None
    docker: str = ""  # the compose service the ranks run in ("": on the box itself)
    model_probe: bool = True  # probe this box's own entry's model before each dial
    controller_grace: float | None = None  # None: the launch's (WorldFormed)


def parse_ssh_dest(text: str, identity: Path | None) -> Ssh:
    """``--ssh [user@]host[:port]``; the port only when one is written."""
    user, _, rest = text.rpartition("@")
    try:
        target, ssh_port = split_address(rest, 22)
        return Ssh(
            target=target,
            port=ssh_port if rest.count(":") == 1 or "]:" in rest else None,
            user=user or None,
            identity_file=str(identity) if identity else None,
        )
    except AddressError as exc:
        raise OptionError("--ssh", f"not [user@]host[:port]: {exc.render()}") from None
    except ValidationError as exc:
        raise OptionError(
            "--ssh", f"`{shown(text)}` is not [user@]host[:port] ({first_error(exc)})"
        ) from None


# Flags (and FDL_TOKEN) > the launcher's spec > the join: block > this box, field by field.
# `flags`, `spec` and `block` are the three as given (flags and spec seen through _Given, which
# validates lazily); `box` is what this box knows without being told.
JOIN: dict[str, Precedence] = {
    "address": Precedence(("flags.address", "spec.address", "block.controller", "box.tunnel")),
    "devices": Precedence(("flags.devices", "spec.devices", "block.devices"), none),
    "host": Precedence(("flags.host", "spec.host", "block.host", "box.hostname")),
    "bin": Precedence(("flags.bin", "block.bin")),
    "args": Precedence(("flags.args", "block.args")),
    "data_path": Precedence(("spec.data_path", "block.data_path")),
    "socket_ifname": Precedence(("spec.socket_ifname", "block.nccl_socket_ifname")),
    "data_source": Precedence(("block.data_source",)),
    "tls_fingerprint": Precedence(
        ("flags.pin", "flags.env_pin", "spec.tls_fingerprint", "block.tls_fingerprint")
    ),
    "persist": Precedence(("flags.persist", "block.persist"), none),
    "model_probe": Precedence(("flags.model_probe", "block.model_probe"), none),
    "controller_grace": Precedence(("flags.controller_grace", "block.controller_grace"), none),
    # The box's own join block beats its cluster entry (a later road knows the box better).
    "gpu_ram_share": Precedence(("block.gpu_ram_share", "spec.gpu_ram_share"), none),
    "docker": Precedence(("flags.docker", "spec.docker", "block.docker")),
}
_HOST_FROM = {
    "spec.host": "the launcher's host",
    "block.host": "join.host",
    "box.hostname": "this box's hostname",
}


class _Given:
    """Flags or a launcher's spec as JOIN reads them: the pins and --docker validated when read."""

    def __init__(self, given: JoinFlags | AgentSpec) -> None:
        self._given = given

    def __getattr__(self, name: str) -> Any:
        return getattr(self._given, name)

    @property
    def address(self) -> str | None:
        if isinstance(self._given, AgentSpec):
            spec = self._given
            return join_address(spec.controller_host, spec.controller_port) if spec.controller_host else None
        return self._given.address

    @property
    def pin(self) -> str | None:
        assert isinstance(self._given, JoinFlags)
        return _pin(self._given.pin, "--tls-fingerprint")

    @property
    def env_pin(self) -> str | None:
        assert isinstance(self._given, JoinFlags)
        return _pin(self._given.env_pin, "FDL_TLS_FINGERPRINT")

    @property
    def docker(self) -> str | None:
        if isinstance(self._given, AgentSpec) or not self._given.docker:
            return self._given.docker
        try:
            return Join.model_validate({"docker": self._given.docker}).docker
        except ValidationError as exc:
            raise OptionError("--docker", first_error(exc)) from None


@dataclass(frozen=True)
class _Box:
    hostname: str
    tunnel: str | None  # the controller's end of an ssh forward, when this box dials through one


def _ssh(flags: JoinFlags, block: Join) -> Ssh | None:
    """--ssh (with -i) > join.ssh (-i replacing its identity_file)."""
    if flags.ssh:
        return parse_ssh_dest(flags.ssh, flags.identity)
    if flags.identity and block.ssh is not None:
        return block.ssh.model_copy(update={"identity_file": str(flags.identity)})
    return block.ssh


def _empty_flags(flags: JoinFlags) -> None:
    """A flag given as "" is a mistake, not a request for the next source."""
    if flags.address == "":
        raise OptionError("ADDRESS", "is empty; write host[:port], e.g. 10.0.0.1:1337")
    if flags.host == "":
        raise OptionError("--host", "is empty", "leave --host out to use this box's hostname")


def _address(places: Mapping[str, object]) -> tuple[str, int]:
    addr, _ = JOIN["address"].pick(places)
    if addr is None:
        raise OptionError(
            "ADDRESS",
            "no controller address",
            "pass HOST:PORT, set join.controller in fdl.yml, or use --ssh",
            kind="refusal",
        )
    try:
        return split_address(addr)
    except AddressError as exc:
        raise OptionError("ADDRESS", exc.render()) from None


def _devices(places: Mapping[str, object]) -> DeviceOffer:
    offer, source = JOIN["devices"].pick(places)
    if source is None:
        return DeviceOffer("all")
    if source == "block.devices":
        return offer  # type: ignore[no-any-return]  # validated with the block
    try:
        return parse_devices(offer)
    except PydanticCustomError as exc:
        hint = exc.context["hint"] if exc.context else None
        if source == "flags.devices":
            raise OptionError("--devices", f"{exc}" + (f"; {hint}" if hint else "")) from None
        raise OptionError("--devices", f"the launcher's devices: {exc}", hint, kind="refusal") from None


def _entry(
    places: Mapping[str, object], flags: JoinFlags, block: Join
) -> tuple[str | None, list[str], list[str]]:
    """The entry point, its arguments, and a note when join.source overrides --bin."""
    entry, _ = JOIN["bin"].pick(places)
    args, _ = JOIN["args"].pick(places)
    args = list(args or ())
    if block.source is not None and flags.bin:
        return (
            entry,
            args,
            ["note: join.source names what runs (its manifest, or source.bin); --bin is ignored"],
        )
    if args and not entry and block.source is None:
        # Arguments for which entry point? Guessing (the launch command's first word?) runs the
        # wrong thing on a `python3 train.py` launch; the walk-in says what it means instead.
        raise OptionError(
            "ARGS",
            "arguments after -- go to this box's own entry point, and none is named",
            "name it with --bin PATH (or join.bin in fdl.yml), or drop the arguments to run the "
            "launch command",
            kind="refusal",
        )
    return entry, args, []


def _host(places: Mapping[str, object], named_by_flag: bool) -> str:
    """The box's name, held to the host-name rule; the message says where a bad one came from."""
    host, source = JOIN["host"].pick(places)
    problem = name_problem(host)
    if problem is None:
        return host  # type: ignore[no-any-return]
    if named_by_flag:
        raise OptionError("--host", f"{problem[0]}; {problem[1]}")
    raise OptionError(
        "--host", f"{_HOST_FROM[str(source)]} {problem[0]}", "name the box with --host NAME", kind="refusal"
    )


def resolve_join(flags: JoinFlags, spec: AgentSpec, block: Join, hostname: str) -> JoinSettings:
    """Each field from the first of its JOIN sources that is set.

    A launcher's spec comes with an empty block: its caller never reads ./fdl.yml then.
    """
    ssh = _ssh(flags, block)
    _empty_flags(flags)
    box = _Box(hostname, TUNNEL_ADDR if ssh is not None else None)
    places: dict[str, object] = {"flags": _Given(flags), "spec": _Given(spec), "block": block, "box": box}
    host, port = _address(places)
    offer = _devices(places)
    entry, args, notes = _entry(places, flags, block)
    value = {field: JOIN[field].pick(places)[0] for field in ("data_path", "socket_ifname", "data_source")}
    pin, _ = JOIN["tls_fingerprint"].pick(places)
    docker, _ = JOIN["docker"].pick(places)
    name = _host(places, bool(flags.host))
    return JoinSettings(
        controller_host=host,
        controller_port=port,
        key=join_key(flags, spec, block, name),
        host=name,
        devices=offer,
        bin=entry,
        ssh=ssh,
        tunnel=ssh is not None or spec.tunnel,
        data_path=value["data_path"] or "",
        env={**block.env, **spec.env},
        socket_ifname=value["socket_ifname"] or "",
        source=block.source,
        data_source=value["data_source"] or "",
        args=args,
        tls_fingerprint=pin or "",
        persist=bool(JOIN["persist"].pick(places)[0]),
        model_probe=JOIN["model_probe"].pick(places)[0] is not False,
        notes=tuple(notes),
        gpu_ram_share=JOIN["gpu_ram_share"].pick(places)[0],
        docker=docker or "",
        controller_grace=_grace(JOIN["controller_grace"].pick(places)[0]),
    )


def _grace(seconds: object) -> float | None:
    return float(seconds) if isinstance(seconds, int) else None


def join_key(flags: JoinFlags, spec: AgentSpec, block: Join, host: str) -> bytes | None:
    """This box's host key, the one its hellos are tagged with: the run's token (FDL_TOKEN or
    --token -, join.token, a spec's key) derived for ``host``, or a key made for one name
    (join.host_key, a launcher's spec's host_key), which holds for that name alone. None:
    open admission. Flags > the join: block > the spec: a fan-out spec comes with an empty
    block, so only a hand-set FLODL_INTERNAL_AGENT_JSON meets both."""
    for token, made, made_for in (
        (flags.token, None, None),
        (block.token, block.host_key, block.host),
        (spec.key, spec.host_key, spec.host),
    ):
        if token:
            return wire.host_key(bytes.fromhex(token), host)
        if made:
            if made_for != host:
                raise OptionError(
                    "--host",
                    f"this box's join key is the key of host {made_for}: it cannot dial as {host}",
                    "drop --host (the key names the box), or pass the run's join.token for another "
                    "name (FDL_TOKEN, --token -)",
                    kind="refusal",
                )
            return bytes.fromhex(made)
    return None


def _pin(text: str | None, where: str) -> str | None:
    try:
        return normalize(text) if text else None
    except ValueError as exc:
        raise OptionError(where, str(exc)) from None


def resolve_libtorch(flag: str | None, block: Join) -> str | None:
    """--libtorch > join.libtorch; None: the running venv runs the join, as it always did."""
    if flag is None:
        return block.libtorch
    try:
        return Join.model_validate({"libtorch": flag}).libtorch
    except ValidationError as exc:
        raise OptionError("--libtorch", first_error(exc)) from None


def probe_join(spec: AgentSpec) -> Join:
    """`fdl probe --spec-stdin`: this box as its cluster entry describes it."""
    try:
        return Join.model_validate(
            {
                "devices": spec.devices,
                "data_path": spec.data_path or None,
                "nccl_socket_ifname": spec.socket_ifname or None,
                "env": spec.env,
            }
        )
    except ValueError as exc:
        raise OptionError(
            "--spec-stdin", f"the cluster entry is not valid here ({first_error(exc)})", kind="refusal"
        ) from None


# --- fdl publish -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PublishFlags:
    spec: str | None = None
    bin: str | None = None
    cwd: str | None = None
    build: str | None = None
    served: Path | None = None
    identity: Path | None = None
    no_build: bool = False
    model_probe: bool | None = None
    tail: tuple[str, ...] | None = None  # after `--`; an empty tail still replaces publish.args


@dataclass(frozen=True)
class PublishSettings:
    """A PublishRequest's fields, paths as written: ``~`` and relative paths are this
    process's home and directory, which the shell expands."""

    source: SourceSpec
    served: Path
    bin: str | None
    cwd: str
    build: str | None
    args: list[str]
    no_build: bool
    model_probe: bool
    identity: Path | None
    gate_docker: str | None = None  # cluster.controller.docker: the compose service the gate builds in
    gate_venv: str | None = None  # cluster.controller.arch: <path>/libtorch/<arch>, the gate's variant


# Flags > the publish: block > defaults (applied in resolve_publish), field by field.
PUBLISH: dict[str, Precedence] = {
    "source": Precedence(("flags.spec", "block.source")),
    "served": Precedence(("flags.served", "block.to")),
    "bin": Precedence(("flags.bin", "block.bin")),
    "cwd": Precedence(("flags.cwd", "block.cwd")),
    "build": Precedence(("flags.build", "block.build")),
    "args": Precedence(("flags.tail", "block.args"), none),  # an empty tail still replaces publish.args
    "model_probe": Precedence(("flags.model_probe", "block.model_probe"), none),
    "identity": Precedence(("flags.identity", "block.identity")),
}


def resolve_publish(
    flags: PublishFlags, block: Publish, controller: Controller | None = None
) -> PublishSettings:
    """Flags > the publish: block > defaults, field by field; the cluster file's ``controller``
    says where the gate builds (its ``docker`` service, or with its ``arch`` variant)."""
    if controller is not None and controller.docker and controller.arch:
        raise OptionError(
            "--cluster",
            "cluster.controller sets both docker and arch: the gate builds in a compose service "
            "(whose image brings its own torch) or with a variant venv of this box, not both",
            "keep docker (build in the service) or arch (build with <path>/libtorch/<arch>)",
            kind="refusal",
        )
    places = {"flags": flags, "block": block}
    text, _ = PUBLISH["source"].pick(places)
    if text is None:
        raise OptionError("SPEC", "name a source: SPEC, or publish.source in fdl.yml", kind="usage")
    try:
        source = parse_source(text)
    except SpecError as exc:
        raise OptionError("SPEC", exc.render()) from None
    value = {field: rule.pick(places)[0] for field, rule in PUBLISH.items()}
    return PublishSettings(
        source=source,
        served=Path(value["served"] or DEFAULT_SERVED),
        bin=value["bin"],
        cwd=value["cwd"] or ".",
        build=value["build"],
        args=list(value["args"] or ()),
        no_build=flags.no_build,
        model_probe=bool(value["model_probe"]),
        identity=Path(value["identity"]) if value["identity"] else None,
        gate_docker=controller.docker if controller is not None else None,
        gate_venv=variant_venv(controller.path, controller.arch) if controller and controller.arch else None,
    )


# --- fdl status / fdl start ------------------------------------------------------------------


def resolve_addr(
    flag: str | None, controller: tuple[str, int] | None, cluster_file: str
) -> tuple[str, str | None]:
    """--addr > the controller of ./fdl.cluster.yml (``controller``, when it has one) > the
    default; with a note saying where the address came from when it was not the flag."""
    if flag is not None:
        try:
            split_address(flag)
        except AddressError as exc:
            raise OptionError("--addr", exc.render()) from None
        return flag, None
    if controller is not None:
        host, port = controller
        return join_address(local_address(host), port), f"controller from {cluster_file}"
    return DEFAULT_ADDR, f"no --addr and no ./fdl.cluster.yml: trying {DEFAULT_ADDR}"


def resolve_pin(flag: str | None, env: Mapping[str, str], cluster_pin: str | None) -> str | None:
    """--tls-fingerprint > FDL_TLS_FINGERPRINT > the certificate ./fdl.cluster.yml serves."""
    env_pin = _pin(env.get("FDL_TLS_FINGERPRINT"), "FDL_TLS_FINGERPRINT")
    return _pin(flag, "--tls-fingerprint") or env_pin or cluster_pin

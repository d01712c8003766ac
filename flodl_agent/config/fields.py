"""The field types of ``fdl.yml`` / ``fdl.cluster.yml``: one validator each, and the strict base model.

Every failure is a ``PydanticCustomError`` of type ``flodl`` (see :func:`.problems.fail`);
the blocks in :mod:`.cluster`, :mod:`.join_window`, :mod:`.join` and :mod:`.models` are
built from these types.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    WithJsonSchema,
)

from ..address import AddressError, check_host, split_address
from ..credentials import valid_token
from ..names import SERVICE_NAME, env_name_problem, name_problem, os_problem, shown
from ..pin import normalize
from ..sources.spec import SpecError, parse_data_source, parse_source
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


def check(rules: list[Rule]) -> None:
    if rules:
        raise fail(*rules)


# --- field types -------------------------------------------------------------


def _named(what: str) -> Any:
    def check(value: str) -> str:
        problem = name_problem(value, what)
        if problem is not None:
            raise fail(((), *problem))
        return value

    return check


def _os_text(value: str) -> str:
    # It reaches a process (argv, an environment, a path): a NUL would crash the spawn.
    problem = os_problem(value)
    if problem is not None:
        raise fail(((), *problem))
    return value


def _service(value: str) -> str:
    if not SERVICE_NAME.match(value):
        raise fail(
            (
                (),
                f"`{shown(value)}` is not a compose service name",
                "name a service of the project's compose file (letters, digits, `_`, `.`, `-`; "
                "a letter or digit first)",
            )
        )
    return value


def _address(value: str) -> str:
    try:
        return check_host(value)
    except AddressError as exc:
        raise fail(((), exc.message, exc.fix)) from None


def _abs_path(value: str) -> str:
    _os_text(value)
    if not value.startswith("/"):
        raise fail(((), f"`{value}` is not an absolute path", "write the full path from /"))
    return value


def _variant(value: str) -> str:
    _os_text(value)
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


def _hex_key(fix: str) -> Callable[[str], str]:
    """A 32-hex credential (the run's token, a host key), stored in lower case; ``fix`` says
    where a good one comes from."""

    def check(value: str) -> str:
        if not valid_token(value):
            raise fail(((), f"must be 32 hex characters (got {len(value)} characters)", fix))
        return value.lower()

    return check


def _fingerprint(value: str) -> str:
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


_IFNAME = re.compile(r"[A-Za-z0-9_.@-]{1,15}")


def _ifname(value: str) -> str:
    # NCCL's syntax: a comma list, optionally prefixed `^` (exclude) or `=` (exact).
    body = value[1:] if value[:1] in ("^", "=") else value
    items = body.split(",")
    if not body or not all(_IFNAME.fullmatch(i) for i in items):
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


_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _env_name(key: str) -> tuple[str, str] | None:
    """Why ``key`` cannot be a rank's variable: none can carry it, or it is not a portable
    name, or the agent owns it."""
    problem = env_name_problem(key)
    if problem is not None:
        return problem
    if not _ENV_KEY.fullmatch(key):
        return f"`{shown(key)}` is not an environment variable name", "use letters, digits and _"
    if key in VISIBILITY_MASKS:
        return (
            f"`{key}` is reserved: the agent scopes each rank to its own device",
            "drop it; choose devices with local_devices (or join.devices / --devices)",
        )
    if key in RANK_IDENTITY:
        return f"`{key}` is reserved: the agent sets it for every rank", "drop it"
    if key.startswith(RESERVED_PREFIX):
        return f"`{key}` is reserved for flodl's own plumbing", "drop it"
    return None


def _env(value: dict[str, str]) -> dict[str, str]:
    rules: list[Rule] = []
    for key, text in value.items():
        problem = _env_name(key) or os_problem(text)
        if problem is not None:
            rules.append(((key,), *problem))
    check(rules)
    return value


def _os_env(value: dict[str, str]) -> dict[str, str]:
    # Only what no process can take (the names the agent owns are the schema's to refuse).
    check([((k,), *p) for k, v in value.items() if (p := env_name_problem(k) or os_problem(v))])
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
    _os_text(value)
    if not re.match(r"^[A-Za-z][A-Za-z0-9]*(=|\s+)\S", value):
        raise fail(((), f"`{value}` is not an ssh option", "write Name=value, e.g. ProxyJump=bastion"))
    return value


TORCH_VARIANT = re.compile(r"cpu|cu\d{3}|rocm\d+(\.\d+)*")  # a concrete variant: no auto


def _libtorch(value: str) -> str:
    if value != "auto" and not TORCH_VARIANT.fullmatch(value):
        raise fail(
            (
                (),
                f"`{value}` is not a torch variant",
                "use auto, cpu, a CUDA variant like cu126 or cu128, or a ROCm one like rocm6.4",
            )
        )
    return value


def _torch_sources(value: dict[str, str]) -> dict[str, str]:
    rules: list[Rule] = []
    for key, where in value.items():
        problem = os_problem(where)
        if problem is not None:
            rules.append(((key,), *problem))
        elif not TORCH_VARIANT.fullmatch(key):
            rules.append(
                (
                    (key,),
                    f"`{key}` is not a torch variant",
                    "key each source by a variant: cpu, cu126, rocm6.4 (auto is a choice, not a source)",
                )
            )
        elif not (re.match(r"https?://[^/\s]+", where) or where.startswith("/")):
            rules.append(
                (
                    (key,),
                    f"`{where}` is neither an http(s):// index URL nor an absolute path",
                    "write a pip index URL (https://download.pytorch.org/whl/cu126) or the absolute "
                    "path of a wheelhouse directory",
                )
            )
    check(rules)
    return value


def _spec(parse: Any) -> Any:
    def check(value: str) -> str:
        _os_text(value)  # the spec's parts reach rsync, git and sshfs as arguments
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
    check([((i,), *p) for i, p in enumerate(map(os_problem, value)) if p is not None])
    return value


def _controller_address(value: str) -> str:
    try:
        split_address(value)
    except AddressError as exc:
        raise fail(((), exc.message, exc.fix)) from None
    return value


OsText = Annotated[str, AfterValidator(_os_text)]  # an argument, an environment value, a path
HostName = Annotated[str, AfterValidator(_named("host name"))]
Name = Annotated[str, AfterValidator(_named("name"))]
Service = Annotated[str, AfterValidator(_service)]
Address = Annotated[str, AfterValidator(_address)]
AbsPath = Annotated[str, AfterValidator(_abs_path)]
Variant = Annotated[str, AfterValidator(_variant)]
TOKEN_FIX = "generate one with: python3 -c 'import secrets; print(secrets.token_hex(16))'"
HOST_KEY_FIX = "the worker role writes it (derived from the run's token for join.host): re-run site.yml"
Token = Annotated[str, AfterValidator(_hex_key(TOKEN_FIX))]
HostKey = Annotated[str, AfterValidator(_hex_key(HOST_KEY_FIX))]
Fingerprint = Annotated[str, AfterValidator(_fingerprint)]
IfName = Annotated[str, AfterValidator(_ifname)]
Env = Annotated[dict[str, str], BeforeValidator(_coerce_env), AfterValidator(_env)]
OsEnv = Annotated[dict[str, str], AfterValidator(_os_env)]  # a launcher's spec: passable, no more
Share = Annotated[float, AfterValidator(_share)]
Port = Annotated[int, Field(ge=1, le=65535)]
# A year: past that a clock's float overflows somewhere (asyncio, threading), and no
# window is meant to be held longer.
MAX_SECONDS = 365 * 24 * 3600
Seconds = Annotated[int, Field(gt=0, le=MAX_SECONDS)]
Ranks = Annotated[int, Field(ge=1)]
SshOption = Annotated[str, AfterValidator(_ssh_option)]
Libtorch = Annotated[str, AfterValidator(_libtorch)]
TorchSources = Annotated[dict[str, str], AfterValidator(_torch_sources)]
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


# The base of every block: strict types, unknown keys refused, frozen.
class Model(BaseModel):
    model_config = ConfigDict(
        strict=True, extra="forbid", frozen=True, populate_by_name=True, validate_default=False
    )

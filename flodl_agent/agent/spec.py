"""The agent spec: what a launcher tells an agent it starts, encoded and decoded in one place.

It travels as hex-encoded JSON on the fan-out session's stdin (``fdl join
--spec-stdin``, ``fdl probe --spec-stdin``) or in FLODL_INTERNAL_AGENT_JSON,
never in argv: the key in it is a credential. A launcher hands each agent
``host_key``, the key of its own name alone; ``key`` (the run's token, from
which an agent derives its name's key) is for a spec written by hand.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..config import Worker
from ..config.fields import OsEnv, OsText, Service, Variant
from ..config.problems import format_path
from ..credentials import SPEC_KEY_PATTERN


class AgentSpec(BaseModel):
    """FLODL_INTERNAL_AGENT_JSON, or the fan-out session's stdin (hex-encoded JSON either way)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    # What reaches the ranks' argv, environment or paths is text a process can take (no NUL).
    host: OsText | None = None
    controller_host: OsText | None = None
    controller_port: int = Field(1337, ge=1, le=65535)
    key: str | None = Field(None, pattern=SPEC_KEY_PATTERN)  # the run's token: any name's key derives from it
    host_key: str | None = Field(None, pattern=SPEC_KEY_PATTERN)  # the key of ``host`` alone
    devices: OsText | None = None
    data_path: OsText = ""
    env: OsEnv = Field(default_factory=dict)
    socket_ifname: OsText = Field("", max_length=256)
    # cluster.workers[].arch: the torch variant sub-path (under a libtorch root) the agent and
    # its ranks should run from. Fan-out already execs <path>/libtorch/<arch>/bin/fdl when it
    # exists; an agent that finds itself elsewhere may re-exec into the variant's fdl. Unset:
    # run where started. Validated as arch is (no absolute path, no `..`): it names a path.
    libtorch: Variant | None = None
    # The agent dials back through the session's `ssh -R` (a tunnel: worker, or tunnel_only):
    # its hello says so, and an NCCL plane refuses it (a forward cannot carry a mesh).
    tunnel: bool = False
    gpu_ram_share: float | None = Field(None, gt=0, allow_inf_nan=False)  # cluster.workers[].gpu_ram_share
    docker: Service | None = None  # cluster.workers[].docker: the compose service the ranks run in
    # The controller port serves TLS (cluster.controller.tls): its certificate's pin.
    tls_fingerprint: str | None = Field(None, pattern=r"^sha256:[0-9a-f]{64}$")

    @model_validator(mode="after")
    def _bound(self) -> AgentSpec:
        if self.host_key is not None and self.host is None:
            raise ValueError("host_key is the key of one host name: the spec must name the host")
        return self


def for_worker(worker: Worker, **dial: object) -> AgentSpec:
    """What a worker entry tells the agent (or the probe) on its box; ``dial`` adds the
    controller_host, controller_port and host_key a launch hands its agents."""
    return AgentSpec.model_validate(
        {
            "host": worker.host,
            "devices": str(worker.local_devices),
            "data_path": worker.data_path or "",
            "env": worker.env,
            "socket_ifname": worker.nccl_socket_ifname or "",
            **({"libtorch": worker.arch} if worker.arch else {}),
            **({"gpu_ram_share": worker.gpu_ram_share} if worker.gpu_ram_share is not None else {}),
            **({"docker": worker.docker} if worker.docker else {}),
            **dial,
        }
    )


def encode(spec: AgentSpec) -> bytes:
    """One stdin line: hex-encoded JSON (what ``--spec-stdin`` reads). Unset fields stay out."""
    return spec.model_dump_json(exclude_unset=True).encode().hex().encode() + b"\n"


def decode(text: str) -> AgentSpec:
    """The inverse of ``encode`` (a trailing newline or blanks are fine)."""
    try:
        raw = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError("the agent spec is not a hex-encoded JSON spec (bad hex)") from None
    try:
        return AgentSpec.model_validate_json(raw)
    except ValidationError as exc:  # bad JSON, or a field out of bounds: name the field, never its value
        first = exc.errors()[0]
        rules = (first.get("ctx") or {}).get("rules") if first["type"] == "flodl" else None
        where = format_path((*first["loc"], *(rules[0][0] if rules else ())))
        raise ValueError(f"the agent spec is not a hex-encoded JSON spec ({where}: {first['msg']})") from None

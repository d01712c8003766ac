"""Message bodies of the join and control channels.

Frames carry msgpack maps; these models give each kind its shape and bounds,
so a peer that authenticates but sends nonsense is refused by name instead of
crashing a handler.
"""

from __future__ import annotations

import shlex
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from ..config.devices import MAX_DEVICES
from ..names import SERVICE_NAME, env_name_problem, name_problem, os_problem, unprintable
from ..names import shown as escaped
from .wire import Frame, Kind


def _printable(text: str) -> str:
    hidden = unprintable(text)
    if hidden is not None:
        raise PydanticCustomError(
            "printable", "holds {char}, a control, bidi or invisible character", {"char": hidden}
        )
    return text


def _host_name(name: str) -> str:
    # Empty stays for admission to refuse by name ("the hello names no host"), with a reply.
    problem = name_problem(name) if name else None
    if problem is not None:
        raise PydanticCustomError("host_name", "{message}", {"message": problem[0]})
    return name


def _passable(text: str) -> str:
    # What a controller says to run reaches exec and the ranks' environment: a NUL there
    # would crash the spawn instead of refusing the message.
    problem = os_problem(text)
    if problem is not None:
        raise PydanticCustomError("os_text", "{message}", {"message": problem[0]})
    return text


def _env_name(name: str) -> str:
    problem = env_name_problem(name)
    if problem is not None:
        raise PydanticCustomError("env_name", "{message}", {"message": problem[0]})
    return name


def _service(name: str) -> str:
    # "": the cluster file names none; else compose's rule, as the schema's (never an option).
    if name and not SERVICE_NAME.match(name):
        raise PydanticCustomError("service", "is not a compose service name", {})
    return name


# Peer-supplied text reaches operators' terminals and logs: nothing a terminal acts on
# (names.printable's rule: no C0/C1 control, DEL, line separator, bidi or format character).
Short = Annotated[str, Field(max_length=256), AfterValidator(_printable)]
HostName = Annotated[str, AfterValidator(_host_name)]  # the one host-name rule (names.py)
Sig = Annotated[str, Field(max_length=128, pattern=r"^[0-9a-f]*$")]
Plane = Literal["nccl", "cpu"]
COMMAND_SHOWN = 1024  # characters of a walk-in's own command that its hello shows the controller
Shown = Annotated[str, Field(max_length=COMMAND_SHOWN), AfterValidator(_printable)]
Arg = Annotated[str, AfterValidator(_passable)]  # an argument or environment value for a rank
EnvName = Annotated[str, AfterValidator(_env_name)]


class Msg(BaseModel):
    """A message body: every field is read by the other side (or it goes)."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class Challenge(Msg):
    nonce: bytes = Field(min_length=16, max_length=16)  # the hello must echo it: no replay
    # The hello must be tagged with the key of the host it names (a run key is configured);
    # False: open admission, every pre-admission frame under zeros.
    bound: bool = False


class ResumeClaim(Msg):
    """A host walking back in to a restarted controller: the launch it trains in and the
    ranks it holds there (the journal's span for it must agree)."""

    launch: str = Field(pattern=r"^[0-9a-f]{8}$")
    first: int = Field(ge=0)
    count: int = Field(ge=1, le=MAX_DEVICES)
    round: int = Field(0, ge=0, lt=2**62)  # the CPU plane's round its ranks push next (0: none yet)


class Hello(Msg):
    """What a walk-in says about itself."""

    nonce: bytes = Field(min_length=16, max_length=16)  # the server's challenge, echoed
    client_nonce: bytes = Field(min_length=16, max_length=16)
    host: HostName
    devices: list[Short] = Field(max_length=MAX_DEVICES)  # "cuda:0", "cpu:1", ...
    device_labels: list[Short] = Field(default_factory=list, max_length=MAX_DEVICES)
    variant: Short = "cpu"  # torch variant label: cpu, cu128, rocm6.4, ...
    dataset_sig: Sig = ""
    model_sig: Sig = ""
    # The published run this box fetched and built, "" when none: the journal's form, so a
    # formed world's journal can always hold what its walk-ins said.
    run_id: str = Field("", pattern=r"^([0-9a-f]{32})?$")
    nccl: Short = ""  # "2.27.3", empty when the variant ships none
    data_path: Short = ""
    # What its ranks run when that is not the launch's command ("": the launch's), for the
    # controller's log and /state.json only: shown_command() makes it fit, it is never run.
    command: Shown = ""
    tunnel: bool = False  # it dials through an ssh forward (--ssh, a tunnel: worker): CPU planes only
    resume: ResumeClaim | None = None  # its ranks train on in this launch: it walks back in

    @property
    def vendor(self) -> str:
        return vendor_of(self.variant)

    @property
    def runs(self) -> str:
        """What its ranks run, as the controller's log says it."""
        if not self.command:
            return "the launch command"
        return f"{f'published run {self.run_id}' if self.run_id else 'its own command'}: {self.command}"


def shown_command(argv: list[str]) -> str:
    """``argv`` as a shell would read it, made fit for a hello's ``command`` (:func:`shown`)."""
    return shown(shlex.join(argv), COMMAND_SHOWN)


def shown(text: str, limit: int = 256) -> str:
    """``text`` made fit for a ``Short`` field (or ``limit``): what a terminal would act on
    (``names.unprintable``'s rule) becomes ``?`` and a long line is cut, the tail marked ``…``."""
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def vendor_of(variant: str) -> str:
    if variant.startswith("cu"):
        return "cuda"
    if variant.startswith("rocm"):
        return "rocm"
    return "cpu"


class Accept(Msg):
    ranks: tuple[int, int]  # (first, count) — provisional until WorldFormed
    salt: bytes | None = None  # only under open admission


class Reject(Msg):
    reason: str
    fix: str = ""
    permanent: bool = False


class HostEnvelope(Msg):
    """One host's share of the formed world, with what the cluster file says of that host.

    The agent overlays what only its box knows (its join block's values win): the same
    rewrite that stamps the join-verified controller address and the box's data root.
    """

    host: str
    first_rank: int
    count: int
    docker: Annotated[Short, AfterValidator(_service)] = (
        ""  # the compose service this host's ranks run in (cluster.workers[].docker)
    )
    gpu_ram_share: float | None = Field(None, gt=0, allow_inf_nan=False)  # the worker's, else the cluster's


class WorldFormed(Msg):
    """The formed world as one host needs it: its own share, never the whole roster
    (which would make formation O(N^2) and outgrow the frame cap at fleet scale)."""

    world_size: int
    host: HostEnvelope
    group: int  # this host's index among the hosts (GROUP_RANK)
    hosts: int  # how many hosts the world spans (GROUP_WORLD_SIZE)
    # The launch's command: a published manifest or a walk-in's own command wins.
    command: list[Arg] = Field(min_length=1)
    env: dict[EnvName, Arg] = Field(default_factory=dict)
    launch: Short = ""  # the launch's label (TORCHELASTIC_RUN_ID); not the published run's identity
    # Seconds the host's ranks train on when the link to the controller breaks, re-dialling
    # with a resume hello (0: they stop at once, as from a controller that predates it).
    controller_grace: float = Field(0.0, ge=0, le=86400)
    # An elastic world's ceiling of ranks (0: not elastic): every rank's timing slots are sized
    # by it, so the world can grow without the parameters' count changing.
    max_world_size: int = Field(0, ge=0, lt=2**31)
    midrun: bool = False  # this host walked into a training world: its ranks sync before a step
    # How often this launch's process-group world re-formed before this share (growth by
    # re-formation): the ranks' TORCHELASTIC_RESTART_COUNT.
    restart_count: int = Field(0, ge=0, lt=2**31)


class RankExited(Msg):
    rank: int
    code: int
    error: Short = ""  # the rank never started, and why (its command missing, not executable)
    reason: Short = ""  # it ran and ended, and says why (observe.exit_reason: a model mismatch)


class Abort(Msg):
    reason: str


class Reform(Msg):
    """A process-group world re-forms to take walk-ins in: stop this host's ranks (as
    torchelastic's agent does, SIGTERM then the kill) and wait on the link for the new world,
    whose ranks start with ``restart`` as their TORCHELASTIC_RESTART_COUNT."""

    restart: int = Field(ge=1, lt=2**31)
    reason: Short = ""


class Release(Msg):
    """An elastic world goes on without this host, whose ranks all ended and one failed: it
    hangs up. (In an elastic launch a host whose ranks failed keeps its link and waits for
    the controller's word, since a process-group world may restart them instead: ``Reform``.)"""

    reason: Short = ""


class Average(Msg):
    """A round pushed towards the controller; the parameters are the frame's raw bytes.

    On the link: a piece of a host's folded round (the sum of its ranks' weight *
    params, float32 or bfloat16: parameters ``offset`` on, of ``params``; 0: the
    whole round in one frame) or its relay's error. On loopback: a rank's push,
    its parameters already in its shared-memory segment (``size`` bytes; ``raw``: as
    they are, for the agent to weigh; without it, an older rank's, already weighed).
    """

    round: int = Field(ge=0, lt=2**62)
    weight: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    error: Short = ""
    bf16: bool = False  # the raw bytes are bfloat16 (bf16_wire): half the bytes on the link
    rank: int = Field(-1, ge=-1)
    size: int = Field(0, ge=0)
    offset: int = Field(0, ge=0, lt=2**40)
    params: int = Field(0, ge=0, lt=2**40)
    raw: bool = False
    # A walk-in's first push (weight 0): it takes the average of the next round the world
    # completes, whatever its number, and is counted in every round after.
    join: bool = False


class Averaged(Msg):
    """A piece of a round's average (the frame's raw bytes: parameters ``offset`` on, of
    ``params``; on loopback, the whole round in the host's shared average) or why not."""

    round: int = Field(ge=0, lt=2**62)
    weight: float = 0.0
    error: str = ""
    saver: int = -1  # ShutdownWithSave: the rank that writes the checkpoint
    bf16: bool = False
    size: int = Field(0, ge=0)
    offset: int = Field(0, ge=0, lt=2**40)
    params: int = Field(0, ge=0, lt=2**40)
    last: bool = True  # the round is whole with this piece
    # The world's accepted weight over every round through this one (on the last piece): a
    # walk-in's ranks start their count of the world's batches from it.
    taken: float = Field(0.0, ge=0.0, allow_inf_nan=False)


class Stream(Msg):
    """Bytes of one rendezvous stream (a rank's connection to the store); ``end`` closes it."""

    id: int = Field(ge=0, lt=2**62)
    data: bytes = Field(default=b"", max_length=64 * 1024)
    end: bool = False


class RankReport(Msg):
    step: int = Field(ge=0, lt=2**62)
    loss: float | None = None
    at: float = 0.0
    step_rate: float | None = Field(None, ge=0)  # the rank's own, over its recent reports


class Heartbeat(Msg):
    """A host is alive; with its ranks' latest progress reports (rank -> report)."""

    ranks: dict[int, RankReport] = Field(default_factory=dict, max_length=1024)


_BODIES: dict[Kind, type[Msg]] = {
    Kind.CHALLENGE: Challenge,
    Kind.HELLO: Hello,
    Kind.ACCEPT: Accept,
    Kind.REJECT: Reject,
    Kind.WORLD_FORMED: WorldFormed,
    Kind.RANK_EXITED: RankExited,
    Kind.ABORT: Abort,
    Kind.REFORM: Reform,
    Kind.RELEASE: Release,
    Kind.STREAM: Stream,
    Kind.AVERAGE: Average,
    Kind.AVERAGED: Averaged,
    Kind.HEARTBEAT: Heartbeat,
}


class BadMessage(ValueError):
    pass


def parse(frame: Frame) -> Msg | None:
    """The typed body of ``frame`` (``None`` for kinds without one)."""
    model = _BODIES.get(frame.kind)
    if model is None:
        return None
    try:
        return model.model_validate(frame.body)
    except ValidationError as exc:
        first = exc.errors()[0]
        # The path names the peer's own keys (an env name): escaped, never a terminal's.
        where = ".".join(escaped(str(p)) for p in first["loc"] if p != "[key]")
        raise BadMessage(f"{frame.kind.name.lower()}: {where}: {first['msg']}") from None

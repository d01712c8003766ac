"""cluster.controller.join: the knobs of the membership window and the rules between them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from ..address import is_loopback
from .fields import (
    DEFAULT_JOIN_TIMEOUT,
    DEFAULT_MAX_JOIN_TIMEOUT,
    MAX_SECONDS,
    Model,
    Ranks,
    Seconds,
    Token,
    check,
)
from .problems import Rule, fail

DEFAULT_CONTROLLER_GRACE = 120
DEFAULT_REFORM_INTERVAL = 60  # seconds between re-formations of a process-group world
DEFAULT_REPLACE_TIMEOUT = 300  # seconds a process group stopped after a loss waits for its replacement
MAX_CEILING = 1_000_000  # ranks: 8 MB of timing slots a round at the most


def _planes(planes: list[str]) -> list[str]:
    # Refused here rather than by min_length: the error then says what to write.
    if not planes:
        raise fail(((), "is empty: no plane would grow", "list the planes that grow, e.g. [cpu]"))
    doubled = sorted({p for p in planes if planes.count(p) > 1})
    if doubled:
        raise fail(((), f"names {', '.join(doubled)} twice", "list each plane once"))
    return planes


Planes = Annotated[list[Literal["cpu", "nccl"]], AfterValidator(_planes)]


class ElasticWindow(Model):
    """cluster.controller.join.elastic: walk-ins keep joining the formed world, up to a ceiling."""

    # Every rank's timing slots are sized by the ceiling (two floats a rank, every round).
    max_ranks: Ranks = Field(le=MAX_CEILING, description="the ceiling of ranks the world may grow to")
    planes: Planes = Field(
        ["cpu"],
        json_schema_extra={"minItems": 1, "uniqueItems": True},
        description="the launch planes whose world grows: a CPU-plane world that averages through "
        "the controller grows live, a torch.distributed process group by re-formation",
    )
    reform_interval: int = Field(
        DEFAULT_REFORM_INTERVAL,
        ge=0,
        le=MAX_SECONDS,
        description="seconds a process-group world trains between two re-formations (a walk-in "
        "that arrives sooner waits): a flapping box cannot stall the run with restarts",
    )
    replace_timeout: int = Field(
        DEFAULT_REPLACE_TIMEOUT,
        ge=1,
        le=MAX_SECONDS,
        description="seconds a process-group world, stopped after losing a host, waits for walk-ins "
        "to take the lost ranks before the run ends",
    )


def ceiling_floor(join: JoinWindow, max_ranks: int) -> tuple[str, int] | None:
    """The knob an elastic ceiling of ``max_ranks`` falls below (``target_ranks``, else
    ``min_rank_start``) and its value; ``None`` when the ceiling holds the world the window forms."""
    for name in ("target_ranks", "min_rank_start"):
        floor: int | None = getattr(join, name)
        if floor is not None and max_ranks < floor:
            return name, floor
    return None


class JoinWindow(Model):
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
    controller_grace: int = Field(
        DEFAULT_CONTROLLER_GRACE,
        ge=0,
        le=86400,
        description="seconds a formed world trains on without its controller, agents re-dialling "
        "to resume (a restarted controller waits as long for them); 0: a lost controller stops the ranks",
    )
    elastic: ElasticWindow | None = Field(
        None,
        description="after the window forms the world, keep admitting walk-ins up to a ceiling "
        "of ranks (default: the world is frozen)",
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
        rules.extend(self._elastic_rules())
        check(rules)
        return self

    def _elastic_rules(self) -> list[Rule]:
        if self.elastic is None:
            return []
        below = ceiling_floor(self, self.elastic.max_ranks)
        if below is None:
            return []
        name, floor = below
        return [
            (
                ("elastic", "max_ranks"),
                f"({self.elastic.max_ranks}) is below {name} ({floor}): the ceiling would be below "
                "the world the window forms",
                f"set elastic.max_ranks to at least {floor}, or lower {name}",
            )
        ]


def locks_walk_ins_out(join: JoinWindow, bind: str) -> bool:
    """Under discovery, does a bind on ``bind`` refuse every walk-in? On a network bind with
    neither a token nor open admission the run key is a per-run salt that only fanned-out
    agents receive: a walk-in's hello cannot verify, and the window waits out its hard cap.
    (``tunnel_only`` binds loopback instead, where admission is open.)"""
    return (
        join.discovery
        and not join.tunnel_only
        and join.token is None
        and not join.open_admission
        and not is_loopback(bind)
    )


LOCKED_OUT_FIX = (
    "set cluster.controller.join.token (walk-ins pass it: FDL_TOKEN or --token -), or bind "
    "127.0.0.1 and tunnel walk-ins through the join door (tunnel_only: true does), or set "
    "open_admission: true on a fully trusted segment"
)


def locked_out_message(bind: str, roster: int) -> str:
    said = (
        "nobody can join: there is no roster to fan out to"
        if roster == 0
        else f"only the {roster} fanned-out worker(s) can join"
    )
    return (
        f"admits no walk-in: on the network bind {bind} with neither a token nor open_admission, "
        f"a walk-in's hello cannot verify (the run key is a salt only fan-out hands out); {said}"
    )

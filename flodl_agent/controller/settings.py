"""What a controller is told to run: the window, the command, the port, the run's knobs (pure).

The launcher builds one from a cluster file and its flags (:mod:`.launcher`); tests and
benches build them directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..protocol.messages import Plane
from .elastic import Elastic
from .supervision import Limits
from .window import WindowConfig


@dataclass
class Settings:
    window: WindowConfig
    command: list[str]
    bind: str = "127.0.0.1"
    port: int = 1337
    token: str | None = None
    open_admission: bool = False
    plane: Plane = "cpu"
    tunnel_only: bool = False  # every walk-in comes through the join door (cluster.controller.join)
    env: dict[str, str] = field(default_factory=dict)
    launch: str = ""  # this launch's label (8 hex): logs, /state.json, TORCHELASTIC_RUN_ID
    roster: list[str] = field(default_factory=list)  # configured workers, in rank order
    # The roster's configured ranks (None: unknown, a worker offers `all` uncounted): with the
    # window's target, the room left to walk-ins outside the roster (admission.Roster).
    capacity: int | None = None
    max_failure: str = "0"  # ranks that may fail mid-run: "N", or "P%" of the formed world
    shutdown_grace: float = 60.0  # seconds survivors get to save before the run is aborted
    stall_ceiling: float = 600.0  # seconds an averaging round may wait for its last host
    # Seconds a formed world trains on without its controller, its agents re-dialling with
    # resume hellos (0: a lost controller stops the ranks); also how long a restarted
    # controller waits for its journaled hosts.
    controller_grace: float = 0.0
    # Walk-ins keep joining the training world up to a ceiling of ranks (None: it is frozen).
    elastic: Elastic | None = None
    heartbeat_timeout: float = 30.0  # a training host silent this long is cut off (agents beat every 5 s)
    parallelism: dict[str, int] | None = None  # tensor/pipeline/data/expert the formed world must satisfy
    tls: tuple[str, str] | None = None  # (certificate, key): serve the port over TLS
    local_socket: bool = True  # walk-ins on this box may come through a unix socket (local_port)
    # What the cluster file says of each roster host (docker, gpu_ram_share), and of any
    # other walk-in (the cluster's defaults): it rides that host's envelope in WorldFormed.
    host_facts: dict[str, dict[str, Any]] = field(default_factory=dict)
    walk_in_facts: dict[str, Any] = field(default_factory=dict)

    def facts(self, host: str) -> dict[str, Any]:
        return self.host_facts.get(host, self.walk_in_facts)

    @property
    def limits(self) -> Limits:
        return Limits(self.max_failure, self.shutdown_grace, self.stall_ceiling, self.heartbeat_timeout)

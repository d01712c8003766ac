"""What a walk-in is told: the options one dial runs with (flags, env, fdl.yml, a launcher's spec).

Its own module, below the agent's shell, so that the modules the agent drives
(the box, its containers) can read them without importing the agent.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from ..config.devices import DeviceOffer
from ..config.models import Source, Ssh

HEARTBEAT_EVERY = 5.0  # seconds between beats while ranks train (the controller waits 30 by default)


@dataclass
class AgentOptions:
    controller_host: str = "127.0.0.1"
    controller_port: int = 1337
    key: bytes | None = None  # this box's host key (options.join_key); None under open admission
    host: str = field(default_factory=socket.gethostname)
    devices: DeviceOffer = field(default_factory=lambda: DeviceOffer("all"))
    bin: str | None = None  # this box's own entry point: with args, its ranks' command
    ssh: Ssh | None = None
    tunnel: bool = False  # dials through an ssh forward: ssh set, or a launcher's ssh -R
    data_path: str = ""
    env: dict[str, str] = field(default_factory=dict)
    model_sig: str = ""
    dataset_sig: str = ""
    run_id: str = ""
    socket_ifname: str = ""  # nccl_socket_ifname: NCCL's syntax; gloo gets one concrete interface
    source: Source | None = None  # join.source: fetch, check and build the run before every dial
    data_source: str = ""  # join.data_source: mount data_path read-only from here (sshfs, door A)
    stage: str = "~/.flodl/stage"  # node-local: where the fetched tree and its build live
    args: list[str] = field(default_factory=list)  # bin's arguments (a published manifest's replace them)
    tls_fingerprint: str = ""  # the controller port speaks TLS: its certificate's pinned fingerprint
    heartbeat_every: float = HEARTBEAT_EVERY  # seconds between beats while ranks train
    # Seconds the ranks train on when the controller goes away (join.controller_grace,
    # --controller-grace); None: what the launch says in WorldFormed.
    controller_grace: float | None = None
    # What only this box knows beats what the controller's cluster file says of it (the envelope):
    docker: str = ""  # the compose service its ranks run in (join.docker / workers[].docker)
    model_probe: bool = True  # probe the model its own entry builds before each dial (join.model_probe)
    gpu_ram_share: float | None = None  # APU boxes: the RAM fraction the GPU claims (join.gpu_ram_share)

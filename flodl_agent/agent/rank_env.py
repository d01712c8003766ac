"""The rank environment: torchrun's variables plus what only this box knows.

Pure: the agent reads its own environment, this box's interfaces and its
interpreter's PATH into a :class:`Box`; here they become one environment per rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..observe.exit_reason import ENV as REASON_ENV
from ..observe.metrics import ENV as METRICS_ENV
from ..protocol.messages import WorldFormed
from ..train.device_memory import SHARE_ENV
from ..train.segments import MAX_WORLD_ENV, MIDRUN_ENV


@dataclass(frozen=True)
class Box:
    """What every child of an agent starts from."""

    base: Mapping[str, str]  # the agent's own environment
    path: str  # PATH with the variant's venv bin/ first
    data_path: str = ""
    env: Mapping[str, str] = field(default_factory=dict)  # the box's own env: entries (they win)
    ifnames: Mapping[str, str] = field(default_factory=dict)  # socket_ifnames() against this box
    gpu_ram_share: float | None = None  # join.gpu_ram_share: beats what the envelope says of this host


def reason_file(directory: Path, rank: int) -> Path:
    """Where a rank leaves why it ended (observe.exit_reason): the run's directory, beside its
    progress file."""
    return directory / f"exit-{rank}.txt"


def box_env(box: Box) -> dict[str, str]:
    """The agent's environment less the credential and our plumbing, the variant's venv
    first on PATH, the data root named (the box's env: entries are the caller's to add)."""
    env = {k: v for k, v in box.base.items() if k != "FDL_TOKEN" and not k.startswith("FLODL_INTERNAL_")}
    env["PATH"] = box.path
    if box.data_path:
        env["FLODL_DATA_PATH"] = box.data_path
    return env


def rank_envs(
    box: Box,
    world: WorldFormed,
    devices: list[str],
    road: str,
    store_port: int,
    plane: Mapping[str, str] | None = None,
    reports: Mapping[int, Path] | None = None,
) -> list[dict[str, str]]:
    """One environment per offered device, in order.

    ``road`` is the controller address this join used (the controller's own idea
    of it is wrong behind a tunnel or NAT); ``store_port`` is the loopback port of
    the rendezvous store (the store itself on rank 0's host, a relay elsewhere);
    ``plane`` the CPU plane's variables; ``reports`` each rank's progress file.
    """
    mine, group = world.host, world.group
    share = box.gpu_ram_share if box.gpu_ram_share is not None else mine.gpu_ram_share
    # An elastic world: the ceiling sizes every rank's timing slots; a walk-in's ranks sync first.
    elastic = {MAX_WORLD_ENV: str(world.max_world_size)} if world.max_world_size > 0 else {}
    if world.midrun:
        elastic[MIDRUN_ENV] = "1"
    envs = []
    for local, device in enumerate(devices):
        # The rank is the user's code: it gets no credential and none of our plumbing.
        env = box_env(box)
        env.update(world.env)
        env.update(box.env)  # the box's own entries beat the cluster's
        env.update(
            RANK=str(mine.first_rank + local),
            WORLD_SIZE=str(world.world_size),
            LOCAL_RANK=str(local),
            LOCAL_WORLD_SIZE=str(mine.count),
            GROUP_RANK=str(group),
            GROUP_WORLD_SIZE=str(world.hosts),  # torchrun's: how many hosts (agents) the world spans
            # Every rank is a client of the agent's store, as under torchrun's agent.
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(store_port),
            TORCHELASTIC_USE_AGENT_STORE="True",
            TORCHELASTIC_RESTART_COUNT=str(world.restart_count),  # a re-formed world's: one more each time
            TORCHELASTIC_RUN_ID=world.launch or "flodl",
            FLODL_CONTROLLER=road,
            **(plane or {}),
            FLODL_DEVICE=device,
            FLODL_LAUNCH=world.launch,  # this launch's label (not the published run's identity)
        )
        env.update(elastic)
        if share is not None:  # the Trainer's gpu_ram_share when code leaves it unset
            env[SHARE_ENV] = str(share)
        for key, value in box.ifnames.items():
            env.setdefault(key, value)  # an explicit env: entry wins
        if mine.count > 1:  # torchrun's default: ranks sharing a box must not oversubscribe it
            env.setdefault("OMP_NUM_THREADS", "1")
        if device.startswith("cuda:"):
            env["CUDA_VISIBLE_DEVICES"] = device.split(":")[1]
        if reports is not None:
            report = reports[mine.first_rank + local]
            env[METRICS_ENV] = str(report)
            env[REASON_ENV] = str(reason_file(report.parent, mine.first_rank + local))
        envs.append(env)
    return envs

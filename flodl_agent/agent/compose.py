"""Ranks in a compose service (``workers[].docker``, ``join.docker``) and the publish gate's
service (``controller.docker``): the plan, from facts (pure).

Each rank is one ``compose run`` of the service, named per launch and rank so that it can be
stopped and removed for certain (a killed ``compose run`` client does not always take its
container along). What the rank needs rides a second compose file (the *override*) beside the
project's own: the host's network (the agent's store, relay and CPU plane listen on loopback,
and NCCL/gloo peers dial this host's interfaces), ``init`` (a rank as PID 1 would ignore the
SIGTERM that stops it), the agent's user (the run's private directory is mode 0700), the
rank's working directory, the private directory and the data root mounted at the same paths,
and the GPUs. The environment never rides argv: it is a file of ``export`` lines in the
private directory that ``sh`` reads inside the container before it execs the rank (compose
tools print their engine's argv, and podman-compose 1.0.3 puts every ``-e`` value there).

The IO shell is :mod:`flodl_agent.agent.containers`.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import PurePath
from typing import Any


@dataclass(frozen=True)
class Provider:
    """A compose tool: how to call it, and the container engine that inspects, stops and
    removes its containers by name."""

    name: str  # as docs and messages spell it
    argv: tuple[str, ...]
    engine: str  # "docker" or "podman"
    podman_compose: bool = False  # its own global flags, and its 1.0.3 network bug

    @property
    def gpu_cdi(self) -> bool:
        """NVIDIA GPUs as CDI devices (podman) rather than a device reservation (docker)."""
        return self.engine == "podman"


# The order a box's tool is looked for in (FLODL_COMPOSE names one to use it alone).
PROVIDERS = (
    Provider("docker compose", ("docker", "compose"), "docker"),
    Provider("docker-compose", ("docker-compose",), "docker"),
    Provider("podman-compose", ("podman-compose",), "podman", podman_compose=True),
    Provider("podman compose", ("podman", "compose"), "podman"),
)
PROVIDER_ENV = "FLODL_COMPOSE"

# What `docker compose` looks for in a directory, in order; each with its override file.
DEFAULT_FILES = ("compose.yaml", "compose.yml", "docker-compose.yaml", "docker-compose.yml")
_OVERRIDES = {
    "compose.yaml": ("compose.override.yaml", "compose.override.yml"),
    "compose.yml": ("compose.override.yaml", "compose.override.yml"),
    "docker-compose.yaml": ("docker-compose.override.yaml", "docker-compose.override.yml"),
    "docker-compose.yml": ("docker-compose.override.yml", "docker-compose.override.yaml"),
}

# Inside the container: read the environment file ($0), then become the rank.
ENTRY = '. "$0" && exec "$@"'
HOST_PYTHON_IN_CONTAINER = "python3"
NO_START = 125  # the engines' own code for "the container did not run"
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]+")


def providers(wanted: str | None) -> tuple[Provider, ...]:
    """The tools to try, in order: all of them, or the one ``FLODL_COMPOSE`` names."""
    if not wanted:
        return PROVIDERS
    chosen = tuple(p for p in PROVIDERS if p.name == wanted.strip())
    if not chosen:
        names = ", ".join(p.name for p in PROVIDERS)
        raise ValueError(f"{PROVIDER_ENV}={wanted!r} names no compose tool (one of: {names})")
    return chosen


def compose_files(
    cwd: PurePath, env: Mapping[str, str], is_file: Callable[[PurePath], bool]
) -> list[PurePath]:
    """The project's compose files, found as ``docker compose`` finds them: ``COMPOSE_FILE``
    (split on ``COMPOSE_PATH_SEPARATOR``, default ``:``; relative to ``cwd``), else the first
    default name in ``cwd`` or its nearest parent that has one, plus that file's override.
    Empty when there is none."""
    listed = env.get("COMPOSE_FILE", "")
    if listed:
        separator = env.get("COMPOSE_PATH_SEPARATOR") or ":"
        return [cwd / part for part in listed.split(separator) if part]
    for where in (cwd, *cwd.parents):
        for name in DEFAULT_FILES:
            if is_file(where / name):
                override = next((where / o for o in _OVERRIDES[name] if is_file(where / o)), None)
                return [where / name] + ([override] if override is not None else [])
    return []


def services_in(documents: Iterable[Any]) -> set[str]:
    """The service names the compose files (parsed YAML) declare."""
    names: set[str] = set()
    for doc in documents:
        services = doc.get("services") if isinstance(doc, dict) else None
        if isinstance(services, dict):
            names.update(str(name) for name in services)
    return names


@dataclass(frozen=True)
class Container:
    """One container of the service: a rank, or the publish gate's build."""

    service: str
    name: str
    workdir: str  # mounted at the same path, and the working directory
    user: str  # "uid:gid": the private directory and the mounts are this user's
    mounts: tuple[tuple[str, bool], ...] = ()  # (path, read-only), each at the same path
    host_network: bool = True
    gpu: str = ""  # "", "nvidia" or "amd"
    groups: tuple[int, ...] = ()  # host group ids the GPU device nodes need (AMD: video, render)
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def ipc_host(self) -> bool:
        # NCCL between this host's ranks (one container each) meets in /dev/shm and CUDA IPC.
        return bool(self.gpu)


def _volumes(box: Container) -> list[str]:
    """The working directory and the mounts, each at the same path; ``:ro`` where read-only."""
    volumes, seen = [], set()
    for path, read_only in ((box.workdir, False), *box.mounts):
        if path == "/":
            raise ValueError("cannot mount / into a container: run from the project directory")
        if path not in seen:  # one mount per target: compose refuses a second
            seen.add(path)
            volumes.append(f"{path}:{path}" + (":ro" if read_only else ""))
    return volumes


def _gpu_keys(provider: Provider, box: Container) -> dict[str, Any]:
    """How the service gets the GPUs: CDI or device nodes (``devices``), or a reservation."""
    if box.gpu == "nvidia" and provider.gpu_cdi:
        return {"devices": ["nvidia.com/gpu=all"]}  # CDI (nvidia-ctk cdi generate): indices stay the host's
    if box.gpu == "nvidia":
        reservation = {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}
        return {"deploy": {"resources": {"reservations": {"devices": [reservation]}}}}
    if box.gpu == "amd":
        return {"devices": ["/dev/kfd", "/dev/dri"]}
    return {}


def _sharing_keys(provider: Provider, box: Container) -> dict[str, Any]:
    """The host IPC namespace and the GPU nodes' groups, where the tool reads the keys."""
    keys: dict[str, Any] = {}
    if not provider.podman_compose:  # podman-compose 1.0.3 reads neither key: see run_argv
        if box.ipc_host:
            keys["ipc"] = "host"
        if box.groups:
            keys["group_add"] = [str(g) for g in box.groups]
    return keys


def override(provider: Provider, box: Container) -> dict[str, Any]:
    """The second compose file: what this container needs on top of the project's service."""
    service: dict[str, Any] = {
        "init": True,
        "user": box.user,
        "working_dir": box.workdir,
        "volumes": _volumes(box),
        "labels": dict(box.labels),
    }
    if box.host_network:
        service["network_mode"] = "host"
    service.update(_gpu_keys(provider, box))
    service.update(_sharing_keys(provider, box))
    return {"services": {box.service: service}}


def run_argv(
    provider: Provider,
    files: Sequence[PurePath | str],
    override_file: PurePath | str,
    box: Container,
    env_file: PurePath | str,
    command: Sequence[str],
    podman_shim: PurePath | str | None = None,
) -> list[str]:
    """``compose -f … -f OVERRIDE run`` of one container; no environment value in it."""
    argv = list(provider.argv)
    if provider.podman_compose:
        if podman_shim is not None and box.host_network:
            argv += ["--podman-path", str(podman_shim)]
        extra = (["--ipc=host"] if box.ipc_host else []) + [f"--group-add={g}" for g in box.groups]
        if extra:
            argv.append(f"--podman-run-args={' '.join(extra)}")
    for path in (*files, override_file):
        argv += ["-f", str(path)]
    # No --rm: the engine keeps the exit code (podman-compose 1.0.3's run always exits 0);
    # the agent reads it, then removes the container.
    return [*argv, "run", "-T", "--no-deps", "--name", box.name, box.service, "sh", "-c", ENTRY,
            str(env_file), *command]  # fmt: skip


def env_script(env: Mapping[str, str]) -> str:
    """The environment as ``export`` lines for ``sh`` (any value, newlines included)."""
    lines = []
    for key, value in sorted(env.items()):
        if not _IDENTIFIER.match(key):
            raise ValueError(f"`{key}` is not an environment variable name a container can take")
        lines.append(f"export {key}={shlex.quote(value)}\n")
    return "".join(lines)


def container_env(env: Mapping[str, str], user_env: Mapping[str, str]) -> dict[str, str]:
    """A rank's environment inside the service: the image keeps its own PATH (this box's venv
    is not in it) unless the cluster's or the box's env: entries set one."""
    return {k: v for k, v in env.items() if k != "PATH" or "PATH" in user_env}


def container_command(command: Sequence[str], host_python: str) -> list[str]:
    """The rank's command inside the service: the agent's own interpreter (a Python entry point
    runs under it on the box) becomes the image's python3."""
    if command and command[0] == host_python:
        return [HOST_PYTHON_IN_CONTAINER, *command[1:]]
    return list(command)


def container_name(launch: str, token: str, rank: int | str) -> str:
    """``flodl-<launch>-<token>-r<rank>``: per launch and rank, unique per attempt (``token``)."""
    slug = _NAME_UNSAFE.sub("-", launch).strip("-.")[:24]
    return "-".join(part for part in ("flodl", slug, token, f"r{rank}") if part)


def inspect_argv(engine: str, name: str) -> list[str]:
    return [engine, "inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", name]


def exit_code(inspected: str | None, client_code: int) -> int:
    """The container's exit code from ``inspect_argv``'s output; a container that never ran
    (not there, or only created) is the client's failure, never a success."""
    status, _, code = (inspected or "").strip().partition(" ")
    if status == "exited" and code.lstrip("-").isdigit():
        return int(code)
    return client_code or NO_START


def stop_argv(engine: str, names: Sequence[str], grace: float) -> list[str]:
    """SIGTERM (through init), then SIGKILL after ``grace`` seconds."""
    return [engine, "stop", "-t", str(max(1, round(grace))), *names]


def remove_argv(engine: str, names: Sequence[str]) -> list[str]:
    return [engine, "rm", "-f", *names]


def repair_podman_args(args: Sequence[str]) -> list[str] | None:
    """What the podman shim runs for podman-compose 1.0.3 under host networking (None: answer
    success without running podman).

    Its ``run`` follows the service's ``--network host`` with the project's default network
    (``--net NAME --network-alias SERVICE``), which podman refuses (later releases fixed it):
    that first pair goes when ``--network host`` comes before it. The network itself is never
    used, so ``network exists`` says yes and none is made (ranks starting at once would race to
    create it). Nothing else changes.
    """
    out = list(args)
    if out[:2] == ["network", "exists"]:
        return None
    for i in range(len(out) - 3):
        if out[i] == "--net" and out[i + 2] == "--network-alias":
            if any(a == "--network" and b == "host" for a, b in pairwise(out[:i])):
                del out[i : i + 4]
            break
    return out

"""Ranks in a compose service, and the publish gate's build there: the IO around :mod:`.compose`.

The compose tool is found once per process (``FLODL_COMPOSE`` pins one), the project as that
tool finds it (``COMPOSE_FILE``, else the working directory and its parents), and the service
is checked in it before anything starts. Every container is named; whatever way a run ends,
the names are stopped (SIGTERM through init, SIGKILL after the grace) and removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from ..errors import Failure
from ..protocol.messages import vendor_of
from ..retry import Permanent, Transient
from .compose import (
    DEFAULT_FILES,
    PROVIDER_ENV,
    Container,
    Provider,
    compose_files,
    container_command,
    container_env,
    container_name,
    env_script,
    exit_code,
    inspect_argv,
    override,
    providers,
    remove_argv,
    run_argv,
    services_in,
    stop_argv,
)
from .rank_env import Box, box_env

if TYPE_CHECKING:
    from ..protocol.messages import WorldFormed
    from .options import AgentOptions

RANKS_FIELD = "docker (join.docker, or workers[].docker in the cluster file)"
DETECT_TIMEOUT = 30.0
ENGINE_TIMEOUT = 60.0
SHIM = """#!{python}
# podman for podman-compose 1.0.3 under host networking (flodl_agent.agent.compose.repair_podman_args).
import os, sys
from flodl_agent.agent.compose import repair_podman_args
args = repair_podman_args(sys.argv[1:])
if args is None:
    sys.exit(0)
os.execv({podman!r}, [{podman!r}, *args])
"""
_found: dict[tuple[str, str], Provider] = {}


class ComposeError(Failure):
    """The compose service cannot be used: nothing was started in it."""


class NoComposeTool(ComposeError):
    """What the box lacks (no compose tool answers), not what a run names."""


@dataclass(frozen=True)
class Project:
    provider: Provider
    files: tuple[Path, ...]
    service: str


class _Tags(yaml.SafeLoader):
    """Compose files may carry compose's own tags (``!reset``, ``!override``): read past them."""


_Tags.add_multi_constructor("!", lambda loader, suffix, node: None)


def _answers(argv: list[str], env: Mapping[str, str]) -> bool:
    try:
        proc = subprocess.run(
            argv, env=dict(env), stdin=subprocess.DEVNULL, capture_output=True, timeout=DETECT_TIMEOUT
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return proc.returncode == 0


def find_provider(env: Mapping[str, str], field: str) -> Provider:
    """The first compose tool that answers, with an engine that answers (cached per process)."""
    wanted, path = env.get(PROVIDER_ENV, ""), env.get("PATH", os.defpath)
    if (wanted, path) in _found:
        return _found[(wanted, path)]
    try:
        order = providers(wanted)
    except ValueError as exc:
        raise NoComposeTool(f"{field}: {exc}", f"unset {PROVIDER_ENV}, or name one of those tools") from None
    for candidate in order:
        if shutil.which(candidate.argv[0], path=path) is None:
            continue
        engine = candidate.engine
        if engine == "docker" and not shutil.which("docker", path=path) and shutil.which("podman", path=path):
            engine = "podman"  # docker-compose against podman's socket
        if _answers([*candidate.argv, "version"], env) and _answers([engine, "version"], env):
            _found[(wanted, path)] = replace(candidate, engine=engine)
            return _found[(wanted, path)]
    names = ", ".join(p.name for p in order)
    raise NoComposeTool(
        f"{field}: no compose tool answers on this box (looked for {names}, in that order, each "
        "with its engine)",
        "install one (Debian: apt-get install podman-compose), or drop the field to run on the box itself",
    )


def find_project(service: str, cwd: Path, env: Mapping[str, str], field: str) -> Project:
    """The provider, the project's compose files and the service checked in them."""
    provider = find_provider(env, field)
    files = [Path(f) for f in compose_files(cwd, env, lambda p: Path(p).is_file())]
    if not files:
        raise ComposeError(
            f"{field}: `{service}`: no compose file in {cwd} or above it ({', '.join(DEFAULT_FILES)})",
            "run from the project directory (a fan-out worker runs in its path:), or set COMPOSE_FILE "
            "(in env:) to the project's compose file",
        )
    documents = []
    for file in files:
        try:
            documents.append(yaml.load(file.read_text(), Loader=_Tags))  # a SafeLoader
        except OSError as exc:
            raise ComposeError(
                f"{field}: cannot read the compose file {file} ({exc.strerror or exc})",
                "check COMPOSE_FILE and the file's permissions",
            ) from None
        except yaml.YAMLError as exc:
            raise ComposeError(f"{field}: {file} is not YAML ({exc})", "fix the compose file") from None
    names = services_in(documents)
    if service not in names:
        listed = ", ".join(sorted(names)) or "none"
        raise ComposeError(
            f"{field}: no service `{service}` in {', '.join(map(str, files))} (its services: {listed})",
            "name one of its services, or add the service to the compose file",
        )
    return Project(provider, tuple(files), service)


def _user() -> str:
    return f"{os.getuid()}:{os.getgid()}"


def _gpu_groups() -> tuple[int, ...]:
    """The host's video and render groups: the AMD device nodes' owners (numbers: the image's
    /etc/group need not know the names)."""
    gids = []
    for name in ("video", "render"):
        with contextlib.suppress(KeyError):
            gids.append(grp.getgrnam(name).gr_gid)
    return tuple(gids)


def _write(path: Path, text: str, mode: int = 0o600) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


async def _engine(argv: list[str], env: Mapping[str, str], timeout: float = ENGINE_TIMEOUT) -> str | None:
    """An engine command's output, or None when it failed."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
    except OSError:
        return None
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return None
    return out.decode(errors="replace") if proc.returncode == 0 else None


def client_env(options: AgentOptions, world_env: Mapping[str, str]) -> dict[str, str]:
    """The compose tool's own environment: the agent's, less the credential and our plumbing,
    with the env: entries (COMPOSE_FILE may be one)."""
    own = Box(base=dict(os.environ), path=os.environ.get("PATH", os.defpath))
    return box_env(own) | dict(world_env) | options.env


async def check_service(
    service: str, options: AgentOptions, cwd: Path | None, world_env: Mapping[str, str], run: bool = False
) -> Project:
    """Before anything starts: the tool, the project and the service. A Permanent failure, but
    for what ``run`` supplies (the cluster file's service, the published tree's compose file, the
    launch's env): a Transient one, the run's own failure (the next run may be fine)."""
    where = (cwd or Path.cwd()).absolute()
    if where == Path("/"):
        raise Permanent(
            f"{RANKS_FIELD}: the ranks' working directory is /, which no container can mount",
            "run the agent from the project directory (flodl-join.service runs in flodl_worker_home)",
        )
    if options.data_path == "/":
        raise Permanent(f"{RANKS_FIELD}: data_path is /, which no container can mount", "name the data root")
    kind = Transient if run else Permanent
    try:
        env_script({**world_env, **options.env})  # every name one a container can take
        return await asyncio.to_thread(
            find_project, service, where, client_env(options, world_env), RANKS_FIELD
        )
    except ValueError as exc:
        raise kind(f"{RANKS_FIELD}: {exc}", "check the cluster's and this box's env:") from None
    except ComposeError as exc:
        raise (Permanent if isinstance(exc, NoComposeTool) else kind)(exc.message, exc.fix) from None


class ComposeRanks:
    """This attempt's ranks in the service: started, their exit codes read, stopped and removed."""

    def __init__(
        self,
        project: Project,
        options: AgentOptions,
        world: WorldFormed,
        variant: str,
        cwd: Path | None,
        log: Callable[[str], None],
    ) -> None:
        self.project, self.log = project, log
        self.env = client_env(options, world.env)
        self.user_env = {**world.env, **options.env}
        self.cwd = (cwd or Path.cwd()).absolute()
        self.vendor = {"cuda": "nvidia", "rocm": "amd"}.get(vendor_of(variant), "")
        self.data_path = options.data_path
        self.labels = {
            "flodl.host": options.host,
            "flodl.launch": world.launch,
            "flodl.agent": str(os.getpid()),
        }
        self.token = secrets.token_hex(3)
        self.launch = world.launch
        self.live: dict[int, str] = {}  # rank -> its container, until removed
        self.clients: list[asyncio.subprocess.Process] = []
        # A rank's own removal, in flight: stop() waits for it. Cut mid-way (its task cancelled
        # when the agent exits, and asyncio kills the engine command with its transport), it can
        # leave the container behind while stop()'s removal of the same name fails beside it.
        self._removing: set[asyncio.Future[str | None]] = set()
        self._stopping = False  # stop() began: it removes every container itself

    def _shim(self, directory: Path) -> Path | None:
        podman = shutil.which("podman", path=self.env.get("PATH"))
        if podman is None:
            return None
        shim = directory / "podman"
        if not shim.exists():
            _write(shim, SHIM.format(python=sys.executable, podman=podman), 0o700)
        return shim

    async def start(
        self, rank: int, command: list[str], env: dict[str, str], directory: Path
    ) -> asyncio.subprocess.Process:
        """One rank's ``compose run`` (the client process); ``directory``: the run's private one."""
        provider = self.project.provider
        device = env.get("FLODL_DEVICE", "")
        box = Container(
            service=self.project.service,
            name=container_name(self.launch, self.token, rank),
            workdir=str(self.cwd),
            user=_user(),
            mounts=((str(directory), False),) + (((self.data_path, True),) if self.data_path else ()),
            gpu=self.vendor if device.startswith("cuda:") else "",
            groups=_gpu_groups() if self.vendor == "amd" and device.startswith("cuda:") else (),
            labels={**self.labels, "flodl.rank": str(rank)},
        )
        env_file, override_file = directory / f"env-{rank}", directory / f"compose-{rank}.yml"
        _write(env_file, env_script(container_env(env, self.user_env)))  # names checked by check_service
        _write(override_file, yaml.safe_dump(override(provider, box), sort_keys=False))
        shim = self._shim(directory) if provider.podman_compose else None
        argv = run_argv(
            provider,
            self.project.files,
            override_file,
            box,
            env_file,
            container_command(command, sys.executable),
            shim,
        )
        self.live[rank] = box.name
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=self.env,
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.clients.append(proc)
        if len(self.live) == 1:
            self.log(f"ranks run in the compose service {box.service} ({provider.name}, {box.name} …)")
        return proc

    async def exit_code(self, rank: int, client_code: int) -> int:
        """The rank's own exit code, as the engine kept it; then its container goes."""
        name = self.live.get(rank)
        if name is None:
            return client_code
        engine = self.project.provider.engine
        inspected = await _engine(inspect_argv(engine, name), self.env)
        if not self._stopping:
            removal = asyncio.ensure_future(_engine(remove_argv(engine, [name]), self.env))
            self._removing.add(removal)
            removal.add_done_callback(self._removing.discard)
            await asyncio.shield(removal)  # cancelled, this rank still goes; stop() waits for it
            self.live.pop(rank, None)  # only now: a cancelled read leaves it to stop()
        return exit_code(inspected, client_code)

    async def stop(self, grace: float) -> None:
        """Stop and remove every container still there; clients that outlive theirs are killed."""
        self._stopping = True
        names = list(self.live.values())
        engine = self.project.provider.engine
        if names:
            await _engine(stop_argv(engine, names, grace), self.env, grace + ENGINE_TIMEOUT)
        for proc in self.clients:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # no client may create a container now
        # A rank's own removal goes first: two removals of one container collide in the engine.
        await asyncio.gather(*self._removing, return_exceptions=True)
        if names:
            # Also whatever a client created after the stop above (a rank that was still starting).
            await _engine(remove_argv(engine, names), self.env)
        self.live.clear()

    def again(self) -> None:
        """The world re-formed: the next ranks' containers are watched and removed as the first were."""
        self._stopping = False
        self.clients = [proc for proc in self.clients if proc.returncode is None]


def run_in_service(
    service: str,
    command: list[str],
    workdir: Path,
    mounts: tuple[Path, ...],
    env: Mapping[str, str],
    field: str,
    timeout: float | None = None,
) -> tuple[int, str]:
    """``command`` in ``service`` (the publish gate's build or model probe): ``workdir`` and
    ``mounts`` at the same paths, ``env`` its whole environment on top of the image's; its exit
    code and output. Raises ComposeError when the service cannot be used, TimeoutError."""
    client = dict(os.environ)
    project = find_project(service, Path.cwd(), client, field)
    provider = project.provider
    name = container_name("gate", secrets.token_hex(3), "0")
    with tempfile.TemporaryDirectory(prefix="flodl-gate-") as scratch:
        private = Path(scratch)
        box = Container(
            service=service,
            name=name,
            workdir=str(workdir),
            user=_user(),
            mounts=(*((str(m), False) for m in mounts), (str(private), True)),
            host_network=False,  # a build reaches out (pip, git) through the service's own network
            labels={"flodl.gate": str(workdir)},
        )
        try:
            _write(private / "env", env_script(env))
        except ValueError as exc:
            raise ComposeError(f"{field}: {exc}", "check the environment the gate passes") from None
        _write(private / "compose.yml", yaml.safe_dump(override(provider, box), sort_keys=False))
        argv = run_argv(provider, project.files, private / "compose.yml", box, private / "env", command)
        try:
            proc = subprocess.run(
                argv,
                env=client,
                cwd=Path.cwd(),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
                start_new_session=True,
            )
            inspected = subprocess.run(
                inspect_argv(provider.engine, name), capture_output=True, text=True, env=client
            )
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{shlex.join(command)} did not end within {timeout:.0f}s") from None
        finally:
            subprocess.run(remove_argv(provider.engine, [name]), capture_output=True, env=client)
    code = exit_code(inspected.stdout if inspected.returncode == 0 else None, proc.returncode)
    return code, (proc.stdout + proc.stderr).strip()

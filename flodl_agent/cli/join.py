"""`fdl join`: walk into a join window and run this box's ranks.

The shell reads ./fdl.yml, the launcher's spec, the token and the host name;
``options.resolve_join`` decides what wins.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

import click

from ..agent.agent import join as run_join
from ..agent.options import AgentOptions
from ..agent.spec import AgentSpec, decode
from ..config import Join
from ..config.source import MAX_BYTES
from ..credentials import CredentialError, stdin_line
from ..hardware.libtorch import reexec, settle
from ..retry import AgentFailure
from .common import (
    FilePath,
    RunExit,
    TailCommand,
    err,
    fail,
    load,
    log,
    option_error,
    project_file,
    token_or_exit,
)
from .options import JoinFlags, OptionError, resolve_join, resolve_libtorch

# A spec is a worker entry of a cluster file (at most MAX_BYTES) and a key, hex-encoded.
SPEC_LINE_MAX = 2 * MAX_BYTES + 256


def read_spec(from_stdin: bool, command: str = "join") -> AgentSpec:
    """The launcher's spec: the fan-out session's stdin (one bounded line), else
    FLODL_INTERNAL_AGENT_JSON."""
    try:
        raw = stdin_line(SPEC_LINE_MAX, "--spec-stdin") if from_stdin else None
    except CredentialError as exc:
        fail(command, str(exc))
    raw = raw if raw is not None else os.environ.get("FLODL_INTERNAL_AGENT_JSON", "")
    if not raw.strip():
        if from_stdin:
            fail(command, "--spec-stdin got no spec on stdin")
        return AgentSpec()
    try:
        return decode(raw)
    except ValueError as exc:
        fail(command, str(exc))


def join_block(config_file: Path | None) -> Join:
    path = project_file(config_file)
    if path is None:
        return Join()
    return load(path, None, False).config.join or Join()


def pick_variant(flag: str | None, block: Join, devices: str | None = None) -> None:
    """join.libtorch / --libtorch: become the chosen variant's fdl when it is not this one.
    A CPU offer (--devices / join.devices cpu:N) makes ``auto`` a CPU box's choice."""
    try:
        wanted = resolve_libtorch(flag, block)
    except OptionError as exc:
        option_error("join", exc)
    if wanted is None:
        return
    try:
        cpu_offer = (
            devices.startswith("cpu")
            if devices is not None
            else bool(block.devices and block.devices.kind == "cpu")
        )
        target = settle(wanted, block.torch_sources, log, cpu_offer=cpu_offer)
        if target is not None:
            variant, venv = target
            log(f"libtorch {wanted}: running the join from {venv}")
            reexec(venv, sys.argv, variant)
    except AgentFailure as exc:
        fail("join", exc.message, exc.fix or None, exc.code)


class _JoinCommand(TailCommand):
    usage = "[OPTIONS] [ADDRESS] [-- ARGS...]"  # ARGS: --bin's, verbatim; never the address


@click.command(name="join", cls=_JoinCommand)
@click.argument("address", required=False)
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="fdl.yml whose join: block supplies the defaults (default: ./fdl.yml if present).",
)
@click.option(
    "--token",
    "token_opt",
    metavar="-",
    help="`-` reads the run's join.token from stdin (or set FDL_TOKEN); the box dials with its name's key.",
)
@click.option(
    "--ssh", "ssh_dest", metavar="[USER@]HOST[:PORT]", help="Dial through an ssh -L forward (CPU plane only)."
)
@click.option("--identity", type=FilePath(path_type=Path, dir_okay=False), help="ssh key for --ssh.")
@click.option(
    "--tls-fingerprint",
    "pin",
    metavar="SHA256",
    help="The controller serves TLS: pin its certificate (default: FDL_TLS_FINGERPRINT, else "
    "join.tls_fingerprint).",
)
@click.option(
    "--host",
    "host_name",
    help="This box's name in the roster (default: hostname): up to 253 characters, no spaces, / \\ : @; "
    "a join.host_key holds for its own name only.",
)
@click.option("--devices", help="Devices to offer: 0,1 | all | cpu:N, at most 1024 (default: every GPU).")
@click.option("--persist/--no-persist", default=None, help="Re-dial with backoff until a permanent failure.")
@click.option(
    "--model-probe/--no-model-probe",
    default=None,
    help="Before each dial, run this box's own entry (--bin, join.source) once to learn the model it "
    "builds, so the window refuses a box whose model differs (default: on; cached until the entry changes).",
)
@click.option(
    "--controller-grace",
    type=click.IntRange(0, 86400),
    help="Seconds this box's ranks train on when the controller goes away mid-run, re-dialling "
    "to resume in its launch (default: join.controller_grace, else the launch's; 0: stop them at once).",
)
@click.option(
    "--bin",
    "entry",
    metavar="PATH",
    help="This box's own entry point; with the ARGS after --, its ranks' command instead of the "
    "launch's (a .py file that is not executable runs under this venv's python).",
)
@click.option(
    "--docker",
    metavar="SERVICE",
    help="Run this box's ranks in this compose service (the project's compose file: the working "
    "directory's or COMPOSE_FILE; docker compose, docker-compose, podman-compose or podman compose).",
)
@click.option(
    "--libtorch",
    metavar="VARIANT",
    help="Torch variant to run in: auto | cpu | cuNNN | rocmX.Y (acquired when missing).",
)
@click.option("--backoff", type=click.FloatRange(0.1, 60), default=5.0, hidden=True)
@click.option("--spec-stdin", is_flag=True, hidden=True, help="Read a launcher's agent spec from stdin.")
@click.option("--tag", hidden=True, help="Marks a fan-out agent so the next launch can clean up orphans.")
def join_cmd(
    address: str | None,
    config_file: Path | None,
    token_opt: str | None,
    ssh_dest: str | None,
    identity: Path | None,
    pin: str | None,
    host_name: str | None,
    devices: str | None,
    persist: bool | None,
    model_probe: bool | None,
    controller_grace: int | None,
    entry: str | None,
    docker: str | None,
    libtorch: str | None,
    backoff: float,
    spec_stdin: bool,
    tag: str | None,
) -> None:
    """Walk into a join window at ADDRESS (host:port) and run this box's ranks.

    The ranks run the launch's command, or this box's own: `--bin PATH -- ARGS`
    (join.bin, join.args), ARGS passed verbatim; a published run this box fetched
    (join.source) wins over both. ARGS need --bin. The controller logs and shows
    each host's command: keep secrets out of it (join.env is not shown).

    Through --ssh (an ssh -L forward) only the CPU plane runs: a forward cannot
    carry an NCCL mesh, and an NCCL window refuses the box.

    Every flag defaults from the join: block of fdl.yml. Exit 0 clean, 1
    transient (re-dial), 2 permanent. SIGINT, SIGTERM and SIGHUP end the ranks
    (exit 1); SIGUSR1 cuts a backoff short.
    """
    # A launcher's spec is the whole story: a stray ./fdl.yml on the worker must not reroute it.
    block = Join() if spec_stdin else join_block(config_file)
    # Before stdin is read (a --token - or --spec-stdin line): the re-exec'd agent reads it.
    pick_variant(libtorch, block, devices)
    spec = read_spec(spec_stdin)
    flags = JoinFlags(
        address=address,
        token=token_or_exit(token_opt),
        ssh=ssh_dest,
        identity=identity,
        pin=pin,
        env_pin=os.environ.get("FDL_TLS_FINGERPRINT"),
        host=host_name,
        devices=devices,
        persist=persist,
        bin=entry,
        args=tuple(click.get_current_context().meta["tail"] or ()),
        docker=docker,
        model_probe=model_probe,
        controller_grace=controller_grace,
    )
    try:
        settings = resolve_join(flags, spec, block, socket.gethostname())
    except OptionError as exc:
        option_error("join", exc)
    for note in settings.notes:
        log(note)
    options = AgentOptions(
        controller_host=settings.controller_host,
        controller_port=settings.controller_port,
        key=settings.key,
        host=settings.host,
        devices=settings.devices,
        bin=settings.bin,
        ssh=settings.ssh,
        tunnel=settings.tunnel,
        data_path=settings.data_path,
        env=settings.env,
        socket_ifname=settings.socket_ifname,
        source=settings.source,
        data_source=settings.data_source,
        args=settings.args,
        tls_fingerprint=settings.tls_fingerprint,
        gpu_ram_share=settings.gpu_ram_share,
        docker=settings.docker,
        model_probe=settings.model_probe,
        controller_grace=settings.controller_grace,
    )
    spinner = err.status(f"admitted as {options.host}; waiting for the world to form")

    def on_wait(waiting: bool) -> None:
        if err.is_terminal:
            (spinner.start if waiting else spinner.stop)()

    async def main() -> int:
        # SIGTERM (systemd stop, a launcher's orphan clean-up) and SIGHUP (its ssh session
        # gone) must end the ranks too, as Ctrl-C does (asyncio.run cancels on it):
        # cancelling unwinds through the attempt's clean-up, which kills them.
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if task is not None:
                loop.add_signal_handler(sig, task.cancel)
        try:
            return await run_join(
                options, persist=settings.persist, log=log, backoff_start=backoff, on_wait=on_wait
            )
        except asyncio.CancelledError:
            log("stopped by a signal; ranks ended")
            return 1

    raise RunExit(asyncio.run(main()))  # a failed write to stdout (rank lines) changes no code

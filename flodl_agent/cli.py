"""``fdl``: the operator's command line.

Thin shell: parse flags, call the pure cores, print with rich. Exit codes:
0 success, 1 invalid input or a failed operation, 2 usage error, 70 a bug.
"""

from __future__ import annotations

import asyncio
import difflib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any, NoReturn

import click
from pydantic import ValidationError
from pydantic_core import PydanticCustomError
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from . import __version__
from .agent import AgentOptions, AgentSpec, parse_agent_spec
from .agent import join as run_join
from .config import (
    Cluster,
    ConfigError,
    DeviceOffer,
    FdlConfig,
    Join,
    Loaded,
    Problem,
    Ssh,
    load_config,
    parse_devices,
)
from .controller import Controller, parse_max_failure
from .launcher import LaunchError, LaunchOptions
from .launcher import launch as run_launch
from .net import AddressError, join_address, split_address
from .probe import Finding
from .ranks import known_ranks, plan_window
from .status import Unreachable, one_line, read_token, render, request, resolve_addr, resolve_pin

EXAMPLES = ("lab", "reference")

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _print_problems(problems: list[Problem]) -> None:
    for problem in problems:
        style = "red" if problem.severity == "error" else "yellow"
        err.print(problem.render(), style=style, markup=False)


def _emit_json(payload: Any) -> None:
    click.echo(json.dumps(payload, indent=2))


def _load(file: Path, base: Path | None, as_json: bool) -> Loaded:
    try:
        return load_config(file, base)
    except ConfigError as exc:
        if as_json:
            _emit_json({"valid": False, "errors": [p.as_dict() for p in exc.problems], "warnings": []})
        else:
            _print_problems(list(exc.problems))
        raise SystemExit(1) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "-V", "--version", prog_name="fdl")
def cli() -> None:
    """flodl fleet: stand up and run multi-host training fleets."""


@cli.group()
def config() -> None:
    """Check, show and describe fdl.yml / fdl.cluster.yml."""


file_arg = click.argument("file", type=click.Path(path_type=Path, dir_okay=False))
base_opt = click.option(
    "--base",
    type=click.Path(path_type=Path, dir_okay=False),
    help="fdl.yml to deep-merge FILE onto (the overlay rule).",
)
json_opt = click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")


@config.command("check")
@file_arg
@base_opt
@json_opt
def config_check(file: Path, base: Path | None, as_json: bool) -> None:
    """Validate FILE. Exit 0 valid, 1 invalid; warnings go to stderr."""
    loaded = _load(file, base, as_json)
    if as_json:
        _emit_json({"valid": True, "errors": [], "warnings": [w.as_dict() for w in loaded.warnings]})
        return
    _print_problems(loaded.warnings)
    out.print(f"ok: {' + '.join(loaded.files)}: {_summary(loaded.config)}", markup=False)


def _summary(config: FdlConfig) -> str:
    parts = []
    if config.cluster is not None:
        capacity = config.cluster.capacity
        ranks = "ranks known at dispatch" if capacity is None else f"{capacity} ranks"
        parts.append(f"cluster with {len(config.cluster.workers)} workers, {ranks}")
    if config.join is not None:
        parts.append("join block")
    if config.publish is not None:
        parts.append("publish block")
    return ", ".join(parts) or "nothing configured"


def _redacted(config: FdlConfig) -> dict[str, Any]:
    """Secrets never reach a terminal or a log: show that a token is set, not what it is."""
    data = config.model_dump(mode="json", by_alias=True)
    blocks = [data["join"]]
    if config.cluster is not None:
        blocks.append(data["cluster"]["controller"]["join"])
    for block in blocks:
        if block and block.get("token"):
            block["token"] = "<redacted>"
    return data


def _show_payload(config: FdlConfig) -> dict[str, Any]:
    payload: dict[str, Any] = {"config": _redacted(config)}
    cluster = config.cluster
    if cluster is not None:
        starts = {r.host: (r.start, r.stop) for r in known_ranks(cluster)}
        payload["capacity"] = cluster.capacity
        payload["workers"] = [
            {
                "host": w.host,
                "devices": w.local_devices.to_data(),
                "capacity": w.capacity,
                "ranks": list(starts[w.host]) if w.host in starts else None,
            }
            for w in cluster.workers
        ]
        plan = plan_window(cluster.controller.join, cluster.capacity)
        payload["window"] = {
            "quorum": plan.quorum,
            "target": plan.target,
            "join_timeout": plan.join_timeout,
            "max_join_timeout": plan.max_join_timeout,
            "start": plan.start,
        }
    return payload


@config.command("show")
@file_arg
@base_opt
@json_opt
def config_show(file: Path, base: Path | None, as_json: bool) -> None:
    """Print FILE normalized, with rank capacity, rank ranges and the window plan."""
    loaded = _load(file, base, as_json)
    payload = _show_payload(loaded.config)
    if as_json:
        _emit_json(payload)
        return
    _print_problems(loaded.warnings)
    cluster = loaded.config.cluster
    if cluster is None:
        out.print_json(json.dumps(payload["config"]))
        return
    ctl = cluster.controller
    out.print(f"controller {ctl.host}:{ctl.port}", markup=False)
    table = Table("host", "devices", "ranks", "nccl_socket_ifname", "path", "arch")
    for worker, row in zip(cluster.workers, payload["workers"], strict=True):
        ranks = "at dispatch" if row["ranks"] is None else f"[{row['ranks'][0]}..{row['ranks'][1]})"
        table.add_row(
            worker.host,
            str(worker.local_devices),
            ranks,
            worker.nccl_socket_ifname or "-",
            worker.path or ctl.path or "-",
            worker.arch or "-",
        )
    out.print(table)
    w = payload["window"]
    quorum = "at dispatch" if w["quorum"] is None else w["quorum"]
    target = "none (holds for the window)" if w["target"] is None else w["target"]
    out.print(
        f"window: start {w['start']}, quorum {quorum}, target {target}, "
        f"join_timeout {w['join_timeout']}s, hard cap {w['max_join_timeout']}s",
        markup=False,
    )


@config.command("schema")
def config_schema() -> None:
    """Print the JSON Schema of fdl.yml / fdl.cluster.yml (for editors and CI)."""
    schema = FdlConfig.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "flodl fleet configuration (fdl.yml, fdl.cluster.yml)"
    _emit_json(schema)


@config.command("example")
@click.argument("name", type=click.Choice(EXAMPLES), default="reference")
def config_example(name: str) -> None:
    """Print an example cluster file: `reference` (every field) or `lab` (the lab fleet)."""
    text = resources.files("flodl_agent").joinpath(f"examples/{name}.fdl.cluster.yml").read_text()
    click.echo(text, nl=False)


def _log(line: str) -> None:
    err.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {escape(line)}")


async def _live_roster(controller: Controller) -> None:
    """A spinner with the roster while the window is open (terminals only)."""
    with err.status("opening the join window") as spinner:
        while controller.window.phase in ("waiting", "staging"):
            spinner.update(escape(one_line(controller.summary())))
            await asyncio.sleep(0.5)  # the display's refresh interval


def _token_or_exit(option: str | None) -> str | None:
    try:
        return read_token(option)
    except ValueError as exc:
        err.print(f"fdl: {exc}", style="red", markup=False)
        raise SystemExit(2) from None


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=Path("fdl.cluster.yml"),
    show_default=True,
    help="Cluster file to launch.",
)
@base_opt
@click.option("--bind", help="Bind address (default: cluster.controller.host).")
@click.option(
    "--port", type=click.IntRange(0, 65535), help="Port (default: cluster.controller.port; 0 picks one)."
)
@click.option(
    "--plane",
    type=click.Choice(["cpu", "nccl"]),
    default="cpu",
    show_default=True,
    help="Data plane the run uses; nccl refuses CPU offers and mixed GPU vendors.",
)
@click.option(
    "--fanout/--no-fanout",
    default=True,
    show_default=True,
    help="Start an agent on every configured worker over ssh. --no-fanout when the workers run "
    "their own join unit (fdl join --persist).",
)
@click.option(
    "--max-failure",
    default="0",
    show_default=True,
    callback=lambda _ctx, _param, value: _max_failure(value),
    help="Ranks that may fail mid-run before it ends: a count (2) or a share of the world (25%). "
    "Within it a lost rank is evicted and averaging renormalizes; beyond it the survivors averaging "
    "through the controller save a checkpoint (ShutdownWithSave) and the run fails.",
)
@click.option(
    "--stall-ceiling",
    type=click.FloatRange(1, 86400),
    default=600,
    show_default=True,
    help="Seconds an averaging round may wait for its last host before the run ends with ShutdownWithSave.",
)
@click.option(
    "--parallelism",
    callback=lambda _ctx, _param, value: _parallelism(value),
    help="tensor=N,pipeline=N[,data=N][,expert=N]: the formed world (hosts as nodes, ranks per host "
    "as GPUs) must satisfy it, or the run fails at formation with the arithmetic.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the run's report on stdout at the end: verdict, the world as formed, every rank's exit.",
)
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def launch(
    config_file: Path,
    base: Path | None,
    bind: str | None,
    port: int | None,
    plane: str,
    fanout: bool,
    max_failure: str,
    stall_ceiling: float,
    parallelism: dict[str, int] | None,
    as_json: bool,
    command: tuple[str, ...],
) -> None:
    """Open the join window and run COMMAND on every admitted rank.

    COMMAND (after --) is the run's entry point and arguments, stated once here
    and sent to every agent. Exit 0 when the run is done, 1 when it failed.
    """
    loaded = _load(config_file, base, False)
    options = LaunchOptions(
        command=list(command),
        bind=bind,
        port=port,
        plane="nccl" if plane == "nccl" else "cpu",
        fanout=fanout,
        max_failure=max_failure,
        stall_ceiling=stall_ceiling,
        parallelism=parallelism,
    )
    _launch_loaded(loaded, config_file, options, as_json)


def _parallelism(value: str | None) -> dict[str, int] | None:
    from .placement import PlacementError
    from .placement.parallel import parse_parallelism

    if value is None:
        return None
    try:
        return parse_parallelism(value)
    except PlacementError as exc:
        raise click.BadParameter(exc.render(), param_hint="--parallelism") from None


def _max_failure(value: str) -> str:
    try:
        return parse_max_failure(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-failure") from None


def _launch_loaded(
    loaded: Loaded, config_file: Path, options: LaunchOptions, as_json: bool = False
) -> NoReturn:
    _print_problems(loaded.warnings)
    cluster = loaded.config.cluster
    if cluster is None:
        err.print(f"fdl launch: {config_file} has no cluster: block to launch", style="red", markup=False)
        raise SystemExit(1)
    try:
        code = asyncio.run(
            run_launch(
                cluster,
                options,
                _log,
                _live_roster if err.is_terminal else None,
                (lambda report: click.echo(json.dumps(report, indent=2))) if as_json else None,
            )
        )
    except LaunchError as exc:
        err.print(f"fdl launch: {exc.render()}", style="red", markup=False)
        raise SystemExit(1) from None
    raise SystemExit(code)


@cli.command(
    name="@",
    hidden=True,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.argument("name")
@click.option("--plane", type=click.Choice(["cpu", "nccl"]), default="cpu", help="Data plane of the run.")
@click.option("--fanout/--no-fanout", default=True, help="Start agents on the configured workers.")
@click.argument("command_name", metavar="COMMAND")
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def at_cluster(
    ctx: click.Context, name: str, plane: str, fanout: bool, command_name: str, extra: tuple[str, ...]
) -> None:
    """`fdl @NAME COMMAND [ARGS]`: run a named command of fdl.yml on the cluster of fdl.NAME.yml.

    `fdl @NAME status` and `fdl @NAME start` talk to that cluster's controller.
    """
    overlay = Path(f"fdl.{name}.yml")
    base = Path("fdl.yml") if Path("fdl.yml").is_file() else None
    if not overlay.is_file():
        err.print(f"fdl @{name}: no {overlay} here", style="red", markup=False)
        err.print(f"    fix: run from the project directory, or create {overlay}", style="red", markup=False)
        raise SystemExit(2)
    loaded = _load(overlay, base, False)
    cluster = loaded.config.cluster
    if command_name == "probe" and cluster is not None:
        _probe_cluster(cluster, name, "--json" in extra)
    if command_name in ("status", "start") and cluster is not None:
        addr = f"{cluster.controller.host}:{cluster.controller.port}"
        cmd = status if command_name == "status" else start
        ctx.invoke(cmd, addr=addr)
        return
    commands = loaded.config.commands
    if command_name not in commands:
        close = difflib.get_close_matches(command_name, list(commands), n=1)
        hint = (
            f"did you mean `{close[0]}`?"
            if close
            else (f"known: {', '.join(commands)}" if commands else "add a commands: block to fdl.yml")
        )
        err.print(f"fdl @{name}: no command `{command_name}`\n    fix: {hint}", style="red", markup=False)
        raise SystemExit(2)
    options = LaunchOptions(
        command=[*commands[command_name], *extra], plane="nccl" if plane == "nccl" else "cpu", fanout=fanout
    )
    _launch_loaded(loaded, overlay, options)


@cli.command(name="join", context_settings={"ignore_unknown_options": True})
@click.argument("address", required=False)
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="fdl.yml whose join: block supplies the defaults (default: ./fdl.yml if present).",
)
@click.option(
    "--token", "token_opt", metavar="-", help="`-` reads the run's join.token from stdin (or set FDL_TOKEN)."
)
@click.option("--ssh", "ssh_dest", metavar="[USER@]HOST[:PORT]", help="Dial through an ssh -L forward.")
@click.option("--identity", type=click.Path(path_type=Path, dir_okay=False), help="ssh key for --ssh.")
@click.option(
    "--tls-fingerprint", "pin", metavar="SHA256", help="The controller serves TLS: pin its certificate."
)
@click.option("--host", "host_name", help="This box's name in the roster (default: hostname).")
@click.option("--devices", help="Devices to offer: 0,1 | all | cpu:N (default: every GPU).")
@click.option("--persist/--no-persist", default=None, help="Re-dial with backoff until a permanent failure.")
@click.option("--bin", "entry", help="Local path of the run's entry point on this box.")
@click.option("--backoff", type=click.FloatRange(0.1, 60), default=5.0, hidden=True)
@click.option("--spec-stdin", is_flag=True, hidden=True, help="Read a launcher's agent spec from stdin.")
@click.option("--tag", hidden=True, help="Marks a fan-out agent so the next launch can clean up orphans.")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
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
    entry: str | None,
    backoff: float,
    spec_stdin: bool,
    tag: str | None,
    args: tuple[str, ...],
) -> None:
    """Walk into a join window at ADDRESS (host:port) and run this box's ranks.

    Every flag defaults from the join: block of fdl.yml. Exit 0 clean, 1
    transient (re-dial), 2 permanent.
    """
    # A launcher's spec is the whole story: a stray ./fdl.yml on the worker must not reroute it.
    block = Join() if spec_stdin else _join_block(config_file)
    spec = _agent_spec(spec_stdin)
    token = _token_or_exit(token_opt) or block.token
    ssh = block.ssh
    if ssh_dest:
        user, _, rest = ssh_dest.rpartition("@")
        try:
            target, ssh_port = split_address(rest, 22)
            ssh = Ssh(
                target=target,
                port=ssh_port if rest.count(":") == 1 or "]:" in rest else None,
                user=user or None,
                identity_file=str(identity) if identity else None,
            )
        except (AddressError, ValidationError) as exc:
            raise click.BadParameter(
                f"`{ssh_dest}` is not [user@]host[:port] ({_first_error(exc)})", param_hint="--ssh"
            ) from None
    elif identity and ssh is not None:
        ssh = ssh.model_copy(update={"identity_file": str(identity)})
    default_addr = "127.0.0.1:1337" if ssh is not None else None
    spec_addr = join_address(spec.controller_host, spec.controller_port) if spec.controller_host else None
    addr = address or spec_addr or block.controller or default_addr
    if addr is None:
        err.print("fdl join: no controller address", style="red", markup=False)
        err.print(
            "    fix: pass HOST:PORT, set join.controller in fdl.yml, or use --ssh", style="red", markup=False
        )
        raise SystemExit(2)
    try:
        wanted = devices or spec.devices
        offer = parse_devices(wanted) if wanted else (block.devices or DeviceOffer("all"))
    except PydanticCustomError as exc:
        err.print(f"fdl join: --devices: {exc}", style="red", markup=False)
        raise SystemExit(2) from None
    if args and list(args) != block.args and block.source is None:
        _log("note: the run's arguments come from the controller; local arguments are ignored")
    try:
        host, port = split_address(addr)
    except AddressError as exc:
        raise click.BadParameter(str(exc), param_hint="ADDRESS") from None
    key_hex = token or spec.key
    options = AgentOptions(
        controller_host=host,
        controller_port=port,
        key=bytes.fromhex(key_hex) if key_hex else None,
        host=host_name or spec.host or block.host or socket.gethostname(),
        devices=offer,
        bin=entry or block.bin,
        ssh=ssh,
        data_path=spec.data_path or block.data_path or "",
        env={**block.env, **spec.env},
        socket_ifname=spec.socket_ifname or block.nccl_socket_ifname or "",
        source=block.source,
        data_source=block.data_source or "",
        args=list(args) or list(block.args),
        tls_fingerprint=_join_pin(pin) or block.tls_fingerprint or "",
    )
    keep = block.persist if persist is None else persist
    spinner = err.status(f"admitted as {options.host}; waiting for the world to form")

    def on_wait(waiting: bool) -> None:
        if err.is_terminal:
            (spinner.start if waiting else spinner.stop)()

    async def main() -> int:
        # SIGTERM (systemd stop, a launcher's orphan clean-up) must end the ranks too:
        # cancelling unwinds through the attempt's clean-up, which kills them.
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if task is not None:
                loop.add_signal_handler(sig, task.cancel)
        try:
            return await run_join(options, persist=keep, log=_log, backoff_start=backoff, on_wait=on_wait)
        except asyncio.CancelledError:
            _log("stopped by a signal; ranks ended")
            return 1

    raise SystemExit(asyncio.run(main()))


def _join_pin(pin: str | None) -> str | None:
    from .tls import normalize

    try:
        return normalize(pin) if pin else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--tls-fingerprint") from None


def _first_error(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return str(exc.errors()[0]["msg"])
    return str(exc)


def _join_block(config_file: Path | None) -> Join:
    path = config_file or (Path("fdl.yml") if Path("fdl.yml").is_file() else None)
    if path is None:
        return Join()
    loaded = _load(path, None, False)
    return loaded.config.join or Join()


def _agent_spec(from_stdin: bool) -> AgentSpec:
    """The launcher's spec: the fan-out session's stdin, else FLODL_INTERNAL_AGENT_JSON."""
    raw = sys.stdin.readline() if from_stdin else os.environ.get("FLODL_INTERNAL_AGENT_JSON", "")
    if not raw.strip():
        if from_stdin:
            err.print("fdl join: --spec-stdin got no spec on stdin", style="red", markup=False)
            raise SystemExit(2)
        return AgentSpec()
    try:
        return parse_agent_spec(raw)
    except ValueError as exc:
        err.print(f"fdl join: {exc}", style="red", markup=False)
        raise SystemExit(2) from None


addr_opt = click.option(
    "--addr", help="Controller address host:port (default: ./fdl.cluster.yml, else 127.0.0.1:1337)."
)
pin_opt = click.option(
    "--tls-fingerprint",
    "pin",
    metavar="SHA256",
    help="The controller serves TLS: pin its certificate (default: FDL_TLS_FINGERPRINT, else the "
    "certificate ./fdl.cluster.yml serves).",
)


def _pin_or_exit(pin: str | None) -> str | None:
    try:
        return resolve_pin(pin, Path.cwd())
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--tls-fingerprint") from None


@cli.command()
@addr_opt
@pin_opt
@json_opt
@click.option("--watch", is_flag=True, help="Refresh every second until the run ends.")
def status(addr: str | None, pin: str | None, as_json: bool, watch: bool) -> None:
    """Show the controller's phase, countdowns and roster. Exit 1 when nobody answers."""
    target, note = resolve_addr(addr, Path.cwd())
    pinned = _pin_or_exit(pin)
    if note and not as_json:
        err.print(f"note: {note}", style="dim", markup=False)

    def fetch() -> dict[str, Any]:
        try:
            return request(target, "GET", "/state.json", pin=pinned).body
        except Unreachable as exc:
            err.print(f"fdl status: {exc}", style="red", markup=False)
            raise SystemExit(1) from None

    state = fetch()
    if as_json:
        _emit_json(state)
        return
    if not watch:
        for part in render(state):
            out.print(part)
        return
    with Live(Group(*render(state)), console=out, refresh_per_second=4) as live:
        while state.get("phase") not in ("done", "failed"):
            time.sleep(1.0)  # the refresh interval of a watch display
            try:
                state = request(target, "GET", "/state.json", pin=pinned).body
            except Unreachable:
                break
            live.update(Group(*render(state)))


@cli.command()
@addr_opt
@pin_opt
@click.option(
    "--token",
    "token_opt",
    metavar="-",
    help="`-` reads the run's join.token from stdin (or set FDL_TOKEN); not needed on the controller host.",
)
def start(addr: str | None, pin: str | None, token_opt: str | None) -> None:
    """Fire a manual or hybrid window's start. Exit 0 armed, 1 refused."""
    target, note = resolve_addr(addr, Path.cwd())
    pinned = _pin_or_exit(pin)
    if note:
        err.print(f"note: {note}", style="dim", markup=False)
    token = _token_or_exit(token_opt)
    try:
        reply = request(target, "POST", "/start", form={"token": token} if token else None, pin=pinned)
    except Unreachable as exc:
        err.print(f"fdl start: {exc}", style="red", markup=False)
        raise SystemExit(1) from None
    if reply.status in (200, 202):
        out.print(f"armed: {reply.body.get('reason', 'start accepted')}", markup=False)
        return
    err.print(
        f"refused ({reply.status}): {reply.body.get('error', 'no reason given')}", style="red", markup=False
    )
    raise SystemExit(1)


LEVEL_STYLE = {"ok": "green", "warn": "yellow", "fail": "red bold"}


@cli.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="fdl.yml (a worker's join: block) or fdl.cluster.yml (a controller). "
    "Default: whichever is in this directory; with neither, the box alone.",
)
@base_opt
@click.option("--no-dial", is_flag=True, help="Do not try to reach the controller.")
@click.option("--spec-stdin", is_flag=True, hidden=True, help="Probe as a cluster entry on stdin says.")
@json_opt
def probe(
    config_file: Path | None, base: Path | None, no_dial: bool, spec_stdin: bool, as_json: bool
) -> None:
    """Check this box before it walks in (or runs a controller).

    torch and its variant against this box's GPUs, NCCL, the socket interface,
    the data root, the node-local cache, the controller (through the join's ssh
    forward when it has one), the controller port, and stale config keys.
    Exit 0 when nothing failed, 1 otherwise.
    """
    from .probe import as_json_payload, check, gather

    if config_file is None and not spec_stdin:
        config_file = next((p for p in (Path("fdl.yml"), Path("fdl.cluster.yml")) if p.is_file()), None)
    join = cluster = None
    findings: list[Finding] = []
    if spec_stdin:  # `fdl @NAME probe`: this box as its cluster entry describes it
        join = _probe_join(_agent_spec(True))
    elif config_file is not None:
        try:
            loaded = load_config(config_file, base)
        except ConfigError as exc:  # a finding like any other: the rest of the box is still probed
            findings += [Finding("config", "fail", p.render()) for p in exc.problems]
        else:
            join, cluster = loaded.config.join, loaded.config.cluster
            findings += [Finding("config", "warn", w.render()) for w in loaded.warnings]
            findings.append(Finding("config", "ok", f"{' + '.join(loaded.files)} is valid"))
    facts = gather(join, cluster, dial=not no_dial)
    findings += check(facts, join, cluster)
    failed = any(f.level == "fail" for f in findings)
    if as_json:
        _emit_json(as_json_payload(facts, findings))
    else:
        table = Table("", "check", "finding", box=None, show_header=False, pad_edge=False)
        for f in findings:
            table.add_row(*_finding_row(f))
        out.print(table)
        out.print("[red]not ready[/]" if failed else "[green]ready[/]")
    raise SystemExit(1 if failed else 0)


def _finding_row(f: Finding, *where: str) -> tuple[str, ...]:
    text = f.message + (f"\n  fix: {f.fix}" if f.fix and f.level != "ok" else "")
    return (f"[{LEVEL_STYLE[f.level]}]{f.level}[/]", *where, f.check, escape(text))


def _probe_join(spec: AgentSpec) -> Join:
    try:
        return Join.model_validate(
            {
                "devices": spec.devices,
                "data_path": spec.data_path or None,
                "nccl_socket_ifname": spec.socket_ifname or None,
                "env": spec.env,
            }
        )
    except ValueError as exc:
        err.print(f"fdl probe: the cluster entry is not valid here ({_first_error(exc)})", style="red")
        raise SystemExit(2) from None


def _probe_cluster(cluster: Cluster, name: str, as_json: bool) -> None:
    """`fdl @NAME probe`: every worker over ssh, the controller here, and the findings across them."""
    from .cluster_probe import across, probe_cluster
    from .cluster_probe import as_json as cluster_json

    if not as_json:
        err.print(f"probing the controller and {len(cluster.workers)} worker(s) of {name}…", style="dim")
    reports = asyncio.run(probe_cluster(cluster))
    findings = across(reports)
    payload = cluster_json(reports, findings)
    if as_json:
        _emit_json(payload)
        raise SystemExit(0 if payload["ok"] else 1)
    table = Table("", "host", "check", "finding", box=None, show_header=False, pad_edge=False)
    for report in reports:
        for f in report.findings:
            if f.level != "ok":
                table.add_row(*_finding_row(f, report.host))
        if report.payload is not None and not any(f.level != "ok" for f in report.findings):
            table.add_row("[green]ok[/]", report.host, "", "every check passed")
    for f in findings:
        table.add_row(*_finding_row(f, "(across)"))
    out.print(table)
    out.print("[green]ready[/]" if payload["ok"] else "[red]not ready[/]")
    raise SystemExit(0 if payload["ok"] else 1)


class _TailCommand(click.Command):
    """Everything after `--` is the tail (``ctx.meta["tail"]``, None without a `--`): an
    empty tail is still a tail, and a tail never fills an optional positional argument."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["tail"] = None
        if "--" in args:
            cut = args.index("--")
            args, ctx.meta["tail"] = args[:cut], args[cut + 1 :]
        return super().parse_args(ctx, args)

    def format_usage(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        formatter.write_usage(ctx.command_path, "[OPTIONS] [SPEC] [-- ARGS...]")


@cli.command(cls=_TailCommand)
@click.argument("spec", required=False)
@click.option("--bin", "entry", help="Entry point, relative to --cwd.")
@click.option("--cwd", help="Project directory inside the tree (default: its root).")
@click.option("--build", help="Build line, run once here as the gate (and by every worker).")
@click.option("--to", "served", type=click.Path(path_type=Path, file_okay=False), help="Served directory.")
@click.option(
    "--identity", type=click.Path(path_type=Path, dir_okay=False), help="ssh key for rsync:// and git+ssh://."
)
@click.option("--no-build", is_flag=True, help="Publish without running the build gate.")
@click.option(
    "--model-probe/--no-model-probe",
    default=None,
    help="Probe the entry's model here; every box then probes its own before it dials, and the "
    "join window refuses a box that builds a different model. The entry must build its model "
    "through flodl_agent.train.Trainer (or call flodl_agent.signature.answer_probe).",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="fdl.yml whose publish: block supplies the defaults (default: ./fdl.yml if present).",
)
@json_opt
@click.pass_context
def publish(
    ctx: click.Context,
    spec: str | None,
    entry: str | None,
    cwd: str | None,
    build: str | None,
    served: Path | None,
    identity: Path | None,
    no_build: bool,
    model_probe: bool | None,
    config_file: Path | None,
    as_json: bool,
) -> None:
    """Publish a run: fetch SPEC into the served tree, build it once as a gate, write its manifest.

    SPEC is file:///abs, rsync://[user@]host[:port]:/abs, or git+https|ssh|file://…#ref.
    Everything after `--` is the run's arguments. Flags default from the publish: block of
    fdl.yml, field by field; a `--` tail replaces its args even when empty. Workers pick the
    run up on their next dial. Exit 0 published, 1 otherwise (nothing published).
    """
    from .config.models import Publish
    from .publish import PublishError, PublishRequest
    from .publish import publish as run_publish
    from .sources import SpecError, parse_source

    path = config_file or (Path("fdl.yml") if Path("fdl.yml").is_file() else None)
    block = (_load(path, None, as_json).config.publish if path else None) or Publish()
    text = spec or block.source
    if text is None:
        raise click.UsageError("name a source: SPEC, or publish.source in fdl.yml")
    try:
        source = parse_source(text)
    except SpecError as exc:
        raise click.BadParameter(exc.render(), param_hint="SPEC") from None
    key = identity or (Path(block.identity) if block.identity else None)
    request = PublishRequest(
        source=source,
        served=(served or Path(block.to or "~/.flodl/run")).expanduser().absolute(),
        bin=entry or block.bin,
        cwd=cwd or block.cwd or ".",
        build=build or block.build,
        args=list(ctx.meta["tail"]) if ctx.meta["tail"] is not None else list(block.args),
        no_build=no_build,
        model_probe=block.model_probe if model_probe is None else model_probe,
        identity=str(key.expanduser()) if key else None,
    )
    try:
        report = run_publish(request, log=_log if not as_json else lambda _: None)
    except PublishError as exc:
        if as_json:
            _emit_json({"published": False, "error": exc.message, "fix": exc.fix})
        else:
            err.print(f"fdl publish: {exc.render()}", style="red", markup=False)
        raise SystemExit(1) from None
    host = socket.getfqdn()
    spellings = report.spellings(host)
    manifest = report.manifest
    if as_json:
        _emit_json(
            {
                "published": True,
                "tree": str(report.tree),
                "files": report.files,
                "manifest": manifest.model_dump(),
                "fetch": spellings,
            }
        )
        return
    built = (
        f"passed: {manifest.build}"
        if manifest.built
        else ("not built (--no-build)" if manifest.build else "no build line")
    )
    table = Table("", "", box=None, show_header=False, pad_edge=False)
    for name, value in (
        ("run", manifest.run),
        (
            "tree",
            f"{report.tree}  ({report.files} file{'' if report.files == 1 else 's'}, "
            f"digest {manifest.digest[:12]})",
        ),
        ("origin", manifest.origin),
        ("build", built),
        ("cwd", manifest.cwd),
        ("bin", manifest.bin or "(the launch command's)"),
        ("args", shlex.join(manifest.args) if manifest.args else "(none)"),
        (
            "model",
            f"{manifest.model_sig[:12]}  (every box probes its own before it dials)"
            if manifest.model_sig
            else "not probed (the formation check compares models)",
        ),
        ("fetch", f"{spellings['plain']}   (a key without a forced command)"),
        ("", f"{spellings['rrsync']}   (behind rrsync -ro <served>: the door B recipe)"),
    ):
        table.add_row(f"[bold]{name}[/]", escape(value))
    out.print("[green]published[/]")
    out.print(table)


DEPLOY_STYLE = {"changed": "yellow", "failed": "red bold", "unreachable": "red bold", "ok": "green"}


@cli.command()
@click.argument("playbook", type=click.Path(path_type=Path, dir_okay=False), default="site.yml")
@click.option(
    "-i", "--inventory", type=click.Path(path_type=Path), help="Inventory (default: ansible.cfg's)."
)
@click.option("-l", "--limit", help="Only these hosts or groups (ansible's --limit pattern).")
@click.option("-e", "--extra", "extras", multiple=True, metavar="KEY=VALUE", help="An extra variable.")
@click.option("--check", is_flag=True, help="Dry run: report what would change (--check --diff).")
@click.option(
    "--artifacts",
    type=click.Path(path_type=Path, file_okay=False),
    help="Where each run's artifacts go (default: build/deploy in the project).",
)
@click.option("-q", "--quiet", is_flag=True, help="Only the summary: no per-host progress lines.")
@json_opt
def deploy(
    playbook: Path,
    inventory: Path | None,
    limit: str | None,
    extras: tuple[str, ...],
    check: bool,
    artifacts: Path | None,
    quiet: bool,
    as_json: bool,
) -> None:
    """Run a playbook of the project (site.yml by default) against an inventory.

    Per-host progress as it happens, a summary table per host, the event stream kept
    under the artifacts directory, and the exit code of ansible-playbook itself
    (0 ok, 2 a host failed, 4 a host unreachable).
    """
    from .deploy import DeployError, HostResult
    from .deploy import deploy as run_deploy

    extravars: dict[str, str] = {}
    for item in extras:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise click.BadParameter(f"`{item}` is not KEY=VALUE", param_hint="--extra")
        extravars[key] = value

    def show(result: HostResult) -> None:
        if quiet or as_json or result.status == "skipped":
            return
        style = DEPLOY_STYLE.get(result.status, "dim")
        line = f"[{style}]{result.status:<11}[/] {escape(result.host):<28} {escape(result.task)}"
        out.print(line + (f"\n            [red]{escape(result.message)}[/]" if result.message else ""))

    try:
        result = run_deploy(
            playbook,
            inventory=inventory,
            limit=limit,
            extravars=extravars,
            check=check,
            artifacts=artifacts,
            on_result=show,
        )
    except DeployError as exc:
        err.print(f"fdl deploy: {exc.render()}", style="red", markup=False)
        raise SystemExit(2) from None
    if as_json:
        _emit_json(result.as_json())
        raise SystemExit(result.rc)
    table = Table("host", "ok", "changed", "failed", "unreachable", "skipped", box=None, pad_edge=False)
    for host, counts in result.recap.items():
        bad = counts["failures"] or counts["dark"]
        table.add_row(
            f"[{'red' if bad else 'green'}]{escape(host)}[/]",
            str(counts["ok"]),
            str(counts["changed"]),
            str(counts["failures"]),
            str(counts["dark"]),
            str(counts["skipped"]),
        )
    out.print(table)
    verdict = "[green]deployed[/]" if result.ok else f"[red]failed[/] (ansible-playbook exited {result.rc})"
    out.print(f"{verdict}; events in {escape(str(result.artifacts))}")
    raise SystemExit(result.rc)


@cli.group()
def tls() -> None:
    """TLS on the controller port: a self-signed certificate that clients pin."""


@tls.command("generate")
@click.option("--cert", type=click.Path(path_type=Path, dir_okay=False), required=True, help="PEM out.")
@click.option("--key", type=click.Path(path_type=Path, dir_okay=False), required=True, help="PEM key out.")
@click.option("--name", "names", multiple=True, help="A DNS name or address of the controller (repeat).")
@click.option("--force", is_flag=True, help="Replace an existing certificate (every pin must change).")
def tls_generate(cert: Path, key: Path, names: tuple[str, ...], force: bool) -> None:
    """Write a self-signed certificate and key (0600) for cluster.controller.tls; print the fingerprint
    workers pin (join.tls_fingerprint)."""
    from .tls import generate

    if (cert.exists() or key.exists()) and not force:
        err.print(
            f"fdl tls generate: {cert if cert.exists() else key} exists\n"
            "    fix: keep it (fdl tls fingerprint prints its pin), or --force to replace it and re-pin",
            style="red",
            markup=False,
        )
        raise SystemExit(2)
    click.echo(generate(cert, key, list(names) or [socket.getfqdn()]))


@tls.command("fingerprint")
@click.argument("cert", type=click.Path(path_type=Path, dir_okay=False, exists=True))
def tls_fingerprint(cert: Path) -> None:
    """Print a PEM certificate's pin (sha256:<hex>), as join.tls_fingerprint takes it."""
    from .tls import cert_fingerprint

    try:
        click.echo(cert_fingerprint(cert))
    except ValueError as exc:
        raise click.BadParameter(f"not a PEM certificate ({exc})", param_hint="CERT") from None


@cli.group()
def nccl() -> None:
    """NCCL alignment across a fleet."""


@nccl.command("pin")
@click.argument("version")
@click.option(
    "--venv",
    type=click.Path(path_type=Path, file_okay=False),
    help="The variant's virtualenv (default: the one running fdl).",
)
@click.option("--cuda", help="CUDA version or major the wheel is for (default: what the venv's torch says).")
@click.option(
    "--find-links",
    type=click.Path(path_type=Path, file_okay=False),
    help="Install from this wheelhouse only (air-gapped fleets).",
)
@json_opt
def nccl_pin(
    version: str, venv: Path | None, cuda: str | None, find_links: Path | None, as_json: bool
) -> None:
    """Install NCCL VERSION (the nvidia-nccl-cu<major> wheel) into this box's variant venv.

    Run it on every box whose hello was refused for NCCL version skew, with the
    cohort's version; it prints the join.env entry that puts the pinned library first.
    Exit 0 pinned, 1 otherwise.
    """
    from .nccl import NcclError
    from .nccl import pin as run_pin

    target = (venv or Path(sys.prefix)).absolute()
    try:
        pinned = run_pin(version, target, cuda, find_links)
    except NcclError as exc:
        if as_json:
            _emit_json({"pinned": False, "error": exc.message, "fix": exc.fix})
        else:
            err.print(f"fdl nccl pin: {exc.render()}", style="red", markup=False)
        raise SystemExit(1) from None
    if as_json:
        _emit_json(
            {
                "pinned": True,
                "package": pinned.package,
                "version": pinned.version,
                "lib": pinned.lib,
                "env": pinned.env,
            }
        )
        return
    out.print(f"[green]pinned[/] {pinned.package}=={pinned.version} in {escape(str(target))}")
    out.print(f"  library  {escape(pinned.lib)}")
    out.print("  add to this box's fdl.yml (or flodl_worker_env), so every rank loads it first:")
    out.print("    join:\n      env:")
    for key, value in pinned.env.items():
        out.print(f"        {key}: {escape(value)}")


def _fleet_from_cluster(path: Path, role: str, as_json: bool) -> tuple[int, int]:
    """(nodes, GPUs per node) of a cluster file's workers: every worker must list its GPUs alike."""
    from .placement import PlacementError

    cluster = _load(path, None, as_json).config.cluster
    workers = cluster.workers if cluster is not None else []
    if not workers:
        raise PlacementError(
            f"{path} lists no workers", "plan against a cluster file with workers, or --nodes"
        )
    counts = []
    for i, worker in enumerate(workers):
        offer = worker.local_devices
        if offer.kind != "gpus" and role != "sandbox":
            raise PlacementError(
                f"cluster.workers[{i}] ({worker.host}) offers `{offer}`, not a list of GPUs",
                "list its GPUs (local_devices: [0, 1, ...]) so they can be counted, or pass --gpus-per-node",
            )
        counts.append(len(offer.gpus))
    if len(set(counts)) > 1:
        odd = next(i for i, c in enumerate(counts) if c != counts[0])
        raise PlacementError(
            f"cluster.workers[{odd}] ({workers[odd].host}) has {counts[odd]} GPUs, cluster.workers[0] "
            f"({workers[0].host}) {counts[0]}: placement needs nodes of one size",
            "plan the nodes of each size as their own fleet",
        )
    return len(workers), counts[0]


def _fleet_from_ray(address: str, wanted: int | None, segment_size: int | None) -> tuple[int, int, list[str]]:
    """(nodes, GPUs per node, the segment selection) read from a live Ray cluster; ``wanted``
    nodes of it (default: every GPU node)."""
    from .placement import PlacementError
    from .placement.ray_cluster import live_fleet, ray_module
    from .placement.segments import decode_topology, select_segment_nodes

    ray = ray_module()
    if not ray.is_initialized():
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    live = ray.nodes()
    nodes, gpus = live_fleet(live)
    if wanted is not None and wanted > nodes:
        raise PlacementError(
            f"--nodes {wanted}: the Ray cluster has {nodes} alive GPU nodes", "ask for at most that many"
        )
    nodes = wanted or nodes
    chosen: list[str] = []
    if segment_size is not None:
        chosen, _ = select_segment_nodes(decode_topology(live), segment_size, nodes)
    return nodes, gpus, chosen


@cli.command()
@click.option(
    "--tensor", type=click.IntRange(min=1), default=1, show_default=True, help="Tensor-parallel size."
)
@click.option("--pipeline", type=click.IntRange(min=1), default=1, show_default=True, help="Pipeline stages.")
@click.option(
    "--data", type=click.IntRange(min=1), help="Data-parallel size (default: whatever uses every GPU)."
)
@click.option(
    "--expert", type=click.IntRange(min=1), default=1, show_default=True, help="Expert-parallel size."
)
@click.option(
    "--role", type=click.Choice(["trainer", "inference", "sandbox"]), help="Fleet role (default: env)."
)
@click.option("--nodes", type=click.IntRange(min=1), help="Node count.")
@click.option("--gpus-per-node", type=click.IntRange(min=0), help="GPUs per node.")
@click.option("--segment-size", type=click.IntRange(min=1), help="Nodes per NVLink segment.")
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Count nodes and GPUs from this cluster file's workers.",
)
@click.option(
    "--ray",
    "ray_address",
    help="Count nodes and GPUs on this live Ray cluster (`auto`: RAY_ADDRESS or the local one); "
    "with --segment-size, also pick the segments from its NVLink topology.",
)
@json_opt
def plan(
    tensor: int,
    pipeline: int,
    data: int | None,
    expert: int,
    role: str | None,
    nodes: int | None,
    gpus_per_node: int | None,
    segment_size: int | None,
    config_file: Path | None,
    ray_address: str | None,
    as_json: bool,
) -> None:
    """Check a parallelism request against a fleet before anything is claimed.

    The fleet comes from flags, a cluster file's workers (--config), or the
    DOCKYARD_* environment a container declares. Exit 0 when it can be placed,
    1 with the arithmetic when it cannot.
    """
    from dataclasses import replace

    from .placement import FleetSpec, ParallelismSpec, PlacementError, preflight

    try:
        env = dict(os.environ)
        if role:
            env["DOCKYARD_FLEET_ROLE"] = role
        segments: list[str] = []
        if config_file is not None:
            nodes, gpus_per_node = _fleet_from_cluster(
                config_file, env.get("DOCKYARD_FLEET_ROLE", "trainer"), as_json
            )
            env.setdefault("DOCKYARD_FLEET_ROLE", "trainer")
        if ray_address is not None:
            nodes, gpus_per_node, segments = _fleet_from_ray(ray_address, nodes, segment_size)
            env.setdefault("DOCKYARD_FLEET_ROLE", "trainer")
        for name, value in (
            ("DOCKYARD_NUM_NODES", nodes),
            ("DOCKYARD_GPUS_PER_NODE", gpus_per_node),
            ("DOCKYARD_SEGMENT_SIZE", segment_size),
        ):
            if value is not None:
                env[name] = str(value)
        fleet = FleetSpec.from_env(env)
        spec = ParallelismSpec(tensor, pipeline, 1, expert)
        if data is None and fleet.total_gpus and fleet.total_gpus % spec.replica == 0:
            data = fleet.total_gpus // spec.replica
        result = preflight(replace(spec, data=data or 1), fleet)
    except PlacementError as exc:
        if as_json:
            _emit_json({"ok": False, "error": exc.message, "fix": exc.fix})
        else:
            err.print(f"fdl plan: {exc.render()}", style="red", markup=False)
        raise SystemExit(1) from None
    payload = {
        "ok": True,
        "fleet": {
            "role": fleet.role,
            "nodes": fleet.num_nodes,
            "gpus_per_node": fleet.gpus_per_node,
            "strategy": fleet.placement_strategy,
            "segment_size": fleet.segment_size,
        },
        "parallelism": {"tensor": tensor, "pipeline": pipeline, "data": data, "expert": expert},
        "replica_gpus": result.replica_gpus,
        "replicas": result.replicas,
        "unified": result.unified,
        "notes": result.notes,
        "segment_nodes": segments,
    }
    if as_json:
        _emit_json(payload)
        return
    out.print(
        f"[green]placeable[/]: {fleet.role} fleet, {fleet.num_nodes} nodes x {fleet.gpus_per_node} GPUs "
        f"({fleet.placement_strategy}); tensor {tensor} x pipeline {pipeline} x data {data} (expert {expert})"
    )
    out.print(
        f"  {result.replicas} replicas of {result.replica_gpus} GPUs, "
        + ("one unified cross-node placement group each" if result.unified else "per-node STRICT_PACK groups")
    )
    for note in result.notes:
        out.print(f"  note: {escape(note)}")
    if segments:
        out.print(f"  segments: {escape(', '.join(segments))}")


@cli.group()
def placement() -> None:
    """Fleet placement on Ray (seed 001)."""


smi_opt = click.option(
    "--smi",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="Read this `nvidia-smi -q` output instead of running nvidia-smi.",
)


def _node_resources(smi: Path | None) -> dict[str, float]:
    import shutil

    from .placement import topology_resources

    if smi is not None:
        text = smi.read_text()
    elif shutil.which("nvidia-smi"):
        proc = subprocess.run(["nvidia-smi", "-q"], capture_output=True, text=True, timeout=60, check=False)
        text = proc.stdout if proc.returncode == 0 else ""
    else:
        text = ""
    return topology_resources(text, os.environ)


@placement.command("resources")
@smi_opt
def placement_resources(smi: Path | None) -> None:
    """Print this node's topology resources as JSON, for `ray start --resources=...`.

    nvlink_domain_<fabric> from nvidia-smi -q and topo_rank from FLODL_TOPO_RANK,
    else SLURM_NODEID (encoded rank + 1: a resource of quantity 0 vanishes from
    Ray). A node without an NVLink fabric prints {} and is never chosen for a
    segment.
    """
    click.echo(json.dumps(_node_resources(smi), sort_keys=True))


@placement.command("node")
@click.option("--address", metavar="HOST:PORT", help="The head to join (default: start a head here).")
@click.option("--port", type=click.IntRange(1, 65535), default=6379, show_default=True, help="A head's port.")
@click.option("--temp-dir", help="Ray's session directory (default: Ray's own).")
@smi_opt
@click.option("--dry-run", is_flag=True, help="Print the ray start command instead of running it.")
def placement_node(
    address: str | None, port: int, temp_dir: str | None, smi: Path | None, dry_run: bool
) -> None:
    """Run this box as a Ray node of the fleet, with its topology resources (what the
    worker role's flodl-ray.service runs): `ray start --block`, replacing this process.
    """
    from .placement.ray_cluster import node_argv

    if address is not None:
        try:
            host, node_port = split_address(address, default_port=6379)
        except AddressError as exc:
            raise click.BadParameter(str(exc), param_hint="--address") from None
        address = join_address(host, node_port)
    argv = node_argv(_node_resources(smi), address=address, port=port, temp_dir=temp_dir)
    if dry_run:
        click.echo(shlex.join(argv))
        return
    if not Path(argv[0]).is_file():
        err.print(
            f"fdl placement node: Ray is not installed in this venv ({argv[0]} is missing)\n"
            "    fix: pip install 'flodl-fleet[ray]' (the worker role does with flodl_worker_ray_address)",
            style="red",
            markup=False,
        )
        raise SystemExit(2)
    sys.stdout.flush()
    os.execv(argv[0], argv)


def _internal_error(exc: BaseException) -> NoReturn:
    if os.environ.get("FDL_DEBUG"):
        raise exc
    err.print(
        f"fdl: internal error: {type(exc).__name__}: {exc}\n"
        "This is a bug in fdl. Rerun with FDL_DEBUG=1 for the traceback and report it.",
        style="red",
        markup=False,
    )
    sys.exit(70)


def main() -> None:
    args = sys.argv[1:]
    if args and args[0].startswith("@") and len(args[0]) > 1:
        args = ["@", args[0][1:], *args[1:]]  # `fdl @cluster train` -> the hidden `@` command
    try:
        cli.main(args=args, prog_name="fdl")
    except Exception as exc:  # the last line of defence: never a bare traceback
        _internal_error(exc)

"""`fdl launch`: open the join window and run a command on every admitted rank."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import NoReturn

import click
from rich.markup import escape

from ..address import AddressError, check_host
from ..config import Loaded
from ..config.join_window import MAX_CEILING
from ..controller.controller import Controller
from ..controller.supervision import parse_max_failure
from ..fleet.launcher import LaunchError, LaunchOptions
from ..fleet.launcher import launch as run_launch
from ..observe.status import one_line
from ..protocol.messages import Plane
from .common import RunExit, base_opt, err, load, log, print_problems


async def _live_roster(controller: Controller) -> None:
    """A spinner with the roster while the window is open (terminals only)."""
    with err.status("opening the join window") as spinner:
        while controller.window.phase in ("waiting", "staging"):
            spinner.update(escape(one_line(controller.view.summary())))
            await asyncio.sleep(0.5)  # the display's refresh interval


def _parallelism(value: str | None) -> dict[str, int] | None:
    from ..placement import PlacementError
    from ..placement.parallel import parse_parallelism

    if value is None:
        return None
    try:
        return parse_parallelism(value)
    except PlacementError as exc:
        raise click.BadParameter(exc.render(), param_hint="--parallelism") from None


def _bind(value: str | None) -> str | None:
    try:
        return None if value is None else check_host(value, "write an IP address or a host name of this box")
    except AddressError as exc:
        raise click.BadParameter(exc.render(), param_hint="--bind") from None


def _max_failure(value: str) -> str:
    try:
        return parse_max_failure(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-failure") from None


@click.command(context_settings={"allow_interspersed_args": False})
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=Path("fdl.cluster.yml"),
    show_default=True,
    help="Cluster file to launch.",
)
@base_opt
@click.option(
    "--bind",
    callback=lambda _ctx, _param, value: _bind(value),
    help="Bind address (default: cluster.controller.host).",
)
@click.option(
    "--port", type=click.IntRange(0, 65535), help="Port (default: cluster.controller.port; 0 picks one)."
)
@click.option(
    "--plane",
    type=click.Choice(["cpu", "nccl"]),
    help="Data plane the run uses (default: cluster.plane, else cpu). nccl refuses CPU offers, mixed "
    "GPU vendors and tunnelled boxes (an ssh forward carries only the cpu plane).",
)
@click.option(
    "--fanout/--no-fanout",
    default=True,
    show_default=True,
    help="Start an agent on every configured worker over ssh, after counting the GPUs of those that "
    "offer `local_devices: all`. --no-fanout when the workers run their own join unit "
    "(fdl join --persist).",
)
@click.option(
    "--max-failure",
    default="0",
    show_default=True,
    callback=lambda _ctx, _param, value: _max_failure(value),
    help="Ranks that may fail mid-run before it ends: a count (2) or a share of the world (25%). "
    "Within it a lost rank is evicted and averaging renormalizes (with --elastic, a process group "
    "re-forms and a walk-in takes the lost ranks); beyond it the survivors averaging "
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
    "--controller-grace",
    type=click.IntRange(0, 86400),
    help="Seconds the formed world trains on if this controller dies, its agents re-dialling to "
    "resume (default: cluster.controller.join.controller_grace, 120; 0: a lost controller stops "
    "the ranks). Started again on the port, the launch resumes its journaled world.",
)
@click.option(
    "--elastic",
    metavar="N",
    type=click.IntRange(1, MAX_CEILING),
    help="Turn on elastic growth with a ceiling of N ranks: after the window forms the world, "
    "walk-ins keep joining it until it holds N (overrides cluster.controller.join.elastic.max_ranks; "
    "the planes that grow are the file's, default cpu).",
)
@click.option(
    "--fresh",
    is_flag=True,
    help="Discard the port's journal of an unfinished launch and open a new window instead of resuming it.",
)
@click.option(
    "--handoff",
    is_flag=True,
    help="SIGTERM (a unit's stop or restart) hands a training world to the next controller on this "
    "port instead of stopping it: the hosts train on for the controller grace and a restarted launch "
    "resumes them. SIGINT still stops the run. The standing controller unit runs with it.",
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
    plane: Plane | None,  # click's Choice holds it to these
    fanout: bool,
    max_failure: str,
    stall_ceiling: float,
    controller_grace: int | None,
    elastic: int | None,
    fresh: bool,
    handoff: bool,
    parallelism: dict[str, int] | None,
    as_json: bool,
    command: tuple[str, ...],
) -> None:
    """Open the join window and run COMMAND on every admitted rank.

    COMMAND (after --) is the run's entry point and arguments, stated once here
    and sent to every agent: what a walk-in's ranks run unless it brings its own
    (fdl join --bin PATH -- ARGS) or fetched a published run, whose manifest wins.
    The log names what each host runs. Exit 0 when the run is done, 1 when it failed,
    130 (143, 129) when the operator stopped it with Ctrl-C (SIGTERM, SIGHUP: a
    dropped ssh session): every agent is told the operator stopped the launch.
    Output that cannot be written (a full disk) is dropped, never the run's code.
    Watched (a status page, fdl status --watch), the port serves the final phase
    a few seconds after the verdict; as it closes, the run's report is kept in
    ~/.flodl/controller/verdict-PORT.json, where fdl status finds it.
    """
    loaded = load(config_file, base, False)
    options = LaunchOptions(
        command=list(command),
        bind=bind,
        port=port,
        plane=plane,
        fanout=fanout,
        max_failure=max_failure,
        stall_ceiling=stall_ceiling,
        controller_grace=controller_grace,
        elastic=elastic,
        fresh=fresh,
        handoff=handoff,
        parallelism=parallelism,
    )
    launch_loaded(loaded, config_file, options, as_json)


def launch_loaded(
    loaded: Loaded, config_file: Path, options: LaunchOptions, as_json: bool = False
) -> NoReturn:
    """Run a loaded cluster file's launch to its end; exit with the run's code."""
    print_problems(loaded.warnings)
    cluster = loaded.config.cluster
    if cluster is None:
        err.print(f"fdl launch: {config_file} has no cluster: block to launch", style="red", markup=False)
        raise SystemExit(1)
    try:
        code = asyncio.run(
            run_launch(
                cluster,
                options,
                log,
                _live_roster if err.is_terminal else None,
                (lambda report: click.echo(json.dumps(report, indent=2))) if as_json else None,
            )
        )
    except LaunchError as exc:
        err.print(f"fdl launch: {exc.render()}", style="red", markup=False)
        raise SystemExit(1) from None
    except KeyboardInterrupt:  # a second Ctrl-C while the first one's stop was under way
        err.print("fdl launch: interrupted again: stopped at once", style="red", markup=False)
        raise RunExit(130) from None
    raise RunExit(code)

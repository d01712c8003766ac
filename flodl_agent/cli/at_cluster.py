"""`fdl @NAME COMMAND [ARGS]`: a named command of fdl.yml on the cluster of fdl.NAME.yml.

``main`` rewrites `fdl @NAME ...` to this hidden `@` command.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import click

from ..address import join_address, local_address
from ..fleet.launcher import LaunchOptions
from ..names import name_problem, shown
from ..protocol.messages import Plane
from .common import fail, load, present, project_file
from .launch import launch_loaded
from .probe import probe_cluster
from .status import start, status


@click.command(
    name="@",
    hidden=True,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.argument("name")
@click.option(
    "--plane",
    type=click.Choice(["cpu", "nccl"]),
    help="Data plane of the run (default: cluster.plane, else cpu).",
)
@click.option("--fanout/--no-fanout", default=True, help="Start agents on the configured workers.")
@click.argument("command_name", metavar="COMMAND")
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def at_cluster(
    ctx: click.Context,
    name: str,
    plane: Plane | None,
    fanout: bool,
    command_name: str,
    extra: tuple[str, ...],
) -> None:
    """`fdl @NAME COMMAND [ARGS]`: run a named command of fdl.yml on the cluster of fdl.NAME.yml.

    `fdl @NAME status` and `fdl @NAME start` talk to that cluster's controller.
    """
    problem = name_problem(name, "cluster name")
    if problem is not None:
        fail(f"@{shown(name)}", *problem)
    overlay = Path(f"fdl.{name}.yml")
    # Anything there is loaded (a FIFO is refused by name); a name too long to hold is not there.
    if present(overlay) is None:
        fail(f"@{name}", f"no {overlay} here", f"run from the project directory, or create {overlay}")
    loaded = load(overlay, project_file(), False)
    cluster = loaded.config.cluster
    if command_name == "probe" and cluster is not None:
        probe_cluster(cluster, name, "--json" in extra)
    if command_name in ("status", "start") and cluster is not None:
        addr = join_address(local_address(cluster.controller.host), cluster.controller.port)
        ctx.invoke(status if command_name == "status" else start, addr=addr)
        return
    commands = loaded.config.commands
    if command_name not in commands:
        close = difflib.get_close_matches(command_name, list(commands), n=1)
        hint = (
            f"did you mean `{close[0]}`?"
            if close
            else (f"known: {', '.join(commands)}" if commands else "add a commands: block to fdl.yml")
        )
        fail(f"@{name}", f"no command `{shown(command_name)}`", hint)
    options = LaunchOptions(command=[*commands[command_name], *extra], plane=plane, fanout=fanout)
    launch_loaded(loaded, overlay, options)

"""The `fdl` group, its commands, and the entry point's last line of defence."""

from __future__ import annotations

import difflib
import os
import sys
from typing import NoReturn

import click

from .. import __version__
from .at_cluster import at_cluster
from .common import err, pipe_safe_streams
from .config import config
from .deploy import deploy
from .join import join_cmd
from .launch import launch
from .libtorch import libtorch
from .nccl import nccl
from .plan import placement, plan
from .probe import probe
from .publish import publish
from .status import start, status
from .tls import tls


@click.group(
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    invoke_without_command=True,
)
@click.version_option(__version__, "-V", "--version", prog_name="fdl")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """flodl fleet: stand up and run multi-host training fleets.

    `fdl help COMMAND...` (or `fdl COMMAND --help`) says what a command does."""
    if ctx.invoked_subcommand is None:  # plain `fdl`: the help, and success (as `fdl --help`)
        click.echo(ctx.get_help())


@cli.command("help")
@click.argument("names", nargs=-1, metavar="[COMMAND...]")
@click.pass_context
def help_cmd(ctx: click.Context, names: tuple[str, ...]) -> None:
    """Show the help of fdl, or of a command (`fdl help config check`)."""
    assert ctx.parent is not None  # the `fdl` group's
    here, command = ctx.parent, ctx.parent.command
    for name in names:
        if not isinstance(command, click.Group):
            raise click.UsageError(f"`{here.command_path}` has no subcommands (`{name}`)", ctx)
        found = command.get_command(here, name)
        if found is None or found.hidden:
            raise click.UsageError(f"no such command `{here.command_path} {name}`{_close(here, name)}", ctx)
        here, command = click.Context(found, info_name=name, parent=here), found
    click.echo(command.get_help(here))


def _close(ctx: click.Context, name: str) -> str:
    """The visible subcommand of ``ctx`` closest to ``name`` as a hint, or nothing."""
    group = ctx.command
    if not isinstance(group, click.Group):
        return ""
    visible = [n for n in group.list_commands(ctx) if not getattr(group.get_command(ctx, n), "hidden", True)]
    close = difflib.get_close_matches(name, visible, n=1)
    return f" (did you mean `{close[0]}`?)" if close else ""


# click lists them by name, whatever the order here.
for command in (
    config,
    launch,
    at_cluster,
    join_cmd,
    status,
    start,
    probe,
    libtorch,
    publish,
    deploy,
    tls,
    nccl,
    plan,
    placement,
):
    cli.add_command(command)


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
    pipe_safe_streams()  # a reader that leaves early (`fdl status | head -1`) is no failure
    try:
        cli.main(args=args, prog_name="fdl")
    except Exception as exc:  # the last line of defence: never a bare traceback
        _internal_error(exc)

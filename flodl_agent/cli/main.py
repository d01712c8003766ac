"""The `fdl` group, its commands, and the entry point's last line of defence."""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from typing import NoReturn

import click

from .. import __version__
from .common import err, finish, pipe_safe_streams

# Each command's module, imported when the command runs (or a help lists it): `fdl status`
# need not load the controller, the agent and their libraries (a second a run, otherwise).
COMMANDS = {
    "config": ("config", "config"),
    "launch": ("launch", "launch"),
    "@": ("at_cluster", "at_cluster"),
    "join": ("join", "join_cmd"),
    "status": ("status", "status"),
    "start": ("status", "start"),
    "probe": ("probe", "probe"),
    "libtorch": ("libtorch", "libtorch"),
    "publish": ("publish", "publish"),
    "deploy": ("deploy", "deploy"),
    "tls": ("tls", "tls"),
    "nccl": ("nccl", "nccl"),
    "plan": ("plan", "plan"),
    "placement": ("plan", "placement"),
}


class _Commands(click.Group):
    """The `fdl` group, its commands loaded on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            module, attr = COMMANDS[cmd_name]
            self.add_command(getattr(importlib.import_module(f"{__package__}.{module}"), attr), cmd_name)
        return self.commands.get(cmd_name)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except click.exceptions.NoSuchCommand as exc:  # click's hint reads the loaded ones alone
            raise click.exceptions.NoSuchCommand(
                exc.command_name, possibilities=self.list_commands(ctx), ctx=ctx
            ) from None


@click.group(
    cls=_Commands,
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
    except SystemExit as exc:  # click's standalone mode always ends so
        sys.exit(finish(exc))
    except Exception as exc:  # the last line of defence: never a bare traceback
        _internal_error(exc)

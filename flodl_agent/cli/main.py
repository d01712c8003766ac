"""The `fdl` group, its commands, and the entry point's last line of defence."""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import click

from .. import __version__
from .at_cluster import at_cluster
from .common import err
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


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "-V", "--version", prog_name="fdl")
def cli() -> None:
    """flodl fleet: stand up and run multi-host training fleets."""


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
    try:
        cli.main(args=args, prog_name="fdl")
    except Exception as exc:  # the last line of defence: never a bare traceback
        _internal_error(exc)

"""`fdl nccl`: NCCL alignment across a fleet."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.markup import escape

from .common import FilePath, emit_json, err, json_opt, out


@click.group()
def nccl() -> None:
    """NCCL alignment across a fleet."""


@nccl.command("pin")
@click.argument("version")
@click.option(
    "--venv",
    type=FilePath(path_type=Path, file_okay=False),
    help="The variant's virtualenv (default: the one running fdl).",
)
@click.option("--cuda", help="CUDA version or major the wheel is for (default: what the venv's torch says).")
@click.option(
    "--find-links",
    type=FilePath(path_type=Path, file_okay=False),
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
    from ..probing.nccl import NcclError
    from ..probing.nccl import pin as run_pin

    target = (venv or Path(sys.prefix)).absolute()
    try:
        pinned = run_pin(version, target, cuda, find_links)
    except NcclError as exc:
        if as_json:
            emit_json({"pinned": False, "error": exc.message, "fix": exc.fix})
        else:
            err.print(f"fdl nccl pin: {exc.render()}", style="red", markup=False)
        raise SystemExit(1) from None
    if as_json:
        emit_json(
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

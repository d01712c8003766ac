"""`fdl libtorch`: the torch variants on this box, and acquiring one (what join.libtorch uses).

The shell over :mod:`flodl_agent.hardware.libtorch` (reading the venvs and the cards, acquiring)
and :mod:`flodl_agent.hardware.variants` (the choice, the listing): the same root, the same rule
and the same sources as `fdl join`, so what these commands say is what a join does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from ..config import Join
from ..retry import AgentFailure
from .common import emit_json, fail, json_opt, log, out
from .join import join_block
from .options import OptionError, resolve_libtorch

config_opt = click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="fdl.yml whose join: block names torch_sources (and libtorch) (default: ./fdl.yml if present).",
)


def _variant(_ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """auto | cpu | cuNNN | rocmX.Y, by join.libtorch's own rule."""
    if value is None:
        return None
    try:
        return resolve_libtorch(value, Join())
    except OptionError as exc:
        raise click.BadParameter(
            f"{exc.message}: name auto, cpu, a CUDA one like cu126 or a ROCm one like rocm6.4",
            param_hint="VARIANT",
        ) from None


def _source(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """An http(s):// index URL as given, or a wheelhouse directory made absolute."""
    if value is None or re.match(r"https?://[^/\s]+", value):
        return value
    where = Path(value).expanduser().absolute()
    try:
        found = where.is_dir()
    except OSError:  # a name the file system cannot hold (too long for one path component)
        found = False
    if not found:
        raise click.BadParameter(
            f"`{value}` is neither an http(s):// index URL nor a directory",
            param_hint="--source",
        )
    return str(where)


@click.group()
def libtorch() -> None:
    """The torch variants on this box: one venv each under the libtorch root.

    The root is the one `fdl join` uses: $FLODL_LIBTORCH_ROOT, else the
    directory holding the running venv when it is named libtorch (the worker
    role's /opt/flodl/libtorch), else ~/.flodl/libtorch. A variant is cpu,
    cuNNN (cu126, cu128) or rocmX.Y (rocm6.4); `auto` is the one this box's
    cards need, as join.libtorch: auto picks it.
    """


@libtorch.command("list")
@config_opt
@json_opt
def list_cmd(config_file: Path | None, as_json: bool) -> None:
    """Each variant venv under the root and what `auto` would pick.

    Per venv: its torch, the build (CPU, CUDA, ROCm), the arch flags it ships
    kernels for, its NCCL, and whether it covers this box's cards (read from
    nvidia-smi and the KFD topology, never torch). Exit 0.
    """
    from ..hardware.libtorch import survey
    from ..hardware.variants import listing

    block = join_block(config_file)
    found = survey("auto")
    try:
        auto: Any = found.choose("auto", block.torch_sources)
    except AgentFailure as exc:
        auto = exc
    payload = listing(found.venvs, found.running, found.box, found.root, auto)
    if as_json:
        emit_json(payload)
        return
    _print_listing(payload)


def _build(row: dict[str, Any]) -> str:
    return f"CUDA {row['cuda']}" if row["cuda"] else f"ROCm {row['hip']}" if row["hip"] else "CPU"


def _print_listing(payload: dict[str, Any]) -> None:
    out.print(f"libtorch root {escape(payload['root'])}")
    box = payload["box"]
    cards = ", ".join(f"GPU {g['index']} {g['name']} ({g['arch'] or '?'})" for g in box["gpus"])
    extra = [f"driver CUDA {box['driver_cuda']}"] if box["driver_cuda"] else []
    extra += [f"ROCm {box['rocm']}"] if box["rocm"] else []
    out.print(f"this box: {escape(cards or 'no GPU')}{''.join(f'; {e}' for e in extra)}")
    if not payload["variants"]:
        out.print("no variant venv under the root")
    table = Table("variant", "torch", "build", "archs", "nccl", "this box", box=None, pad_edge=False)
    for row in payload["variants"]:
        name = row["name"] + (" (running)" if row["running"] else "")
        if row["problem"]:
            table.add_row(escape(name), "", "", "", "", f"[red]unusable[/]: {escape(row['problem'])}")
            continue
        style = {True: "green", False: "red", None: "dim"}[row["covers"]]
        says = escape(row["coverage"] + (f" ({row['note']})" if row["note"] else ""))
        table.add_row(
            escape(name),
            escape(row["torch"]),
            _build(row),
            escape(" ".join(row["archs"]) or "-"),
            escape(row["nccl"] or "-"),
            f"[{style}]{says}[/]",
        )
    if payload["variants"]:
        out.print(table)
    out.print(_auto_line("auto", payload["auto"]))


def _auto_line(wanted: str, pick: dict[str, Any]) -> str:
    if "error" in pick:
        return f"[red]{wanted}: {escape(pick['error'])}[/]\n    fix: {escape(pick['fix'])}"
    if pick["acquire"]:
        what = "not installed" if pick["variant"] == wanted else f"{pick['variant']}, not installed"
        return (
            f"{wanted}: [yellow]{what}[/] (`fdl libtorch acquire {wanted}`, or the next join "
            f"acquires it): {escape(pick['reason'])}"
        )
    return f"{wanted}: [green]{pick['variant']}[/] at {escape(pick['venv'])}: {escape(pick['reason'])}"


@libtorch.command("which")
@click.argument("variant", required=False, metavar="[VARIANT]", callback=_variant)
@config_opt
@json_opt
def which_cmd(variant: str | None, config_file: Path | None, as_json: bool) -> None:
    """The venv `fdl join` would run in for VARIANT, or the variant it would acquire, and why.

    VARIANT defaults to join.libtorch of fdl.yml, else auto. Exit 0 when it is
    determined, 2 when it cannot be (the fix is named).
    """
    from ..hardware.libtorch import survey
    from ..hardware.variants import choice_json

    block = join_block(config_file)
    wanted = variant or block.libtorch or "auto"
    try:
        pick = choice_json(survey(wanted).choose(wanted, block.torch_sources))
    except AgentFailure as exc:
        if as_json:
            emit_json({"wanted": wanted, "error": exc.message, "fix": exc.fix})
        fail("libtorch which", exc.message, exc.fix or None, exc.code)
    if as_json:
        emit_json({"wanted": wanted, **pick})
    else:
        out.print(_auto_line(wanted, pick))


@libtorch.command("acquire")
@click.argument("variant", metavar="VARIANT|auto", callback=_variant)
@click.option(
    "--source",
    metavar="URL|DIR",
    callback=_source,
    help="A pip index URL or a wheelhouse directory to take torch from "
    "(default: join.torch_sources.<variant>, else download.pytorch.org's index for it).",
)
@config_opt
@json_opt
def acquire_cmd(variant: str, source: str | None, config_file: Path | None, as_json: bool) -> None:
    """Install VARIANT as a venv under the root, as `fdl join` would before its dial.

    auto is the variant this box's cards need. The venv gets torch from the
    source and flodl-fleet at this fdl's version (from the same wheelhouse when
    it holds it), and is renamed into place only once its torch imports and is
    that variant, so a failed or killed acquisition leaves nothing that looks
    installed. Already there: says so and exits 0. Exit 1 when the source
    could not be reached (try again), 2 when it cannot serve VARIANT.
    """
    from ..hardware.libtorch import acquire, survey
    from ..hardware.variants import choice_json, source_for

    block = join_block(config_file)
    try:
        found = survey(variant)
        choice = found.choose(variant, block.torch_sources)
        if choice.venv is not None:
            if as_json:
                emit_json({"wanted": variant, "acquired": False, **choice_json(choice)})
            else:
                out.print(f"libtorch {variant}: already there, nothing to acquire ({escape(choice.reason)})")
            return
        src = source or source_for(choice.variant, block.torch_sources)
        log(f"libtorch {variant}: {choice.reason}")
        path = acquire(choice.variant, found.root, src, log)
    except AgentFailure as exc:
        if as_json:
            emit_json({"wanted": variant, "acquired": False, "error": exc.message, "fix": exc.fix})
        fail("libtorch acquire", exc.message, exc.fix or None, exc.code)
    if as_json:
        emit_json(
            {"wanted": variant, "acquired": True, "variant": choice.variant, "venv": str(path), "source": src}
        )
    else:
        out.print(f"libtorch {variant}: {choice.variant} installed at {escape(str(path))}")
        out.print(f"  torch from {escape(src)}")

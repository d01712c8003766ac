"""What every command of the CLI shares: the consoles, problem and error printing,
loading a config file, JSON output, and the shared flags."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn, TextIO, cast

import click
from rich.console import Console
from rich.markup import escape

from ..config import ConfigError, Loaded, Problem, load_config
from ..credentials import read_token
from ..names import printable_lines
from .options import OptionError

PROJECT_FILE = Path("fdl.yml")
CLUSTER_FILE = Path("fdl.cluster.yml")

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


class PipeSafe:
    """A standard stream whose reader may leave first (`fdl status | head -1`): that is not a
    failure. The first write that meets the closed pipe points the stream's descriptor at
    /dev/null (later writes, and the interpreter's last flush, go nowhere), sets ``gone``, and
    the command goes on to end with its own exit code, never a traceback or click's 1."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.gone = False

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._lost()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._lost()

    def _lost(self) -> None:
        self.gone = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self.stream.fileno())
        finally:
            os.close(devnull)

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, buffer: the stream's
        return getattr(self.stream, name)


def pipe_safe_streams() -> None:
    """Wrap sys.stdout and sys.stderr (the entry point does, once): rich, click.echo and the
    agent's rank lines all write through them."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, PipeSafe):
            setattr(sys, name, cast(TextIO, PipeSafe(stream)))


def stdout_gone() -> bool:
    """Whether stdout's reader has left: a command that only refreshes output can stop."""
    return isinstance(sys.stdout, PipeSafe) and sys.stdout.gone


def print_problems(problems: list[Problem]) -> None:
    for problem in problems:
        style = "red" if problem.severity == "error" else "yellow"
        err.print(problem.render(), style=style, markup=False)


def emit_json(payload: Any) -> None:
    click.echo(json.dumps(payload, indent=2))


def load(file: Path, base: Path | None, as_json: bool) -> Loaded:
    """Load and validate a config file; an invalid one ends the command with exit 1."""
    try:
        return load_config(file, base)
    except ConfigError as exc:
        if as_json:
            emit_json({"valid": False, "errors": [p.as_dict() for p in exc.problems], "warnings": []})
        else:
            print_problems(list(exc.problems))
        raise SystemExit(1) from None


def project_file(explicit: Path | None = None) -> Path | None:
    """``--config`` when given, else ./fdl.yml when there is one: the project's defaults."""
    if explicit is not None:
        return explicit
    return PROJECT_FILE if PROJECT_FILE.is_file() else None


def log(line: str) -> None:
    # A line may quote a peer (a refusal's reason, a host name): no markup, nothing a terminal acts on.
    err.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {escape(printable_lines(line))}")


def fail(command: str, message: str, fix: str | None = None, code: int = 2) -> NoReturn:
    """`fdl COMMAND: message` (and its fix) in red on stderr, then exit ``code``."""
    text = f"fdl {command}: {message}" + (f"\n    fix: {fix}" if fix else "")
    err.print(text, style="red", markup=False)
    raise SystemExit(code)


def option_error(command: str, exc: OptionError) -> NoReturn:
    """An option that cannot be used, printed as its kind says; exit 2 whichever."""
    if exc.kind == "param":
        raise click.BadParameter(exc.message, param_hint=exc.param) from None
    if exc.kind == "usage":
        raise click.UsageError(exc.message) from None
    fail(command, exc.message, exc.fix)


def token_or_exit(option: str | None) -> str | None:
    try:
        return read_token(option)
    except ValueError as exc:
        err.print(f"fdl: {exc}", style="red", markup=False)
        raise SystemExit(2) from None


class TailCommand(click.Command):
    """Everything after `--` is the tail (``ctx.meta["tail"]``, None without a `--`): an
    empty tail is still a tail, and a tail never fills an optional positional argument."""

    usage = "[OPTIONS] [-- ARGS...]"

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["tail"] = None
        if "--" in args:
            cut = args.index("--")
            args, ctx.meta["tail"] = args[:cut], args[cut + 1 :]
        return super().parse_args(ctx, args)

    def format_usage(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        formatter.write_usage(ctx.command_path, self.usage)


file_arg = click.argument("file", type=click.Path(path_type=Path, dir_okay=False))
base_opt = click.option(
    "--base",
    type=click.Path(path_type=Path, dir_okay=False),
    help="fdl.yml to deep-merge FILE onto (the overlay rule).",
)
json_opt = click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")

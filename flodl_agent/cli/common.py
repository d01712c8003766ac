"""What every command of the CLI shares: the consoles, problem and error printing,
loading a config file, JSON output, and the shared flags."""

from __future__ import annotations

import contextlib
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
from ..config.source import path_kind
from ..credentials import read_token
from ..names import printable_lines, shown
from .options import OptionError

PROJECT_FILE = Path("fdl.yml")
CLUSTER_FILE = Path("fdl.cluster.yml")

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


STREAMS = {"stdout": "standard output", "stderr": "standard error"}


class PipeSafe:
    """A standard stream that may stop taking writes: its reader left (`fdl status | head -1`),
    or its disk is full or failing (`> /dev/full`). The first write or flush that fails points
    the stream's descriptor at /dev/null (later writes, and the interpreter's last flush, go
    nowhere) and sets ``gone``; a failure other than a closed pipe is also kept in ``failed``
    and said once on stderr. The command goes on: a running agent keeps training, and the
    exit code is the command's own (``finish`` makes a success 1 after a failed write)."""

    def __init__(self, stream: TextIO, name: str = "stdout") -> None:
        self.stream = stream
        self.name = name
        self.gone = False
        self.failed: OSError | None = None

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as exc:
            self._lost(exc)
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as exc:
            self._lost(exc)

    def _lost(self, exc: OSError) -> None:
        if self.gone:
            return
        self.gone = True
        with contextlib.suppress(OSError, ValueError):  # no descriptor to repoint: writes stay caught
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self.stream.fileno())
            finally:
                os.close(devnull)
        if isinstance(exc, BrokenPipeError):
            return  # the reader left: no failure
        self.failed = exc
        if self.name != "stderr" and sys.stderr is not None:  # stderr cannot say that stderr failed
            why = exc.strerror or type(exc).__name__
            print(
                f"fdl: cannot write to {STREAMS[self.name]}: {why}; the rest of it is dropped "
                "(free space where it goes, or redirect it)",
                file=sys.stderr,
            )

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, buffer: the stream's
        return getattr(self.stream, name)


def pipe_safe_streams() -> None:
    """Wrap sys.stdout and sys.stderr (the entry point does, once): rich, click.echo and the
    agent's rank lines all write through them."""
    for name in STREAMS:
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, PipeSafe):
            setattr(sys, name, cast(TextIO, PipeSafe(stream, name)))


def stdout_gone() -> bool:
    """Whether stdout's reader has left: a command that only refreshes output can stop."""
    return isinstance(sys.stdout, PipeSafe) and sys.stdout.gone


class RunExit(SystemExit):
    """The exit code of a run (a launch's verdict, a walk-in's clean/transient/permanent):
    a failed write to stdout or stderr never changes it."""


def finish(exc: SystemExit) -> int | str | None:
    """The process's exit code for a command that ended with ``exc``: every stream flushed
    first (a write that fails now is said, not "Exception ignored" at exit), then a success
    whose output could not be written is 1."""
    for name in STREAMS:
        stream = getattr(sys, name)
        if stream is not None:
            with contextlib.suppress(ValueError):  # closed by whoever held it: nothing to flush
                stream.flush()
    failed = any(isinstance(s, PipeSafe) and s.failed is not None for s in (sys.stdout, sys.stderr))
    if failed and not isinstance(exc, RunExit) and exc.code in (0, None):
        return 1
    return exc.code


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
    return present(PROJECT_FILE)


def present(path: Path) -> Path | None:
    """``path`` when anything is there: a FIFO, a directory or a dangling link is refused by
    the load, by name, never taken for no file at all."""
    return path if os.path.lexists(path) else None


class FilePath(click.Path):
    """A path flag or argument held to its kind before anything opens it (and waits): a file
    (dir_okay=False) that is there must be a regular one, not a FIFO, a device or a /proc
    file; a directory (file_okay=False) must be a directory; either, one of the two."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        path = super().convert(value, param, ctx)
        try:
            kind = path_kind(Path(os.fsdecode(path)))
        except (OSError, ValueError):
            return path  # missing or unreachable: the command says so as it always has
        wanted = (
            {None} if not self.dir_okay else {"a directory"} if not self.file_okay else {None, "a directory"}
        )
        if kind not in wanted:
            what = "a regular file" if None in wanted else "a directory"
            self.fail(f"{shown(os.fsdecode(path))} is not {what} ({kind or 'a file'}): name one", param, ctx)
        return path


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

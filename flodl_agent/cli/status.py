"""`fdl status` and `fdl start`: the operator's side of the controller's HTTP surface.

The shell reads ./fdl.cluster.yml and FDL_TLS_FINGERPRINT; ``options.resolve_addr``
and ``resolve_pin`` decide what wins.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, NoReturn

import click
from rich.console import Group
from rich.live import Live

from ..address import split_address
from ..config import Cluster, ConfigError, load_config
from ..config.source import NotRegular
from ..controller.journaling import lost_verdict
from ..observe.status import Unreachable, peer, render, render_verdict, request
from ..observe.verdict import last_verdict, on_this_box
from .common import (
    CLUSTER_FILE,
    emit_json,
    err,
    json_opt,
    option_error,
    out,
    present,
    stdout_gone,
    token_or_exit,
)
from .options import OptionError, resolve_addr, resolve_pin
from .tls import cert_pin

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


def _active_cluster(path: Path) -> Cluster | None:
    """The cluster of ./fdl.cluster.yml; none when it is missing or invalid (then the defaults
    apply). A FIFO or a device there is invalid: the load refuses it, never waits on it."""
    if present(path) is None:
        return None
    try:
        return load_config(path).config.cluster
    except ConfigError:
        return None


def _cluster_pin(cluster: Cluster | None) -> str | None:
    if cluster is None or cluster.controller.tls is None:
        return None
    with contextlib.suppress(OSError, ValueError, NotRegular):  # no readable certificate: no pin from it
        return cert_pin(Path(cluster.controller.tls.cert))  # never waits on a FIFO
    return None


def target(addr: str | None, pin: str | None) -> tuple[str, str | None, str | None]:
    """(address, pin, a note on where the address came from) for talking to the controller."""
    path = Path.cwd() / CLUSTER_FILE
    cluster = _active_cluster(path) if not (addr and pin) else None
    controller = (cluster.controller.host, cluster.controller.port) if cluster is not None else None
    try:
        pinned = resolve_pin(pin, os.environ, _cluster_pin(cluster))
        address, note = resolve_addr(addr, controller, str(path))
    except OptionError as exc:
        option_error("status", exc)
    return address, pinned, note


def _gone(where: str, problem: Unreachable, as_json: bool, lines: bool = False) -> NoReturn:
    """Nobody answers: say so, then how the last launch on that port ended when this box kept it
    (``lines``: as one JSON line, a watch's)."""
    err.print(f"fdl status: {problem}", style="red", markup=False)
    with contextlib.suppress(ValueError):
        host, port = split_address(where)
        verdict = last_verdict(host, port)
        # A controller killed mid-run kept no verdict: its journal tells, over an older launch's verdict.
        # Only when nothing listens: a slow or pinned controller is alive, whatever its journal says.
        lost = lost_verdict(port) if problem.nobody and on_this_box(host) else None
        if lost is not None and (verdict is None or verdict.get("launch") != lost["launch"]):
            verdict = lost
        if verdict is not None:
            if as_json:
                _emit(verdict | {"live": False}, lines)
            else:
                for part in render_verdict(verdict, time.time()):
                    out.print(part)
    raise SystemExit(1)


def _emit(state: dict[str, Any], line: bool) -> None:
    if line:  # JSON Lines: a document a line (click.echo flushes: `| jq` sees each as it comes)
        click.echo(json.dumps(state, separators=(",", ":")))
    else:
        emit_json(state)


def _show(state: dict[str, Any], as_json: bool, lines: bool) -> None:
    if as_json:
        _emit(state, lines)
    else:
        for part in render(state):
            out.print(part)


@click.command()
@addr_opt
@pin_opt
@json_opt
@click.option(
    "--watch",
    is_flag=True,
    help="Refresh every second until the run ends: in place on a terminal; otherwise one plain "
    "rendering per refresh (with --json, one JSON document a line). Started before the launch, "
    "it waits for the window to open.",
)
def status(addr: str | None, pin: str | None, as_json: bool, watch: bool) -> None:
    """Show the controller's phase, countdowns, roster and every rank's progress.

    When nobody answers, and the address is this box's, it shows how the last launch
    on that port ended (the verdict the controller kept in ~/.flodl/controller of the
    user who ran it, or its journal when the controller was killed mid-run). Exit 0
    when a controller answers, 1 when none does (also when a kept verdict is shown:
    --json's `ok` says how it ended); a reader that leaves early (`fdl status |
    head -1`) changes neither."""
    where, pinned, note = target(addr, pin)
    if note and not as_json:
        err.print(f"note: {note}", style="dim", markup=False)
    try:
        state = _first_state(where, pinned, watch)
    except Unreachable as exc:
        _gone(where, exc, as_json, lines=watch)
    if not watch:
        _show(state, as_json, lines=False)
    elif out.is_terminal and not as_json:
        _live(where, pinned, state)
    else:
        _refreshes(where, pinned, state, as_json)


def _first_state(where: str, pinned: str | None, watch: bool) -> dict[str, Any]:
    """The controller's state. A watch started before the launch (the natural order) waits,
    saying so once, for a controller to listen; anything else that fails ends it as ever."""
    said = False
    while True:
        try:
            return request(where, "GET", "/state.json", pin=pinned).body
        except Unreachable as exc:
            if not (watch and exc.nobody):
                raise
            if not said:
                err.print(
                    f"fdl status: no controller at {where} yet: waiting for a launch to open its "
                    "window (Ctrl-C stops)",
                    style="dim",
                    markup=False,
                )
                said = True
        time.sleep(1.0)  # the refresh interval of a watch


def _refreshes(where: str, pinned: str | None, state: dict[str, Any], as_json: bool) -> None:
    """A watch into a pipe or file: every refresh in full (a blank line between plain ones),
    until the run ends or the reader leaves."""
    while True:
        _show(state, as_json, lines=True)
        if state.get("phase") in ("done", "failed") or stdout_gone():
            return
        if not as_json:
            out.print()
        time.sleep(1.0)  # the refresh interval of a watch
        try:
            state = request(where, "GET", "/state.json", pin=pinned).body
        except Unreachable as exc:  # the controller went before its final phase reached this watch
            _gone(where, exc, as_json, lines=True)


def _live(where: str, pinned: str | None, state: dict[str, Any]) -> None:
    """A terminal's watch: one display, redrawn in place."""
    lost: Unreachable | None = None
    with Live(Group(*render(state)), console=out, refresh_per_second=4) as live:
        while state.get("phase") not in ("done", "failed"):
            time.sleep(1.0)  # the refresh interval of a watch display
            try:
                state = request(where, "GET", "/state.json", pin=pinned).body
            except Unreachable as exc:
                lost = exc
                break
            live.update(Group(*render(state)))
    if lost is not None:  # the controller went before its final phase reached this watch
        _gone(where, lost, False)


@click.command()
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
    where, pinned, note = target(addr, pin)
    if note:
        err.print(f"note: {note}", style="dim", markup=False)
    token = token_or_exit(token_opt)
    try:
        reply = request(where, "POST", "/start", form={"token": token} if token else None, pin=pinned)
    except Unreachable as exc:
        err.print(f"fdl start: {exc}", style="red", markup=False)
        raise SystemExit(1) from None
    if reply.status in (200, 202):
        out.print(f"armed: {peer(reply.body.get('reason', 'start accepted'))}", markup=False)
        return
    err.print(
        f"refused ({reply.status}): {peer(reply.body.get('error', 'no reason given'))}",
        style="red",
        markup=False,
    )
    raise SystemExit(1)

"""`fdl launch`: open the window for a cluster, fan agents out, wait for the verdict."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .address import is_loopback
from .config.join_window import LOCKED_OUT_FIX, locked_out_message, locks_walk_ins_out
from .config.models import Cluster
from .controller import Controller, Settings
from .errors import Failure
from .fanout import Fanout, FanoutError, plan
from .listener import BindError
from .messages import Plane
from .ranks import plan_window
from .window import WindowConfig


class LaunchError(Failure):
    """A launch that cannot start (bad window plan, port taken, fan-out impossible)."""


@dataclass(frozen=True)
class LaunchOptions:
    command: list[str]
    bind: str | None = None
    port: int | None = None
    plane: Plane = "cpu"
    fanout: bool = True
    max_failure: str = "0"
    stall_ceiling: float = 600.0
    parallelism: dict[str, int] | None = None


def controller_for(cluster: Cluster, options: LaunchOptions, log: Callable[[str], None]) -> Controller:
    join = cluster.controller.join
    try:
        window = WindowConfig.from_plan(plan_window(join, cluster.capacity), discovery=join.discovery)
    except ValueError as exc:
        raise LaunchError(
            str(exc), "list devices explicitly, or set cluster.controller.join.min_rank_start"
        ) from None
    bind = options.bind or cluster.controller.host
    if join.tunnel_only and not is_loopback(bind):
        # Reachability through the guardrailed sshd is the credential: nothing else may reach the port.
        log(f"tunnel_only: binding 127.0.0.1 instead of {bind}; walk-ins arrive through the join door")
        bind = "127.0.0.1"
    if bind != cluster.controller.host and locks_walk_ins_out(join, bind):
        # The file's own bind was checked when it loaded; --bind moved the window.
        said = locked_out_message(bind, len(cluster.workers))
        if not cluster.workers:
            raise LaunchError(f"--bind {bind} {said}", LOCKED_OUT_FIX)
        log(f"warning: --bind {bind} {said}")
    settings = Settings(
        window=window,
        command=options.command,
        bind=bind,
        port=cluster.controller.port if options.port is None else options.port,
        token=join.token,
        open_admission=join.open_admission,
        plane=options.plane,
        env=dict(cluster.env),
        launch=secrets.token_hex(4),
        roster=[w.host for w in cluster.workers],
        max_failure=options.max_failure,
        stall_ceiling=options.stall_ceiling,
        parallelism=options.parallelism,
        tls=(cluster.controller.tls.cert, cluster.controller.tls.key) if cluster.controller.tls else None,
        host_facts={w.host: cluster.host_facts(w.host) for w in cluster.workers},
        walk_in_facts=cluster.host_facts(None),
    )
    return Controller(settings, log=log)


async def launch(
    cluster: Cluster,
    options: LaunchOptions,
    log: Callable[[str], None],
    watch: Callable[[Controller], Awaitable[None]] | None = None,
    report: Callable[[dict[str, Any]], None] | None = None,
) -> int:
    """Run one launch to its verdict; ``watch`` (a live display) runs alongside, and
    ``report`` gets the run's report (the world as formed, every rank's exit) at the end."""
    controller = controller_for(cluster, options, log)
    try:
        await controller.start()
    except BindError as exc:
        raise LaunchError(str(exc), "another controller may hold the port; pick one with --port") from None
    settings = controller.settings
    mode = "open (salt handed out in Accept)" if controller.open else "credential-checked"
    window = settings.window
    log(
        f"join window open on {settings.bind}:{controller.port} "
        f"(launch {settings.launch}, admission {mode}); "
        f"quorum {window.quorum}, target {window.target}, start {window.start}"
    )
    by_host = {w.host: w for w in cluster.workers}

    def session_ended(host: str, code: int, tail: str) -> None:
        # A session that dies before its host joined shrinks what can still walk in;
        # once quorum is out of reach, waiting for the hard cap only wastes the operator's time.
        window = controller.window
        if code == 0 or host in controller.links or window.phase not in ("waiting", "staging"):
            return
        if cluster.controller.join.discovery:
            return
        waiting = [w for h, w in by_host.items() if h not in controller.links and fanout.alive(h)]
        if any(w.capacity is None for w in waiting):
            return  # a worker offering `all` may still bring any number of ranks
        if window.joined_ranks + sum(w.capacity or 0 for w in waiting) < window.config.quorum:
            controller.fail(
                f"fan-out to {host} failed (ssh exit {code}{': ' + tail if tail else ''}); "
                f"quorum {window.config.quorum} is out of reach"
            )

    fanout = Fanout(log, session_ended)
    try:
        if options.fanout and cluster.workers:
            try:
                plans = [
                    plan(w, cluster, controller.port, controller.key, settings.bind) for w in cluster.workers
                ]
            except FanoutError as exc:
                raise LaunchError(str(exc), "or launch with --no-fanout and let workers walk in") from None
            try:
                await fanout.start(plans)
            except FanoutError as exc:
                raise LaunchError(str(exc), "install openssh-client on the controller box") from None
        watcher = asyncio.ensure_future(watch(controller)) if watch is not None else None
        await controller.finished.wait()
        if watcher is not None:
            watcher.cancel()
    finally:
        await controller.close()
        await fanout.stop()
    if report is not None:
        report(controller.view.report())
    return controller.exit_code

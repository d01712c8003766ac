"""`fdl launch`: open the window for a cluster, fan agents out, wait for the verdict."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import secrets
import signal
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..address import is_loopback, join_address
from ..config.join_window import (
    LOCKED_OUT_FIX,
    ElasticWindow,
    JoinWindow,
    ceiling_floor,
    locked_out_message,
    locks_walk_ins_out,
)
from ..config.models import Cluster
from ..config.problems import format_path
from ..config.ranks import CapacityUnknown, fanout_ranks, plan_window
from ..config.source import path_kind
from ..controller.controller import Controller
from ..controller.elastic import Elastic
from ..controller.journal import Journal, JournalError, Resume, on_start, settings_digest
from ..controller.journaling import Journaler
from ..controller.listener import BindError
from ..controller.settings import Settings
from ..controller.window import WindowConfig
from ..errors import Failure
from ..observe.verdict import keep_verdict
from ..protocol.messages import Plane
from .dispatch import DispatchError, count_devices
from .fanout import Fanout, FanoutError, plan

LINGER = 3.0  # a watcher polling once a second sees the final phase within it
LINGER_CAP = 10.0  # however slow the watcher, the port closes by then
WATCHED = 5.0  # a poll of /state.json this recent means someone is watching


class LaunchError(Failure):
    """A launch that cannot start (bad window plan, port taken, fan-out impossible)."""


@dataclass(frozen=True)
class LaunchOptions:
    command: list[str]
    bind: str | None = None
    port: int | None = None
    plane: Plane | None = None  # --plane; None: the cluster file's plane, else cpu
    fanout: bool = True
    max_failure: str = "0"
    stall_ceiling: float = 600.0
    parallelism: dict[str, int] | None = None
    controller_grace: int | None = None  # --controller-grace; None: the cluster file's
    elastic: int | None = None  # --elastic: the ceiling of ranks; None: the cluster file's
    fresh: bool = False  # --fresh: discard an unfinished launch's journal instead of resuming it
    handoff: bool = False  # --handoff: SIGTERM hands a training world to the next controller
    linger: float = LINGER  # seconds the port serves the final phase after the verdict, when watched


def bind_failure(exc: BindError, bind: str, port: int) -> LaunchError:
    """Why the port did not open, by its errno, and the fix for that cause."""
    where = f"cannot open the join window on {join_address(bind, port)}"
    if exc.errno == errno.EADDRINUSE:
        return LaunchError(
            f"{where}: port {port} is already in use",
            "another controller may hold the port; pick one with --port",
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return LaunchError(
            f"{where}: address {bind} is not on this host",
            "bind one of its addresses, 0.0.0.0, or fix cluster.controller.host (--bind overrides it)",
        )
    if exc.errno is not None and exc.errno < 0:  # getaddrinfo's codes: the name does not resolve
        return LaunchError(
            f"{where}: the name {bind} does not resolve",
            "bind one of this host's addresses, 0.0.0.0, or fix cluster.controller.host",
        )
    if exc.errno == errno.EACCES:
        return LaunchError(str(exc), "a port below 1024 needs privileges: pick another with --port")
    if exc.errno is None:
        return LaunchError(str(exc), "check cluster.controller.tls: the cert and key files and their pair")
    return LaunchError(str(exc), "pick another address with --bind or port with --port")


class OperatorStop:
    """SIGINT, SIGTERM or SIGHUP on the controller: the operator's stop, not a host's fault.

    The run fails with a reason that says so, which rides the Abort to every agent;
    the launch then exits 128 + the signal (130 for Ctrl-C, 143, 129 for a dropped ssh
    session's hangup), the shell's convention, so no wrapper mistakes it for a transient
    failure to relaunch. A second SIGINT or SIGTERM stops at once; a hangup stays caught to
    the end, since a dropped session's comes twice (the kernel's, then its shell's).
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    REPEATED = (signal.SIGHUP,)

    def __init__(self, controller: Controller, log: Callable[[str], None], handoff: bool = False) -> None:
        self.controller = controller
        self.log = log
        self.handoff = handoff  # SIGTERM hands a training world over instead of stopping it
        self.signal: signal.Signals | None = None
        self._installed: list[signal.Signals] = []

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in self.SIGNALS:
            with contextlib.suppress(ValueError, NotImplementedError, RuntimeError):  # not the main thread
                loop.add_signal_handler(sig, self._stop, sig)
                self._installed.append(sig)

    def remove(self) -> None:
        """SIGINT and SIGTERM act as ever again (a second one stops at once); SIGHUP stays caught."""
        loop = asyncio.get_running_loop()
        for sig in [s for s in self._installed if s not in self.REPEATED]:
            loop.remove_signal_handler(sig)
            self._installed.remove(sig)

    def release(self) -> None:
        """Every handler gone: the launch has ended. After a hangup, a later one is ignored:
        the shell's may come after the whole stop, and must not turn exit 129 into a kill."""
        self.remove()
        loop = asyncio.get_running_loop()
        while self._installed:
            sig = self._installed.pop()
            loop.remove_signal_handler(sig)
            if sig == self.signal:
                signal.signal(sig, signal.SIG_IGN)

    def _stop(self, sig: signal.Signals) -> None:
        self.remove()
        if self.signal is not None or self.controller.finished.is_set():
            return  # a stop under way, or the run has its verdict and the launch is closing
        if self.handoff and sig == signal.SIGTERM and self.controller.hand_off():
            grace = self.controller.settings.controller_grace
            self.log(
                f"SIGTERM: handing the world over to the next controller on this port (its hosts "
                f"train on for {grace:g}s); SIGINT stops the run itself"
            )
            return
        self.signal = sig
        self.log(f"{sig.name}: the operator stopped the launch; telling every host")
        self.controller.fail(f"the operator stopped the launch ({sig.name} on the controller)")

    def exit_code(self, verdict: int) -> int:
        """The launch's exit code: the run's verdict, or 128 + the operator's signal (said)."""
        if self.signal is None:
            return verdict
        self.log(f"launch stopped by the operator ({self.signal.name}): exit {128 + self.signal}")
        return 128 + self.signal


def controller_for(
    cluster: Cluster,
    options: LaunchOptions,
    log: Callable[[str], None],
    probed: Mapping[str, int] | None = None,
) -> Controller:
    """``probed``: the ranks of each worker offering ``all``, counted at dispatch."""
    return Controller(settings_for(cluster, options, log, probed), log=log)


def settings_for(
    cluster: Cluster,
    options: LaunchOptions,
    log: Callable[[str], None],
    probed: Mapping[str, int] | None = None,
) -> Settings:
    """What the launch's controller runs: the cluster file under the launch's flags."""
    join = cluster.controller.join
    check_tls_files(cluster)
    configured = capacity(cluster, probed)
    try:
        window = WindowConfig.from_plan(plan_window(join, configured), discovery=join.discovery)
    except ValueError as exc:
        raise LaunchError(
            str(exc),
            "list devices explicitly, set cluster.controller.join.min_rank_start, or launch with "
            "fan-out (it counts `all` workers over ssh)",
        ) from None
    plane = options.plane or cluster.plane or "cpu"
    if refused := cluster.plane_rules(plane):
        # --plane nccl over a file with tunnels or CPU ranks: refused before any dial.
        loc, message, fix = refused[0]
        raise LaunchError(f"--plane {plane}: cluster.{format_path(loc)} {message}", fix)
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
    return Settings(
        window=window,
        command=options.command,
        bind=bind,
        port=cluster.controller.port if options.port is None else options.port,
        token=join.token,
        open_admission=join.open_admission,
        plane=plane,
        tunnel_only=join.tunnel_only,
        env=dict(cluster.env),
        launch=secrets.token_hex(4),
        roster=[w.host for w in cluster.workers],
        capacity=configured,
        max_failure=options.max_failure,
        stall_ceiling=options.stall_ceiling,
        controller_grace=float(
            join.controller_grace if options.controller_grace is None else options.controller_grace
        ),
        elastic=elastic_for(join, options),
        parallelism=options.parallelism,
        tls=(cluster.controller.tls.cert, cluster.controller.tls.key) if cluster.controller.tls else None,
        host_facts={w.host: cluster.host_facts(w.host) for w in cluster.workers},
        walk_in_facts=cluster.host_facts(None),
    )


def elastic_for(join: JoinWindow, options: LaunchOptions) -> Elastic | None:
    """The launch's growth: --elastic's ceiling over the file's, on the file's planes (cpu
    when the file has no elastic block); ``None`` when neither asks, the frozen world."""
    block = join.elastic
    if options.elastic is None:
        return None if block is None else Elastic(block.max_ranks, *_paced(block))
    # The file's own ceiling was held to its window when it loaded; the flag is checked here.
    if below := ceiling_floor(join, options.elastic):
        name, floor = below
        raise LaunchError(
            f"--elastic {options.elastic} is below cluster.controller.join.{name} ({floor}): "
            "the ceiling would be below the world the window forms",
            f"pass --elastic {floor} or more, or lower {name}",
        )
    if block is None:
        return Elastic(options.elastic)
    return Elastic(options.elastic, *_paced(block))


def _paced(block: ElasticWindow) -> tuple[tuple[str, ...], float, float]:
    """The file's elastic block past its ceiling: the planes, the re-formations' pace and wait."""
    return tuple(block.planes), block.reform_interval, block.replace_timeout


def check_tls_files(cluster: Cluster) -> None:
    """The TLS pair must be regular files: a FIFO there would hang the port's opening."""
    tls = cluster.controller.tls
    for field, path in (("cert", tls.cert), ("key", tls.key)) if tls is not None else ():
        try:
            kind = path_kind(Path(path))
        except (OSError, ValueError):  # missing: the TLS load says so, as ever
            continue
        if kind is not None:
            raise LaunchError(
                f"cluster.controller.tls.{field}: {path} is not a regular file ({kind})",
                "point it at the PEM file (fdl tls generate writes the pair)",
            )


def capacity(cluster: Cluster, probed: Mapping[str, int] | None) -> int | None:
    """The configured ranks, with the counted ``all`` workers; ``None`` while one is uncounted."""
    if cluster.capacity is not None or not probed:
        return cluster.capacity
    try:
        return sum(r.count for r in fanout_ranks(cluster, probed))
    except CapacityUnknown:
        return None


async def launch(
    cluster: Cluster,
    options: LaunchOptions,
    log: Callable[[str], None],
    watch: Callable[[Controller], Awaitable[None]] | None = None,
    report: Callable[[dict[str, Any]], None] | None = None,
) -> int:
    """Run one launch to its verdict; ``watch`` (a live display) runs alongside, and
    ``report`` gets the run's report (the world as formed, every rank's exit) at the end."""
    controller, probed, journal = await _open(cluster, options, log)
    log(opened_words(controller))
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
        counts = [w.capacity if w.capacity is not None else probed.get(w.host) for w in waiting]
        if None in counts:
            return  # a worker offering `all`, uncounted, may still bring any number of ranks
        if window.joined_ranks + sum(c or 0 for c in counts) < window.config.quorum:
            controller.fail(
                f"fan-out to {host} failed (ssh exit {code}{': ' + tail if tail else ''}); "
                f"quorum {window.config.quorum} is out of reach"
            )

    fanout = Fanout(log, session_ended)
    stop = OperatorStop(controller, log, options.handoff)
    stop.install()
    try:
        # A resumed world's agents are running already (their units re-dial): no new sessions.
        if options.fanout and cluster.workers and controller.readoption is None:
            await _fan_out(fanout, cluster, controller)
        watcher = asyncio.ensure_future(watch(controller)) if watch is not None else None
        await controller.finished.wait()
        if watcher is not None:
            watcher.cancel()
        # Not after the operator's stop: a signal means now (systemd's stop, a relaunch that
        # wants the port); the kept verdict answers status from here on.
        if controller.view.watched(WATCHED) and stop.signal is None and not controller.handed_off:
            await _linger(controller, options.linger)
    finally:
        stop.remove()
        try:
            await _close(controller, journal, fanout)
        finally:
            stop.release()
    if report is not None:
        report(controller.view.report())
    return stop.exit_code(controller.exit_code)


async def _close(controller: Controller, journal: Journaler, fanout: Fanout) -> None:
    # Kept before the port closes: a status query finds the controller or its verdict, never neither.
    journal.close()
    if not controller.handed_off:  # a handed-off world has no verdict yet: its journal tells it
        keep_verdict(controller.view.report(), controller.settings.bind, controller.port)
    await controller.close()
    await fanout.stop()


def opened_words(controller: Controller) -> str:
    """The launch's first line: the window it opened, or the launch it resumed."""
    settings, window = controller.settings, controller.settings.window
    mode = "open (salt handed out in Accept)" if controller.open else "credential-checked"
    if controller.readoption is not None:
        hosts = len(controller.readoption.expected)
        return (
            f"launch {settings.launch} resumed on {settings.bind}:{controller.port} (admission {mode}): "
            f"its world trains on; waiting up to {settings.controller_grace:g}s for its {hosts} "
            f"host{'s' if hosts != 1 else ''} to walk back in"
        )
    return (
        f"join window open on {settings.bind}:{controller.port} "
        f"(launch {settings.launch}, admission {mode}); "
        f"quorum {window.quorum}, target {window.target}, start {window.start}"
    )


async def _open(
    cluster: Cluster, options: LaunchOptions, log: Callable[[str], None]
) -> tuple[Controller, Mapping[str, int], Journaler]:
    """The launch's controller, its join window open, the ranks of the ``all`` workers
    it counted (with fan-out), and the journal of its port (held by this launch)."""
    try:
        # `local_devices: all` workers are counted before the window's plan is fixed.
        probed = await count_devices(cluster, log) if options.fanout else {}
    except DispatchError as exc:
        raise LaunchError(exc.message, exc.fix) from None
    settings = settings_for(cluster, options, log, probed)
    keeper, resume = _journal(settings, options, log)
    if resume is not None:
        settings = replace(settings, launch=resume.launch)  # the same launch, carried on
    controller = Controller(settings, log=log, resume=resume)
    try:
        await controller.start()
    except BindError as exc:
        if keeper is not None:
            keeper.close()
        raise bind_failure(exc, controller.settings.bind, controller.settings.port) from None
    if keeper is None:  # an ephemeral port: its journal is found only once it is open
        try:
            keeper = Journaler.open(controller, log)
        except JournalError as exc:  # another controller holds this port's journal (another bind)
            await controller.close()
            raise LaunchError(str(exc), exc.fix) from None
    keeper.ctl = controller
    controller.view.listeners.append(keeper.on_note)
    return controller, probed, keeper


def _journal(
    settings: Settings, options: LaunchOptions, log: Callable[[str], None]
) -> tuple[Journaler | None, Journal | None]:
    """The port's journal, held for this launch, and the launch it resumes (None: a new
    window; a journal left unfinished is then closed). No keeper yet for port 0."""
    if settings.port == 0:
        return None, None
    try:
        keeper, left = Journaler.take(settings.port, log, strict=not options.fresh)
        decision = on_start(left, settings_digest(settings), fresh=options.fresh, path=keeper.path)
    except JournalError as exc:  # another controller holds it, it cannot be trusted, or other settings
        raise LaunchError(str(exc), exc.fix) from None
    if isinstance(decision, Resume):
        log(f"launch {decision.journal.launch} did not finish: resuming it (journal {keeper.path})")
        return keeper, decision.journal
    if decision.why:
        log(decision.why)
    keeper.discard(left)
    return keeper, None


async def _fan_out(fanout: Fanout, cluster: Cluster, controller: Controller) -> None:
    """An ssh session to every worker, its spec (host key included) on the session's stdin."""
    try:
        plans = [
            plan(w, cluster, controller.port, controller.host_key(w.host), controller.settings.bind)
            for w in cluster.workers
        ]
    except FanoutError as exc:
        raise LaunchError(str(exc), "or launch with --no-fanout and let workers walk in") from None
    try:
        await fanout.start(plans)
    except FanoutError as exc:
        raise LaunchError(str(exc), "install openssh-client on the controller box") from None


async def _linger(controller: Controller, seconds: float) -> None:
    """Someone is watching (a page, `fdl status --watch`): serve the final phase ``seconds``
    more, and on until a poll after the verdict came (up to LINGER_CAP), so they see how it ended."""
    ended = controller.clock()
    await asyncio.sleep(seconds)  # the linger itself: time to read the final phase
    if (controller.view.polled or 0.0) >= ended:
        return
    polled = asyncio.Event()
    controller.view.on_poll = polled.set
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(polled.wait(), max(0.0, LINGER_CAP - seconds))

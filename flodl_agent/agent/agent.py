"""The agent: a box walking into a join window and running its ranks.

``fdl join`` is a loop around one attempt: prepare the box, dial (direct, or
through an ``ssh -N -L`` forward to the controller box), hello, wait for the
world, spawn one rank per offered device, report exits, and leave. Exit codes
say what the caller should do: 0 clean, 1 transient (re-dial), 2 permanent
(stop; the systemd unit pairs it with RestartPreventExitStatus=2).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from ..address import join_address
from ..config.ranks import rank_span
from ..controller.supervision import ranks_failed, teardown_note
from ..errors import CLEAN, PERMANENT, TRANSIENT
from ..hardware.offer import Offer
from ..net import keepalive
from ..observe import exit_reason
from ..protocol import wire
from ..protocol.join_protocol import (
    Aborted,
    Closed,
    Event,
    Formed,
    JoinClient,
    JoinError,
)
from ..protocol.messages import BadMessage, HostEnvelope, WorldFormed, shown, shown_command
from ..protocol.streams import dial, next_event, take_over, write_parts
from ..protocol.tunnel import Tunnel
from ..retry import BACKOFF_START, AgentFailure, Backoff, Permanent, Transient
from ..sources.build import entry_command
from ..train.averaging import AverageRelay
from ..train.rendezvous import StreamRelay, warm_store
from . import contained
from .box import box_offer, get_ready, this_box
from .containers import ComposeRanks, check_service
from .grace import Grace
from .greeting import BROKE_FIX, greet
from .options import AgentOptions
from .prepare import Prepared
from .rank_env import rank_envs, reason_file
from .rank_io import CANNOT_EXECUTE, hang_up, heartbeat, start_failure
from .regrowth import Regrowth, fresh_store, reformed, rendezvous
from .uplink import Uplink
from .watch import link_events, reported, supervise

LAUNCH = re.compile(r"[0-9a-f]{8}")  # a launch's label: what a resume hello names

KILL_GRACE = 5.0


class Attempt:
    """One dial: hello, admission, the formed world, the ranks."""

    def __init__(
        self,
        options: AgentOptions,
        offer: Offer,
        log: Callable[[str], None],
        on_wait: Callable[[bool], None] = lambda _: None,
        prepared: Prepared | None = None,
    ) -> None:
        self.options = options
        self.prepared = prepared  # the published run this box fetched and built
        self.offer = offer
        self.log = log
        self.on_wait = on_wait  # True while admitted and waiting for the world (a spinner's cue)
        self.children: list[asyncio.subprocess.Process] = []
        self.contained: dict[int, contained.Contained] = {}  # rank -> its reaper (not compose's)
        self._warm: asyncio.Future[None] | None = None  # the store's torch import, under way
        self.compose: ComposeRanks | None = None  # the ranks run in a compose service
        self.road = ("", 0)  # what this attempt dialled: a resume re-dials it
        self.uplink: Uplink | None = None  # the road up while ranks train (its connection may change)

    async def run(self, dial_host: str, dial_port: int) -> int:
        self.road = (dial_host, dial_port)
        reader, writer = await dial(dial_host, dial_port, self.options.tls_fingerprint)
        keepalive(writer)
        try:
            return await self._session(reader, writer, join_address(dial_host, dial_port))
        except JoinError as exc:
            if exc.reply:
                writer.write(exc.reply)  # the controller logs and counts why this box hangs up
            raise (Permanent if exc.permanent else Transient)(exc.message, exc.fix) from None
        except wire.Dropped as exc:
            raise Transient(f"the controller sent a frame that does not verify ({exc})") from None
        except BadMessage as exc:
            raise Transient(f"the controller sent a malformed message ({exc})") from None
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            raise Transient(
                f"the connection to the controller broke ({exc.__class__.__name__})", BROKE_FIX
            ) from None
        except TimeoutError:
            raise Transient(
                "the controller did not answer in time", "is that port a flodl controller?"
            ) from None
        finally:
            writer.close()
            if self.uplink is not None:
                self.uplink.writer.close()  # a resumed connection
            await self._kill_children()

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, road: str) -> int:
        client = JoinClient(self.options.key)
        answer = await greet(reader, writer, client, self.hello())
        first_rank, count = answer.accept.ranks
        self.log(
            f"admitted as {self.options.host}: {rank_span(range(first_rank, first_rank + count), noun=True)} "
            "(provisional); waiting for the world to form"
        )
        if first_rank == 0:
            # Rank 0's host serves the rendezvous store, whose torch import takes seconds:
            # do it while the window fills, not after the world formed (ranks wait on it).
            self._warm = asyncio.ensure_future(asyncio.to_thread(warm_store))
        self.on_wait(True)
        try:
            while not isinstance(event := await next_event(reader, client), Formed):
                if isinstance(event, Aborted):
                    raise Transient(f"the controller aborted the run: {event.reason}")
                if isinstance(event, Closed):
                    raise Transient("the controller closed the connection", BROKE_FIX)
        finally:
            self.on_wait(False)
        return await self._train(event.world, road, reader, writer, client)

    def hello(self) -> dict[str, Any]:
        """What this box says about itself (the client adds the nonces)."""
        return {
            "host": self.options.host,
            "devices": self.offer.devices,
            "device_labels": self.offer.labels,
            "variant": self.offer.variant,
            "nccl": self.offer.nccl,
            "model_sig": self.options.model_sig,
            "dataset_sig": self.options.dataset_sig,
            "run_id": self.options.run_id,
            "data_path": self.options.data_path,
            "command": shown_command(own) if (own := self.own_command()) else "",
            "tunnel": self.options.tunnel or self.options.ssh is not None,
        }

    def _grace(
        self,
        world: WorldFormed,
        uplink: Uplink,
        averager: AverageRelay,
        relay: StreamRelay,
        events: Callable[[Event], None],
    ) -> Grace:
        """How the ranks outlive a lost controller: this box's --controller-grace, else the
        launch's; none for a launch without a label (nothing to resume)."""
        mine = world.host
        seconds = self.options.controller_grace
        seconds = world.controller_grace if seconds is None else seconds
        if not LAUNCH.fullmatch(world.launch):
            seconds = 0.0

        def resume() -> dict[str, Any]:
            claim = {"launch": world.launch, "first": mine.first_rank, "count": mine.count}
            return self.hello() | {"resume": claim | {"round": averager.next_round}}

        return Grace(
            seconds,
            self.road,
            self.options.tls_fingerprint,
            self.options.key,
            resume,
            uplink,
            averager,
            relay,
            events,
            self.log,
        )

    def rank_env(
        self,
        world: WorldFormed,
        road: str,
        store_port: int,
        plane: dict[str, str] | None = None,
        reports: dict[int, Path] | None = None,
        inherit: bool = True,
    ) -> list[dict[str, str]]:
        """Per-rank environments (:func:`~flodl_agent.agent.rank_env.rank_envs`) for this box;
        without ``inherit``, none of the agent's own environment (a container has its own)."""
        box = this_box(self.options)
        box = box if inherit else replace(box, base={})
        return rank_envs(box, world, self.offer.devices, road, store_port, plane, reports)

    def own_command(self) -> list[str] | None:
        """What this box's ranks run whatever the launch says: the published run it fetched
        (the manifest is the authority), else its own entry and arguments (--bin PATH -- ARGS,
        join.bin/args); None: the launch's command."""
        if self.prepared is not None:
            return list(self.prepared.command)
        if self.options.bin:
            return entry_command(self.options.bin, self.options.args)
        return None

    def command(self, world: WorldFormed) -> list[str]:
        return self.own_command() or list(world.command)

    async def _train(
        self,
        world: WorldFormed,
        road: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        client: JoinClient,
    ) -> int:
        mine = world.host
        if mine.host != self.options.host:
            raise Transient(f"the formed world was addressed to {mine.host}, not this host")
        command = self.command(world)
        cwd = self.prepared.cwd if self.prepared is not None else None
        await self._compose_ranks(world, cwd, reader, writer, client)
        said = "joined the training world mid-run" if world.midrun else "world formed"
        if world.restart_count:  # a walk-in into a process group: it re-formed with this host in it
            said = f"world re-formed (restart {world.restart_count}) with this host"
        self.log(
            f"{said}: {world.world_size} ranks; this host runs "
            f"{rank_span(range(mine.first_rank, mine.first_rank + mine.count), noun=True)}"
        )
        uplink = self.uplink = Uplink(reader, writer, client)
        relay, store, store_port = await rendezvous(mine.first_rank, uplink, self.log)
        averager = AverageRelay(list(range(mine.first_rank, mine.first_rank + mine.count)), uplink.stream)
        plane = averager.env(await averager.listen())
        # From here the link is its own protocol: the average's pieces land in shared memory.
        client.codec.sink = averager.destination
        regrowth = Regrowth()
        events = link_events(relay, averager, regrowth)
        uplink.link = take_over(reader, writer, client, events)
        grace = self._grace(world, uplink, averager, relay, events)
        # Progress reports live beside the plane's segments: the run's private directory.
        reports = {
            r: averager.directory / f"metrics-{r}.json"
            for r in range(mine.first_rank, mine.first_rank + mine.count)
        }
        abort = asyncio.ensure_future(grace.keep())
        beat = asyncio.ensure_future(heartbeat(uplink, reports, self.options.heartbeat_every))
        try:
            while True:  # one pass per world: a process group re-formed to grow runs again
                envs = self.rank_env(world, road, store_port, plane, reports, inherit=self.compose is None)
                ranks = await self._start(envs, mine, command, cwd, uplink, averager, relay)
                codes = await supervise(ranks, abort, relay, serving=store is not None, reform=regrowth.asked)
                if codes is not None and world.max_world_size and any(codes):  # an elastic world's word
                    codes = None if await regrowth.word(abort, uplink, self.log) else codes
                if codes is not None:
                    break
                await self._stop(ranks, regrowth)
                if store is not None:  # before the new world: a far host's ranks may dial first
                    store, store_port = await fresh_store(relay, self.log)  # never the old keys
                world = await reformed(world, regrowth, abort, uplink, self.log)
            if not uplink.up.is_set():  # the ranks ended while the controller was away
                await reported(uplink, abort)
        finally:
            assert uplink.link is not None
            uplink.link.on_event = None  # whatever still comes is read and dropped: the run is over here
            abort.cancel()
            beat.cancel()  # its last beat carries the ranks' final reports: before the half-close
            await asyncio.gather(beat, return_exceptions=True)
            if self.compose is not None:
                await self.compose.stop(KILL_GRACE)  # while the directory they mount is still there
            await relay.close()
            await averager.close()
            store = None
        await uplink.link.drain()  # the last pieces it queued go before the half-close
        await hang_up(uplink.reader, uplink.writer)
        if any(c != 0 for c in codes):
            self.log(ranks_failed(self.options.host, dict(enumerate(codes, mine.first_rank))))
            return TRANSIENT
        return CLEAN

    async def _start(
        self,
        envs: list[dict[str, str]],
        mine: HostEnvelope,
        command: list[str],
        cwd: Path | None,
        uplink: Uplink,
        averager: AverageRelay,
        relay: StreamRelay,
    ) -> list[asyncio.Future[int]]:
        """This host's ranks, started and watched; ranks that cannot start are the run's failure."""
        for local, env in enumerate(envs):
            try:
                self.children.append(await self._spawn(mine.first_rank + local, command, env, cwd, averager))
            except (OSError, ValueError) as exc:  # the run's failure, not the box's: said, then re-dial
                await relay.close()
                await averager.close()  # its shared-memory directory goes with it
                await self._kill_children()
                failure = start_failure(command, exc)  # on the road as it is now (a resume rebinds it)
                await self._could_not_start(mine, uplink.reader, uplink.writer, uplink.client, *failure)
        return [
            asyncio.ensure_future(self._rank(proc, mine.first_rank + local, uplink, averager))
            for local, proc in enumerate(self.children)
        ]

    async def _stop(self, ranks: list[asyncio.Future[int]], regrowth: Regrowth) -> None:
        """The controller re-forms the world: this host's ranks stop, their exits reported as
        they end (the controller counts them as the re-formation's, never as failures)."""
        regrowth.acted()
        self.log(f"the world re-forms (restart {regrowth.restart}): stopping this host's ranks")
        await self._kill_children()
        await asyncio.gather(*ranks, return_exceptions=True)  # each said its exit
        self.children.clear()
        self.contained.clear()
        if self.compose is not None:
            self.compose.again()

    async def _compose_ranks(
        self,
        world: WorldFormed,
        cwd: Path | None,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        client: JoinClient,
    ) -> None:
        """The ranks run in a compose service when the box or the cluster file names one; a
        service that cannot run them is the ranks' failure, said to the controller."""
        mine = world.host
        service = self.options.docker or mine.docker  # the box's own value beats the cluster file's
        if service:
            try:  # the cluster file's service, or the published tree's compose file: the run's own
                project = await check_service(service, self.options, cwd, world.env, run=True)
            except AgentFailure as exc:
                await self._could_not_start(mine, reader, writer, client, exc, CANNOT_EXECUTE, exc.message)
            self.compose = ComposeRanks(project, self.options, world, self.offer.variant, cwd, self.log)

    async def _spawn(
        self, rank: int, command: list[str], env: dict[str, str], cwd: Path | None, averager: AverageRelay
    ) -> asyncio.subprocess.Process:
        if self.compose is not None:
            return await self.compose.start(rank, command, env, averager.directory)
        held = self.contained[rank] = await contained.start(command, env, cwd)
        return held.proc

    async def _could_not_start(
        self,
        mine: HostEnvelope,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        client: JoinClient,
        failure: AgentFailure,
        code: int,
        why: str,
    ) -> NoReturn:
        """This host's ranks never started: tell the controller each one's end (``code`` as a
        shell gives it, and why), hang up, and fail the attempt (transient unless the box is
        at fault: --persist stays for the next run)."""
        for rank in range(mine.first_rank, mine.first_rank + mine.count):
            exited = {"rank": rank, "code": code, "error": shown(why)}
            write_parts(writer, client.send(wire.Kind.RANK_EXITED, exited))
        await hang_up(reader, writer)
        raise failure

    async def _rank(
        self,
        proc: asyncio.subprocess.Process,
        rank: int,
        uplink: Uplink,
        averager: AverageRelay,
    ) -> int:
        last = ""  # its last words: how a crash ended (teardown_note)
        held = self.contained.get(rank)
        async for line in contained.lines_until_exit(proc, held):
            sys.stdout.write(f"[rank {rank}] {line}\n")
            sys.stdout.flush()
            last = line if line.strip() else last
        code = await proc.wait()
        if self.compose is not None:
            code = await self.compose.exit_code(rank, code)  # the container's, not its client's
        if held is not None and (left := contained.left_note(rank, held.left)) is not None:
            self.log(left)
        if (note := teardown_note(rank, code, last)) is not None:
            self.log(note)
        averager.rank_exited(rank)
        said = exit_reason.read(reason_file(averager.directory, rank)) if code else ""
        exited = {"rank": rank, "code": code} | ({"reason": said} if said else {})
        uplink.send(wire.Kind.RANK_EXITED, exited)
        return code

    async def _kill_children(self) -> None:
        if self.compose is not None:
            await self.compose.stop(KILL_GRACE)  # its clients die with their containers
        alive = [p for p in self.children if p.returncode is None]
        for proc in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        await asyncio.gather(*(_reap(proc) for proc in alive))  # one grace for all, not one each


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """A rank told to stop: its end, or the kill once the grace is over."""
    try:
        await asyncio.wait_for(proc.wait(), KILL_GRACE)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


async def join_once(
    options: AgentOptions, log: Callable[[str], None], on_wait: Callable[[bool], None] = lambda _: None
) -> int:
    offer = box_offer(options.devices)
    options, prepared = await get_ready(options, log, offer.variant)
    if options.docker:  # before the dial: a box that cannot start its ranks must not take any
        cwd = prepared.cwd if prepared else None  # the published tree's compose file is the run's
        await check_service(options.docker, options, cwd, {}, run=prepared is not None)
    attempt = Attempt(options, offer, log, on_wait, prepared)
    if options.ssh is None:
        return await attempt.run(options.controller_host, options.controller_port)
    async with Tunnel(options.ssh, options.controller_host, options.controller_port) as tunnel:
        return await attempt.run("127.0.0.1", tunnel.local_port)


async def join(
    options: AgentOptions,
    *,
    persist: bool,
    log: Callable[[str], None],
    backoff_start: float = BACKOFF_START,
    attempts: int | None = None,
    on_wait: Callable[[bool], None] = lambda _: None,
    jitter: Callable[[], float] = random.random,
) -> int:
    """``fdl join``: one attempt, or with ``persist`` a loop that stops only on a permanent failure.

    SIGUSR1 cuts a backoff short ("a window just opened: dial now"); during a run it does nothing.
    ``jitter`` draws the backoff's jitter (a float in [0, 1)).
    """
    dial_now = asyncio.Event()
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGUSR1, dial_now.set)
        handled = True
    except (ValueError, NotImplementedError, RuntimeError):  # not the main thread
        handled = False
    try:
        backoff = Backoff(jitter, start=backoff_start)
        return await _join_loop(options, persist, log, backoff, attempts, on_wait, dial_now)
    finally:
        if handled:
            loop.remove_signal_handler(signal.SIGUSR1)


async def _join_loop(
    options: AgentOptions,
    persist: bool,
    log: Callable[[str], None],
    backoff: Backoff,
    attempts: int | None,
    on_wait: Callable[[bool], None],
    dial_now: asyncio.Event,
) -> int:
    tries = 0
    while True:
        tries += 1
        started = time.monotonic()
        dial_now.clear()  # a nudge during this attempt cuts the backoff after it
        try:
            code = await join_once(options, log, on_wait)
            if code == CLEAN:
                log(f"run finished cleanly on {options.host}")
        except AgentFailure as exc:
            log(exc.render())
            code = exc.code
        if not persist or code == PERMANENT or (attempts is not None and tries >= attempts):
            return code
        delay = backoff.delay(time.monotonic() - started)
        log(f"re-dialling in {delay:.0f}s")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(dial_now.wait(), delay)  # the backoff itself, or a nudge
            log("nudged (SIGUSR1): re-dialling now")

"""A join storm: N walk-ins dial one controller at once; how fast does the world form?

Ours: one in-process ``Controller`` (open admission on 127.0.0.1, auto start,
quorum = target = N; with ``--bound``, a token and every walk-in in the roster,
so each hello is verified under the key derived for the name it gives: one
HKDF per hello) and N simulated agents, each a raw asyncio connection that
speaks the real join protocol (challenge, hello, accept, rekey, WorldFormed,
RANK_EXITED, close). Per N it reports admissions per second (N over first dial
to last Accept), formation latency (the last hello sent to the last WorldFormed
received), the p99 of ``GET /state.json`` sampled every 20 ms during the storm,
and the controller process's RSS.

Layout: each N runs in a fresh child process (clean RSS, fresh loop) holding
the controller, the status sampler and the poller; the N agents run in a
grandchild process, as walk-ins run on other boxes. Both use CLOCK_MONOTONIC
(``time.perf_counter``), so their timestamps compare. Agents stamp WorldFormed
on arrival and verify it only once all N have it: on one core, N agents'
decoding would otherwise be billed to the controller's fan-out.

Why the last hello and not the N-th Accept: the controller writes the N-th
Accept and every WorldFormed in one synchronous step, so the N-th agent reads
its Accept only after the whole fan-out; anchored there, the fan-out vanishes.

Baseline, in the same storm: a 20 ms polling window. A real asyncio task polls
``window.joined_ranks >= N`` every 20 ms. Its detection delay is counted from
the moment the window reached its target (the N-th join, stamped by a timing
wrapper on ``window.join``); a poller-driven controller then needs the same
fan-out, so its formation is ours plus that delay. Where the poller's due tick
fell inside our own fan-out step (which blocks the loop, and which a polling
controller would not be running then), the due time stands in for the blocked
tick; a tick already overdue when the target is reached counts as instant, which
favours the baseline on a saturated loop. torchrun's c10d rendezvous is not measured (see ``C10D_REASON``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import resource
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flodl_agent.controller.controller import Controller
from flodl_agent.controller.settings import Settings
from flodl_agent.controller.window import WindowConfig
from flodl_agent.protocol import wire
from flodl_agent.protocol.join_protocol import Accepted, Challenged, Formed, JoinClient
from flodl_agent.protocol.messages import WorldFormed
from flodl_agent.protocol.streams import next_event, write_parts

FULL_NS = (100, 1000, 10000)
QUICK_NS = (100, 1000)
DIAL_CONCURRENCY = 256  # a 2-core box cannot open 10,000 sockets in the same instant
STATUS_EVERY = 0.020
POLL_TICK = 0.020
FD_SLACK = 256  # listener, status client, pipes, epoll, stdio
GOAL_N = 10_000
GOAL_FORMATION_MS = 50.0
GOAL_STATUS_P99_MS = 50.0
C10D_REASON = (
    "not measured: torch.distributed's c10d rendezvous needs one blocking TCPStore client per agent "
    "(a thread or process each); thousands of them on 2 cores would time the harness, not the rendezvous"
)


def storm_timeout(n: int) -> float:
    """Generous: the point is to finish with a verdict, not to time out a slow controller."""
    return 60.0 + n * 0.02


# --- process plumbing ----------------------------------------------------------


def raise_nofile(want: int) -> tuple[int, str | None]:
    """Raise the soft descriptor limit toward ``want``; returns the limit and a note if it moved."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= want:
        return soft, None
    if hard != resource.RLIM_INFINITY and hard < want:
        # Only a privileged process may lift the hard limit; try, then settle for the hard limit.
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            return want, f"raised RLIMIT_NOFILE soft {soft} / hard {hard} to {want}"
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard, f"raised RLIMIT_NOFILE soft {soft} to the hard limit {hard}"
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return want, f"raised RLIMIT_NOFILE soft {soft} to {want}"


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def listen_overflows() -> int | None:
    """TcpExt ListenOverflows: handshakes dropped because the accept queue was full."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            table = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            return int(table["ListenOverflows"]) if "ListenOverflows" in table else None
    return None


def percentile(samples: list[float], q: float) -> float | None:
    """Nearest-rank percentile (no interpolation: with few samples it is the honest worst)."""
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


# --- the agents' side (the grandchild process) -------------------------------------


@dataclass
class Walkins:
    n: int
    hellos: list[float] = field(default_factory=list)
    accepts: list[float] = field(default_factory=list)
    formed: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    first_dial: float | None = None
    all_formed: asyncio.Event = field(default_factory=asyncio.Event)
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    released: asyncio.Event = field(default_factory=asyncio.Event)  # verify, report, leave
    aborted: bool = False

    def fail(self, reason: str) -> None:
        self.errors.append(reason)
        self.failed.set()

    def arrived(self) -> None:
        self.formed.append(time.perf_counter())
        if len(self.formed) == self.n:
            self.all_formed.set()


def check_world(world: WorldFormed, host: str, first: int, n: int) -> None:
    """The world names this host at the rank its Accept promised."""
    if world.world_size != n:
        raise AssertionError(f"expected a world of {n} ranks, got {world.world_size}")
    if (world.host.host, world.host.first_rank) != (host, first):
        raise AssertionError(f"{host} was promised rank {first}, the world says {world.host}")


def name(i: int) -> str:
    return f"walkin-{i:05d}"


async def walk_in(i: int, port: int, dials: asyncio.Semaphore, side: Walkins, run_key: bytes | None) -> None:
    """One simulated agent: the agent's own protocol objects over a raw connection; with
    ``run_key``, it dials with its own name's key, as a provisioned worker does."""
    host = name(i)
    async with dials:  # held through Accept: bounds the handshakes in flight, not the open links
        if side.first_dial is None:
            side.first_dial = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            client = JoinClient(wire.host_key(run_key, host) if run_key else None)
            writer.write(client.start())
            challenged = await next_event(reader, client)
            if not isinstance(challenged, Challenged):
                raise AssertionError(f"expected a challenge, got {challenged!r}")
            writer.write(client.hello({"host": host, "devices": ["cpu:0"]}))
            side.hellos.append(time.perf_counter())
            accepted = await next_event(reader, client)
            if not isinstance(accepted, Accepted) or (accepted.accept.salt is None) is (run_key is None):
                raise AssertionError(f"expected an accept, got {accepted!r}")
            side.accepts.append(time.perf_counter())
        except BaseException:
            writer.close()
            raise
    try:
        # Stamped on arrival, as the transport reads the socket, before this agent's task runs
        # and decodes: on a fleet each agent does that on its own box, in parallel; here N
        # agents share one core, and that work is the harness's.
        if client.codec.buffered:  # the last joiner's Accept and WorldFormed came together
            side.arrived()
        else:
            feed = reader.feed_data

            def arrival(data: bytes) -> None:
                reader.feed_data = feed  # type: ignore[method-assign]
                side.arrived()
                feed(data)

            reader.feed_data = arrival  # type: ignore[method-assign,assignment]
        formed = await next_event(reader, client)
        await side.released.wait()
        if side.aborted:
            return
        if not isinstance(formed, Formed):
            raise AssertionError(f"expected WorldFormed, got {formed!r}")
        first = accepted.accept.ranks[0]
        check_world(formed.world, host, first, side.n)
        del formed  # N agents each holding an N-host world is O(N^2) memory for the harness
        # Report the rank finished before leaving: a link closing with ranks
        # unreported reads as a dead host and fails the run.
        write_parts(writer, client.send(wire.Kind.RANK_EXITED, {"rank": first, "code": 0}))
        await writer.drain()
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def guarded(i: int, port: int, dials: asyncio.Semaphore, side: Walkins, run_key: bytes | None) -> None:
    try:
        await walk_in(i, port, dials, side, run_key)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        side.fail(f"walkin-{i:05d}: {type(exc).__name__}: {exc}")


async def agents_main(n: int, port: int, dial_concurrency: int) -> None:
    """Stdout: `formed` or `failed: ...`, then (after `release`/`abort` on stdin) one JSON line."""
    gc.disable()  # the harness's own pauses would read as the controller's delivery
    loop = asyncio.get_running_loop()
    commands = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(commands), sys.stdin)
    side = Walkins(n)
    dials = asyncio.Semaphore(dial_concurrency)
    token = os.environ.get("FDL_TOKEN")  # --bound: the run's token, never in argv
    run_key = bytes.fromhex(token) if token else None
    tasks = [asyncio.create_task(guarded(i, port, dials, side, run_key)) for i in range(n)]
    ended = [asyncio.create_task(side.all_formed.wait()), asyncio.create_task(side.failed.wait())]
    await asyncio.wait(ended, return_when=asyncio.FIRST_COMPLETED)
    print("formed" if side.all_formed.is_set() else f"failed: {side.errors[0]}", flush=True)
    side.aborted = (await commands.readline()).strip() != b"release"
    side.released.set()
    if side.aborted:
        for task in tasks:
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for waiter in ended:
        waiter.cancel()
    report = {
        "first_dial": side.first_dial,
        "last_hello": max(side.hellos, default=None),
        "last_accept": max(side.accepts, default=None),
        "last_formed": max(side.formed, default=None),
        "accepted": len(side.accepts),
        "formed": len(side.formed),
        "errors": list(dict.fromkeys(side.errors))[:5],
    }
    print(json.dumps(report), flush=True)


# --- the controller's side (the child process) --------------------------------------


@dataclass
class Watch:
    n: int
    reached: float | None = None  # the window's N-th join (the N-th Accept is written next)
    fanout_end: float | None = None  # every WorldFormed written
    cpu: list[float] = field(default_factory=list)  # the controller process's CPU seconds at both
    ticks: list[float] = field(default_factory=list)  # the 20 ms poller's checks
    noticed: float | None = None  # when the 20 ms poller saw the target
    status_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    failed: asyncio.Event = field(default_factory=asyncio.Event)

    def fail(self, reason: str) -> None:
        self.errors.append(reason)
        self.failed.set()


def instrument(ctl: Controller, watch: Watch) -> None:
    """Timestamps only: wrap the window's join and the controller's log; behaviour is unchanged."""
    window = ctl.window
    join, log = window.join, ctl.log
    joined = [0]  # no host leaves before formation in a healthy storm

    def timed_join(host: str, ranks: int, now: float) -> Any:
        decision = join(host, ranks, now)
        # Our own count, so the instrumentation adds nothing to the controller's own work.
        joined[0] += ranks
        if watch.reached is None and joined[0] >= watch.n:
            watch.reached = time.perf_counter()
            watch.cpu.append(time.process_time())
        return decision

    def timed_log(line: str) -> None:
        if line.startswith("world formed"):  # logged once every share has been written
            watch.fanout_end = time.perf_counter()
            watch.cpu.append(time.process_time())
        log(line)

    window.join = timed_join  # type: ignore[method-assign]
    ctl.log = timed_log


async def sample_status(port: int, watch: Watch, stop: asyncio.Event) -> None:
    """An operator hammering `fdl status`: one fresh connection per sample, read to EOF."""
    while not stop.is_set():
        started = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /state.json HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        data = await reader.read()  # the server closes after each reply
        watch.status_s.append(time.perf_counter() - started)
        writer.close()
        if not data.startswith(b"HTTP/1.1 200"):
            watch.fail(f"/state.json answered {data[:40]!r}")
            return
        # A fixed cadence, not a fixed gap: a slow reply does not stretch the interval.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, started + STATUS_EVERY - time.perf_counter()))


async def poll_window(ctl: Controller, watch: Watch) -> None:
    """The baseline: a window that learns of the target by polling every 20 ms."""
    # Runs past the storm's end until it notices: a small storm can finish inside one tick.
    while not watch.failed.is_set():
        now = time.perf_counter()
        watch.ticks.append(now)
        if ctl.window.joined_ranks >= watch.n:
            watch.noticed = now
            return
        await asyncio.sleep(POLL_TICK)


async def watch_controller(ctl: Controller, watch: Watch, stop: asyncio.Event) -> None:
    """A phase of `forming` seen from outside the controller means `_form` raised midway."""
    while not stop.is_set():
        phase = ctl.window.phase
        if phase in ("forming", "failed"):
            await asyncio.sleep(0.05)
            gc.collect()  # frees the handler task, whose unretrieved exception reaches our handler
            await asyncio.sleep(0)
            watch.fail(f"controller stuck in phase {phase}: {ctl.window.failure or 'no world was sent'}")
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.02)


async def run_storm(n: int, dial_concurrency: int, bound: bool = False) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    watch = Watch(n)

    def on_exception(_: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        watch.errors.append(f"{context.get('message')}: {type(exc).__name__}: {exc}" if exc else str(context))

    loop.set_exception_handler(on_exception)
    gc.collect()
    rss_before = rss_mb()
    overflows_before = listen_overflows()
    window = WindowConfig(quorum=n, target=n, join_timeout=600, max_join_timeout=1200, start="auto")
    token = secrets.token_hex(16) if bound else None
    roster = [name(i) for i in range(n)] if bound else []
    ctl = Controller(
        Settings(
            window=window, command=["true"], port=0, token=token, roster=roster, capacity=n if bound else None
        )
    )
    instrument(ctl, watch)
    await ctl.start()
    stop = asyncio.Event()
    helpers = [
        asyncio.create_task(sample_status(ctl.port, watch, stop)),
        asyncio.create_task(poll_window(ctl, watch)),
        asyncio.create_task(watch_controller(ctl, watch, stop)),
    ]
    agents = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "bench.join_storm", "--agents", str(n), "--port", str(ctl.port)],
        *["--dials", str(dial_concurrency)],
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        limit=1 << 20,
        env={**os.environ, **({"FDL_TOKEN": token} if token else {})},
    )
    assert agents.stdin is not None and agents.stdout is not None
    verdict = asyncio.create_task(agents.stdout.readline())
    failed = asyncio.create_task(watch.failed.wait())
    await asyncio.wait([verdict, failed], timeout=storm_timeout(n), return_when=asyncio.FIRST_COMPLETED)
    rss_peak = rss_mb()  # every link still open, every WorldFormed sent
    said = verdict.result().decode().strip() if verdict.done() else ""
    ok = said == "formed" and not watch.failed.is_set()
    if not ok and not watch.failed.is_set():
        if not verdict.done():
            said = f"no world after {storm_timeout(n):.0f}s (controller phase {ctl.window.phase})"
        watch.fail(said.removeprefix("failed: ") or "the agents' process exited before the world formed")
    stop.set()
    # The status sample in flight ends before the agents verify and leave: that work is the harness's.
    await asyncio.gather(*helpers, return_exceptions=True)
    released_at = time.perf_counter()
    agents.stdin.write(b"release\n" if ok else b"abort\n")
    await agents.stdin.drain()
    report: dict[str, Any] = {}
    teardown_s: float | None = None
    try:
        if not verdict.done():
            await asyncio.wait_for(verdict, storm_timeout(n))
        report = json.loads(await asyncio.wait_for(agents.stdout.readline(), storm_timeout(n)))
        await agents.wait()
        if ok:
            await asyncio.wait_for(ctl.finished.wait(), storm_timeout(n))
            teardown_s = time.perf_counter() - released_at
            if ctl.exit_code != 0 or ctl.window.phase != "done":
                watch.errors.append(f"controller ended {ctl.window.phase} (exit {ctl.exit_code})")
    except (TimeoutError, ValueError) as exc:
        watch.errors.append(f"teardown: {type(exc).__name__}: {exc} (controller phase {ctl.window.phase})")
        with contextlib.suppress(ProcessLookupError):
            agents.kill()
        await agents.wait()
    failed.cancel()
    await ctl.close()
    overflows_after = listen_overflows()
    watch.errors.extend(report.get("errors", []))
    overflows = None
    if overflows_before is not None and overflows_after is not None:
        overflows = overflows_after - overflows_before
    send_us = send_floor_us()
    return summarize(watch, report, ok, rss_before, rss_peak, teardown_s, overflows) | {
        "admission": "bound" if bound else "open",
        # The fan-out's floor on this box: one send a host, whatever encodes the frames.
        "send_us": round(send_us, 1),
        "fanout_floor_ms": round(n * send_us / 1e3, 1),
    }


def send_floor_us(pairs: int = 256, size: int = 300) -> float:
    """Microseconds one small send costs on an established loopback TCP connection (a WorldFormed
    frame's size; on loopback the kernel also does the receiving end's work in that call)."""
    data = b"\0" * size
    with socket.create_server(("127.0.0.1", 0), backlog=pairs) as server:
        links = []
        try:
            for _ in range(pairs):
                near = socket.create_connection(server.getsockname())
                links.append((near, server.accept()[0]))
            start = time.perf_counter()
            for near, _ in links:
                near.send(data)
            return (time.perf_counter() - start) / pairs * 1e6
        finally:
            for near, far in links:
                near.close()
                far.close()


def poll_detect(watch: Watch) -> float | None:
    """Seconds the 20 ms poller needed to notice the target, net of our fan-out blocking the loop."""
    if watch.reached is None or watch.noticed is None or watch.fanout_end is None:
        return None
    before = [t for t in watch.ticks if t < watch.reached]
    if not before:
        return watch.noticed - watch.reached
    due = max(before) + POLL_TICK
    # A tick due while our fan-out held the loop was blocked by work a poller would not be doing yet.
    seen = max(due, watch.reached) if due < watch.fanout_end else watch.noticed
    return seen - watch.reached


def summarize(
    watch: Watch,
    report: dict[str, Any],
    ok: bool,
    rss_before: float,
    rss_peak: float,
    teardown_s: float | None,
    overflows: int | None,
) -> dict[str, Any]:
    n = watch.n
    admissions = formation = detect = fanout = admit_last = deliver = None
    if report.get("accepted") == n:
        admissions = n / (report["last_accept"] - report["first_dial"])
    if ok and report.get("formed") == n:
        formation = report["last_formed"] - report["last_hello"]
        detect = poll_detect(watch)
        if watch.reached is not None and watch.fanout_end is not None:
            # formation = admit the last hello + fan-out (controller) + delivery (kernel, agents' loop)
            admit_last = watch.reached - report["last_hello"]
            fanout = watch.fanout_end - watch.reached
            deliver = report["last_formed"] - watch.fanout_end
    baseline = None if formation is None or detect is None else formation + detect
    p99 = percentile(watch.status_s, 0.99)

    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else round(seconds * 1e3, 2)

    return {
        "n": n,
        "admissions_per_s": None if admissions is None else round(admissions, 1),
        "formation_ms": ms(formation),
        "status_p99_ms": ms(p99),
        "rss_mb": round(rss_peak, 1),
        "rss_delta_mb": round(rss_peak - rss_before, 1),
        "baseline_poll_formation_ms": ms(baseline),
        "ratio": round(formation / baseline, 3) if formation is not None and baseline else None,
        "poll_detect_ms": ms(detect),
        "admit_last_ms": ms(admit_last),
        "fanout_ms": ms(fanout),
        # What the fan-out cost the controller's process, whatever else shares the machine.
        "fanout_cpu_ms": ms(watch.cpu[1] - watch.cpu[0]) if len(watch.cpu) == 2 else None,
        "deliver_ms": ms(deliver),
        "accepted": report.get("accepted"),
        "status_samples": len(watch.status_s),
        "status_max_ms": ms(max(watch.status_s)) if watch.status_s else None,
        "teardown_s": None if teardown_s is None else round(teardown_s, 2),
        "listen_overflows": overflows,
        "error": "; ".join(dict.fromkeys(watch.errors))[:2000] or None,
    }


def describe(r: dict[str, Any]) -> str:
    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1f} ms"

    def na(value: object) -> object:
        return "n/a" if value is None else value

    lines = [
        f"n={r['n']}: admissions {na(r['admissions_per_s'])}/s; "
        f"formed {ms(r['formation_ms'])} after the last hello (admit {ms(r.get('admit_last_ms'))}, "
        f"fan-out {ms(r.get('fanout_ms'))} (CPU {ms(r.get('fanout_cpu_ms'))}), "
        f"delivery {ms(r.get('deliver_ms'))}; one send a host alone: {ms(r.get('fanout_floor_ms'))}); "
        f"20 ms poller: {ms(r['poll_detect_ms'])} to notice + the same = "
        f"{ms(r['baseline_poll_formation_ms'])} (ratio {na(r['ratio'])})",
        f"  /state.json p99 {ms(r['status_p99_ms'])}, max {ms(r['status_max_ms'])} "
        f"over {r['status_samples']} samples; controller RSS {r['rss_mb']:.1f} MB "
        f"({r['rss_delta_mb']:+.1f} MB over the storm); "
        f"teardown {na(r['teardown_s'])} s; listen overflows {na(r['listen_overflows'])}",
    ]
    if r.get("error"):
        lines.append(f"  FAILED ({na(r.get('accepted'))} of {r['n']} accepted): {r['error']}")
    return "\n".join(lines)


# --- driver --------------------------------------------------------------------


def run_child(n: int, dial_concurrency: int, bound: bool) -> dict[str, Any]:
    """Each N in a fresh interpreter: clean RSS, a fresh loop, no leftovers from the last storm."""
    argv = [sys.executable, "-m", "bench.join_storm", "--child", str(n), "--dials", str(dial_concurrency)]
    argv += ["--bound"] if bound else []
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=4 * storm_timeout(n))
    except subprocess.TimeoutExpired:
        return {"n": n, "error": "the storm process did not finish in time"}
    lines = proc.stdout.strip().splitlines()
    try:
        result: dict[str, Any] = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"n": n, "error": f"the storm process exited {proc.returncode}: {' | '.join(tail)}"}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help=f"N in {QUICK_NS} only (a smoke run)")
    parser.add_argument("--n", type=int, nargs="+", metavar="N", help=f"storm sizes (default {FULL_NS})")
    parser.add_argument(
        "--dials", type=int, default=DIAL_CONCURRENCY, help="handshakes in flight (default %(default)s)"
    )
    parser.add_argument(
        "--bound",
        action="store_true",
        help="names bound to keys: a token, every walk-in in the roster, each hello under its name's key",
    )
    # Internal: one storm's controller side, and its agents' side.
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--agents", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agents is not None:
        asyncio.run(agents_main(args.agents, args.port, args.dials))
        return
    if args.child is not None:
        print(json.dumps(asyncio.run(run_storm(args.child, args.dials, args.bound))))
        return
    ns = args.n or (QUICK_NS if args.quick else FULL_NS)
    # One descriptor per agent in each process (agents' ends, controller's ends); children inherit.
    limit, note = raise_nofile(max(ns) + FD_SLACK)
    if note:
        print(note)
    results = []
    for asked in ns:
        n = min(asked, limit - FD_SLACK)
        if n < asked:
            print(f"note: N={asked} needs {asked + FD_SLACK} descriptors per process, the limit is {limit}; "
                  f"capped to {n}")  # fmt: skip
        result = run_child(n, args.dials, args.bound)
        if n < asked:
            result["capped_from"] = asked
        print(describe(result) if "admissions_per_s" in result else f"n={n}: FAILED: {result['error']}")
        results.append(result)
    formed = [r for r in results if r.get("formation_ms") is not None]
    largest = max((r["n"] for r in formed), default=None)
    worst_formation = max((r["formation_ms"] for r in formed), default=None)
    p99s = [r["status_p99_ms"] for r in results if r.get("status_p99_ms") is not None]
    worst_status = max(p99s, default=None)
    print("goals (from the issue; reported, not asserted):")
    print(f"  {GOAL_N} walk-ins formed into one world on 2 cores: largest world formed here {largest}")
    print(f"  formation under {GOAL_FORMATION_MS:.0f} ms after the last hello: worst {worst_formation} ms")
    print(f"  /state.json p99 under {GOAL_STATUS_P99_MS:.0f} ms: worst {worst_status} ms")
    print(f"baseline_c10d: null ({C10D_REASON})")
    print(
        json.dumps(
            {
                "bench": "join_storm",
                "results": results,
                "ratio": max(results, key=lambda r: r["n"]).get("ratio") if results else None,
                "baseline_c10d": None,
                "baseline_c10d_reason": C10D_REASON,
            }
        )
    )


if __name__ == "__main__":
    main()

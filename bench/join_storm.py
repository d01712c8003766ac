"""A join storm: N walk-ins dial one controller at once; how fast does the world form?

Ours: one in-process ``Controller`` (open admission on 127.0.0.1, auto start,
quorum = target = N) and N simulated agents, each a raw asyncio connection that
speaks the real join protocol (challenge, hello, accept, rekey, WorldFormed,
RANK_EXITED, close). Per N it reports admissions per second, formation latency
(the N-th Accept received to the last WorldFormed received), the p99 of
``GET /state.json`` sampled every 20 ms during the storm, and the process RSS.

Baseline, in the same storm: a 20 ms polling window. A real asyncio task polls
``window.joined_ranks >= N`` every 20 ms; its detection delay after the N-th
Accept plus the same fan-out time is what a poller would need to form.
torchrun's c10d rendezvous is not measured (see ``C10D_REASON``).

Each N runs in a fresh child process so RSS and the event loop start clean.
Both ends of every connection live in that one process, so the RSS and the
loop time include the simulated agents' side too: the figures are upper bounds
for the controller alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flodl_agent import wire
from flodl_agent.controller import Controller, Settings
from flodl_agent.messages import Accept, Challenge, Hello, WorldFormed
from flodl_agent.messages import parse as parse_message
from flodl_agent.window import WindowConfig

FULL_NS = (100, 1000, 10000)
QUICK_NS = (100, 1000)
DIAL_CONCURRENCY = 256  # a 2-core box cannot open 10,000 sockets in the same instant
STATUS_EVERY = 0.020
POLL_TICK = 0.020
FDS_PER_AGENT = 2  # both ends of every loopback connection are this process's descriptors
FD_SLACK = 256  # listener, status client, epoll, stdio, imports
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
    """TcpExt ListenOverflows: SYNs or ACKs dropped because the accept queue was full."""
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


# --- one storm -----------------------------------------------------------------


@dataclass
class Storm:
    n: int
    accepts: list[float] = field(default_factory=list)
    formed: list[float] = field(default_factory=list)
    status_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    first_dial: float | None = None
    noticed: float | None = None  # when the 20 ms poller saw the target
    all_formed: asyncio.Event = field(default_factory=asyncio.Event)
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    released: asyncio.Event = field(default_factory=asyncio.Event)  # agents may verify and leave

    def fail(self, reason: str) -> None:
        self.errors.append(reason)
        self.failed.set()
        self.released.set()


def split_frame(buffer: bytearray) -> bytes | None:
    """One whole frame's bytes off the front of ``buffer`` (header-length framing only, no tag check)."""
    if len(buffer) < wire.HEADER.size:
        return None
    length = wire.HEADER.unpack_from(buffer)[3]
    end = wire.HEADER.size + length
    if len(buffer) < end:
        return None
    frame = bytes(buffer[:end])
    del buffer[:end]
    return frame


async def next_raw(reader: asyncio.StreamReader, buffer: bytearray) -> bytes:
    while True:
        frame = split_frame(buffer)
        if frame is not None:
            return frame
        data = await reader.read(65536)
        if not data:
            raise ConnectionError("the controller closed the link")
        buffer += data


def verify(codec: wire.Codec, raw: bytes) -> wire.Frame:
    codec.feed(raw)
    frame = codec.next_frame()
    assert frame is not None  # split_frame handed over exactly one whole frame
    return frame


async def walk_in(i: int, port: int, dials: asyncio.Semaphore, storm: Storm) -> None:
    """One simulated agent, speaking the real protocol over a raw connection."""
    host = f"walkin-{i:05d}"
    buffer = bytearray()
    async with dials:  # held through Accept: bounds the handshakes in flight, not the open links
        if storm.first_dial is None:
            storm.first_dial = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(wire.Channel.JOIN.value)
            # Loopback bind means open admission: pre-admission frames carry the all-zeros key.
            codec = wire.Codec(wire.OPEN_KEY)
            challenge = parse_message(verify(codec, await next_raw(reader, buffer)))
            if not isinstance(challenge, Challenge):
                raise AssertionError(f"{host}: expected a challenge, got {challenge!r}")
            client_nonce = wire.new_nonce()
            hello = Hello(nonce=challenge.nonce, client_nonce=client_nonce, host=host, devices=["cpu:0"])
            writer.write(codec.encode(wire.Kind.HELLO, hello.model_dump()))
            accept = parse_message(verify(codec, await next_raw(reader, buffer)))
            if not isinstance(accept, Accept) or accept.salt is None:
                raise AssertionError(f"{host}: expected an open-admission accept, got {accept!r}")
            storm.accepts.append(time.perf_counter())
        except BaseException:
            writer.close()
            raise
    try:
        codec.rekey(wire.connection_key(accept.salt, challenge.nonce, client_nonce))
        raw = await next_raw(reader, buffer)
        # Stamp on arrival, verify after every agent has its copy: in one process the
        # agents' tag checks and decoding would otherwise be billed to the fan-out.
        storm.formed.append(time.perf_counter())
        if len(storm.formed) == storm.n:
            storm.all_formed.set()
            storm.released.set()
        await storm.released.wait()
        if storm.failed.is_set():
            return
        frame = verify(codec, raw)
        if frame.kind is not wire.Kind.WORLD_FORMED or frame.body.get("world_size") != storm.n:
            raise AssertionError(f"{host}: expected WorldFormed of {storm.n} ranks, got {frame.kind.name}")
        first = accept.ranks[0]
        if frame.body["hosts"][first]["host"] != host:
            raise AssertionError(f"{host}: rank {first} belongs to {frame.body['hosts'][first]['host']}")
        if first == storm.n - 1:
            WorldFormed.model_validate(frame.body)  # one full parse, as the real agent does
        # Report the rank finished before leaving: a link closing with ranks
        # unreported reads as a dead host and fails the run.
        writer.write(codec.encode(wire.Kind.RANK_EXITED, {"rank": first, "code": 0}))
        await writer.drain()
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def guarded(i: int, port: int, dials: asyncio.Semaphore, storm: Storm) -> None:
    try:
        await walk_in(i, port, dials, storm)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        storm.fail(f"walkin-{i:05d}: {type(exc).__name__}: {exc}")


async def sample_status(port: int, storm: Storm, stop: asyncio.Event) -> None:
    """An operator hammering `fdl status`: one fresh connection per sample, read to EOF."""
    while not stop.is_set():
        started = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /state.json HTTP/1.1\r\nHost: x\r\n\r\n")
        data = await reader.read()  # the server closes after each reply
        storm.status_s.append(time.perf_counter() - started)
        writer.close()
        if not data.startswith(b"HTTP/1.1 200"):
            storm.fail(f"/state.json answered {data[:40]!r}")
            return
        # A fixed cadence, not a fixed gap: a slow reply does not stretch the interval.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, started + STATUS_EVERY - time.perf_counter()))


async def poll_window(ctl: Controller, storm: Storm, stop: asyncio.Event) -> None:
    """The baseline: a window that learns of the target by polling every 20 ms."""
    while not stop.is_set():
        if ctl.window.joined_ranks >= storm.n:
            storm.noticed = time.perf_counter()
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), POLL_TICK)


async def watch_controller(ctl: Controller, storm: Storm, stop: asyncio.Event) -> None:
    """A phase of `forming` seen from outside the controller means `_form` raised midway."""
    while not stop.is_set():
        phase = ctl.window.phase
        if phase in ("forming", "failed"):
            await asyncio.sleep(0.05)
            gc.collect()  # surfaces the handler task's unretrieved exception to our handler
            await asyncio.sleep(0)
            detail = ctl.window.failure or "the world never reached its members"
            storm.fail(f"controller stuck in phase {phase}: {detail}")
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.02)


async def run_storm(n: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    storm = Storm(n)

    def on_exception(_: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        storm.errors.append(f"{context.get('message')}: {type(exc).__name__}: {exc}" if exc else str(context))

    loop.set_exception_handler(on_exception)
    gc.collect()
    rss_before = rss_mb()
    overflows_before = listen_overflows()
    window = WindowConfig(quorum=n, target=n, join_timeout=600, max_join_timeout=1200, start="auto")
    ctl = Controller(Settings(window=window, command=["true"], port=0))
    await ctl.start()
    stop = asyncio.Event()
    helpers = [
        asyncio.create_task(sample_status(ctl.port, storm, stop)),
        asyncio.create_task(poll_window(ctl, storm, stop)),
        asyncio.create_task(watch_controller(ctl, storm, stop)),
    ]
    dials = asyncio.Semaphore(DIAL_CONCURRENCY)
    agents = [asyncio.create_task(guarded(i, ctl.port, dials, storm)) for i in range(n)]
    ended = [asyncio.create_task(storm.all_formed.wait()), asyncio.create_task(storm.failed.wait())]
    await asyncio.wait(ended, timeout=storm_timeout(n), return_when=asyncio.FIRST_COMPLETED)
    rss_peak = rss_mb()  # every link still open, every WorldFormed buffered
    if not storm.all_formed.is_set() and not storm.failed.is_set():
        storm.fail(
            f"timed out after {storm_timeout(n):.0f}s: {len(storm.accepts)} accepted, "
            f"{len(storm.formed)} formed, controller phase {ctl.window.phase}"
        )
    stop.set()
    storm.released.set()
    await asyncio.gather(*helpers, return_exceptions=True)
    teardown_s: float | None = None
    if storm.failed.is_set():
        for task in agents:
            task.cancel()
        await asyncio.gather(*agents, return_exceptions=True)
    else:
        started = time.perf_counter()
        await asyncio.wait(agents, timeout=storm_timeout(n))
        try:
            await asyncio.wait_for(ctl.finished.wait(), storm_timeout(n))
            teardown_s = time.perf_counter() - started
            if ctl.exit_code != 0 or ctl.window.phase != "done":
                storm.errors.append(f"controller ended {ctl.window.phase} (exit {ctl.exit_code})")
        except TimeoutError:
            storm.errors.append(f"controller never reached done (phase {ctl.window.phase})")
    for task in ended:
        task.cancel()
    await ctl.close()
    overflows_after = listen_overflows()
    return summarize(storm, rss_before, rss_peak, teardown_s, overflows_before, overflows_after)


def summarize(
    storm: Storm,
    rss_before: float,
    rss_peak: float,
    teardown_s: float | None,
    overflows_before: int | None,
    overflows_after: int | None,
) -> dict[str, Any]:
    n = storm.n
    ok = len(storm.formed) == n and not storm.failed.is_set()
    result: dict[str, Any] = {"n": n}
    admissions = None
    if storm.first_dial is not None and len(storm.accepts) == n:
        admissions = n / (max(storm.accepts) - storm.first_dial)
    result["admissions_per_s"] = round(admissions, 1) if admissions else None
    formation_ms = poll_detect_ms = baseline_ms = None
    if ok:
        nth_accept = max(storm.accepts)
        formation_ms = (max(storm.formed) - nth_accept) * 1e3
        if storm.noticed is not None:
            # A poller cannot form before the join it polls for; one that ticks
            # between the controller's join and the agent reading its Accept lost nothing.
            poll_detect_ms = max(0.0, (storm.noticed - nth_accept) * 1e3)
            baseline_ms = poll_detect_ms + formation_ms
    p99 = percentile(storm.status_s, 0.99)
    result.update(
        formation_ms=None if formation_ms is None else round(formation_ms, 2),
        status_p99_ms=None if p99 is None else round(p99 * 1e3, 2),
        rss_mb=round(rss_peak, 1),
        rss_delta_mb=round(rss_peak - rss_before, 1),
        baseline_poll_formation_ms=None if baseline_ms is None else round(baseline_ms, 2),
        ratio=round(formation_ms / baseline_ms, 3) if formation_ms is not None and baseline_ms else None,
        poll_detect_ms=None if poll_detect_ms is None else round(poll_detect_ms, 2),
        status_samples=len(storm.status_s),
        status_max_ms=round(max(storm.status_s) * 1e3, 2) if storm.status_s else None,
        teardown_s=None if teardown_s is None else round(teardown_s, 2),
        listen_overflows=(
            overflows_after - overflows_before
            if overflows_before is not None and overflows_after is not None
            else None
        ),
        error="; ".join(dict.fromkeys(storm.errors))[:2000] or None,
    )
    return result


def describe(r: dict[str, Any]) -> str:
    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1f} ms"

    lines = [
        f"n={r['n']}: admissions {r['admissions_per_s'] or 'n/a'}/s; "
        f"formed {ms(r['formation_ms'])} after the {r['n']}th accept; "
        f"20 ms poller {ms(r['poll_detect_ms'])} to notice + fan-out = {ms(r['baseline_poll_formation_ms'])} "
        f"(ratio {r['ratio'] if r['ratio'] is not None else 'n/a'})",
        f"  /state.json p99 {ms(r['status_p99_ms'])}, max {ms(r['status_max_ms'])} over "
        f"{r['status_samples']} samples; RSS {r['rss_mb']:.1f} MB ({r['rss_delta_mb']:+.1f} MB over the storm); "
        f"teardown {r['teardown_s'] if r['teardown_s'] is not None else 'n/a'} s; "
        f"listen overflows {r['listen_overflows'] if r['listen_overflows'] is not None else 'n/a'}",
    ]
    if r.get("error"):
        lines.append(f"  FAILED: {r['error']}")
    return "\n".join(lines)


# --- driver --------------------------------------------------------------------


def run_child(n: int) -> dict[str, Any]:
    """Each N in a fresh interpreter: clean RSS, a fresh loop, no leftovers from the last storm."""
    argv = [sys.executable, "-m", "bench.join_storm", "--child", str(n)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=3 * storm_timeout(n) + 60)
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
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)  # one storm, in this process
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(asyncio.run(run_storm(args.child))))
        return
    ns = args.n or (QUICK_NS if args.quick else FULL_NS)
    limit, note = raise_nofile(FDS_PER_AGENT * max(ns) + FD_SLACK)  # children inherit the limit
    if note:
        print(note)
    fits = (limit - FD_SLACK) // FDS_PER_AGENT
    results = []
    for asked in ns:
        n = min(asked, fits)
        if n < asked:
            print(f"note: N={asked} needs {FDS_PER_AGENT * asked + FD_SLACK} descriptors, the limit is {limit}; "
                  f"capped to {n}")  # fmt: skip
        result = run_child(n)
        if n < asked:
            result["capped_from"] = asked
        result.setdefault("ratio", None)
        print(describe(result) if "admissions_per_s" in result else f"n={n}: FAILED: {result['error']}")
        results.append(result)
    formed = [r for r in results if r.get("formation_ms") is not None]
    largest = max(formed, key=lambda r: r["n"], default=None)
    worst_formation = max((r["formation_ms"] for r in formed), default=None)
    worst_status = max(
        (r["status_p99_ms"] for r in results if r.get("status_p99_ms") is not None), default=None
    )
    print("goals (from the issue; reported, not asserted):")
    print(f"  {GOAL_N} walk-ins formed into one world on 2 cores: "
          f"largest world formed here {largest['n'] if largest else 'none'}")  # fmt: skip
    print(f"  formation under {GOAL_FORMATION_MS:.0f} ms after the last hello: worst {worst_formation} ms")
    print(f"  /state.json p99 under {GOAL_STATUS_P99_MS:.0f} ms: worst {worst_status} ms")
    print(f"baseline_c10d: null ({C10D_REASON})")
    print(
        json.dumps(
            {
                "bench": "join_storm",
                "results": results,
                "ratio": results[-1].get("ratio") if results else None,
                "baseline_c10d": None,
                "baseline_c10d_reason": C10D_REASON,
            }
        )
    )


if __name__ == "__main__":
    main()

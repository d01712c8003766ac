"""Abuse during an open window, over real sockets.

The attacker dials the controller at this box's own non-loopback address (the
controller sees a remote peer: the dial guard and the per-peer cap apply);
legitimate walk-ins come through loopback, as tunnelled workers do. The run must
form and finish, the flood must be counted and turned away, and the
controller's memory must stay bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import resource
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from flodl_agent.agent.agent import TRANSIENT, AgentFailure, join_once
from flodl_agent.agent.options import AgentOptions
from flodl_agent.config import DeviceOffer
from flodl_agent.controller.controller import Controller
from flodl_agent.controller.http_surface import HttpLimits
from flodl_agent.controller.listener import Timeouts
from flodl_agent.observe.status import Unreachable, request
from flodl_agent.protocol import preamble, wire
from flodl_agent.protocol.join_protocol import Challenged, JoinClient
from flodl_agent.protocol.tls import generate
from tests.support import free_port, remote_address
from tests.support.control_plane import agent, run, settings, until, walk_in

TOKEN = "00112233445566778899aabbccddeeff"
FDL = Path(sys.executable).with_name("fdl")


REMOTE = remote_address()  # the attacker's road in
needs_remote = pytest.mark.skipif(REMOTE is None, reason="needs a non-loopback address on this box")


def kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def state(port: int) -> dict[str, object]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/state.json")
    body = json.loads(conn.getresponse().read())
    conn.close()
    return body  # type: ignore[no-any-return]


@pytest.fixture
def launched(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int, Path]]:
    """`fdl launch` with a join.token on every address: two ranks, discovery, an open window."""
    with launch(tmp_path) as started:
        yield started


@contextlib.contextmanager
def launch(tmp_path: Path, files: int | None = None) -> Iterator[tuple[subprocess.Popen[str], int, Path]]:
    """The launched fixture's controller; ``files``: its open-file limit, soft and hard (it cannot
    raise a hard limit)."""
    port = free_port()
    limit = None if files is None else (files, files)
    window = {
        "discovery": True,
        "token": TOKEN,
        "min_rank_start": 2,
        "target_ranks": 2,  # the window closes the instant both boxes are in
        "join_timeout": 120,
        "max_join_timeout": 240,
    }
    config = tmp_path / "fdl.cluster.yml"
    config.write_text(
        json.dumps({"cluster": {"controller": {"host": "127.0.0.1", "port": port, "join": window}}})
    )
    out = tmp_path / "ranks"
    out.mkdir()
    # Each rank waits for the test's word, so the controller is measured while the run is live.
    write = (
        f"import os, time; go = os.path.join(r'{out}', 'go')\n"
        "while not os.path.exists(go): time.sleep(0.05)\n"
        f"open(os.path.join(r'{out}', os.environ['RANK']), 'w').write('x')"
    )
    rank = [sys.executable, "-c", write]
    proc = subprocess.Popen(
        [str(FDL), "launch", "--config", str(config), "--bind", "0.0.0.0", "--json", "--", *rank],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "NO_COLOR": "1"},
        preexec_fn=None if limit is None else lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limit),
    )
    try:
        yield proc, port, out
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


async def hold_idle(port: int, count: int, opened: list[asyncio.StreamWriter]) -> None:
    """Connections that say nothing: each holds a slot until the controller cuts it."""
    for _ in range(count):
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection(REMOTE, port)
            opened.append(writer)


async def junk(port: int, rounds: int) -> None:
    """Garbage on every channel, and join frames under no key at all."""
    for i in range(rounds):
        with contextlib.suppress(OSError, ConnectionError):
            reader, writer = await asyncio.open_connection(REMOTE, port)
            writer.write(
                [b"xxxx", preamble.Channel.JOIN.value + os.urandom(64), b"GET /" + os.urandom(32)][i % 3]
            )
            await writer.drain()
            await asyncio.wait_for(reader.read(), 10)
            writer.close()


async def wrong_keys(port: int, rounds: int) -> None:
    """Whole handshakes under a wrong run key: the hello fails authentication."""
    for i in range(rounds):
        opts = AgentOptions(
            controller_host=str(REMOTE),
            controller_port=port,
            key=os.urandom(16),
            host=f"intruder-{i}",
            devices=DeviceOffer("cpu", cpus=1),
        )
        with contextlib.suppress(Exception):
            await asyncio.wait_for(join_once(opts, lambda _: None), 15)


@needs_remote
def test_a_flood_during_the_window_does_not_keep_walk_ins_out_or_grow_the_controller(
    launched: tuple[subprocess.Popen[str], int, Path],
) -> None:
    proc, port, out = launched

    async def scenario() -> None:
        await until(lambda: _answers(port), timeout=30)
        baseline = kib(proc.pid, "VmRSS")
        idle: list[asyncio.StreamWriter] = []
        flood = [
            asyncio.ensure_future(hold_idle(port, 400, idle)),
            *(asyncio.ensure_future(junk(port, 60)) for _ in range(4)),
            *(asyncio.ensure_future(wrong_keys(port, 15)) for _ in range(4)),
        ]
        # The flood is on before anyone legitimate dials.
        await until(lambda: len(idle) >= 300, timeout=30)
        walkers = [
            await asyncio.create_subprocess_exec(
                str(FDL),
                "join",
                f"127.0.0.1:{port}",
                "--host",
                name,
                "--devices",
                "cpu:1",
                env={**os.environ, "FDL_TOKEN": TOKEN, "NO_COLOR": "1"},
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
            for name in ("box-a", "box-b")
        ]
        await until(lambda: _phase(port) == "training", timeout=120)  # both walked in: the world formed
        peak = kib(proc.pid, "VmHWM")
        seen = await asyncio.to_thread(state, port)
        (out / "go").write_text("")
        codes = await asyncio.wait_for(asyncio.gather(*(w.wait() for w in walkers)), 120)
        assert codes == [0, 0], "a legitimate walk-in did not finish"
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        for writer in idle:
            writer.close()
        # Turned away and counted: over the per-peer cap, out of dial budget, failed authentication.
        dropped = seen["dropped"]
        assert isinstance(dropped, dict)
        # 400 silent connections from one address: past the per-peer cap the rest are turned away
        # (as rate-limited once the wrong-key hellos and the junk spent the address's budget).
        turned_away = dropped.get("busy_peer", 0) + dropped.get("rate_limited", 0)
        assert turned_away >= 400 - Timeouts().per_peer - 20, dropped
        assert seen["refused"].get("bad_key", 0) >= 1  # a hello under a wrong key: refused, counted
        assert seen["admitted"] == 2
        # Bounded: hundreds of connections and handshakes cost the controller a few MB, not a leak.
        assert peak - baseline < 64 * 1024, f"the controller grew {(peak - baseline) // 1024} MiB"

    asyncio.run(asyncio.wait_for(scenario(), 240))
    assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else ""
    report = json.loads(proc.stdout.read() if proc.stdout else "{}")
    assert report["ok"] and sorted(h["host"] for h in report["hosts"]) == ["box-a", "box-b"]
    assert sorted(p.name for p in out.iterdir()) == ["0", "1", "go"]


def _phase(port: int) -> object:
    with contextlib.suppress(OSError, ValueError):
        return state(port)["phase"]
    return None


def _answers(port: int) -> bool:
    with contextlib.suppress(OSError, ValueError):
        return "phase" in state(port)
    return False


@needs_remote
def test_a_slow_loris_does_not_block_state_json_and_is_cut_off() -> None:
    async def scenario() -> None:
        # The whole request's deadline, shortened for the test.
        ctl = Controller(settings(bind="0.0.0.0"), timeouts=Timeouts(http=HttpLimits(timeout=2.0)))
        await ctl.start()
        lorises = []
        for _ in range(40):
            reader, writer = await asyncio.open_connection(REMOTE, ctl.port)
            writer.write(b"GET /state.json HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # and never the rest
            await writer.drain()
            lorises.append((reader, writer))
        # Everyone else is served while the lorises hang on.
        status, body = await asyncio.to_thread(_get, ctl.port)
        assert status == 200 and body["phase"] == "waiting"
        assert all(not r.at_eof() for r, _ in lorises)
        # The deadline is per request, not per byte: every loris is cut, and counted.
        endings = await asyncio.wait_for(asyncio.gather(*(r.read() for r, _ in lorises)), 30)
        assert all(e == b"" for e in endings)
        await until(lambda: ctl.dropped.get("timeout", 0) == 40)
        for _, w in lorises:
            w.close()
        await ctl.close()

    run(scenario)


def _get(port: int) -> tuple[int, dict[str, object]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/state.json")
    reply = conn.getresponse()
    body = json.loads(reply.read())
    conn.close()
    return reply.status, body


# --- the join handshake, fuzzed against a live controller ------------------------

HELLO_FIELDS = (
    "nonce",
    "client_nonce",
    "host",
    "devices",
    "device_labels",
    "variant",
    "dataset_sig",
    "model_sig",
    "run_id",
    "nccl",
    "data_path",
    "pid",
)
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=300),
    st.binary(max_size=40),
    st.lists(st.text(max_size=20), max_size=40),
    st.dictionaries(st.text(max_size=5), st.integers(-(2**63), 2**63 - 1), max_size=3),
)


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[Controller, asyncio.AbstractEventLoop, list[dict[str, Any]]]]:
    """One open-admission controller on loopback for every example; its loop's unhandled errors."""
    loop = asyncio.new_event_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    # A target nobody reaches: fuzzed hellos that happen to be valid join and leave again.
    ctl = Controller(settings(quorum=1000, target=1000, join_timeout=3600.0, max_join_timeout=7200.0))
    asyncio.run_coroutine_threadsafe(ctl.start(), loop).result(30)
    yield ctl, loop, errors
    asyncio.run_coroutine_threadsafe(ctl.close(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()


def _exchange(port: int, first: bytes, then: Callable[[bytes], bytes] | None = None) -> bytes:
    """Send ``first`` after the join preamble (and ``then(challenge)``); what came back until close."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        s.sendall(preamble.Channel.JOIN.value + first)
        got = b""
        if then is not None:
            while len(got) < wire.HEADER.size or len(got) < wire.HEADER.size + _length(got):
                chunk = s.recv(65536)
                if not chunk:
                    return got
                got += chunk
            s.sendall(then(got))
        s.shutdown(socket.SHUT_WR)
        while chunk := s.recv(65536):
            got += chunk
        return got


def _length(header: bytes) -> int:
    return int(wire.HEADER.unpack(header[: wire.HEADER.size])[3])  # magic, version, kind, length, tag


@hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.binary(max_size=2000))
def test_fuzzed_join_bytes_are_refused_without_harm(
    live: tuple[Controller, asyncio.AbstractEventLoop, list[dict[str, Any]]], garbage: bytes
) -> None:
    ctl, _, errors = live
    _exchange(ctl.port, garbage)  # the controller hangs up; nothing else to see
    assert errors == [] and not ctl.links


@hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=st.dictionaries(st.sampled_from(HELLO_FIELDS) | st.text(max_size=8), VALUES, max_size=12),
    echo=st.booleans(),
)
def test_authenticated_hellos_of_any_shape_get_an_answer_never_a_crash(
    live: tuple[Controller, asyncio.AbstractEventLoop, list[dict[str, Any]]], body: dict[str, Any], echo: bool
) -> None:
    """A peer that holds the key and sends nonsense: refused by name, or admitted when it happens to
    be a valid hello (and gone again when it hangs up), never a handler crash."""
    ctl, _, errors = live
    client = JoinClient(None)

    def hello(challenge_bytes: bytes) -> bytes:
        client.receive_data(challenge_bytes)
        assert isinstance(client.next_event(), Challenged)
        if echo:  # answer this connection's challenge, so the hello reaches validation and admission
            body.pop("nonce", None)  # the client fills in the challenge's
        else:
            body.setdefault("nonce", None)
        return client.hello(body, check=False)

    _exchange(ctl.port, b"", hello)
    assert errors == []


def test_after_the_fuzzing_a_legitimate_walk_in_is_still_admitted(
    live: tuple[Controller, asyncio.AbstractEventLoop, list[dict[str, Any]]],
) -> None:
    ctl, loop, errors = live
    opts = agent(ctl, "after-the-storm")
    outcome = asyncio.run_coroutine_threadsafe(_admitted_then_leave(ctl, opts), loop).result(60)
    assert outcome and errors == []


async def _admitted_then_leave(ctl: Controller, opts: AgentOptions) -> bool:
    task = asyncio.ensure_future(join_once(opts, lambda _: None))
    await until(lambda: "after-the-storm" in ctl.links, timeout=30)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return True


# --- TLS under a flood -------------------------------------------------------------------


@needs_remote
def test_a_flood_of_silent_tls_dials_is_capped_and_counted_while_status_answers(tmp_path: Path) -> None:
    """The gate works on the bare socket, before the handshake: 400 dials from one address
    that never send a ClientHello hold at most the per-peer cap, each held one is cut at the
    handshake's deadline and charged to the dial guard, and a pinned `fdl status` is served
    throughout; the spent address is then told it is rate-limited, for one send."""
    cert, key = tmp_path / "c.pem", tmp_path / "c.key"
    pin = generate(cert, key, ["127.0.0.1"])
    per_peer = 64
    timeouts = Timeouts(preamble=2.0, per_peer=per_peer)

    async def scenario() -> None:
        ctl = Controller(settings(bind="0.0.0.0", tls=(str(cert), str(key))), timeouts=timeouts)
        await ctl.start()
        idle: list[asyncio.StreamWriter] = []
        await hold_idle(ctl.port, 400, idle)
        await until(lambda: ctl.dropped["busy_peer"] == 400 - per_peer)
        assert ctl.listener.gate.unsettled(str(REMOTE)) == per_peer
        status = await asyncio.to_thread(
            subprocess.run,
            [str(FDL), "status", "--json", "--addr", f"127.0.0.1:{ctl.port}"],
            capture_output=True,
            text=True,
            env={**os.environ, "NO_COLOR": "1", "FDL_TLS_FINGERPRINT": pin},
            check=False,
        )
        assert status.returncode == 0, status.stderr
        seen = json.loads(status.stdout)
        assert seen["phase"] == "waiting" and seen["dropped"]["busy_peer"] == 400 - per_peer
        await until(lambda: ctl.dropped["timeout"] == per_peer)  # the handshake's deadline
        assert ctl.listener.gate.unsettled(str(REMOTE)) == 0
        with pytest.raises(Unreachable, match="rate-limits this address"):
            await asyncio.to_thread(request, f"{REMOTE}:{ctl.port}", "GET", "/state.json", pin=pin)
        box = AgentOptions(
            controller_host=str(REMOTE),
            controller_port=ctl.port,
            host="box-r",
            devices=DeviceOffer("cpu", cpus=1),
            tls_fingerprint=pin,
        )
        told = await walk_in(box)  # a pinned walk-in reads the alert as the same transient refusal
        assert isinstance(told, AgentFailure) and told.code == TRANSIENT
        assert told.message == "refused: rate-limited by the controller after bad dials (wrong token?)"
        assert ctl.dropped["rate_limited"] >= 2
        for writer in idle:
            writer.close()
        await ctl.close()

    run(scenario)


@needs_remote
def test_out_of_file_descriptors_the_controller_says_so_once_and_recovers(tmp_path: Path) -> None:
    """A controller held to 64 descriptors, flooded with silent dials: at the limit it stops
    accepting and says so once (asyncio's own loop would log a traceback per attempt), the
    dials it holds are cut at their deadline, and it accepts again: `fdl status` answers."""
    with launch(tmp_path, files=64) as (proc, port, _):

        async def scenario() -> None:
            await until(lambda: _answers(port), timeout=30)
            idle: list[asyncio.StreamWriter] = []
            await hold_idle(port, 200, idle)  # far past the limit; the backlog holds the rest
            # The held ones time out, the address is then rate-limited and the backlog drains.
            await until(lambda: _answers(port), timeout=60)
            seen = await asyncio.to_thread(state, port)
            dropped = seen["dropped"]
            assert isinstance(dropped, dict) and dropped["timeout"] >= 20, dropped
            for writer in idle:
                writer.close()

        asyncio.run(asyncio.wait_for(scenario(), 120))
        proc.terminate()
        _, log = proc.communicate(timeout=30)
    starved = [line for line in log.splitlines() if "out of file descriptors (EMFILE" in line]
    assert 1 <= len(starved) <= 3, log[-3000:]  # once per episode, not once per accept attempt
    assert "accepting connections again after" in log
    assert "Traceback" not in log and "socket.accept() out of system resource" not in log
    assert len(log) < 20_000, f"{len(log)} bytes of log"

"""The CPU plane's averaging rounds against gloo's all_reduce, same tensors, same run.

Seconds per averaging round through the controller (float32 and bf16_wire: one
host per rank, each host's agent a process of its own, every round crossing its
control link) and per gloo ``all_reduce``, over 10 rounds after two warm-up rounds
each (the steady state a training run lives in: the first rounds fault the
buffers in); effective bandwidth = model bytes / seconds per round. The hub's
ranks adopt their tensors (as the Trainer does) and, like gloo's, run one thread
each. Two networks:

- **loopback**: everything on this box (memory-bound: the links are never the
  limit), 2 and 4 ranks, 1, 64 and 512 MB of float32; the machine's memory-copy
  bandwidth is printed beside. The agents dial 127.0.0.1 and so come through the
  controller's local socket (:mod:`flodl_agent.protocol.local_port`), as walk-ins on its
  box do; ``hub_tcp`` is the float32 hub with that socket off, over TCP loopback
  (as agents behind a tunnel reach it).
- **shaped** (root, iproute2): a network namespace per host joined through a
  switch namespace, each worker's link shaped to 1 Gbit/s each way and the
  controller's to 10 Gbit/s (``bench.netns``); the controller, the agents and
  their ranks, and gloo's ranks run in their hosts' namespaces, over the same
  links. 2 and 4 ranks, 64 MB. Without root it is skipped, and says why.

``--quick``: 64 MB only, loopback at 2 and 4 ranks, shaped at 2. ``--smoke``: the
shaped network with a 1 MB model, one round, float32 and gloo (the test suite's
check that it builds, measures and leaves nothing behind).

The last line is one JSON object: ``ratio`` (loopback, 2 ranks, 64 MB: gloo's
seconds per round over the float32 hub's, higher is better), ``ratio_bf16``,
``ratio_4`` (the same at 4 ranks), ``ratio_tcp`` and ``ratio_4_tcp`` (over TCP
loopback), ``shaped_ratio`` and ``shaped_ratio_bf16`` (2 ranks, 64 MB, shaped),
and ``floor`` (``floor_tcp``): what any hub over an authenticated unix (TCP)
stream must spend on this box, measured in the same run (the kernel's CPU per
byte of a local stream, both ends, and Poly1305's speed), the loopback round that
leaves when it runs on every core at once with nothing else (``hub_floor_s``),
and gloo's round over it (``ratio_ceiling``). The hub moves 2 x ranks models
through the kernel a round where a ring moves 2 x (ranks - 1), and tags each
of them twice (sent, verified): on a box whose cores the ranks and agents
share, that is the ceiling on ``ratio``, whatever the hub's own code does.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives import poly1305

from bench import netns
from bench.walkins import AGENT, free_port, run_world
from flodl_agent.protocol import local_port
from flodl_agent.train.hub import CHUNK

ROUNDS = 10
CONTROLLER_PORT = 29500  # a fresh namespace: nothing else listens there
GLOO_PORT = 29501
RUN_TIMEOUT = 600.0

HUB_RANK = """
import json, os, sys, time
import torch
from flodl_agent.train import Averager

numel, rounds, bf16, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
torch.set_num_threads(1)  # as gloo's ranks (OMP_NUM_THREADS=1): the hosts share this box's cores
tensor = torch.ones(numel)
avg = Averager(bf16_wire=bf16)
avg.adopt([tensor])  # as the Trainer does: the parameters live in the rank's segment
for _ in range(2):  # warm, as gloo is: connections, every buffer's first touch
    avg.average([tensor], 1.0)
start = time.perf_counter()
for _ in range(rounds):
    avg.average([tensor], 1.0)
seconds = (time.perf_counter() - start) / rounds
open(os.path.join(out, os.environ["RANK"]), "w").write(json.dumps(seconds))
"""

GLOO_RANK = """
import json, os, sys, time
import torch
import torch.distributed as dist

numel, rounds, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
tensor = torch.ones(numel)
for _ in range(2):  # warm, as the hub is
    dist.all_reduce(tensor)
start = time.perf_counter()
for _ in range(rounds):
    dist.all_reduce(tensor)
    tensor /= dist.get_world_size()
seconds = (time.perf_counter() - start) / rounds
open(os.path.join(out, os.environ["RANK"]), "w").write(json.dumps(seconds))
dist.barrier()
dist.destroy_process_group()
"""


def slowest(out: str) -> float:
    """The slowest rank's seconds per round (a round ends when every rank has it)."""
    return max(float(json.loads(p.read_text())) for p in Path(out).iterdir())


def finish(procs: list[subprocess.Popen[bytes]], what: str, timeout: float = RUN_TIMEOUT) -> None:
    """Wait for every process; none outlives this call (a namespace goes only when its processes do)."""
    deadline = time.monotonic() + timeout
    try:
        codes = [p.wait(max(0.1, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if codes is None or any(codes):
        sys.exit(f"{what} failed: exit codes {codes or 'timed out'}")


def hub_command(numel: int, bf16: bool, out: str, rounds: int) -> list[str]:
    return [sys.executable, "-c", HUB_RANK, str(numel), str(rounds), "1" if bf16 else "0", out]


def hub(ranks: int, numel: int, bf16: bool, rounds: int = ROUNDS, local: bool = True) -> float:
    """Seconds per round through the controller on loopback; each host's agent runs in a process
    of its own, as on a real fleet (``local``: through the controller's local socket, as agents on
    its box are; otherwise over TCP loopback, as through a tunnel)."""
    out = tempfile.mkdtemp()
    run_world(hub_command(numel, bf16, out, rounds), [(f"h{i}", 1) for i in range(ranks)], local=local)
    return slowest(out)


def gloo_env(rank: int, ranks: int, addr: str, port: int, ifname: str) -> dict[str, str]:
    return {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": str(ranks),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": ifname,
        "OMP_NUM_THREADS": "1",
    }


def gloo(ranks: int, numel: int, rounds: int = ROUNDS) -> float:
    out = tempfile.mkdtemp()
    port = free_port()
    command = [sys.executable, "-c", GLOO_RANK, str(numel), str(rounds), out]
    finish(
        [subprocess.Popen(command, env=gloo_env(r, ranks, "127.0.0.1", port, "lo")) for r in range(ranks)],
        "gloo",
    )
    return slowest(out)


def hub_shaped(t: netns.Topology, ranks: int, numel: int, bf16: bool, rounds: int = ROUNDS) -> float:
    """Seconds per round through a controller in its namespace, each host's agent (and its rank)
    in a worker's, every round over the shaped links."""
    out = tempfile.mkdtemp()
    env = {**os.environ, "FDL_TOKEN": secrets.token_hex(16)}  # a non-loopback window takes a token
    serve = [sys.executable, "-m", "bench.walkins", "serve", t.controller.address, str(CONTROLLER_PORT)]
    serve += [str(ranks), "--", *hub_command(numel, bf16, out, rounds)]
    ctl = subprocess.Popen(netns.in_ns(t.controller.ns, serve), env=env, stdout=subprocess.PIPE)
    procs = [ctl]
    try:
        assert ctl.stdout is not None
        if ctl.stdout.readline().strip() != b"listening":
            raise RuntimeError("the shaped network's controller did not open its window")
        for w in t.workers[:ranks]:
            agent = [sys.executable, "-c", AGENT, str(CONTROLLER_PORT), w.name, "1", t.controller.address]
            procs.append(subprocess.Popen(netns.in_ns(w.ns, agent), env=env))
    finally:
        finish(procs, "the shaped hub run")
    return slowest(out)


def gloo_shaped(t: netns.Topology, ranks: int, numel: int, rounds: int = ROUNDS) -> float:
    out = tempfile.mkdtemp()
    command = [sys.executable, "-c", GLOO_RANK, str(numel), str(rounds), out]
    master = t.workers[0].address
    procs = [
        subprocess.Popen(netns.in_ns(w.ns, command), env=gloo_env(r, ranks, master, GLOO_PORT, "eth0"))
        for r, w in enumerate(t.workers[:ranks])
    ]
    finish(procs, "the shaped gloo run")
    return slowest(out)


STREAM_SENDER = """
import socket, sys
where, n, buffer, piece = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), 1 << 20
data = memoryview(bytearray(piece))
if where.isdigit():
    s = socket.create_connection(("127.0.0.1", int(where)))
else:
    s = socket.socket(socket.AF_UNIX)
    s.connect("\\0" + where[1:])
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer)  # as local_port.tune: no imports timed
with s:
    for _ in range(n // piece):
        s.sendall(data)
"""


def socket_cpu_s_per_gb(nbytes: int = 256 << 20, local: bool = False) -> float:
    """CPU seconds (sender and receiver, user and kernel) a GB through a loopback TCP stream
    (``local``: a unix socket with the buffers the controller's local socket has)."""
    with socket.create_server(("127.0.0.1", 0)) as server, socket.socket(socket.AF_UNIX) as unix:
        name = f"@flodl-bench/{os.getpid()}"  # abstract: "@" stands for the NUL argv cannot carry
        unix.bind("\0" + name[1:])
        unix.listen()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        mine = resource.getrusage(resource.RUSAGE_SELF)
        where = name if local else str(server.getsockname()[1])
        sender = subprocess.Popen(
            [sys.executable, "-c", STREAM_SENDER, where, str(nbytes), str(local_port.BUFFER)]
        )
        conn, _ = (unix if local else server).accept()
        if local:
            local_port.tune(conn)
        with conn:
            into, got = memoryview(bytearray(1 << 20)), 0
            while got < nbytes and (n := conn.recv_into(into)):
                got += n
        sender.wait()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        end = resource.getrusage(resource.RUSAGE_SELF)

    def cpu(a: resource.struct_rusage, b: resource.struct_rusage) -> float:
        return b.ru_utime - a.ru_utime + b.ru_stime - a.ru_stime

    return (cpu(before, after) + cpu(mine, end)) / (got / 1e9)


def poly1305_gbps(nbytes: int = 64 << 20) -> float:
    """Poly1305 over ``nbytes`` in the hub's pieces (one core: it holds the GIL)."""
    data = np.ones(nbytes // 4, np.float32).data.cast("B")  # touched: no page faults timed
    key = secrets.token_bytes(32)
    piece = 4 * CHUNK
    start = time.perf_counter()
    for first in range(0, nbytes, piece):
        poly1305.Poly1305.generate_tag(key, data[first : first + piece])
    return nbytes / (time.perf_counter() - start) / 1e9


def floor(
    gloo_s: float | None, socket_s: float, mac_gbps: float, cores: int, ranks: int = 2, mb: int = 64
) -> dict[str, Any]:
    """The loopback round a hub over an authenticated stream costs on this box at the least, as
    far as a plain stream measures it: every host's model up and the average back down through
    the kernel (``socket_s`` CPU seconds a GB, both ends), each tagged once and verified once
    (Poly1305 at ``mac_gbps``), spread over every core with nothing else to do (no copies, no
    sums, no Python). An estimate: the plain stream's 1 MiB writes and reads are not the
    hub's, and on the local socket the hub has come in a tenth under it."""
    model = mb * 1024 * 1024 / 1e9  # GB
    cpu = 2 * ranks * model * socket_s + 2 * 2 * ranks * model / mac_gbps
    hub_floor = cpu / cores
    return {
        "socket_cpu_s_per_gb": round(socket_s, 3),
        "poly1305_gbps": round(mac_gbps, 2),
        "cores": cores,
        "hub_floor_s": round(hub_floor, 4),
        "ratio_ceiling": round(gloo_s / hub_floor, 3) if gloo_s else None,
    }


def memcpy_gbps(nbytes: int = 256 * 1024 * 1024) -> float:
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    start = time.perf_counter()
    for _ in range(3):
        np.copyto(dst, src)
    return nbytes * 3 / (time.perf_counter() - start) / 1e9


def row(net: str, ranks: int, mb: int, seconds: dict[str, float]) -> dict[str, Any]:
    """One case's figures: seconds per round and effective bandwidth of each contender."""
    nbytes = mb * 1024 * 1024
    out: dict[str, Any] = {"net": net, "ranks": ranks, "model_mb": mb}
    for name, s in seconds.items():
        out[f"{name}_s"] = round(s, 4)
        out[f"{name}_gbps"] = round(nbytes / s / 1e9, 3)
    return out


def ratio(rows: list[dict[str, Any]], net: str, ranks: int, hub: str = "hub") -> float | None:
    """gloo's seconds over the hub's for the 64 MB case (higher is better); None if not run."""
    for r in rows:
        if (r["net"], r["ranks"], r["model_mb"]) == (net, ranks, 64) and f"{hub}_s" in r:
            return round(float(r["gloo_s"]) / float(r[f"{hub}_s"]), 3)
    return None


def summary(rows: list[dict[str, Any]], memcpy: float, shaped_skipped: str | None) -> dict[str, Any]:
    return {
        "bench": "averaging",
        "rows": rows,
        "memcpy_gbps": round(memcpy, 2),
        "baseline": "gloo all_reduce, same tensors, same network, same run",
        "ratio": ratio(rows, "loopback", 2),
        "ratio_bf16": ratio(rows, "loopback", 2, "hub_bf16"),
        "ratio_4": ratio(rows, "loopback", 4),
        "ratio_tcp": ratio(rows, "loopback", 2, "hub_tcp"),
        "ratio_4_tcp": ratio(rows, "loopback", 4, "hub_tcp"),
        "shaped_ratio": ratio(rows, "shaped", 2),
        "shaped_ratio_bf16": ratio(rows, "shaped", 2, "hub_bf16"),
        "shaped_skipped": shaped_skipped,
    }


def case(
    net: str, ranks: int, mb: int, t: netns.Topology | None = None, rounds: int = ROUNDS, bf16: bool = True
) -> dict[str, Any]:
    numel = mb * 1024 * 1024 // 4
    seconds: dict[str, float] = {}
    for wire in (False, True) if bf16 else (False,):
        name = "hub_bf16" if wire else "hub"
        seconds[name] = (
            hub(ranks, numel, wire, rounds) if t is None else hub_shaped(t, ranks, numel, wire, rounds)
        )
    if t is None:  # the same box's agents over TCP loopback, as through a tunnel
        seconds["hub_tcp"] = hub(ranks, numel, False, rounds, local=False)
    seconds["gloo"] = gloo(ranks, numel, rounds) if t is None else gloo_shaped(t, ranks, numel, rounds)
    result = row(net, ranks, mb, seconds)
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="64 MB only: loopback at 2 and 4 ranks, shaped at 2"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="the shaped network only: 1 MB, one round, no bf16"
    )
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    if args.smoke:
        loopback: list[tuple[int, int]] = []
        shaped, mb, rounds = [2], 1, 1
    elif args.quick:
        loopback, shaped, mb, rounds = [(2, 64), (4, 64)], [2], 64, ROUNDS
    else:
        loopback = [(ranks, size) for ranks in (2, 4) for size in (1, 64, 512)]
        shaped, mb, rounds = [2, 4], 64, ROUNDS
    for ranks, size in loopback:
        rows.append(case("loopback", ranks, size))
    skipped = netns.available()
    made: list[str] = []
    if skipped is None:
        with netns.shaped(max(shaped)) as t:
            made = [ns for ns in netns.namespaces() if ns.startswith(t.prefix)]
            for ranks in shaped:
                rows.append(case("shaped", ranks, mb, t, rounds, bf16=not args.smoke))
    else:
        print(f"shaped network skipped: it {skipped}", flush=True)
    result = summary(rows, memcpy_gbps(), skipped)
    gloo_2 = [r["gloo_s"] for r in rows if (r["net"], r["ranks"], r["model_mb"]) == ("loopback", 2, 64)]
    if gloo_2:  # the ceiling on ``ratio``: what the kernel and the tags alone cost here
        mac, cores = poly1305_gbps(), os.cpu_count() or 1
        result["floor"] = floor(gloo_2[0], socket_cpu_s_per_gb(local=True), mac, cores)
        result["floor_tcp"] = floor(gloo_2[0], socket_cpu_s_per_gb(), mac, cores)
    result["shaped_namespaces"] = made  # what was built (and, by now, removed)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

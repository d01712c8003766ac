"""A shaped network for benchmarks: one network namespace per host, a switch between them.

Each host (the controller and every worker) gets a namespace of its own with one
interface, ``eth0``, the end of a veth pair whose other end sits on a bridge in
the switch's namespace. Both ends of a pair are shaped with ``tc`` tbf, so the
link is the limit each way: workers at 1 Gbit/s, the controller at 10 Gbit/s (a
head node with a fat pipe, workers behind slower links: the case the CPU plane
is for). Traffic stays inside the namespaces made here; ``shaped`` removes them
when it ends, even on failure, and first removes what an earlier run of a
process no longer alive left behind (their names carry that process's id).

Needs root and iproute2 (``ip``, ``tc``). The plan (names, addresses, commands)
is pure, so it is tested without either.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass

PREFIX = "fdl-bench-"  # every namespace this module makes starts so, then the making process's id
SUBNET = "10.213.7"
WORKER_RATE = 1_000_000_000  # bits per second
CONTROLLER_RATE = 10_000_000_000
KERNEL_HZ = 250  # tbf's bucket must hold at least a tick's worth of bytes at its rate


@dataclass(frozen=True)
class Host:
    name: str  # ctl, w0, w1, ...
    ns: str
    address: str
    rate: int  # bits per second, each way
    port: str  # the switch's end of its link


@dataclass(frozen=True)
class Topology:
    prefix: str
    switch: str
    controller: Host
    workers: tuple[Host, ...]

    @property
    def hosts(self) -> tuple[Host, ...]:
        return (self.controller, *self.workers)

    @property
    def namespaces(self) -> list[str]:
        return [self.switch, *(h.ns for h in self.hosts)]


def topology(
    workers: int,
    pid: int | None = None,
    worker_rate: int = WORKER_RATE,
    controller_rate: int = CONTROLLER_RATE,
) -> Topology:
    prefix = f"{PREFIX}{os.getpid() if pid is None else pid}-"
    hosts = [("ctl", controller_rate), *((f"w{i}", worker_rate) for i in range(workers))]
    made = [
        Host(name, prefix + name, f"{SUBNET}.{i + 1}", rate, f"p{i}") for i, (name, rate) in enumerate(hosts)
    ]
    return Topology(prefix, prefix + "sw", made[0], tuple(made[1:]))


def tbf(rate: int) -> list[str]:
    """A token bucket at ``rate`` bits per second: its burst at least a kernel tick's bytes."""
    burst = max(1 << 20, rate // 8 // KERNEL_HZ)
    return ["tbf", "rate", f"{rate}bit", "burst", str(burst), "latency", "50ms"]


def in_ns(ns: str, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


def setup_commands(t: Topology) -> list[list[str]]:
    """Every command that builds ``t``, in order."""
    commands = [["ip", "netns", "add", ns] for ns in t.namespaces]
    commands += [
        ["ip", "-n", t.switch, "link", "add", "br0", "type", "bridge"],
        ["ip", "-n", t.switch, "link", "set", "br0", "up"],
    ]
    for h in t.hosts:
        commands += [
            [
                "ip",
                "-n",
                t.switch,
                "link",
                "add",
                h.port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                h.ns,
            ],
            ["ip", "-n", t.switch, "link", "set", h.port, "master", "br0", "up"],
            ["ip", "-n", h.ns, "addr", "add", f"{h.address}/24", "dev", "eth0"],
            ["ip", "-n", h.ns, "link", "set", "eth0", "up"],
            ["ip", "-n", h.ns, "link", "set", "lo", "up"],  # the host's own loopback: its agent and ranks
            # Both ends shaped: what leaves the host, and what the switch sends it.
            in_ns(h.ns, ["tc", "qdisc", "add", "dev", "eth0", "root", *tbf(h.rate)]),
            in_ns(t.switch, ["tc", "qdisc", "add", "dev", h.port, "root", *tbf(h.rate)]),
        ]
    return commands


def parse_list(output: str) -> list[str]:
    """Names from ``ip netns list`` (``name`` or ``name (id: 3)`` per line)."""
    return [line.split()[0] for line in output.splitlines() if line.strip()]


def stale(names: list[str], alive: Callable[[int], bool]) -> list[str]:
    """Namespaces this module made for a process that is gone."""
    found = []
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or not alive(int(pid)):
            found.append(name)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def available() -> str | None:
    """None when shaped networks can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs iproute2 ({', '.join(missing)} not found)"
    return None


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return parse_list(out)


def remove(names: list[str]) -> None:
    for name in names:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


@contextlib.contextmanager
def shaped(workers: int) -> Iterator[Topology]:
    """Build a shaped topology for ``workers`` workers; remove it afterwards, whatever happens."""
    why = available()
    if why is not None:
        raise RuntimeError(f"a shaped network {why}")
    remove(stale(namespaces(), _alive))
    t = topology(workers)
    try:
        for command in setup_commands(t):
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")
        yield t
    finally:
        # Deleting a namespace takes its end of every pair with it, and so the pair.
        remove([ns for ns in namespaces() if ns.startswith(t.prefix)])

"""Admission: is this hello welcome in this cohort? (pure)

A window with a roster admits the roster's names, and names outside it only
into the room its target leaves beyond the roster (``Roster``). That a hello
may use the name it gives is settled before admission: a bound hello is tagged
with that name's host key (``join_protocol``). The cohort's references
(vendor, run identity, NCCL version, model and dataset signatures) are read
off the members admitted so far, so a member leaving before formation takes
its vote with it. Every refusal condemns only the dial that caused it, names
the cause and the fix, and says whether re-dialling can help (transient) or
not (permanent). Permanent is for what is wrong with the box itself (no name,
no device, its NCCL against the cohort's); a box that does not fit this
launch's plane or cohort (a tunnel, CPU ranks or another vendor under NCCL) is
refused transiently, so a standing fleet's ``--persist`` units stay up for the
next launch.
"""

from __future__ import annotations

import hmac
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import parse_qs

from ..protocol.messages import Hello, Plane

# What the controller logs of a bad_key refusal: a hello under the wrong key (join_protocol's
# WrongKey), and a walk-in that holds none (KeyRefused). Neither ever reaches check().
WRONG_KEY_WORDS = (
    "its hello does not verify under the key of host {host} (a wrong join.token, another host's "
    "key, or one from before the token changed)"
)
NO_KEY_WORDS = "it has no join key and this run requires one (no join.token on that box)"


@dataclass(frozen=True)
class Refusal:
    code: str  # a fixed name for counting: the reason text carries peer-chosen words
    reason: str
    fix: str
    permanent: bool = False


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


_REFERENCES = ("vendor", "nccl", "model_sig", "dataset_sig")


@dataclass(frozen=True)
class Roster:
    """The names a window admits: its configured workers', and room for walk-ins beyond them.

    ``room``: the ranks that hosts outside ``names`` may hold together; ``None``: any number
    (a discovery window, or one without a roster: whoever walks in is the world).
    """

    names: frozenset[str] = frozenset()
    room: int | None = None
    capacity: int | None = None  # the roster's configured ranks (None: a worker offers `all`, uncounted)

    @classmethod
    def of(cls, names: Iterable[str], capacity: int | None, target: int | None, discovery: bool) -> Roster:
        """A roster window leaves walk-ins the ranks its target has beyond the roster's
        capacity ("target_ranks above the configured capacity"), and none when either is
        unknown or the target has nothing beyond it: the roster's ranks are the roster's."""
        names = frozenset(names)
        if discovery or not names:
            return cls(names, None, capacity)
        room = 0 if capacity is None or target is None else max(0, target - capacity)
        return cls(names, room, capacity)


class Cohort:
    """The hellos admitted so far, in admission order.

    Keeps, for each compared attribute, the first member that set it, and the
    ranks held by hosts outside the roster, so a check costs O(1) however many
    boxes walked in; only the departure of a reference member costs a scan.
    """

    def __init__(self, roster: Roster | None = None) -> None:
        self.roster = roster or Roster()
        self.outside = 0  # ranks held by members outside the roster
        self._by_host: dict[str, Hello] = {}
        self._refs: dict[str, Hello | None] = dict.fromkeys(_REFERENCES)

    @classmethod
    def of(cls, hellos: Iterable[Hello], roster: Roster | None = None) -> Cohort:
        cohort = cls(roster)
        for hello in hellos:
            cohort.add(hello)
        return cohort

    def __contains__(self, host: object) -> bool:
        return host in self._by_host

    def __len__(self) -> int:
        return len(self._by_host)

    @property
    def first(self) -> Hello | None:
        return next(iter(self._by_host.values()), None)

    @property
    def run_id(self) -> str:
        """The published run the cohort holds: its first member's (admission holds the rest to it)."""
        first = self.first
        return first.run_id if first is not None else ""

    def reference(self, attr: str) -> Hello | None:
        """The first member, in admission order, with a non-empty ``attr``."""
        return self._refs[attr]

    def add(self, hello: Hello) -> None:
        self._by_host[hello.host] = hello
        if hello.host not in self.roster.names:
            self.outside += len(hello.devices)
        for attr in _REFERENCES:
            if self._refs[attr] is None and getattr(hello, attr):
                self._refs[attr] = hello

    def remove(self, host: str) -> None:
        gone = self._by_host.pop(host, None)
        if gone is not None and host not in self.roster.names:
            self.outside -= len(gone.devices)
        for attr in _REFERENCES:
            if gone is not None and self._refs[attr] is gone:
                self._refs[attr] = next((h for h in self._by_host.values() if getattr(h, attr)), None)


_SIGNATURES = (
    (
        "model_sig",
        "model_mismatch",
        "model mismatch: the model this box builds differs from the cohort's",
        "this box runs different model code: a stale source tree, a wrong --bin, or different "
        "arguments; fix it and --persist re-dials",
    ),
    (
        "dataset_sig",
        "dataset_mismatch",
        "dataset mismatch: this box's data root differs from the cohort's",
        "sync the data root (or mount the shared one read-only with join.data_source)",
    ),
)


TUNNEL_FIX = (
    "run the job in a CPU mode (fdl launch --plane cpu: gloo or a cpu_* ElChe mode averages "
    "through the controller, which a tunnel carries), or let this box reach the others directly "
    "(no --ssh / join.ssh, no tunnel: true); --persist walks into the next CPU-plane launch"
)


def check(cohort: Cohort, hello: Hello, plane: Plane, tunnel_only: bool = False) -> Refusal | None:
    """``None`` when ``hello`` may join ``cohort``; otherwise why not: the first of ``RULES``
    that refuses it. ``tunnel_only``: the window admits through the join door alone (every
    walk-in is tunnelled)."""
    dial = Dial(cohort, hello, plane, tunnel_only)
    for rule in RULES:
        if (refusal := rule(dial)) is not None:
            return refusal
    return None


@dataclass(frozen=True)
class Dial:
    """What a rule judges: the hello, the cohort so far and the window's plane."""

    cohort: Cohort
    hello: Hello
    plane: Plane
    tunnel_only: bool = False


def _not_resuming(dial: Dial) -> Refusal | None:
    """A resume hello reaches a controller that opened a new window: the launch it claims is
    gone (its controller did not come back with it), so its ranks have no world to rejoin."""
    claim = dial.hello.resume
    if claim is None:
        return None
    return Refusal(
        "no_resume",
        f"it resumes launch {claim.launch}, and this controller opened a new window: it resumes no launch",
        "its ranks stop; walk in to this window as a new host (--persist re-dials)",
    )


def _named(dial: Dial) -> Refusal | None:
    if dial.hello.host.strip():
        return None
    return Refusal(
        "no_host", "the hello names no host", "give the box a name with --host NAME", permanent=True
    )


def _offers_devices(dial: Dial) -> Refusal | None:
    if dial.hello.devices:
        return None
    return Refusal(
        "no_device",
        "the box offers no device",
        "check that its GPUs are visible (fdl probe), or offer CPU ranks with --devices cpu:N",
        permanent=True,
    )


def _each_device_once(dial: Dial) -> Refusal | None:
    seen: set[str] = set()
    for device in dial.hello.devices:
        if device in seen:
            return Refusal(
                "duplicate_device",
                f"device {device} is offered twice",
                "list each device once in --devices",
                True,
            )
        seen.add(device)
    return None


def _in_roster_or_room(dial: Dial) -> Refusal | None:
    return _outside_roster(dial.cohort, dial.hello)


def _not_joined(dial: Dial) -> Refusal | None:
    if dial.hello.host not in dial.cohort:
        return None
    return Refusal(
        "host_joined",
        f"host {dial.hello.host} already joined this run",
        "a stale worker from a previous launch still holds the name, or two boxes share a "
        "hostname; --host renames a walk-in",
    )


def _no_tunnel_under_nccl(dial: Dial) -> Refusal | None:
    if dial.plane != "nccl" or not (dial.hello.tunnel or dial.tunnel_only):
        return None
    # Admitted, it would hang at NCCL's first collective: a forward is hub and spoke.
    how = (
        "this box dials through an ssh tunnel"
        if dial.hello.tunnel
        else "this window admits through the ssh door alone (tunnel_only)"
    )
    return Refusal(
        "tunnel_under_nccl",
        f"{how}, and a tunnel carries only the CPU plane: an NCCL data plane needs a mesh "
        "between the hosts, which a port forward cannot carry",
        TUNNEL_FIX,
    )


def _no_cpu_under_nccl(dial: Dial) -> Refusal | None:
    if dial.plane != "nccl" or dial.hello.vendor != "cpu":
        return None
    return Refusal(
        "cpu_under_nccl",
        "CPU devices cannot join an NCCL data plane",
        "offer GPUs, or run the job in a CPU mode (gloo or a cpu_* ElChe mode); "
        "--persist walks into the next launch that takes CPU ranks",
    )


def _one_vendor_under_nccl(dial: Dial) -> Refusal | None:
    hello, ref = dial.hello, dial.cohort.reference("vendor")
    if dial.plane != "nccl" or ref is None or ref.vendor == hello.vendor:
        return None
    return Refusal(
        "vendor_mismatch",
        f"GPU vendor mismatch: this box is {hello.vendor} ({hello.variant}), the cohort is "
        f"{ref.vendor} ({ref.variant}, first joined by {ref.host})",
        "a CUDA box and a ROCm box cannot share an NCCL/RCCL data plane; use a CPU ElChe mode "
        "(which mixes vendors legally) or a one-vendor fleet; --persist walks into the next "
        "launch that fits",
    )


def _one_nccl_under_nccl(dial: Dial) -> Refusal | None:
    hello, ref = dial.hello, dial.cohort.reference("nccl")
    if dial.plane != "nccl" or ref is None or not hello.nccl:
        return None
    if _major_minor(ref.nccl) == _major_minor(hello.nccl):
        return None
    return Refusal(
        "nccl_skew",
        f"NCCL version skew: this box loads NCCL {hello.nccl}, the cohort {ref.nccl} (from {ref.host})",
        f"pin the cohort's NCCL on this box (fdl nccl pin {ref.nccl}), or align the torch "
        "variants so every box loads the same NCCL major.minor",
        permanent=True,
    )


def _same_run(dial: Dial) -> Refusal | None:
    hello, first = dial.hello, dial.cohort.first
    if first is None or first.run_id == hello.run_id:
        return None
    return Refusal(
        "run_mismatch",
        f"run identity mismatch: this box holds run {hello.run_id or '(none)'}, the cohort "
        f"{first.run_id or '(none)'}",
        "a publish landed between two boxes' fetches; nothing to fix: the stale side picks the "
        "new run up on its next dial",
    )


def _same_signatures(dial: Dial) -> Refusal | None:
    hello = dial.hello
    for attr, code, what, fix in _SIGNATURES:
        ref = dial.cohort.reference(attr)
        # A box without a signature is not compared here: the formation check is its backstop.
        if ref is not None and getattr(hello, attr) and getattr(ref, attr) != getattr(hello, attr):
            return Refusal(code, f"{what} (first signed by {ref.host})", fix)
    return None


# In this order: what is wrong with the box itself first, then its fit to the roster, the
# plane and the cohort. The first refusal is the one the box hears.
RULES: tuple[Callable[[Dial], Refusal | None], ...] = (
    _not_resuming,
    _named,
    _offers_devices,
    _each_device_once,
    _in_roster_or_room,
    _not_joined,
    _no_tunnel_under_nccl,
    _no_cpu_under_nccl,
    _one_vendor_under_nccl,
    _one_nccl_under_nccl,
    _same_run,
    _same_signatures,
)


def _outside_roster(cohort: Cohort, hello: Hello) -> Refusal | None:
    """A name outside the roster takes the room beyond it, or is refused."""
    roster, host, count = cohort.roster, hello.host, len(hello.devices)
    if roster.room is None or host in roster.names:
        return None
    if roster.room == 0:
        held = "an unknown number of" if roster.capacity is None else f"all {roster.capacity}"
        return Refusal(
            "not_in_roster",
            f"host {host} is not in this run's roster (cluster.workers), and the window's ranks are "
            f"{held} the roster's: it leaves no room for walk-ins",
            "dial as this box's cluster.workers name (--host, join.host), add it to cluster.workers, "
            "or make room for walk-ins: cluster.controller.join.target_ranks above the roster's "
            "ranks, or discovery: true",
            permanent=True,
        )
    if count > roster.room:
        return Refusal(
            "walk_in_room",
            f"host {host} is not in this run's roster and offers {count} ranks; the window's room "
            f"beyond its roster is {roster.room}",
            "offer fewer devices (--devices), or raise cluster.controller.join.target_ranks",
            permanent=True,
        )
    if cohort.outside + count > roster.room:
        return Refusal(
            "walk_in_room",
            f"host {host} is not in this run's roster, and walk-ins already hold {cohort.outside} of "
            f"the {roster.room} ranks the window leaves beyond it",
            "wait: a walk-in that leaves frees its ranks (--persist re-dials); or raise "
            "cluster.controller.join.target_ranks",
        )
    return None


def window_closed(phase: str) -> Refusal:
    """The refusal of every hello once the window has formed or ended."""
    return Refusal(
        "window_closed", f"the window is closed (phase {phase})", "wait for the next run; --persist re-dials"
    )


@dataclass(frozen=True)
class StartRefused:
    error: str
    penalize: bool  # a wrong token is a bad dial: the dial guard's budget pays for it


def start_refusal(from_loopback: bool, body: bytes, token: str | None) -> StartRefused | None:
    """Who may fire a manual or hybrid window (POST /start): anyone on the controller's box
    or through the ssh tunnel; from elsewhere, only with the run's join.token. None: allowed."""
    if from_loopback:
        return None
    if token is None:
        return StartRefused(
            "this run has no join.token: fire the start on the controller host or through the ssh tunnel",
            penalize=False,
        )
    offered = parse_qs(body.decode("utf-8", "replace")).get("token", [""])[0]
    if not hmac.compare_digest(offered.lower().encode(), token.encode()):
        return StartRefused("bad token: pass the run's join.token (FDL_TOKEN or --token -)", penalize=True)
    return None


@dataclass
class DialGuard:
    """Per-peer rate limit for bad dials, so a flood cannot starve or fail a run.

    Each peer may spend ``burst`` bad dials, refilled at ``rate`` per second;
    a peer out of budget is cut off at the preamble. Good dials cost nothing.
    """

    burst: float = 20.0
    rate: float = 2.0
    max_peers: int = 10_000
    _budget: dict[str, tuple[float, float]] = field(default_factory=dict)

    def _level(self, peer: str, now: float) -> float:
        level, at = self._budget.get(peer, (self.burst, now))
        return min(self.burst, level + (now - at) * self.rate)

    def allow(self, peer: str, now: float) -> bool:
        return self._level(peer, now) >= 1.0

    def penalize(self, peer: str, now: float) -> None:
        level = self._level(peer, now) - 1.0
        self._budget.pop(peer, None)
        self._budget[peer] = (level, now)  # most recent last: the dict is the LRU order
        while len(self._budget) > self.max_peers:
            del self._budget[next(iter(self._budget))]  # forget the peer penalized longest ago


@dataclass
class Gate:
    """Which connections the controller serves at all, before any frame (pure).

    Bad dials spend the peer's ``DialGuard`` budget; one peer may hold at most
    ``per_peer`` unadmitted connections at once (so a flood cannot hold every
    handshake slot or file descriptor); admitted ones do not count. A peer is an
    address, or on loopback the local account that opened the connection (the
    listener asks the kernel: ``tunnel_budget``), since under tunnels every walk-in
    arrives from 127.0.0.1: a stolen door key's flood spends the door account's
    budget, not the controller's descriptors. The controller's own user is exempt
    from both (``counted`` False). ``dropped`` counts every connection turned away or
    cut, by cause.
    """

    per_peer: int = 256
    guard: DialGuard = field(default_factory=DialGuard)
    dropped: Counter[str] = field(default_factory=Counter)
    _unsettled: Counter[str] = field(default_factory=Counter)

    def open(self, peer: str, counted: bool, now: float) -> bool:
        """A new connection from ``peer``; False (and counted) when it is turned away.
        ``counted``: False for the controller's own user on loopback (exempt)."""
        if not counted:
            return True
        if not self.guard.allow(peer, now):
            self.dropped["rate_limited"] += 1
            return False
        if self._unsettled[peer] >= self.per_peer:
            self.dropped["busy_peer"] += 1
            return False
        self._unsettled[peer] += 1
        return True

    def settle(self, peer: str) -> None:
        """One of ``peer``'s opened connections is admitted or gone."""
        self._unsettled[peer] -= 1
        if self._unsettled[peer] <= 0:
            del self._unsettled[peer]

    def bad(self, peer: str, cause: str, counted: bool, now: float) -> None:
        """A dial went wrong (junk, a bad tag, silence): count it, and charge the peer."""
        self.dropped[cause] += 1
        if counted:
            self.guard.penalize(peer, now)

    def unsettled(self, peer: str) -> int:
        return self._unsettled[peer]

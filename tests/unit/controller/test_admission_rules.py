"""Every refusal a dial can hear, word for word: the golden table of admission's messages.

Each row is one rule of ``RULES`` tripped on its own: the refusal's code (what the
controller counts), its reason and fix (what the operator reads) and whether re-dialling
can help. The refusals of a closed window and of ``POST /start`` follow.
"""

from __future__ import annotations

import pytest

from flodl_agent.controller.admission import (
    TUNNEL_FIX,
    Cohort,
    Refusal,
    Roster,
    StartRefused,
    check,
    start_refusal,
    window_closed,
)
from flodl_agent.protocol.messages import Hello, Plane, ResumeClaim

NONCE = b"n" * 16
CUDA = {"variant": "cu128", "nccl": "2.27.3"}
TWO = ["cuda:0", "cuda:1"]

RosterArgs = tuple[list[str], int | None, int | None, bool]
FULL: RosterArgs = (["w1", "w2"], 2, 2, False)  # the roster's ranks are all the roster's
UNCOUNTED: RosterArgs = (["w1"], None, 4, False)  # a worker offers `all`: no room can be promised
ROOMY: RosterArgs = (["w1"], 1, 3, False)  # two ranks beyond the roster


def hello(host: str = "box", devices: list[str] | None = None, **fields: str | bool) -> Hello:
    return Hello(
        nonce=NONCE,
        client_nonce=NONCE,
        host=host,
        devices=["cuda:0"] if devices is None else devices,
        **fields,
    )


NOT_IN_ROSTER_FIX = (
    "dial as this box's cluster.workers name (--host, join.host), add it to cluster.workers, or make "
    "room for walk-ins: cluster.controller.join.target_ranks above the roster's ranks, or discovery: true"
)
TUNNEL_WORDS = (
    ", and a tunnel carries only the CPU plane: an NCCL data plane needs a mesh between the hosts, "
    "which a port forward cannot carry"
)
RUN_FIX = (
    "a publish landed between two boxes' fetches; nothing to fix: the stale side picks the new run up "
    "on its next dial"
)

# id -> (roster, members, candidate, plane, tunnel_only, the refusal it hears)
GOLDEN: dict[str, tuple[RosterArgs | None, list[Hello], Hello, Plane, bool, Refusal]] = {
    "no_resume": (  # before any other rule: it claims a world this window never formed
        None,
        [],
        Hello(
            nonce=NONCE,
            client_nonce=NONCE,
            host="",
            devices=[],
            resume=ResumeClaim(launch="0a1b2c3d", first=2, count=1),
        ),
        "cpu",
        False,
        Refusal(
            "no_resume",
            "it resumes launch 0a1b2c3d, and this controller opened a new window: it resumes no launch",
            "its ranks stop; walk in to this window as a new host (--persist re-dials)",
        ),
    ),
    "no_host": (
        None,
        [],
        hello(host=""),
        "cpu",
        False,
        Refusal("no_host", "the hello names no host", "give the box a name with --host NAME", True),
    ),
    "no_device": (
        None,
        [],
        hello(devices=[]),
        "cpu",
        False,
        Refusal(
            "no_device",
            "the box offers no device",
            "check that its GPUs are visible (fdl probe), or offer CPU ranks with --devices cpu:N",
            True,
        ),
    ),
    "duplicate_device": (
        None,
        [],
        hello(devices=["cuda:0", "cuda:1", "cuda:1"]),
        "cpu",
        False,
        Refusal(
            "duplicate_device", "device cuda:1 is offered twice", "list each device once in --devices", True
        ),
    ),
    "not_in_roster, counted": (
        FULL,
        [],
        hello("stranger"),
        "cpu",
        False,
        Refusal(
            "not_in_roster",
            "host stranger is not in this run's roster (cluster.workers), and the window's ranks are "
            "all 2 the roster's: it leaves no room for walk-ins",
            NOT_IN_ROSTER_FIX,
            True,
        ),
    ),
    "not_in_roster, uncounted": (
        UNCOUNTED,
        [],
        hello("stranger"),
        "cpu",
        False,
        Refusal(
            "not_in_roster",
            "host stranger is not in this run's roster (cluster.workers), and the window's ranks are "
            "an unknown number of the roster's: it leaves no room for walk-ins",
            NOT_IN_ROSTER_FIX,
            True,
        ),
    ),
    "walk_in_room, too big": (
        ROOMY,
        [],
        hello("x", devices=["cuda:0", "cuda:1", "cuda:2"]),
        "cpu",
        False,
        Refusal(
            "walk_in_room",
            "host x is not in this run's roster and offers 3 ranks; the window's room beyond its roster is 2",
            "offer fewer devices (--devices), or raise cluster.controller.join.target_ranks",
            True,
        ),
    ),
    "walk_in_room, taken": (
        ROOMY,
        [hello("x", devices=TWO)],
        hello("y"),
        "cpu",
        False,
        Refusal(
            "walk_in_room",
            "host y is not in this run's roster, and walk-ins already hold 2 of the 2 ranks the window "
            "leaves beyond it",
            "wait: a walk-in that leaves frees its ranks (--persist re-dials); or raise "
            "cluster.controller.join.target_ranks",
            False,
        ),
    ),
    "host_joined": (
        None,
        [hello("a")],
        hello("a"),
        "cpu",
        False,
        Refusal(
            "host_joined",
            "host a already joined this run",
            "a stale worker from a previous launch still holds the name, or two boxes share a hostname; "
            "--host renames a walk-in",
            False,
        ),
    ),
    "tunnel_under_nccl, tunnelled": (
        None,
        [],
        hello(tunnel=True, **CUDA),
        "nccl",
        False,
        Refusal(
            "tunnel_under_nccl", "this box dials through an ssh tunnel" + TUNNEL_WORDS, TUNNEL_FIX, False
        ),
    ),
    "tunnel_under_nccl, tunnel_only": (
        None,
        [],
        hello(**CUDA),
        "nccl",
        True,
        Refusal(
            "tunnel_under_nccl",
            "this window admits through the ssh door alone (tunnel_only)" + TUNNEL_WORDS,
            TUNNEL_FIX,
            False,
        ),
    ),
    "cpu_under_nccl": (
        None,
        [],
        hello(devices=["cpu:0"]),
        "nccl",
        False,
        Refusal(
            "cpu_under_nccl",
            "CPU devices cannot join an NCCL data plane",
            "offer GPUs, or run the job in a CPU mode (gloo or a cpu_* ElChe mode); --persist walks into "
            "the next launch that takes CPU ranks",
            False,
        ),
    ),
    "vendor_mismatch": (
        None,
        [hello("a", **CUDA)],
        hello("b", variant="rocm6.4"),
        "nccl",
        False,
        Refusal(
            "vendor_mismatch",
            "GPU vendor mismatch: this box is rocm (rocm6.4), the cohort is cuda (cu128, first joined by a)",
            "a CUDA box and a ROCm box cannot share an NCCL/RCCL data plane; use a CPU ElChe mode (which "
            "mixes vendors legally) or a one-vendor fleet; --persist walks into the next launch that fits",
            False,
        ),
    ),
    "nccl_skew": (
        None,
        [hello("a", **CUDA)],
        hello("b", variant="cu126", nccl="2.26.1"),
        "nccl",
        False,
        Refusal(
            "nccl_skew",
            "NCCL version skew: this box loads NCCL 2.26.1, the cohort 2.27.3 (from a)",
            "pin the cohort's NCCL on this box (fdl nccl pin 2.27.3), or align the torch variants so every "
            "box loads the same NCCL major.minor",
            True,
        ),
    ),
    "run_mismatch": (
        None,
        [hello("a", run_id="a" * 32)],
        hello("b", run_id="b" * 32),
        "cpu",
        False,
        Refusal(
            "run_mismatch",
            f"run identity mismatch: this box holds run {'b' * 32}, the cohort {'a' * 32}",
            RUN_FIX,
            False,
        ),
    ),
    "run_mismatch, this box holds none": (
        None,
        [hello("a", run_id="a" * 32)],
        hello("b"),
        "cpu",
        False,
        Refusal(
            "run_mismatch",
            f"run identity mismatch: this box holds run (none), the cohort {'a' * 32}",
            RUN_FIX,
        ),
    ),
    "run_mismatch, the cohort holds none": (
        None,
        [hello("a")],
        hello("b", run_id="b" * 32),
        "cpu",
        False,
        Refusal(
            "run_mismatch",
            f"run identity mismatch: this box holds run {'b' * 32}, the cohort (none)",
            RUN_FIX,
        ),
    ),
    "model_mismatch": (
        None,
        [hello("a", model_sig="aa")],
        hello("b", model_sig="bb"),
        "cpu",
        False,
        Refusal(
            "model_mismatch",
            "model mismatch: the model this box builds differs from the cohort's (first signed by a)",
            "this box runs different model code: a stale source tree, a wrong --bin, or different "
            "arguments; fix it and --persist re-dials",
        ),
    ),
    "dataset_mismatch": (
        None,
        [hello("a", dataset_sig="aa")],
        hello("b", dataset_sig="bb"),
        "cpu",
        False,
        Refusal(
            "dataset_mismatch",
            "dataset mismatch: this box's data root differs from the cohort's (first signed by a)",
            "sync the data root (or mount the shared one read-only with join.data_source)",
        ),
    ),
}


@pytest.mark.parametrize(
    ("roster", "members", "candidate", "plane", "tunnel_only", "refusal"),
    list(GOLDEN.values()),
    ids=list(GOLDEN),
)
def test_each_rule_refuses_with_its_own_code_words_and_permanence(
    roster: RosterArgs | None,
    members: list[Hello],
    candidate: Hello,
    plane: Plane,
    tunnel_only: bool,
    refusal: Refusal,
) -> None:
    """A refusal is counted by its code and read by its reason and fix, exactly as written."""
    cohort = Cohort.of(members, Roster.of(*roster) if roster is not None else None)
    assert check(cohort, candidate, plane, tunnel_only) == refusal


def test_the_golden_table_covers_every_refusal_code() -> None:
    """The controller counts refusals by these codes, one per way a dial can be turned away."""
    assert {row[-1].code for row in GOLDEN.values()} == {
        "no_resume",
        "no_host",
        "no_device",
        "duplicate_device",
        "not_in_roster",
        "walk_in_room",
        "host_joined",
        "tunnel_under_nccl",
        "cpu_under_nccl",
        "vendor_mismatch",
        "nccl_skew",
        "run_mismatch",
        "model_mismatch",
        "dataset_mismatch",
    }


@pytest.mark.parametrize("phase", ["forming", "training", "done", "failed"])
def test_a_closed_window_refuses_every_hello_transiently(phase: str) -> None:
    """After formation a hello hears the phase and that the next run is its chance."""
    assert window_closed(phase) == Refusal(
        "window_closed",
        f"the window is closed (phase {phase})",
        "wait for the next run; --persist re-dials",
        False,
    )


NO_TOKEN = StartRefused(
    "this run has no join.token: fire the start on the controller host or through the ssh tunnel",
    penalize=False,
)
BAD_TOKEN = StartRefused("bad token: pass the run's join.token (FDL_TOKEN or --token -)", penalize=True)


@pytest.mark.parametrize(
    ("loopback", "body", "token", "refused"),
    [
        (True, b"", None, None),  # the controller's box (or the tunnel) needs no token
        (True, b"token=wrong", "c0ffee", None),
        (False, b"token=c0ffee", None, NO_TOKEN),  # nothing to prove from elsewhere: not the peer's fault
        (False, b"", None, NO_TOKEN),
        (False, b"token=c0ffee", "c0ffee", None),
        (False, b"token=C0FFEE", "c0ffee", None),  # hex is read case-blind
        (False, b"run=7&token=c0%66fee", "c0ffee", None),  # a form-encoded body
        (False, b"token=c0ffee&token=other", "c0ffee", None),  # the first token field counts
        (False, b"token=wrong", "c0ffee", BAD_TOKEN),  # a wrong token is a bad dial: it is charged
        (False, b"token=c0ffe", "c0ffee", BAD_TOKEN),
        (False, b"", "c0ffee", BAD_TOKEN),
        (False, b"other=c0ffee", "c0ffee", BAD_TOKEN),
        (False, b"token=c0ff\xff", "c0ffee", BAD_TOKEN),  # undecodable bytes are refused, not raised
    ],
)
def test_who_may_fire_the_start(
    loopback: bool, body: bytes, token: str | None, refused: StartRefused | None
) -> None:
    """Loopback may always start; elsewhere only the run's join.token, and a wrong one is penalized."""
    assert start_refusal(loopback, body, token) == refused

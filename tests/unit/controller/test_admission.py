"""Admission refusals by name, each condemning only the dial that caused it."""

from __future__ import annotations

import pytest

from flodl_agent.controller.admission import Cohort, DialGuard, Gate, Roster, check
from flodl_agent.protocol.messages import Hello, Plane

NONCE = b"n" * 16


def hello(host: str = "box", devices: list[str] | None = None, **fields: str | bool) -> Hello:
    return Hello(
        nonce=NONCE,
        client_nonce=NONCE,
        host=host,
        devices=["cuda:0"] if devices is None else devices,
        **fields,
    )


CUDA = {"variant": "cu128", "nccl": "2.27.3"}


@pytest.mark.parametrize(
    ("members", "candidate", "plane", "reason", "permanent"),
    [
        ([], hello(host=""), "cpu", "names no host", True),
        ([], hello(devices=[]), "cpu", "offers no device", True),
        ([], hello(devices=["cuda:0", "cuda:0"]), "cpu", "device cuda:0 is offered twice", True),
        ([hello("a")], hello("a"), "cpu", "host a already joined this run", False),
        ([hello("a", **CUDA)], hello("b", variant="rocm6.4"), "nccl", "GPU vendor mismatch", False),
        ([], hello("b", devices=["cpu:0"], variant="cpu"), "nccl", "CPU devices cannot join an NCCL", False),
        ([hello("a", **CUDA)], hello("b", variant="cu126", nccl="2.26.1"), "nccl", "NCCL version skew", True),
        ([hello("a", run_id="a" * 32)], hello("b", run_id="b" * 32), "cpu", "run identity mismatch", False),
        ([hello("a", model_sig="aa")], hello("b", model_sig="bb"), "cpu", "model mismatch", False),
        ([hello("a", dataset_sig="aa")], hello("b", dataset_sig="bb"), "cpu", "dataset mismatch", False),
    ],
)
def test_refusals(members: list[Hello], candidate: Hello, plane: Plane, reason: str, permanent: bool) -> None:
    refusal = check(Cohort.of(members), candidate, plane)
    assert refusal is not None and reason in refusal.reason and refusal.fix
    assert refusal.permanent is permanent


@pytest.mark.parametrize(
    ("members", "candidate", "plane"),
    [
        ([], hello(**CUDA), "nccl"),
        # CPU modes are vendor-blind: a CUDA box, a ROCm box and a CPU box may share a run
        ([hello("a", **CUDA), hello("b", variant="rocm6.4")], hello("c", devices=["cpu:0"]), "cpu"),
        ([hello("a", **CUDA)], hello("b", variant="cu126", nccl="2.27.5"), "nccl"),  # same major.minor
        # a box without a signature is not compared (the formation check is the backstop)
        ([hello("a", model_sig="aa", dataset_sig="bb")], hello("b"), "cpu"),
        ([hello("a"), hello("b", model_sig="cc")], hello("c", model_sig="cc"), "cpu"),
    ],
)
def test_admitted(members: list[Hello], candidate: Hello, plane: Plane) -> None:
    assert check(Cohort.of(members), candidate, plane) is None


# The tunnel carries the CPU plane only: (hello, plane, tunnel_only) -> refused?
@pytest.mark.parametrize(
    ("candidate", "plane", "tunnel_only", "refused"),
    [
        (hello(tunnel=True, **CUDA), "nccl", False, "this box dials through an ssh tunnel"),
        (hello(**CUDA), "nccl", True, "this window admits through the ssh door alone (tunnel_only)"),
        (hello(tunnel=True, **CUDA), "nccl", True, "this box dials through an ssh tunnel"),
        # a tunnelled CPU box hears of the tunnel first: the CPU mode its fix names covers both
        (hello(tunnel=True, devices=["cpu:0"]), "nccl", False, "this box dials through an ssh tunnel"),
        (hello(tunnel=True, **CUDA), "cpu", False, None),
        (hello(tunnel=True, devices=["cpu:0"]), "cpu", True, None),
        (hello(**CUDA), "nccl", False, None),
    ],
)
def test_an_nccl_plane_refuses_every_tunnelled_box(
    candidate: Hello, plane: Plane, tunnel_only: bool, refused: str | None
) -> None:
    refusal = check(Cohort(), candidate, plane, tunnel_only)
    if refused is None:
        assert refusal is None
        return
    assert refusal is not None and refusal.code == "tunnel_under_nccl" and not refusal.permanent
    assert refused in refusal.reason and "a port forward cannot carry" in refusal.reason
    assert "CPU mode" in refusal.fix and "--plane cpu" in refusal.fix


def test_the_reference_leaves_with_its_member() -> None:
    # the cohort's model signature is read off the members present now
    cohort = Cohort.of([hello("a", model_sig="aa"), hello("b", model_sig="bb")])
    assert check(cohort, hello("c", model_sig="bb"), "cpu") is not None  # a's signature rules
    cohort.remove("a")
    assert check(cohort, hello("c", model_sig="bb"), "cpu") is None  # now b's does
    cohort.remove("b")
    assert check(cohort, hello("c", model_sig="cc"), "cpu") is None
    assert "b" not in cohort and len(cohort) == 0


@pytest.mark.parametrize(
    ("names", "capacity", "target", "discovery", "room"),
    [
        (["w1", "w2"], 2, 2, False, 0),  # the fan-out default: the roster's ranks are the roster's
        (["w1", "w2"], 2, 4, False, 2),  # target_ranks above the capacity: room for walk-ins
        (["w1"], 2, 1, False, 0),  # a target below the capacity leaves nothing beyond it
        (["w1"], None, 4, False, 0),  # a worker offers `all`, uncounted: no room can be promised
        (["w1"], 2, None, False, 0),  # no target (a manual window): nothing beyond the roster
        (["w1"], 2, 2, True, None),  # discovery: whoever walks in
        ([], None, 3, False, None),  # no roster at all: the walk-ins are the world
    ],
)
def test_the_room_a_window_leaves_beyond_its_roster(
    names: list[str], capacity: int | None, target: int | None, discovery: bool, room: int | None
) -> None:
    assert Roster.of(names, capacity, target, discovery).room == room


FULL = Roster.of(["w1", "w2"], 2, 2, False)
ROOMY = Roster.of(["w1"], 1, 3, False)  # two ranks beyond the roster
TWO = ["cuda:0", "cuda:1"]


@pytest.mark.parametrize(
    ("roster", "members", "candidate", "refused"),
    [
        (FULL, [], hello("w2"), None),
        (FULL, [hello("w1")], hello("w2"), None),
        (FULL, [], hello("stranger"), ("not_in_roster", True)),
        (Roster.of(["w1"], None, 4, False), [], hello("stranger"), ("not_in_roster", True)),
        (ROOMY, [], hello("x", devices=TWO), None),
        (ROOMY, [hello("w1")], hello("x", devices=TWO), None),  # roster members take no room
        (ROOMY, [], hello("x", devices=["cuda:0", "cuda:1", "cuda:2"]), ("walk_in_room", True)),
        (ROOMY, [hello("x", devices=TWO)], hello("y"), ("walk_in_room", False)),  # taken, for now
        (ROOMY, [hello("x")], hello("y"), None),
        (Roster.of(["w1"], 1, 1, True), [], hello("stranger"), None),  # discovery
        (Roster(), [], hello("stranger"), None),  # no roster
    ],
)
def test_a_roster_window_admits_its_roster_and_walk_ins_only_into_the_room_beyond_it(
    roster: Roster, members: list[Hello], candidate: Hello, refused: tuple[str, bool] | None
) -> None:
    refusal = check(Cohort.of(members, roster), candidate, "cpu")
    assert (refusal and (refusal.code, refusal.permanent)) == refused
    if refusal is not None:
        assert candidate.host in refusal.reason and "target_ranks" in refusal.fix


def test_a_walk_in_that_leaves_frees_the_room_it_held() -> None:
    cohort = Cohort.of([hello("w1"), hello("x", devices=TWO)], ROOMY)
    assert cohort.outside == 2 and check(cohort, hello("y"), "cpu") is not None
    cohort.remove("w1")
    assert cohort.outside == 2  # a roster member held none of it
    cohort.remove("x")
    assert cohort.outside == 0 and check(cohort, hello("y"), "cpu") is None


def test_dial_guard_budget_refills() -> None:
    guard = DialGuard(burst=3, rate=1.0)
    for _ in range(3):
        assert guard.allow("10.0.0.9", 0.0)
        guard.penalize("10.0.0.9", 0.0)
    assert not guard.allow("10.0.0.9", 0.0)
    assert guard.allow("10.0.0.8", 0.0)  # other peers are unaffected
    assert guard.allow("10.0.0.9", 1.0)  # one second refills one dial


def test_dial_guard_memory_is_bounded() -> None:
    guard = DialGuard(burst=1, rate=1.0, max_peers=100)
    for i in range(1000):
        guard.penalize(f"10.0.{i // 256}.{i % 256}", float(i))
    assert len(guard._budget) == 100 and "10.0.3.231" in guard._budget  # the most recent stay


def test_the_gate_caps_unadmitted_connections_per_peer_and_exempts_loopback() -> None:
    gate = Gate(per_peer=2)
    assert gate.open("10.0.0.1", True, 0.0) and gate.open("10.0.0.1", True, 0.0)
    assert not gate.open("10.0.0.1", True, 0.0)  # a third handshake from the same address
    assert gate.open("10.0.0.2", True, 0.0)  # another address is unaffected
    assert all(gate.open("127.0.0.1", False, 0.0) for _ in range(10))  # loopback: never counted
    assert gate.dropped == {"busy_peer": 1}
    gate.settle("10.0.0.1")
    assert gate.unsettled("10.0.0.1") == 1 and gate.open("10.0.0.1", True, 0.0)


def test_the_gate_turns_away_a_peer_out_of_dial_budget_until_it_refills() -> None:
    gate = Gate(guard=DialGuard(burst=2, rate=1.0))
    for _ in range(2):
        gate.bad("10.0.0.1", "tag", True, 0.0)
    assert not gate.open("10.0.0.1", True, 0.0)
    assert gate.dropped == {"tag": 2, "rate_limited": 1}
    assert gate.open("10.0.0.1", True, 1.0)  # a second later, one dial's worth is back
    gate.bad("127.0.0.1", "magic", False, 1.0)  # loopback is counted, never charged
    assert gate.open("127.0.0.1", False, 1.0) and gate.dropped["magic"] == 1

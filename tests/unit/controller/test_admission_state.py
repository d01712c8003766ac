"""What admission remembers between dials: the roster's room, the cohort's references and
the room its walk-ins hold, and each peer's dial budget and unadmitted connections."""

from __future__ import annotations

import pytest

from flodl_agent.controller.admission import Cohort, DialGuard, Gate, Roster, check
from flodl_agent.protocol.messages import Hello

NONCE = b"n" * 16


def hello(host: str, devices: list[str] | None = None, **fields: str | bool) -> Hello:
    return Hello(
        nonce=NONCE,
        client_nonce=NONCE,
        host=host,
        devices=["cuda:0"] if devices is None else devices,
        **fields,
    )


# -- the roster ------------------------------------------------------------


@pytest.mark.parametrize(
    ("names", "capacity", "target", "discovery", "roster"),
    [
        (["w1", "w2"], 2, 2, False, Roster(frozenset({"w1", "w2"}), 0, 2)),
        (["w1", "w2"], 2, 5, False, Roster(frozenset({"w1", "w2"}), 3, 2)),
        (["w1", "w1"], 2, 3, False, Roster(frozenset({"w1"}), 1, 2)),  # a name is a name once
        (["w1"], 3, 1, False, Roster(frozenset({"w1"}), 0, 3)),  # never a negative room
        (["w1"], None, 4, False, Roster(frozenset({"w1"}), 0, None)),
        (["w1"], 2, None, False, Roster(frozenset({"w1"}), 0, 2)),
        (["w1"], 2, 8, True, Roster(frozenset({"w1"}), None, 2)),  # discovery keeps names and capacity
        ([], 4, 8, False, Roster(frozenset(), None, 4)),
    ],
)
def test_a_roster_keeps_its_names_capacity_and_the_room_beyond_them(
    names: list[str], capacity: int | None, target: int | None, discovery: bool, roster: Roster
) -> None:
    """Room is target minus capacity, floored at 0; discovery or no names: unbounded (None)."""
    assert Roster.of(names, capacity, target, discovery) == roster


def test_a_discovery_roster_still_tells_its_members_from_walk_ins() -> None:
    """Under discovery a walk-in takes no counted room, but the roster's names stay inside it."""
    cohort = Cohort.of([hello("w1"), hello("x", devices=["cuda:0", "cuda:1"])], Roster.of(["w1"], 1, 1, True))
    assert cohort.outside == 2
    cohort.remove("x")
    assert cohort.outside == 0


# -- the cohort ------------------------------------------------------------


def test_walk_ins_admitted_one_after_another_share_the_room() -> None:
    """Each admitted walk-in adds its ranks to the room held; the room's last rank goes, then none."""
    cohort = Cohort(Roster.of(["w1"], 1, 4, False))  # three ranks beyond the roster
    for walk_in in (hello("x"), hello("y", devices=["cuda:0", "cuda:1"])):
        assert check(cohort, walk_in, "cpu") is None
        cohort.add(walk_in)
    assert cohort.outside == 3 and len(cohort) == 2 and "x" in cohort and "y" in cohort
    refusal = check(cohort, hello("z"), "cpu")
    assert (
        refusal is not None and refusal.code == "walk_in_room" and "already hold 3 of the 3" in refusal.reason
    )
    cohort.add(hello("w1", devices=["cuda:0", "cuda:1"]))  # the roster's own take none of it
    assert cohort.outside == 3


def test_removing_a_host_that_never_joined_changes_nothing() -> None:
    """A late close of a link the cohort never admitted is a no-op."""
    cohort = Cohort.of([hello("a", model_sig="aa"), hello("x")], Roster.of(["a"], 1, 2, False))
    cohort.remove("ghost")
    assert len(cohort) == 2 and cohort.outside == 1
    assert cohort.reference("model_sig") is not None and cohort.reference("model_sig").host == "a"


@pytest.mark.parametrize("attr", ["model_sig", "dataset_sig"])
def test_a_signature_reference_passes_to_the_next_member_that_has_one(attr: str) -> None:
    """When the reference member leaves, the next signed member in admission order rules."""
    cohort = Cohort.of([hello("a", **{attr: "aa"}), hello("b"), hello("c", **{attr: "cc"})])
    cohort.remove("a")
    assert cohort.reference(attr) is not None and cohort.reference(attr).host == "c"
    refusal = check(cohort, hello("d", **{attr: "aa"}), "cpu")
    assert refusal is not None and refusal.reason.endswith("(first signed by c)")
    assert check(cohort, hello("d", **{attr: "cc"}), "cpu") is None
    cohort.remove("c")
    assert cohort.reference(attr) is None  # b signs nothing: the next signer sets it


def test_the_vendor_and_nccl_references_follow_the_members_present() -> None:
    """Under NCCL the cohort's vendor and NCCL version are its present members'."""
    cohort = Cohort.of(
        [hello("a", variant="cu128", nccl="2.27.3"), hello("b", variant="cu126", nccl="2.26.1")]
    )
    assert check(cohort, hello("c", variant="cu126", nccl="2.26.2"), "nccl") is not None
    cohort.remove("a")
    nccl, vendor = cohort.reference("nccl"), cohort.reference("vendor")
    assert nccl is not None and vendor is not None and (nccl.host, vendor.host) == ("b", "b")
    assert check(cohort, hello("c", variant="cu126", nccl="2.26.2"), "nccl") is None
    refusal = check(cohort, hello("c", variant="rocm6.4"), "nccl")
    assert refusal is not None and refusal.reason.endswith("(cu126, first joined by b)")


def test_the_first_member_holds_the_run() -> None:
    """The cohort's run is its first member's; an empty cohort holds none."""
    cohort = Cohort()
    assert cohort.first is None and cohort.run_id == ""
    cohort.add(hello("a", run_id="a1" * 16))
    cohort.add(hello("b", run_id="a1" * 16))
    assert cohort.first is not None and cohort.first.host == "a" and cohort.run_id == "a1" * 16
    cohort.remove("a")
    assert cohort.run_id == "a1" * 16 and cohort.first is not None and cohort.first.host == "b"


# -- the dial guard --------------------------------------------------------


def test_a_peer_spends_its_burst_then_waits_for_the_refill_rate() -> None:
    """``burst`` bad dials at once, then one more per ``1/rate`` seconds."""
    guard = DialGuard(burst=3, rate=2.0)
    for _ in range(3):
        assert guard.allow("10.0.0.9", 50.0)
        guard.penalize("10.0.0.9", 50.0)
    assert not guard.allow("10.0.0.9", 50.0)
    assert not guard.allow("10.0.0.9", 50.4)
    assert guard.allow("10.0.0.9", 50.5)  # rate 2/s: half a second refills one dial
    guard.penalize("10.0.0.9", 50.5)
    assert not guard.allow("10.0.0.9", 50.5)


def test_a_rested_peer_gets_its_burst_back_and_no_more() -> None:
    """The budget refills up to ``burst``, however long the peer stayed away."""
    guard = DialGuard(burst=2, rate=1.0)
    guard.penalize("p", 10.0)
    guard.penalize("p", 10.0)
    for _ in range(2):
        assert guard.allow("p", 1000.0)
        guard.penalize("p", 1000.0)
    assert not guard.allow("p", 1000.0)


def test_good_dials_cost_nothing() -> None:
    """Only a penalty spends budget: asking is free."""
    guard = DialGuard(burst=1, rate=0.0)
    assert all(guard.allow("p", 5.0) for _ in range(10))
    guard.penalize("p", 5.0)
    assert not guard.allow("p", 6.0)


def test_a_repeat_offender_is_remembered_longest() -> None:
    """At ``max_peers`` the guard forgets the peer penalized longest ago, not the first one seen."""
    guard = DialGuard(burst=5, rate=0.0, max_peers=2)
    guard.penalize("a", 1.0)
    guard.penalize("b", 2.0)
    guard.penalize("a", 3.0)  # a offends again: it is now the most recent
    guard.penalize("c", 4.0)
    assert list(guard._budget) == ["a", "c"]
    for _ in range(3):
        guard.penalize("a", 5.0)
    assert not guard.allow("a", 5.0)  # a kept its record: five bad dials, five spent
    assert guard.allow("b", 5.0)  # b was forgotten: a fresh burst


# -- the gate --------------------------------------------------------------


def test_the_gate_counts_every_connection_it_turns_away() -> None:
    """Each refused open adds one to its cause, rate-limited or busy."""
    gate = Gate(per_peer=1, guard=DialGuard(burst=1, rate=0.0))
    assert gate.open("10.0.0.1", True, 0.0)
    assert not gate.open("10.0.0.1", True, 0.0)
    assert not gate.open("10.0.0.1", True, 0.0)
    gate.bad("10.0.0.2", "junk", True, 0.0)
    assert not gate.open("10.0.0.2", True, 0.0)
    assert not gate.open("10.0.0.2", True, 0.0)
    assert gate.dropped == {"busy_peer": 2, "junk": 1, "rate_limited": 2}


def test_a_settled_connection_frees_its_slot_and_a_quiet_peer_is_forgotten() -> None:
    """Settling counts down one connection; at zero the peer leaves the gate's memory."""
    gate = Gate(per_peer=3)
    for _ in range(3):
        assert gate.open("10.0.0.1", True, 0.0)
    gate.settle("10.0.0.1")
    assert gate.unsettled("10.0.0.1") == 2
    gate.settle("10.0.0.1")
    gate.settle("10.0.0.1")
    assert gate.unsettled("10.0.0.1") == 0 and "10.0.0.1" not in gate._unsettled


def test_loopback_bad_dials_are_counted_but_never_charged() -> None:
    """Under tunnels every walk-in is 127.0.0.1: one bad tunnel must not lock the others out."""
    gate = Gate(guard=DialGuard(burst=1, rate=0.0))
    for _ in range(3):
        gate.bad("127.0.0.1", "tag", False, 0.0)
    assert gate.dropped == {"tag": 3} and gate.guard.allow("127.0.0.1", 0.0)
    assert gate.open("127.0.0.1", False, 0.0) and gate.unsettled("127.0.0.1") == 0

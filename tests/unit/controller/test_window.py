"""The join window state machine: every diagram edge, every refusal.

Scenarios are scripts of timed events; each step states the verdict and the
phase the window must be in afterwards, so a row reads like a run's log.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from flodl_agent.config import JoinWindow
from flodl_agent.config.ranks import WindowPlan, plan_window
from flodl_agent.controller.window import (
    Decision,
    Fail,
    Form,
    Keep,
    Phase,
    StartMode,
    Window,
    WindowClosed,
    WindowConfig,
)

# -- the script language -------------------------------------------------


@dataclass(frozen=True)
class FormOf:
    """Expect a Form carrying exactly these hosts, in admission order."""

    hosts: tuple[str, ...]


@dataclass(frozen=True)
class FailWith:
    """Expect a Fail whose reason contains this fragment."""

    fragment: str


Expect = Keep | FormOf | FailWith


@dataclass(frozen=True)
class Step:
    kind: str  # join | leave | start | tick | formed | fail
    at: float
    expect: Expect | None = None
    host: str = ""
    ranks: int = 0
    status: int = 0  # start: the reply's status
    text: str = ""  # start: fragment of the reply's reason; fail: the reason


def J(at: float, host: str, ranks: int, expect: Expect) -> Step:
    return Step("join", at, expect, host=host, ranks=ranks)


def L(at: float, host: str, expect: Expect) -> Step:
    return Step("leave", at, expect, host=host)


def S(at: float, status: int, text: str = "") -> Step:
    return Step("start", at, status=status, text=text)


def T(at: float, expect: Expect) -> Step:
    return Step("tick", at, expect)


def FORMED(at: float) -> Step:
    return Step("formed", at)


def X(at: float, reason: str, expect: Expect) -> Step:
    return Step("fail", at, expect, text=reason)


def keep(phase: Phase, deadline: float | None = None) -> Keep:
    return Keep(phase, deadline)


def form(*hosts: str) -> FormOf:
    return FormOf(hosts)


def cfg(
    quorum: int,
    target: int | None,
    start: StartMode = "auto",
    join_timeout: float = 300.0,
    max_join_timeout: float = 600.0,
    discovery: bool = False,
) -> WindowConfig:
    return WindowConfig(quorum, target, join_timeout, max_join_timeout, start, discovery)


def phase_of(expect: Expect) -> Phase:
    if isinstance(expect, Keep):
        return expect.phase
    return "forming" if isinstance(expect, FormOf) else "failed"


def check(decision: Decision, expect: Expect) -> None:
    if isinstance(expect, FormOf):
        assert isinstance(decision, Form), decision
        assert tuple(m.host for m in decision.members) == expect.hosts
    elif isinstance(expect, FailWith):
        assert isinstance(decision, Fail), decision
        assert expect.fragment in decision.reason
    else:
        assert decision == expect


def play(window: Window, steps: list[Step]) -> set[tuple[Phase, Phase]]:
    """Run a script, checking every step; returns the phase edges it crossed."""
    edges: set[tuple[Phase, Phase]] = set()
    for i, step in enumerate(steps):
        before = window.phase
        if step.kind == "start":
            reply = window.request_start(step.at)
            assert (reply.status, reply.accepted) == (step.status, step.status == 202), (i, reply)
            assert step.text in reply.reason, (i, reply)
            assert window.phase == before, i
        elif step.kind == "formed":
            window.formed(step.at)
            assert window.phase == "training", i
        else:
            assert step.expect is not None
            if step.kind == "join":
                decision = window.join(step.host, step.ranks, step.at)
            elif step.kind == "leave":
                decision = window.leave(step.host, step.at)
            elif step.kind == "fail":
                decision = window.fail(step.text, step.at)
            else:
                decision = window.decide(step.at)
            check(decision, step.expect)
            assert window.phase == phase_of(step.expect), (i, window.phase)
        if window.phase != before:
            edges.add((before, window.phase))
    return edges


# -- scenarios: (config, script) ---------------------------------------------

SCENARIOS: dict[str, tuple[WindowConfig, list[Step]]] = {
    # Fan-out defaults: quorum = target = capacity; the last rank in closes it.
    "auto-closes-the-instant-target-is-reached": (
        cfg(4, 4),
        [
            J(0, "a", 2, keep("waiting", 300)),
            J(5, "b", 2, form("a", "b")),
            T(6, keep("forming")),
            T(300, keep("forming")),
        ],
    ),
    "auto-degraded-quorum-forms-at-window-expiry": (
        cfg(2, 4),
        [
            J(0, "a", 1, keep("waiting", 300)),
            J(10, "b", 1, keep("waiting", 300)),  # quorum met, but auto never stages
            T(299.5, keep("waiting", 300)),
            T(300, form("a", "b")),
        ],
    ),
    "auto-below-quorum-waits-past-the-window-then-fails-at-the-cap": (
        cfg(4, 4),
        [
            J(0, "a", 2, keep("waiting", 300)),
            T(300, keep("waiting", 600)),
            T(599.9, keep("waiting", 600)),
            T(
                600,
                FailWith("quorum not met: 2 of 4 ranks joined before the hard cap (max_join_timeout 600s)"),
            ),
            T(601, keep("failed")),
        ],
    ),
    "auto-quorum-reached-after-the-window-forms-at-once": (
        cfg(2, 4),
        [
            J(0, "a", 1, keep("waiting", 300)),
            T(300, keep("waiting", 600)),
            J(450, "b", 1, form("a", "b")),
        ],
    ),
    "auto-target-below-quorum-waits-for-quorum": (
        cfg(3, 2),
        [
            J(0, "a", 2, keep("waiting", 300)),
            J(1, "b", 1, form("a", "b")),
        ],
    ),
    "auto-zero-join-timeout-waits-only-for-quorum": (
        cfg(1, None, join_timeout=0, max_join_timeout=10),
        [
            T(0, keep("waiting", 10)),
            J(1, "a", 1, form("a")),
        ],
    ),
    "discovery-holds-until-join-timeout": (
        cfg(2, None, discovery=True),
        [
            J(0, "a", 1, keep("waiting", 300)),
            J(20, "b", 4, keep("waiting", 300)),  # far past quorum: no roster to close on
            J(200, "c", 8, keep("waiting", 300)),
            T(300, form("a", "b", "c")),
        ],
    ),
    "manual-stages-at-quorum-holds-past-expiry-and-forms-on-start": (
        cfg(2, None, "manual"),
        [
            J(0, "a", 1, keep("waiting", 300)),
            S(5, 409, "quorum not met: 1 of 2 ranks joined"),
            J(10, "b", 1, keep("staging", 300)),
            T(300, keep("staging", 600)),  # expiry holds
            J(350, "c", 2, keep("staging", 600)),  # late walk-in admitted into the hold
            S(400, 202),
            T(400, form("a", "b", "c")),
            S(401, 409, "window already closed (phase forming)"),
        ],
    ),
    "manual-cap-without-start-fails": (
        cfg(2, None, "manual"),
        [
            J(0, "a", 2, keep("staging", 300)),
            T(300, keep("staging", 600)),
            T(600, FailWith("operator start not received before the hard cap (max_join_timeout 600s)")),
            S(601, 409, "window already closed (phase failed)"),
        ],
    ),
    "manual-below-quorum-at-the-cap-fails-on-quorum": (
        cfg(3, None, "manual"),
        [
            J(0, "a", 2, keep("waiting", 300)),
            T(300, keep("waiting", 600)),
            T(600, FailWith("quorum not met: 2 of 3 ranks joined")),
        ],
    ),
    "manual-ignores-a-target": (
        cfg(2, 2, "manual"),
        [
            J(0, "a", 2, keep("staging", 300)),
            J(1, "b", 2, keep("staging", 300)),
        ],
    ),
    "manual-start-racing-the-cap-timer-still-forms": (
        cfg(2, None, "manual"),
        [
            J(0, "a", 2, keep("staging", 300)),
            T(300, keep("staging", 600)),
            S(600.5, 202),
            T(600.5, form("a")),
        ],
    ),
    "hybrid-stages-then-start-forms": (
        cfg(2, 4, "hybrid"),
        [
            J(0, "a", 1, keep("waiting", 300)),
            J(1, "b", 1, keep("staging", 300)),
            S(50, 202, "2 ranks"),
            T(50, form("a", "b")),
        ],
    ),
    "hybrid-stages-then-target-forms": (
        cfg(2, 4, "hybrid"),
        [
            J(0, "a", 2, keep("staging", 300)),
            J(60, "b", 1, keep("staging", 300)),
            J(61, "c", 1, form("a", "b", "c")),
        ],
    ),
    "hybrid-stages-then-expiry-forms": (
        cfg(2, 4, "hybrid"),
        [
            J(0, "a", 2, keep("staging", 300)),
            T(300, form("a")),
        ],
    ),
    "hybrid-quorum-after-the-window-forms-at-once": (
        cfg(2, 4, "hybrid"),
        [
            J(0, "a", 1, keep("waiting", 300)),
            T(300, keep("waiting", 600)),
            J(400, "b", 1, form("a", "b")),
        ],
    ),
    "hybrid-below-quorum-fails-at-the-cap": (
        cfg(2, 4, "hybrid"),
        [
            J(0, "a", 1, keep("waiting", 300)),
            T(650, FailWith("quorum not met: 1 of 2 ranks joined before the hard cap")),
        ],
    ),
    "leave-before-forming-drops-staging-back-to-waiting": (
        cfg(2, None, "manual"),
        [
            J(0, "a", 1, keep("waiting", 300)),
            J(1, "b", 1, keep("staging", 300)),
            L(2, "b", keep("waiting", 300)),
            J(3, "c", 1, keep("staging", 300)),
            S(4, 202),
            T(4, form("a", "c")),
        ],
    ),
    "leave-before-forming-frees-the-host-and-its-ranks": (
        cfg(3, 3),
        [
            J(0, "a", 2, keep("waiting", 300)),
            L(1, "a", keep("waiting", 300)),
            J(2, "b", 1, keep("waiting", 300)),
            J(3, "a", 1, keep("waiting", 300)),  # a redial is a fresh join, at the back of the line
            J(4, "c", 1, form("b", "a", "c")),
        ],
    ),
    "losing-quorum-disarms-a-start": (
        cfg(2, None, "manual"),
        [
            J(0, "a", 2, keep("staging", 300)),
            S(1, 202),
            L(2, "a", keep("waiting", 300)),
            J(3, "b", 2, keep("staging", 300)),  # not queued: regaining quorum does not fire
            S(4, 202),
            T(4, form("b")),
        ],
    ),
    "training-ends-done-when-every-host-link-closes": (
        cfg(3, 3),
        [
            J(0, "a", 1, keep("waiting", 300)),
            J(1, "b", 2, form("a", "b")),
            FORMED(2),
            T(3, keep("training")),
            L(100, "a", keep("training")),
            L(100, "a", keep("training")),  # a repeated close changes nothing
            L(101, "b", keep("done")),
            T(102, keep("done")),
            L(103, "b", keep("done")),
            X(104, "late", keep("done")),  # the first verdict stands
        ],
    ),
    "training-fails-when-the-coordinator-is-lost": (
        cfg(1, 1),
        [
            J(0, "a", 1, form("a")),
            FORMED(1),
            X(50, "coordinator lost", FailWith("coordinator lost")),
            T(51, keep("failed")),
            L(52, "a", keep("failed")),  # links drain after the abort
            X(53, "again", keep("failed")),
        ],
    ),
    "a-host-lost-while-forming-fails-the-run": (
        cfg(2, 2),
        [
            J(0, "a", 1, keep("waiting", 300)),
            J(1, "b", 1, form("a", "b")),
            L(2, "b", FailWith("host b disconnected while the world was forming")),
        ],
    ),
    "fail-from-waiting": (
        cfg(2, 2),
        [J(0, "a", 1, keep("waiting", 300)), X(1, "shutdown", FailWith("shutdown"))],
    ),
    "fail-from-staging": (
        cfg(1, None, "manual"),
        [J(0, "a", 1, keep("staging", 300)), X(1, "shutdown", FailWith("shutdown"))],
    ),
    "fail-from-forming": (cfg(1, 1), [J(0, "a", 1, form("a")), X(1, "ship failed", FailWith("ship failed"))]),
}

DIAGRAM_EDGES: set[tuple[Phase, Phase]] = {
    ("waiting", "forming"),
    ("waiting", "staging"),
    ("staging", "forming"),
    ("waiting", "failed"),
    ("staging", "failed"),
    ("forming", "training"),
    ("training", "done"),
    ("training", "failed"),
}


@pytest.mark.parametrize(("config", "steps"), list(SCENARIOS.values()), ids=list(SCENARIOS))
def test_scenario(config: WindowConfig, steps: list[Step]) -> None:
    play(Window(config, opened_at=0.0), steps)


def test_scenarios_cross_every_edge_of_the_state_diagram() -> None:
    crossed: set[tuple[Phase, Phase]] = set()
    for config, steps in SCENARIOS.values():
        crossed |= play(Window(config, opened_at=0.0), steps)
    assert crossed >= DIAGRAM_EDGES, DIAGRAM_EDGES - crossed


def test_a_window_opened_later_counts_from_its_opening() -> None:
    play(
        Window(cfg(2, 4), opened_at=1000.0),
        [
            J(1000, "a", 1, keep("waiting", 1300)),
            T(1299, keep("waiting", 1300)),
            T(1300, keep("waiting", 1600)),
            T(1600, FailWith("quorum not met: 1 of 2")),
        ],
    )


# -- refusals ------------------------------------------------------------


def _window_in(phase: Phase, start: StartMode = "manual") -> Window:
    w = Window(cfg(1, None, start), opened_at=0.0)
    if phase == "waiting":
        return w
    w.join("a", 1, 0.0)
    if phase == "staging":
        assert w.phase == "staging"
        return w
    if phase == "failed":
        w.fail("stop", 1.0)
        return w
    w.request_start(1.0)
    assert isinstance(w.decide(1.0), Form)
    if phase in ("training", "done"):
        w.formed(2.0)
    if phase == "done":
        w.leave("a", 3.0)
    assert w.phase == phase
    return w


@pytest.mark.parametrize(
    ("start", "phase", "status", "reason"),
    [
        ("auto", "waiting", 409, "auto mode: the window forms on its own; there is nothing to start"),
        ("auto", "failed", 409, "auto mode: the window forms on its own; there is nothing to start"),
        ("manual", "waiting", 409, "quorum not met: 0 of 1 ranks joined"),
        ("hybrid", "waiting", 409, "quorum not met: 0 of 1 ranks joined"),
        ("manual", "forming", 409, "window already closed (phase forming)"),
        ("manual", "training", 409, "window already closed (phase training)"),
        ("manual", "done", 409, "window already closed (phase done)"),
        ("hybrid", "failed", 409, "window already closed (phase failed)"),
        ("manual", "staging", 202, "start accepted"),
        ("hybrid", "staging", 202, "start accepted"),
    ],
)
def test_start_replies(start: StartMode, phase: Phase, status: int, reason: str) -> None:
    w = _window_in(phase, start) if start != "auto" else Window(cfg(1, None, "auto"), 0.0)
    if start == "auto" and phase == "failed":
        w.fail("stop", 0.0)
    armed_before = w.armed
    reply = w.request_start(5.0)
    assert (reply.accepted, reply.status) == (status == 202, status)
    assert reply.reason.startswith(reason)
    assert w.armed is (armed_before or status == 202)  # a refusal never arms
    assert w.phase == phase  # start only arms; decide() moves the phase


def test_a_repeated_start_is_accepted_and_forms_once() -> None:
    w = _window_in("staging")
    assert w.request_start(1.0).accepted
    assert w.request_start(1.5).accepted
    assert isinstance(w.decide(2.0), Form)
    assert w.decide(2.0) == Keep("forming", None)


@pytest.mark.parametrize("phase", ["forming", "training", "done", "failed"])
def test_join_outside_the_window_is_refused_by_phase(phase: Phase) -> None:
    w = _window_in(phase)
    assert not w.can_admit()
    with pytest.raises(WindowClosed, match=rf"phase {phase}") as caught:
        w.join("late", 1, 10.0)
    assert caught.value.phase == phase


@pytest.mark.parametrize("phase", ["waiting", "staging"])
def test_join_is_admitted_while_waiting_or_staging(phase: Phase) -> None:
    assert _window_in(phase).can_admit()


@pytest.mark.parametrize(
    ("host", "ranks", "message"),
    [
        ("a", 1, "host a already joined this run"),
        ("b", 0, "host b offers 0 ranks"),
        ("b", -2, "at least one rank"),
    ],
)
def test_join_refuses_duplicates_and_empty_offers(host: str, ranks: int, message: str) -> None:
    w = Window(cfg(4, 4), 0.0)
    w.join("a", 2, 0.0)
    with pytest.raises(ValueError, match=message):
        w.join(host, ranks, 1.0)
    assert w.joined_ranks == 2
    assert [m.host for m in w.members] == ["a"]


@pytest.mark.parametrize("phase", ["waiting", "training", "failed"])
def test_leave_of_an_unknown_host_is_refused(phase: Phase) -> None:
    w = _window_in(phase)
    with pytest.raises(ValueError, match="host ghost is not a member"):
        w.leave("ghost", 5.0)


@pytest.mark.parametrize("phase", ["waiting", "staging", "training", "done", "failed"])
def test_formed_only_from_forming(phase: Phase) -> None:
    w = _window_in(phase)
    with pytest.raises(RuntimeError, match=rf"phase {phase}"):
        w.formed(5.0)
    assert w.phase == phase


# -- clocks --------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "steps", "deadline"),
    [
        (cfg(2, 4), [], 1300.0),
        (cfg(2, 4), [J(1000, "a", 1, keep("waiting", 1300))], 1300.0),
        (cfg(2, 4), [T(1300, keep("waiting", 1600))], 1600.0),
        (cfg(1, None, "manual"), [J(1000, "a", 1, keep("staging", 1300))], 1300.0),
        (cfg(1, None, "manual"), [T(1350, keep("waiting", 1600))], 1600.0),
        (cfg(1, 1), [J(1000, "a", 1, form("a"))], None),
        (cfg(1, 1), [J(1000, "a", 1, form("a")), FORMED(1001)], None),
        (cfg(2, 2), [T(1600, FailWith("quorum not met"))], None),
    ],
)
def test_next_deadline(config: WindowConfig, steps: list[Step], deadline: float | None) -> None:
    w = Window(config, opened_at=1000.0)
    play(w, steps)
    assert w.next_deadline() == deadline


def test_snapshot_counts_down_and_is_json() -> None:
    w = Window(cfg(2, None, "manual"), opened_at=1000.0)
    w.join("a", 2, 1010.0)
    snap = w.snapshot(1100.0)
    assert snap == {
        "phase": "staging",
        "start": "manual",
        "armed": False,
        "quorum": 2,
        "target": None,
        "joined_ranks": 2,
        "joined_hosts": 1,
        "window_left_s": 200.0,
        "cap_left_s": 500.0,
        "can_start": True,  # manual, quorate: POST /start would be accepted
        "failure": None,
        "failed_in": None,
        "members": [{"host": "a", "ranks": 2, "joined_at": 1010.0}],
    }
    assert json.loads(json.dumps(snap)) == snap

    w.decide(1400.0)
    past = w.snapshot(1400.0)
    assert (past["window_left_s"], past["cap_left_s"]) == (None, 200.0)

    w.request_start(1450.0)
    assert w.snapshot(1450.0)["armed"] is True
    assert w.snapshot(1450.0)["can_start"] is False  # armed already: nothing more to start
    w.decide(1450.0)
    formed = w.snapshot(1450.0)
    assert (formed["phase"], formed["window_left_s"], formed["cap_left_s"]) == ("forming", None, None)


def test_snapshot_names_the_failure() -> None:
    w = Window(cfg(3, 3), opened_at=0.0)
    w.join("a", 1, 0.0)
    w.decide(600.0)
    snap = w.snapshot(600.0)
    assert snap["phase"] == "failed"
    assert snap["failure"] == w.failure
    assert snap["failed_in"] == "waiting"  # the page's phase line marks nothing passed
    assert isinstance(w.failure, str) and "max_join_timeout" in w.failure
    assert (snap["window_left_s"], snap["cap_left_s"]) == (None, None)
    json.dumps(snap)


# -- config --------------------------------------------------------------


def test_from_plan_with_fan_out_defaults_closes_at_full_strength() -> None:
    config = WindowConfig.from_plan(plan_window(JoinWindow(), 4))
    assert config == WindowConfig(4, 4, 300.0, 600.0, "auto", False)
    w = Window(config, opened_at=0.0)
    assert w.join("node-a", 2, 1.0) == Keep("waiting", 300.0)
    assert w.join("node-b", 2, 2.0) == Form(w.members)


def test_from_plan_under_discovery_never_closes_early() -> None:
    plan = plan_window(JoinWindow(discovery=True, min_rank_start=2), 0)
    config = WindowConfig.from_plan(plan, discovery=True)
    assert (config.quorum, config.target, config.discovery) == (2, None, True)


def test_from_plan_needs_a_known_quorum() -> None:
    plan = plan_window(JoinWindow(), None)
    with pytest.raises(ValueError, match="quorum is not known yet"):
        WindowConfig.from_plan(plan)


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (WindowPlan(0, None, 300, 600, "auto"), "at least one rank"),
        (WindowPlan(2, 0, 300, 600, "auto"), "never close early"),
        (WindowPlan(2, 2, 600, 300, "auto"), "below join_timeout"),
    ],
)
def test_config_refuses_unworkable_knobs(plan: WindowPlan, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WindowConfig.from_plan(plan)

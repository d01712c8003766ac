"""The controller's re-formation shell driven message by message, over fake links: what
each host is told, in which order the losses may arrive, and why a run ends. (The real
thing, gloo ranks and agents, is tests/integration/test_elastic_reform.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, cast

from flodl_agent.controller.controller import Controller
from flodl_agent.controller.elastic import Elastic
from flodl_agent.controller.host_link import Link
from flodl_agent.controller.journal import Journal, Span, settings_digest
from flodl_agent.controller.reformation import Reformation
from flodl_agent.controller.supervision import Supervisor
from flodl_agent.controller.traffic import Traffic
from flodl_agent.controller.window import Window
from flodl_agent.protocol import wire
from flodl_agent.protocol.messages import Hello, RankExited, ResumeClaim
from tests.support.control_plane import settings


class _Writer:
    def __init__(self) -> None:
        self.transport = SimpleNamespace(abort=lambda: None)

    def close(self) -> None: ...
    def write(self, data: bytes) -> None: ...


class _Link:
    """A host's link as the controller uses it: what it was sent, by kind."""

    def __init__(self, host: str, ranks: range = range(0)) -> None:
        self.hello = Hello(nonce=b"x" * 16, client_nonce=b"y" * 16, host=host, devices=["cpu:0"])
        self.ranks, self.peer, self.writer = ranks, "127.0.0.1", _Writer()
        self.midrun_step: int | None = None
        self.joined_at = 0.0
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def send(self, kind: wire.Kind, body: dict[str, Any], blob: bytes = b"") -> None:
        self.sent.append((wire.Kind(kind).name, body))

    def send_shared(self, kind: wire.Kind, common: object, own: dict[str, Any]) -> None:
        self.sent.append((wire.Kind(kind).name, own))

    @property
    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.sent]


class _Conn:
    def accept(self, first: int, count: int) -> bytes:
        return b""


def _training(hosts: tuple[str, ...] = ("a", "b", "c"), **knobs: Any) -> tuple[Controller, dict[str, _Link]]:
    """A controller whose elastic process group of one rank a host trains (rank i on hosts[i])."""
    knobs = {"max_failure": "1", "elastic": Elastic(len(hosts), reform_interval=0)} | knobs
    ctl = Controller(settings(**knobs))
    now = ctl.clock()
    ctl.window = Window.resumed(ctl.settings.window, [(host, 1) for host in hosts], now)
    ctl.ceiling, ctl.reformation = len(hosts), Reformation(0.0, now)
    links = {host: _Link(host, range(i, i + 1)) for i, host in enumerate(hosts)}
    ctl.links.update(cast(dict[str, Link], links))
    world = {host: link.ranks for host, link in links.items()}
    ctl.supervisor = Supervisor(world, ctl.settings.limits, now, rendezvous=True, regrows=ctl.regrows)
    ctl.traffic = Traffic(list(hosts), ctl.links, ctl.supervisor, ctl.listener.gate.dropped)
    return ctl, links


def _exit(ctl: Controller, host: str, rank: int, code: int) -> None:
    ctl._exited(host, RankExited(rank=rank, code=code))


def _close(ctl: Controller, host: str) -> None:
    ctl._unregister(ctl.links[host])
    ctl._closed(host)


def _walk_in(ctl: Controller, host: str) -> _Link:
    link = _Link(host)
    assert ctl._admit(link.hello) is None
    ctl._admitted(cast(Link, link), cast(asyncio.StreamWriter, _Writer()), cast(Any, _Conn()))
    return link


def _run(body: Callable[[], None]) -> None:
    async def inside() -> None:  # the controller arms its timers on the running loop
        body()

    asyncio.run(inside())


def test_a_survivors_failure_before_the_lost_hosts_end_begins_the_same_re_formation() -> None:
    def body() -> None:
        ctl, links = _training()
        _exit(ctl, "b", 1, 1)  # its collective broke with c
        assert ctl.supervisor is not None and ctl.supervisor.failed == set()  # b runs it again
        _close(ctl, "c")  # c's end comes after
        _exit(ctl, "a", 0, -15)  # a's rank stopped for the re-formation
        assert links["b"].kinds == ["REFORM"] and links["a"].kinds == ["REFORM"]
        d = _walk_in(ctl, "d")
        assert ctl.window.phase == "training" and ctl.supervisor.world == {
            "a": range(0, 1),
            "b": range(1, 2),
            "d": range(2, 3),
        }
        assert d.kinds == ["WORLD_FORMED"] and links["b"].kinds == ["REFORM", "WORLD_FORMED"]

    _run(body)


def test_a_host_whose_ranks_finished_and_hung_up_as_the_world_re_formed_ends_the_run() -> None:
    def body() -> None:
        ctl, _ = _training()
        _exit(ctl, "b", 1, -6)  # the re-formation begins
        _exit(ctl, "c", 2, 0)  # c's rank had finished: its exit reads as a stop
        _close(ctl, "c")  # and its agent, done, hangs up
        assert ctl.window.phase == "failed"
        assert "host c's ranks had ended (exit 0) as the world re-formed" in ctl.reason

    _run(body)


def test_a_failure_that_may_not_restart_the_world_keeps_its_ranks_failed() -> None:
    def body() -> None:
        ctl, links = _training(elastic=Elastic(3, reform_interval=3600))
        _exit(ctl, "c", 2, 0)  # the world is ending
        _exit(ctl, "b", 1, 1)
        assert ctl.window.phase == "failed" and "rank 2 had already ended (exit 0)" in ctl.reason
        assert ctl.supervisor is not None and ctl.supervisor.failed == {1}  # the status says it
        assert links["a"].kinds == ["ABORT"]

    _run(body)


def test_a_cpu_plane_eviction_releases_the_host_that_waits_for_the_word() -> None:
    def body() -> None:
        ctl, links = _training(("a", "b"), elastic=Elastic(2, planes=("nccl",)))  # cpu does not grow
        ctl.supervisor = Supervisor(dict(ctl.supervisor.world), ctl.settings.limits, ctl.clock())  # type: ignore[union-attr]
        _exit(ctl, "b", 1, 1)  # nothing shows a process group: evicted
        assert links["b"].kinds == ["RELEASE"] and links["a"].kinds == []

    _run(body)


def test_a_handoff_while_the_world_re_forms_is_refused() -> None:
    def body() -> None:
        ctl, _ = _training(controller_grace=120.0)
        ctl.settings = replace(ctl.settings, port=4711)  # a port a next controller could resume on
        _exit(ctl, "b", 1, 1)
        assert ctl.reformation is not None and ctl.reformation.stopping is not None
        assert ctl.hand_off() is False  # its ranks are stopped: nothing trains to hand over

    _run(body)


def test_a_loss_while_a_resumed_controller_takes_the_world_back_ends_the_run() -> None:
    def body() -> None:
        knobs = settings(
            max_failure="1", controller_grace=120.0, launch="abcdef01", elastic=Elastic(3, reform_interval=0)
        )
        spans = tuple(Span(host=h, first=i, stop=i + 1) for i, h in enumerate("abc"))
        journal = Journal(
            launch="abcdef01", port=4000, settings=settings_digest(knobs), plane="cpu", salt="0" * 32,
            world=spans, rendezvous=True,
        )  # fmt: skip
        ctl = Controller(knobs, resume=journal)
        for first, host in enumerate("ab"):
            link = _Link(host)
            link.hello = link.hello.model_copy(
                update={"resume": ResumeClaim(launch="abcdef01", first=first, count=1)}
            )
            assert ctl._admit(link.hello) is None
            ctl._readopted(cast(Link, link))
        _exit(ctl, "b", 1, 1)  # c is still within its grace: neither back nor lost
        assert ctl.window.phase == "failed"
        assert "the controller is still taking the world back" in ctl.reason

    _run(body)

"""The controller's traffic: a restarted controller's floor for the CPU plane's rounds."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from flodl_agent.controller.supervision import Limits, Supervisor
from flodl_agent.controller.traffic import Traffic
from flodl_agent.protocol import wire
from flodl_agent.protocol.messages import Average

WORLD = {"a": range(0, 1), "b": range(1, 2)}


class Link:
    def __init__(self) -> None:
        self.sent: list[tuple[wire.Kind, dict[str, Any], bytes]] = []

    def send(self, kind: wire.Kind, body: dict[str, Any], blob: wire.Blob = b"") -> None:
        self.sent.append((kind, body, bytes(blob)))


def world() -> tuple[Traffic, dict[str, Link]]:
    links = {host: Link() for host in WORLD}
    supervisor = Supervisor(dict(WORLD), Limits(), now=0.0)
    return Traffic(list(WORLD), links, supervisor, Counter()), links


def f32(*values: float) -> bytes:
    return np.array(values, dtype=np.float32).tobytes()


def push(traffic: Traffic, host: str, round_no: int, data: bytes, offset: int = 0, params: int = 2) -> bool:
    return traffic.push(host, Average(round=round_no, weight=1.0, offset=offset, params=params), data, 0.0)


ABANDONED = {"weight": 0.0, "bf16": False, "offset": 0, "params": 0, "last": True, "taken": 0.0}


def test_without_a_resume_rounds_average_as_ever() -> None:
    traffic, links = world()
    assert push(traffic, "a", 0, f32(1, 2))  # opened: its stall ceiling starts
    assert not push(traffic, "b", 0, f32(3, 4))
    for link in links.values():
        ((kind, body, data),) = link.sent
        assert kind is wire.Kind.AVERAGED and body["weight"] == 2.0 and body["last"]
        assert np.frombuffer(data, np.float32).tolist() == [2.0, 3.0]
    assert traffic.hub.floor == 0 and traffic.supervisor.stalls == {}


def test_a_push_below_the_floor_is_answered_at_once_with_weight_zero() -> None:
    traffic, links = world()
    traffic.resumed("a", 4)  # a had round 3 answered (or abandoned) before the controller died
    traffic.resumed("b", 3)  # b had not pushed round 3 yet
    assert not push(traffic, "b", 3, f32(1), params=2)  # never opened: no stall ceiling
    assert links["b"].sent == [(wire.Kind.AVERAGED, {"round": 3, **ABANDONED}, b"")]
    assert not push(traffic, "b", 3, f32(2), offset=1, params=2)  # its later pieces: nothing more
    assert len(links["b"].sent) == 1 and links["a"].sent == [] and traffic.supervisor.stalls == {}
    assert push(traffic, "a", 4, f32(1, 1)) and not push(traffic, "b", 4, f32(3, 3))  # they meet at 4
    assert links["a"].sent[-1][1]["weight"] == links["b"].sent[-1][1]["weight"] == 2.0


def test_a_rising_floor_answers_the_open_rounds_below_it_and_closes_their_ceiling() -> None:
    traffic, links = world()
    traffic.resumed("b", 3)
    assert push(traffic, "b", 3, f32(1, 2))  # opened, waiting for a
    assert 3 in traffic.supervisor.stalls
    traffic.resumed("a", 4)  # a is a round on: b's round 3 is abandoned
    assert links["b"].sent == [(wire.Kind.AVERAGED, {"round": 3, **ABANDONED, "params": 2}, b"")]
    assert links["a"].sent == [] and traffic.supervisor.stalls == {} and traffic.hub.missing(3) == set()
    traffic.resumed("b", 3)  # a lower word moves nothing
    assert traffic.hub.floor == 4 and len(links["b"].sent) == 1


def test_a_walk_in_that_does_not_fit_is_refused_alone_and_the_world_averages_on() -> None:
    traffic, links = world()
    links["c"] = Link()
    push(traffic, "a", 0, f32(1, 1))
    push(traffic, "b", 0, f32(3, 3))  # the world averages 2 parameters
    traffic.push("c", Average(round=0, join=True, params=3), b"", 0.0)  # another model
    assert traffic.hub.waiting == frozenset() and "c" not in traffic.hub.training
    traffic.push("c", Average(round=0, join=True, params=2), b"", 0.0)
    traffic.push("c", Average(round=0, join=True, params=2), b"", 0.0)  # said twice
    wrong, twice = (body["error"] for _, body, _ in links["c"].sent)
    assert "averages 3 parameters, the world 2" in wrong and "builds another model" in wrong
    assert "joined twice" in twice
    push(traffic, "a", 1, f32(1, 1))
    push(traffic, "b", 1, f32(3, 3))
    kind, body, data = links["c"].sent[-1]  # round 1's average, whole: the walk-in's start
    assert kind is wire.Kind.AVERAGED and body["round"] == 1 and body["last"] and data == f32(2, 2)
    assert traffic.hub.training == {"a", "b", "c"}

"""A restarted controller taking its journaled world back (issue 37): who may walk back
in with a resume hello, who is still missing, and the timeline's one line."""

from __future__ import annotations

import pytest

from flodl_agent.controller.journal import Journal
from flodl_agent.controller.readoption import Readoption
from flodl_agent.protocol.messages import Hello, ResumeClaim
from tests.unit.controller.test_journal import world

NONCE = b"\x01" * 16
FIXES = {
    "window_closed": "wait for the next run; --persist re-dials",
    "resume_refused": "its ranks stop; --persist re-dials into the next launch",
}


def back_in(host: str, first: int, count: int, launch: str = "0a1b2c3d") -> Hello:
    claim = ResumeClaim(launch=launch, first=first, count=count)
    return Hello(nonce=NONCE, client_nonce=NONCE, host=host, devices=["cpu:0"] * count, resume=claim)


def readoption(journal: Journal | None = None) -> Readoption:
    return Readoption(journal or world(), started=100.0, grace=60.0)


def test_the_journals_running_hosts_are_expected_in_rank_order() -> None:
    # a's ranks 0-1 and b's rank 2 run; c's one rank exited (it hung up): not expected back.
    assert readoption(world(exits={3: 0})).expected == ["a", "b"]
    assert readoption(world(exits={0: 0}, evicted=("c",), failed=(3,))).expected == ["a", "b"]
    assert readoption(world(exits={0: 0, 1: 0})).expected == ["b", "c"]


@pytest.mark.parametrize(
    ("hello", "code", "words"),
    [
        (back_in("a", 0, 2), None, ""),
        (back_in("a", 0, 2, launch="ffffffff"), "resume_refused", "it resumes launch ffffffff"),
        (back_in("z", 0, 1), "resume_refused", "host z was not in launch 0a1b2c3d's world"),
        (
            back_in("b", 1, 2),
            "resume_refused",
            "host b says it holds ranks 1\u20132; launch 0a1b2c3d's journal gives it rank 2",
        ),
        (
            Hello(nonce=NONCE, client_nonce=NONCE, host="a", devices=["cpu:0"]),
            "window_closed",
            "this controller resumed launch 0a1b2c3d: its world is training and admits only the hosts "
            "it journaled",
        ),
    ],
)
def test_who_may_walk_back_in(hello: Hello, code: str | None, words: str) -> None:
    refusal = readoption().judge(hello, live=set())
    if code is None:
        assert refusal is None
    else:
        assert refusal is not None and refusal.code == code and words in refusal.reason
        assert not refusal.permanent  # --persist stays up for the next launch
        assert refusal.fix == FIXES[code]


def test_a_host_with_a_live_link_cannot_resume_twice_nor_one_handled_as_lost_since() -> None:
    taking = readoption()
    taking.admitted("a")
    twice = taking.judge(back_in("a", 0, 2), live={"a"})
    assert twice is not None and "a second resume" in twice.reason
    assert taking.judge(back_in("a", 0, 2), live=set()) is None  # its link is gone, not yet judged
    taking.lost.add("a")  # the controller handled it as lost (its link closed, or the grace ran out)
    lost = taking.judge(back_in("a", 0, 2), live=set())
    assert lost is not None and lost.reason == "host a was lost from launch 0a1b2c3d after the resume"


def test_a_host_whose_ranks_all_exited_has_nothing_to_resume() -> None:
    refusal = readoption(world(exits={3: 0})).judge(back_in("c", 3, 1), live=set())
    assert refusal is not None and "ranks had all exited" in refusal.reason


def test_an_evicted_host_may_not_come_back() -> None:
    refusal = readoption(world(evicted=("c",), failed=(3,))).judge(back_in("c", 3, 1), live=set())
    assert refusal is not None and "was evicted" in refusal.reason


def test_missing_hosts_and_the_timeline_line() -> None:
    taking = readoption()
    assert taking.deadline == 160.0 and not taking.complete()
    taking.admitted("b")
    assert taking.missing() == ["a", "c"]
    taking.admitted("a")
    taking.admitted("c")
    assert taking.complete() and not taking.said
    assert taking.words(101.25) == "controller resumed: 3 of 3 hosts back in 1.2 s" and taking.said
    one = readoption(world(exits={0: 0, 1: 0, 2: 0}))
    assert one.words(100.0) == "controller resumed: 0 of 1 host back in 0.0 s"

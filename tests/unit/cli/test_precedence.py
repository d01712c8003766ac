"""Precedence as data: the first set source wins, sources after it are never read, and the
tables of fdl join and fdl publish say the documented order."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flodl_agent.agent.spec import AgentSpec
from flodl_agent.cli.options import JOIN, PUBLISH, JoinFlags, OptionError, resolve_join
from flodl_agent.cli.precedence import Precedence, none, unset
from flodl_agent.config import Join


@pytest.mark.parametrize(
    ("value", "is_unset", "is_none"),
    [
        (None, True, True),
        ("", True, False),
        ([], True, False),
        ((), True, False),
        ({}, True, False),
        (False, False, False),
        (0.0, False, False),
        ("x", False, False),
        (["a"], False, False),
    ],
)
def test_what_counts_as_not_given(value: object, is_unset: bool, is_none: bool) -> None:
    assert unset(value) is is_unset
    assert none(value) is is_none


def test_the_first_set_source_wins_and_says_where_it_came_from() -> None:
    rule = Precedence(("a.x", "b.x", "c.x"))
    places = {"a": SimpleNamespace(x=""), "b": SimpleNamespace(x="from b"), "c": SimpleNamespace(x="c")}
    assert rule.pick(places) == ("from b", "b.x")
    assert Precedence(("a.x",)).pick(places) == (None, None)


def test_an_empty_value_is_a_choice_where_the_rule_says_so() -> None:
    # `fdl publish SPEC --` (an empty tail) replaces publish.args; an empty --bin does not.
    places = {"flags": SimpleNamespace(tail=()), "block": SimpleNamespace(args=["--lr", "1"])}
    assert Precedence(("flags.tail", "block.args"), none).pick(places) == ((), "flags.tail")
    assert Precedence(("flags.tail", "block.args")).pick(places) == (["--lr", "1"], "block.args")
    assert PUBLISH["args"].is_unset is none


def test_sources_after_the_winner_are_never_read() -> None:
    class Exploding:
        @property
        def x(self) -> str:
            raise AssertionError("read after the winner")

    assert Precedence(("a.x", "b.x")).pick({"a": SimpleNamespace(x="won"), "b": Exploding()}) == (
        "won",
        "a.x",
    )


def test_the_join_table_states_flags_then_spec_then_block() -> None:
    for field, rule in JOIN.items():
        order = [source.partition(".")[0] for source in rule.sources]
        ranked = [{"flags": 0, "spec": 1, "block": 2, "box": 3}[place] for place in order]
        if field == "gpu_ram_share":  # the box's own join block beats its cluster entry
            assert order == ["block", "spec"]
        else:
            assert ranked == sorted(ranked), field
    assert [s.partition(".")[0] for rule in PUBLISH.values() for s in rule.sources] == [
        "flags",
        "block",
    ] * len(PUBLISH)


def test_a_bad_env_pin_is_not_read_when_the_flag_pins() -> None:
    pin = "sha256:" + "ab" * 32
    flags = JoinFlags(address="10.0.0.1:1337", pin=pin, env_pin="not a pin")
    settings = resolve_join(flags, AgentSpec(), Join(), "box-1")
    assert settings.tls_fingerprint == pin
    with pytest.raises(OptionError) as caught:
        resolve_join(JoinFlags(address="10.0.0.1:1337", env_pin="not a pin"), AgentSpec(), Join(), "box-1")
    assert caught.value.param == "FDL_TLS_FINGERPRINT"


def test_a_bad_host_names_where_it_came_from() -> None:
    flags = JoinFlags(address="10.0.0.1:1337")
    with pytest.raises(OptionError, match=r"^join\.host "):
        resolve_join(flags, AgentSpec(), Join.model_construct(host="a/b"), "box-1")
    with pytest.raises(OptionError, match=r"^this box's hostname "):
        resolve_join(flags, AgentSpec(), Join(), "a/b")
    with pytest.raises(OptionError, match=r"^the launcher's host "):
        resolve_join(flags, AgentSpec.model_construct(host="a/b"), Join(), "box-1")

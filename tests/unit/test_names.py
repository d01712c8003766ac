"""Names and addresses as text: the one host-name rule, escaping for terminals, one address parser."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from flodl_agent.address import AddressError, check_host, split_address
from flodl_agent.names import (
    HOST_NAME_MAX,
    SERVICE_NAME,
    env_name_problem,
    name_problem,
    os_problem,
    printable,
    printable_lines,
    shown,
)
from flodl_agent.protocol.messages import Hello

# Every code point that rewrites what a terminal shows: C0, DEL, C1 (CSI among them), the line
# and paragraph separators, the bidi embeddings, overrides, isolates and marks, zero width.
UNSAFE = [
    "\x00",
    "\x1b",
    "\t",
    "\n",
    "\x7f",
    "\x85",
    "\x9b",
    "\u2028",
    "\u2029",
    "\u202a",
    "\u202b",
    "\u202c",
    "\u202d",
    "\u202e",
    "\u2066",
    "\u2067",
    "\u2068",
    "\u2069",
    "\u200e",
    "\u200f",
    "\u061c",
    "\u200b",
    "\ufeff",
]


@pytest.mark.parametrize("char", UNSAFE)
def test_printable_escapes_what_a_terminal_acts_on_and_names_refuse_it(char: str) -> None:
    escaped = printable(f"a{char}b")
    code = ord(char)
    assert escaped == (f"a\\x{code:02x}b" if code < 0x100 else f"a\\u{code:04x}b")
    problem = name_problem(f"box{char}1")
    assert problem is not None and "control, bidi or invisible" in problem[0]


def test_printable_leaves_text_alone() -> None:
    for text in ["box-7", "Grüße", "日本", "a b", "[red]x[/red]", "😀"]:
        assert printable(text) == text


def test_a_failure_keeps_its_fix_on_a_line_of_its_own_and_a_peer_forges_no_log_line() -> None:
    assert printable_lines("refused: wrong key\n    fix: pass the token") == (
        "refused: wrong key\n    fix: pass the token"  # a line break, not "\\x0a"
    )
    forged = printable_lines("refused: x\n01:30:56 admitted box-9\u202e")
    assert forged == "refused: x\n    01:30:56 admitted box-9\\u202e"  # indented, and escaped within
    assert printable_lines("one line") == "one line"


def test_shown_cuts_a_huge_value_and_escapes_it() -> None:
    assert shown("x" * 3_000_000) == "x" * 59 + "…"
    assert shown("\u202e") == "\\u202e"


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("", "is empty"),
        ("a b", "no spaces"),
        ("../../etc", "no spaces, `/`"),
        ("a\\b", "no spaces"),
        ("user@box", "no spaces"),
        ("box:1", "no spaces"),
        ("a" * (HOST_NAME_MAX + 1), f"at most {HOST_NAME_MAX}"),
        ("-oProxyCommand=x", "starts with `-`"),
    ],
)
def test_the_host_name_rule(name: str, fragment: str) -> None:
    problem = name_problem(name)
    assert problem is not None and fragment in problem[0] and problem[1]


@pytest.mark.parametrize("name", ["box-7", "lab-worker-1", "a" * HOST_NAME_MAX, "böx", "w_1.example"])
def test_names_that_pass(name: str) -> None:
    assert name_problem(name) is None


def test_the_hello_keeps_the_same_rule() -> None:
    base = {"nonce": b"n" * 16, "client_nonce": b"c" * 16, "devices": ["cpu:0"]}
    assert Hello.model_validate(base | {"host": "box-7"}).host == "box-7"
    assert Hello.model_validate(base | {"host": ""}).host == ""  # admission refuses it by name
    for host in ["a b", "ev\u202eil", "box\x9b", "-x", "a" * 254]:
        with pytest.raises(ValidationError):
            Hello.model_validate(base | {"host": host})
    for label in ["ev\u202eil", "GPU\x9b2J"]:
        with pytest.raises(ValidationError):
            Hello.model_validate(base | {"host": "box", "device_labels": [label]})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10.0.0.1:7000", ("10.0.0.1", 7000)),
        ("ctrl", ("ctrl", 1337)),
        ("ctrl.example.com:9", ("ctrl.example.com", 9)),
        ("[fd00::1]:9", ("fd00::1", 9)),
        ("[fd00::1]", ("fd00::1", 1337)),
        ("[fe80::1%eth0]:9", ("fe80::1%eth0", 9)),
    ],
)
def test_addresses_that_parse(text: str, expected: tuple[str, int]) -> None:
    assert split_address(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("http://127.0.0.1:1337", "drop the `http://`"),
        ("fd00::1", "an IPv6 address goes in brackets"),
        ("fd00::1:1337", "an IPv6 address goes in brackets"),
        ("[fd00::1", "brackets hold an IPv6 address"),
        ("[10.0.0.1]:1", "brackets hold an IPv6 address"),
        ("ctrl:99999", "`99999` is not a port"),
        ("ctrl:0", "`0` is not a port"),
        ("ctrl:", "is not a port"),
        ("ctrl:²", "is not a port"),
        (":1337", "names no host"),
        ("a b:1", "is neither an IP address nor a host name"),
        ("1337", "is neither an IP address nor a host name"),  # a port without its host
        ("127.1:1", "is neither an IP address nor a host name"),
        ("a" * 254, "at most 253"),
    ],
)
def test_addresses_that_are_refused(text: str, fragment: str) -> None:
    with pytest.raises(AddressError) as caught:
        split_address(text)
    assert fragment in caught.value.message and caught.value.fix


@pytest.mark.parametrize("text", ["0.0.0.0", "::", "fd00::1", "127.0.0.1", "ctrl.example.com"])
def test_bare_hosts(text: str) -> None:
    assert check_host(text) == text


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty"),
        ("10.0.0.1:1337", "carries brackets or a port"),
        ("[::1]", "carries brackets or a port"),
        ("http://ctrl", "drop the `http://`"),
        ("a" * 3_000_000, "is 3000000 characters long"),
    ],
)
def test_bare_hosts_that_are_refused(text: str, fragment: str) -> None:
    with pytest.raises(AddressError) as caught:
        check_host(text)
    assert fragment in caught.value.message and len(caught.value.message) < 300


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("a\x00b", "NUL byte"), ("\ud800", "\\ud800, a lone surrogate"), ("ok\udfff", "\\udfff")],
)
def test_text_no_process_can_be_passed_is_named(text: str, fragment: str) -> None:
    problem = os_problem(text)
    assert problem is not None and fragment in problem[0] and problem[1]


@pytest.mark.parametrize("text", ["", "x y", "a=b", "two\nlines\t", "\x1b[0m", "日本😀"])
def test_text_the_os_can_pass_is_left_alone(text: str) -> None:
    # Controls and `=` are any value's own business: only what exec cannot take is refused.
    assert os_problem(text) is None


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("", "is empty"),
        ("A=B", "holds `=`"),
        ("=", "holds `=`"),
        ("A\x00", "NUL byte"),
        ("\ud800", "surrogate"),
    ],
)
def test_env_names_no_environment_can_hold(name: str, fragment: str) -> None:
    problem = env_name_problem(name)
    assert problem is not None and fragment in problem[0]
    assert env_name_problem("NCCL_DEBUG") is None


def test_a_service_name_is_the_whole_text() -> None:
    assert SERVICE_NAME.match("svc-1") and not SERVICE_NAME.match("svc\n")

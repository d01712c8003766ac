"""Option resolution, per command: flags > env > the fdl.yml block > defaults (and, for
`fdl join`, the launcher's spec between the flags and the block)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from flodl_agent.agent.spec import AgentSpec
from flodl_agent.cli.options import (
    DEFAULT_ADDR,
    JoinFlags,
    OptionError,
    PublishFlags,
    probe_join,
    resolve_addr,
    resolve_join,
    resolve_pin,
    resolve_publish,
)
from flodl_agent.config import Controller, Join, Publish
from flodl_agent.protocol import wire

HOSTNAME = "this-box"
PIN = "sha256:" + "ab" * 32
PIN_COLONS = ":".join(["CD"] * 32)  # openssl's spelling of sha256:cdcd…
PIN_SPEC = "sha256:" + "5e" * 32
ADDR = {"address": "10.9.9.9:9"}  # so a case that is not about the address resolves one


def join(flags: dict[str, Any], spec: dict[str, Any], block: dict[str, Any]) -> Any:
    return resolve_join(
        JoinFlags(**flags), AgentSpec.model_validate(spec), Join.model_validate(block), HOSTNAME
    )


# Each field of `fdl join`, in its layers: (flag, spec, block, default) as the kwargs that set
# it there (None: the field has no such layer) and what the resolved value reads as.
JOIN_LAYERS: list[tuple[str, Any, Any, Any, Any, Any]] = [
    # field read,      flag layer,                spec layer,              block layer,          values
    (
        "host",
        ({"host": "f"}, "f"),
        ({"host": "s"}, "s"),
        ({"host": "b"}, "b"),
        HOSTNAME,
        lambda s: s.host,
    ),
    (
        "devices",
        ({"devices": "0,1"}, "0,1"),
        ({"devices": "cpu:2"}, "cpu:2"),
        ({"devices": "cpu:3"}, "cpu:3"),
        "all",
        lambda s: str(s.devices),
    ),
    (
        "key",  # this box's host key: the token's, derived for its name
        ({"token": "aa" * 16}, wire.host_key(bytes.fromhex("aa" * 16), HOSTNAME)),
        None,  # the key's spec layer sits under the block's: its own case below
        ({"token": "bb" * 16}, wire.host_key(bytes.fromhex("bb" * 16), HOSTNAME)),
        None,
        lambda s: s.key,
    ),
    (
        "bin",
        ({"bin": "/f/run"}, "/f/run"),
        None,
        ({"bin": "/b/run"}, "/b/run"),
        None,
        lambda s: s.bin,
    ),
    (
        "data_path",
        None,
        ({"data_path": "/s"}, "/s"),
        ({"data_path": "/b"}, "/b"),
        "",
        lambda s: s.data_path,
    ),
    (
        "socket_ifname",
        None,
        ({"socket_ifname": "eth1"}, "eth1"),
        ({"nccl_socket_ifname": "eth2"}, "eth2"),
        "",
        lambda s: s.socket_ifname,
    ),
    (
        "args",  # arguments for this box's own entry point: each layer names one
        ({"args": ("--f",), "bin": "/f/run"}, ["--f"]),
        None,
        ({"args": ["--b"], "bin": "/b/run"}, ["--b"]),
        [],
        lambda s: s.args,
    ),
    (
        "tunnel",  # the box dials through an ssh forward: its own -L, or the launcher's -R
        ({"ssh": "me@door"}, True),
        ({"tunnel": True}, True),
        ({"ssh": {"target": "door"}}, True),
        False,
        lambda s: s.tunnel,
    ),
    (
        "tls_fingerprint",
        ({"pin": PIN_COLONS}, "sha256:" + "cd" * 32),
        ({"tls_fingerprint": PIN_SPEC}, PIN_SPEC),  # a fan-out launch over TLS hands its agents the pin
        ({"tls_fingerprint": PIN}, PIN),
        "",
        lambda s: s.tls_fingerprint,
    ),
    (
        "docker",
        ({"docker": "f"}, "f"),
        ({"docker": "s"}, "s"),
        ({"docker": "b"}, "b"),
        "",  # the ranks run on the box itself (unless the cluster file's envelope names one)
        lambda s: s.docker,
    ),
    (
        "persist",
        ({"persist": False}, False),
        None,
        ({"persist": True}, True),
        False,
        lambda s: s.persist,
    ),
    (
        "ssh",
        ({"ssh": "me@jump:2222"}, ("jump", 2222, "me")),
        None,
        ({"ssh": {"target": "door", "user": "ops"}}, ("door", None, "ops")),
        None,
        lambda s: (s.ssh.target, s.ssh.port, s.ssh.user) if s.ssh else None,
    ),
    (
        "controller",
        ({"address": "10.0.0.1:7000"}, ("10.0.0.1", 7000)),
        ({"controller_host": "fd00::2", "controller_port": 7001}, ("fd00::2", 7001)),
        ({"controller": "10.0.0.3:7002"}, ("10.0.0.3", 7002)),
        None,  # no address at all is an error: its own case below
        lambda s: (s.controller_host, s.controller_port),
    ),
]


def _join_cases() -> list[Any]:
    cases = []
    for name, flag, spec, block, default, read in JOIN_LAYERS:
        layers = [("flag", flag), ("spec", spec), ("block", block)]
        present = [(where, layer) for where, layer in layers if layer is not None]
        # Every layer set, then drop the top one each time: the next one down must win.
        for i, (where, (_, expected)) in enumerate(present):
            kwargs: dict[str, dict[str, Any]] = {"flag": {}, "spec": {}, "block": {}}
            for lower, (setting, _) in present[i:]:
                kwargs[lower] |= setting
            cases.append(pytest.param(name, kwargs, expected, read, id=f"{name}-from-{where}"))
        if name != "controller":
            cases.append(pytest.param(name, None, default, read, id=f"{name}-default"))
    return cases


@pytest.mark.parametrize(("name", "layers", "expected", "read"), _join_cases())
def test_join_precedence_flag_then_spec_then_block_then_default(
    name: str, layers: dict[str, dict[str, Any]] | None, expected: Any, read: Any
) -> None:
    layers = layers or {"flag": {}, "spec": {}, "block": {}}
    flags = layers["flag"] if name == "controller" else ADDR | layers["flag"]
    settings = join(flags, layers["spec"], layers["block"])
    assert read(settings) == expected


def derived(token_hex: str, host: str = HOSTNAME) -> bytes:
    return wire.host_key(bytes.fromhex(token_hex), host)


def test_join_key_takes_the_token_then_the_blocks_then_the_specs() -> None:
    spec = {"key": "cc" * 32}  # a spec written by hand, with the run's key
    assert join(ADDR, spec, {}).key == derived("cc" * 32)
    assert join(ADDR, spec, {"token": "bb" * 16}).key == derived("bb" * 16)
    assert join(ADDR | {"token": "aa" * 16}, spec, {"token": "bb" * 16}).key == derived("aa" * 16)
    assert join(ADDR, {}, {}).key is None  # open admission
    # the token proves any name: the key follows the name the box dials as
    assert join(ADDR | {"host": "other"}, spec, {}).key == derived("cc" * 32, "other")


def test_a_key_made_for_one_name_is_used_as_it_is_and_for_that_name_alone() -> None:
    made = {"host": "w1", "host_key": "dd" * 16}
    assert join(ADDR, made, {}).key == bytes.fromhex("dd" * 16)  # a launcher's spec
    assert join(ADDR, {}, made).key == bytes.fromhex("dd" * 16)  # fdl.yml, as site.yml writes it
    assert join(ADDR | {"token": "aa" * 16}, {}, made).key == derived("aa" * 16, "w1")  # FDL_TOKEN beats it
    for spec, block in ((made, {}), ({}, made)):
        with pytest.raises(OptionError, match="key of host w1: it cannot dial as other") as caught:
            join(ADDR | {"host": "other"}, spec, block)
        assert caught.value.param == "--host" and "FDL_TOKEN" in (caught.value.fix or "")


def test_join_env_merges_the_block_under_the_spec_per_key() -> None:
    settings = join(ADDR, {"env": {"A": "s", "B": "s"}}, {"env": {"B": "b", "C": "b"}})
    assert settings.env == {"A": "s", "B": "s", "C": "b"}


def test_join_gpu_ram_share_takes_the_boxs_block_over_its_cluster_entry() -> None:
    assert join(ADDR, {"gpu_ram_share": 0.75}, {}).gpu_ram_share == 0.75  # the worker entry (fan-out)
    assert join(ADDR, {"gpu_ram_share": 0.75}, {"gpu_ram_share": 0.9}).gpu_ram_share == 0.9
    assert join(ADDR, {}, {}).gpu_ram_share is None


def test_join_passes_source_and_data_source_through_from_the_block() -> None:
    block = {"source": {"from": "file:///srv/run"}, "data_path": "/data", "data_source": "sshfs://h:/data"}
    settings = join({**ADDR}, {}, block)
    assert settings.source is not None and settings.data_source == "sshfs://h:/data"
    assert join(ADDR, {}, {}).source is None and join(ADDR, {}, {}).data_source == ""


def test_join_an_ssh_forward_defaults_the_address_to_its_loopback_end() -> None:
    settings = join({"ssh": "jump"}, {}, {})
    assert (settings.controller_host, settings.controller_port) == ("127.0.0.1", 1337)
    assert join({}, {}, {"ssh": {"target": "door"}}).controller_host == "127.0.0.1"


def test_join_identity_applies_to_the_flag_or_the_blocks_ssh() -> None:
    key = Path("/k/id")
    assert join({"ssh": "jump", "identity": key}, {}, {}).ssh.identity_file == "/k/id"
    assert join({"identity": key}, {}, {"ssh": {"target": "door"}}).ssh.identity_file == "/k/id"
    assert join(ADDR | {"identity": key}, {}, {}).ssh is None  # no ssh to apply it to


# A walk-in's command, as the flags and the join: block state it: (flags, block) -> (bin, args).
# An entry and its arguments merge field by field; arguments alone name no entry point.
WALK_IN_COMMANDS = [
    ({}, {}, (None, [])),  # the launch's command
    ({"bin": "x.py", "args": ("--flag", "v")}, {}, ("x.py", ["--flag", "v"])),
    ({"bin": "x.py"}, {}, ("x.py", [])),
    ({}, {"bin": "/b/train", "args": ["--model", "resnet"]}, ("/b/train", ["--model", "resnet"])),
    (
        {"args": ("--model", "vit")},
        {"bin": "/b/train", "args": ["--model", "resnet"]},
        ("/b/train", ["--model", "vit"]),
    ),
    (
        {"bin": "/f/train"},
        {"bin": "/b/train", "args": ["--model", "resnet"]},
        ("/f/train", ["--model", "resnet"]),
    ),
    # with join.source the fetched run says what runs; the args feed a manifest-less source.bin
    ({"args": ("--x",)}, {"source": {"from": "file:///t", "bin": "run"}}, (None, ["--x"])),
]


@pytest.mark.parametrize(("flags", "block", "expected"), WALK_IN_COMMANDS)
def test_join_a_walk_ins_own_command(flags: dict[str, Any], block: dict[str, Any], expected: Any) -> None:
    settings = join(ADDR | flags, {}, block)
    assert (settings.bin, settings.args) == expected
    assert not settings.notes


def test_join_a_launchers_remote_forward_alone_marks_the_tunnel() -> None:
    assert join(ADDR, {"tunnel": True}, {}).tunnel and not join(ADDR, {}, {}).tunnel


def test_join_arguments_without_an_entry_point_are_refused() -> None:
    with pytest.raises(OptionError) as caught:
        join(ADDR | {"args": ("--model", "resnet")}, {}, {})
    assert (caught.value.param, caught.value.kind) == ("ARGS", "refusal")
    assert caught.value.fix and "--bin PATH" in caught.value.fix and "join.bin" in caught.value.fix


def test_join_a_bin_flag_under_join_source_gets_a_note() -> None:
    settings = join(ADDR | {"bin": "/f/train"}, {}, {"source": {"from": "file:///t"}})
    assert settings.notes and "join.source names what runs" in settings.notes[0]


@pytest.mark.parametrize(
    ("flags", "param", "kind", "words"),
    [
        ({}, "ADDRESS", "refusal", "no controller address"),
        ({"address": "host:notaport"}, "ADDRESS", "param", "port"),
        ({"ssh": "me@host:99999"}, "--ssh", "param", "`99999` is not a port"),
        (ADDR | {"devices": "gpu0"}, "--devices", "param", "`gpu0` is not a device offer"),
        (ADDR | {"pin": "sha256:xyz"}, "--tls-fingerprint", "param", ""),
        (ADDR | {"docker": "--rm"}, "--docker", "param", "is not a compose service name"),
    ],
)
def test_join_refusals_name_the_flag(flags: dict[str, Any], param: str, kind: str, words: str) -> None:
    with pytest.raises(OptionError) as caught:
        join(flags, {}, {})
    assert (caught.value.param, caught.value.kind) == (param, kind)
    assert words in caught.value.message
    if kind == "refusal" and param == "ADDRESS":
        assert caught.value.fix and "--ssh" in caught.value.fix


@pytest.mark.parametrize(
    ("flags", "param", "words"),
    [
        (ADDR | {"host": ""}, "--host", "is empty"),  # not silently this box's hostname
        (ADDR | {"host": "a b"}, "--host", "no spaces"),
        (ADDR | {"host": "../../etc"}, "--host", "no spaces, `/`"),
        (ADDR | {"host": "a\\b"}, "--host", "no spaces"),
        (ADDR | {"host": "a" * 254}, "--host", "at most 253"),
        (ADDR | {"host": "ev\u202eil"}, "--host", "bidi"),
        (ADDR | {"devices": ""}, "--devices", "is empty"),  # not silently every GPU
        (ADDR | {"devices": "cpu:1025"}, "--devices", "at most 1024"),
        (ADDR | {"devices": "cpu:100000"}, "--devices", "at most 1024"),
        ({"address": ""}, "ADDRESS", "is empty"),
        ({"address": "http://127.0.0.1:1337"}, "ADDRESS", "drop the `http://`"),
        ({"address": "fd00::1"}, "ADDRESS", "in brackets"),
        ({"ssh": "me@http://door"}, "--ssh", "drop the `http://`"),
        ({"ssh": "-oProxyCommand=x@door"}, "--ssh", "starts with `-`"),
    ],
)
def test_join_refuses_what_cannot_work_before_any_dial(flags: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(OptionError) as caught:
        join(flags, {}, {})
    assert caught.value.param == param and caught.value.kind == "param"
    assert words in caught.value.message


def test_join_a_hostname_that_is_no_host_name_asks_for_host() -> None:
    with pytest.raises(OptionError) as caught:
        resolve_join(JoinFlags(address="10.0.0.1:9"), AgentSpec(), Join(), "bad host")
    assert caught.value.kind == "refusal" and "this box's hostname" in caught.value.message
    assert caught.value.fix == "name the box with --host NAME"


def test_probe_join_takes_a_cluster_entry_and_refuses_a_bad_one() -> None:
    join_block = probe_join(AgentSpec(devices="cpu:2", data_path="/d", socket_ifname="eth0"))
    assert (str(join_block.devices), join_block.data_path, join_block.nccl_socket_ifname) == (
        "cpu:2",
        "/d",
        "eth0",
    )
    with pytest.raises(OptionError) as caught:
        probe_join(AgentSpec(data_path="relative"))
    assert caught.value.kind == "refusal" and "cluster entry" in caught.value.message


# --- fdl publish -----------------------------------------------------------------------------

SRC_FLAG, SRC_BLOCK = "file:///flag/tree", "file:///block/tree"

PUBLISH_LAYERS: list[tuple[str, Any, Any, Any, Any]] = [
    (
        "source",
        ({"spec": SRC_FLAG}, "/flag/tree"),
        ({"source": SRC_BLOCK}, "/block/tree"),
        None,
        lambda r: r.source.path,
    ),
    ("bin", ({"bin": "f"}, "f"), ({"bin": "b"}, "b"), None, lambda r: r.bin),
    ("cwd", ({"cwd": "f"}, "f"), ({"cwd": "b"}, "b"), ".", lambda r: r.cwd),
    ("build", ({"build": "make f"}, "make f"), ({"build": "make b"}, "make b"), None, lambda r: r.build),
    (
        "served",
        ({"served": Path("/f")}, Path("/f")),
        ({"to": "/b"}, Path("/b")),
        Path("~/.flodl/run"),
        lambda r: r.served,
    ),
    (
        "identity",
        ({"identity": Path("/f/k")}, Path("/f/k")),
        ({"identity": "~/b/k"}, Path("~/b/k")),
        None,
        lambda r: r.identity,
    ),
    (
        "model_probe",
        ({"model_probe": False}, False),
        ({"model_probe": True}, True),
        False,
        lambda r: r.model_probe,
    ),
    ("args", ({"tail": ("--f",)}, ["--f"]), ({"args": ["--b"]}, ["--b"]), [], lambda r: r.args),
]


def _publish_cases() -> list[Any]:
    cases = []
    for name, (flag, from_flag), (block, from_block), default, read in PUBLISH_LAYERS:
        base = {} if name == "source" else {"spec": SRC_FLAG}
        cases.append(pytest.param(base | flag, block, from_flag, read, id=f"{name}-from-flag"))
        cases.append(pytest.param(base, block, from_block, read, id=f"{name}-from-block"))
        if name != "source":
            cases.append(pytest.param(base, {}, default, read, id=f"{name}-default"))
    return cases


@pytest.mark.parametrize(("flags", "block", "expected", "read"), _publish_cases())
def test_publish_precedence_flag_then_block_then_default(
    flags: dict[str, Any], block: dict[str, Any], expected: Any, read: Any
) -> None:
    assert read(resolve_publish(PublishFlags(**flags), Publish.model_validate(block))) == expected


def test_publish_an_empty_tail_still_replaces_the_blocks_args() -> None:
    block = Publish.model_validate({"args": ["--b"]})
    assert resolve_publish(PublishFlags(spec=SRC_FLAG, tail=()), block).args == []
    assert resolve_publish(PublishFlags(spec=SRC_FLAG, no_build=True), block).no_build


@pytest.mark.parametrize(
    ("flags", "param", "kind"),
    [({}, "SPEC", "usage"), ({"spec": "ftp://nope"}, "SPEC", "param")],
)
def test_publish_refusals_name_the_source(flags: dict[str, Any], param: str, kind: str) -> None:
    with pytest.raises(OptionError) as caught:
        resolve_publish(PublishFlags(**flags), Publish())
    assert (caught.value.param, caught.value.kind) == (param, kind)


# --- fdl status / fdl start ------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["", "http://127.0.0.1:1337", "fd00::1", "ctrl:99999", "a b"])
def test_status_refuses_an_address_that_is_not_one(flag: str) -> None:
    with pytest.raises(OptionError) as caught:
        resolve_addr(flag, None, "/p/fdl.cluster.yml")
    assert caught.value.param == "--addr" and caught.value.kind == "param"


@pytest.mark.parametrize(
    ("flag", "controller", "expected", "note"),
    [
        ("10.0.0.1:7000", ("10.0.0.2", 7001), "10.0.0.1:7000", None),
        (None, ("10.0.0.2", 7001), "10.0.0.2:7001", "controller from /p/fdl.cluster.yml"),
        (None, ("0.0.0.0", 7001), "127.0.0.1:7001", "controller from /p/fdl.cluster.yml"),
        (None, ("::", 7001), "[::1]:7001", "controller from /p/fdl.cluster.yml"),
        (None, None, DEFAULT_ADDR, f"no --addr and no ./fdl.cluster.yml: trying {DEFAULT_ADDR}"),
    ],
)
def test_status_address_flag_then_cluster_file_then_default(
    flag: str | None, controller: tuple[str, int] | None, expected: str, note: str | None
) -> None:
    assert resolve_addr(flag, controller, "/p/fdl.cluster.yml") == (expected, note)


CLUSTER_PIN = "sha256:" + "ee" * 32


@pytest.mark.parametrize(
    ("flag", "env", "cluster_pin", "expected"),
    [
        (PIN_COLONS, {"FDL_TLS_FINGERPRINT": PIN}, CLUSTER_PIN, "sha256:" + "cd" * 32),
        (None, {"FDL_TLS_FINGERPRINT": PIN}, CLUSTER_PIN, PIN),
        (None, {}, CLUSTER_PIN, CLUSTER_PIN),
        (None, {"FDL_TLS_FINGERPRINT": ""}, None, None),
    ],
)
def test_status_pin_flag_then_env_then_cluster_certificate(
    flag: str | None, env: dict[str, str], cluster_pin: str | None, expected: str | None
) -> None:
    assert resolve_pin(flag, env, cluster_pin) == expected


def test_status_a_bad_pin_names_where_it_came_from() -> None:
    with pytest.raises(OptionError) as caught:
        resolve_pin(None, {"FDL_TLS_FINGERPRINT": "nope"}, None)
    assert caught.value.param == "FDL_TLS_FINGERPRINT"
    with pytest.raises(OptionError) as caught:
        resolve_pin("nope", {}, None)
    assert caught.value.param == "--tls-fingerprint"


def test_join_takes_fdl_tls_fingerprint_under_the_flag_and_over_the_spec_and_block() -> None:
    spec, block = {"tls_fingerprint": PIN_SPEC}, {"tls_fingerprint": PIN}
    assert join(ADDR | {"env_pin": PIN_COLONS}, spec, block).tls_fingerprint == "sha256:" + "cd" * 32
    assert join(ADDR | {"pin": PIN, "env_pin": PIN_COLONS}, spec, block).tls_fingerprint == PIN
    with pytest.raises(OptionError) as caught:
        join(ADDR | {"env_pin": "nope"}, {}, {})
    assert caught.value.param == "FDL_TLS_FINGERPRINT"


def test_the_resolvers_import_neither_click_nor_asyncio() -> None:
    code = "import sys, flodl_agent.cli.options; print(sorted({'click', 'asyncio'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_publish_builds_where_the_cluster_files_controller_says() -> None:
    def gate(**controller: str) -> Any:
        block = Controller.model_validate({"host": "h", **controller})
        return resolve_publish(PublishFlags(spec="file:///src"), Publish(), block)

    assert (gate().gate_docker, gate().gate_venv) == (None, None)  # this venv, the CPU variant
    assert gate(arch="cu126").gate_venv == "/opt/flodl/libtorch/cu126"  # the role's home without a path
    assert gate(arch="precompiled/cu128", path="/srv/x").gate_venv == "/srv/x/libtorch/precompiled/cu128"
    assert gate(docker="cuda").gate_docker == "cuda"
    with pytest.raises(OptionError) as both:
        gate(docker="cuda", arch="cu126")
    assert both.value.kind == "refusal" and "both docker and arch" in both.value.message

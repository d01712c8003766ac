"""Property tests: every valid model round-trips through YAML (and JSON), and
no input whatsoever escapes as anything but a ConfigError."""

from __future__ import annotations

import json
import string
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_agent.config import ConfigError, FdlConfig, parse_yaml, to_yaml, validate_data, validate_document
from flodl_agent.config.models import RANK_IDENTITY, RESERVED_PREFIX, VISIBILITY_MASKS

names = st.from_regex(r"[a-z][a-z0-9-]{0,10}", fullmatch=True)
dns_names = st.from_regex(r"[a-z]([a-z0-9-]{0,9}[a-z0-9])?", fullmatch=True)  # no label ends in `-`
paths = st.from_regex(r"/[a-z0-9_]{1,8}(/[a-z0-9_.-]{1,8}){0,3}", fullmatch=True)
env_keys = st.from_regex(r"[A-Z_][A-Z0-9_]{0,12}", fullmatch=True).filter(
    lambda k: k not in VISIBILITY_MASKS and k not in RANK_IDENTITY and not k.startswith(RESERVED_PREFIX)
)
# Text a process can be passed (names.os_problem): anything UTF-8 writes (no lone surrogate)
# but NUL.
passable = st.characters(codec="utf-8", exclude_characters="\x00")
env = st.dictionaries(env_keys, st.text(passable, max_size=20), max_size=3)
devices = st.one_of(
    st.just("all"),
    st.integers(1, 64).map(lambda n: f"cpu:{n}"),
    st.lists(st.integers(0, 15), min_size=1, max_size=8, unique=True),
)
shares = st.floats(min_value=0.01, max_value=4.0, allow_nan=False)
ssh = st.fixed_dictionaries(
    {},
    optional={
        "target": dns_names,
        "port": st.integers(1, 65535),
        "user": names,
        "identity_file": paths,
        "options": st.lists(
            st.sampled_from(["ProxyJump=bastion", "ServerAliveInterval=15", "Compression yes"])
        ),
    },
)


@st.composite
def join_windows(draw: st.DrawFn) -> dict[str, Any]:
    out: dict[str, Any] = {}
    timeout = draw(st.integers(1, 10_000))
    if draw(st.booleans()):
        out["join_timeout"] = timeout
    else:
        timeout = 300
    cap = draw(st.integers(timeout, 20_000))
    if cap != 600 or timeout > 600:
        out["max_join_timeout"] = max(cap, timeout)
    start = draw(st.sampled_from(["auto", "manual", "hybrid"]))
    out["start"] = start
    discovery = draw(st.booleans())
    if discovery:
        out["discovery"] = True
        out["tunnel_only"] = draw(st.booleans())
    minimum = draw(st.integers(1, 64)) if discovery or draw(st.booleans()) else None
    if minimum is not None:
        out["min_rank_start"] = minimum
    if start != "manual" and draw(st.booleans()):
        out["target_ranks"] = draw(st.integers(minimum or 1, 128))
    if draw(st.booleans()):
        out["token"] = draw(st.text("0123456789abcdef", min_size=32, max_size=32))
    else:
        out["open_admission"] = draw(st.booleans())
    return out


WORKER_KEYS = [
    ("ssh", ssh),
    ("tunnel", st.booleans()),
    ("path", paths),
    ("arch", st.sampled_from(["precompiled/cu128", "builds/sm61-sm120", "cpu"])),
    ("docker", names),
    ("data_path", paths),
    ("env", env),
    ("gpu_ram_share", shares),
]


@st.composite
def workers_of(draw: st.DrawFn, host: str, several: bool) -> dict[str, Any]:
    worker: dict[str, Any] = {"host": host, "local_devices": draw(devices)}
    if several or draw(st.booleans()):
        worker["nccl_socket_ifname"] = draw(st.sampled_from(["eth0", "enp1s0", "^lo,docker0", "=ib0"]))
    for key, strategy in WORKER_KEYS:
        if draw(st.booleans()):
            worker[key] = draw(strategy)
    return worker


@st.composite
def controllers(draw: st.DrawFn, join: dict[str, Any], roster: bool) -> dict[str, Any]:
    controller: dict[str, Any] = {"host": draw(st.sampled_from(["127.0.0.1", "10.0.0.1", "ctrl.example"]))}
    if draw(st.booleans()):
        controller["port"] = draw(st.integers(1, 65535))
    for key, strategy in [("path", paths), ("docker", names)]:
        if draw(st.booleans()):
            controller[key] = draw(strategy)
    controller["join"] = join
    # With no roster, a network bind must let walk-ins verify.
    network_bind = controller["host"] != "127.0.0.1"
    if not roster and network_bind and not join.get("tunnel_only") and "token" not in join:
        join["open_admission"] = True
    return controller


@st.composite
def clusters(draw: st.DrawFn) -> dict[str, Any]:
    hosts = draw(st.lists(names, max_size=5, unique=True))
    join = draw(join_windows())
    if not hosts:
        join.update(discovery=True, min_rank_start=join.get("min_rank_start", 1))
    workers = [draw(workers_of(host, len(hosts) > 1)) for host in hosts]
    cluster: dict[str, Any] = {"controller": draw(controllers(join, bool(hosts))), "workers": workers}
    if draw(st.booleans()):
        cluster["env"] = draw(env)
    if draw(st.booleans()):
        cluster["gpu_ram_share"] = draw(shares)
    if draw(st.booleans()):
        # nccl only where nothing tunnels and no worker offers CPU ranks (the plane's rules)
        meshable = not join.get("tunnel_only") and not any(
            w.get("tunnel") or str(w["local_devices"]).startswith("cpu") for w in workers
        )
        cluster["plane"] = draw(st.sampled_from(["cpu", "nccl"] if meshable else ["cpu"]))
    return {"cluster": cluster}


join_blocks = st.fixed_dictionaries(
    {},
    optional={
        "controller": st.sampled_from(["10.0.0.1:1337", "ctrl", "[fd00::1]:7"]),
        "host": names,
        "devices": devices,
        "args": st.lists(st.text(passable, max_size=10), max_size=4),
        "persist": st.booleans(),
        "libtorch": st.sampled_from(["auto", "cpu", "cu128", "rocm6.4"]),
        "source": st.fixed_dictionaries(
            {"from": st.sampled_from(["file:///t", "rsync://h:/tree", "git+https://h/o/r#v1"])},
            optional={"cwd": names, "build": st.text(passable, max_size=20), "bin": names},
        ),
        "env": env,
    },
).map(lambda block: block | {"bin": "train"} if block.get("args") and "source" not in block else block)


@settings(max_examples=150, deadline=None)
@given(
    clusters(),
    st.one_of(st.none(), join_blocks),
    st.dictionaries(names, st.lists(st.text(passable, max_size=12), min_size=1, max_size=4), max_size=3),
)
def test_valid_models_round_trip_through_yaml_and_json(
    data: dict[str, Any], join: dict[str, Any] | None, commands: dict[str, list[str]]
) -> None:
    if join is not None:
        data = {**data, "join": join}
    if commands:
        data = {**data, "commands": commands}
    model = validate_data(data)
    again = validate_document(parse_yaml(to_yaml(model), "roundtrip.yml"))
    assert again == model
    as_json = json.loads(model.model_dump_json(by_alias=True))
    assert FdlConfig.model_validate(as_json) == model


field_names = st.sampled_from(
    [
        "cluster",
        "controller",
        "workers",
        "join",
        "host",
        "port",
        "local_devices",
        "env",
        "ssh",
        "token",
        "start",
        "min_rank_start",
        "target_ranks",
        "options",
        "source",
        "from",
        "devices",
        "publish",
        "x",
    ]
)
junk = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-5, 70_000),
        st.floats(allow_nan=True),
        st.text(string.printable, max_size=12),
        names,
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(field_names, children, max_size=5)
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(junk)
def test_any_structure_is_a_model_or_a_config_error(data: Any) -> None:
    try:
        validate_data(data)
    except ConfigError as exc:
        assert exc.problems and all(p.message for p in exc.problems)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_any_text_is_a_model_or_a_config_error(text: str) -> None:
    try:
        validate_document(parse_yaml(text, "fuzz.yml"))
    except ConfigError as exc:
        assert exc.problems and all(p.file == "fuzz.yml" for p in exc.problems)

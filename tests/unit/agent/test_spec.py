"""The agent spec: a launcher's encoding is what an agent decodes, field for field."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from flodl_agent.agent.spec import AgentSpec, decode, encode, for_worker
from flodl_agent.config import Cluster, ClusterBuilder
from flodl_agent.fleet.fanout import plan


def _cluster() -> Cluster:
    return (
        ClusterBuilder()
        .controller("10.0.0.1", path="/opt/flodl")
        .worker(
            "node-a",
            local_devices=[0, 1],
            data_path="/data",
            env={"A": "1"},
            nccl_socket_ifname="eth1",
        )
        .build()
    )


def test_a_worker_entry_round_trips_through_one_stdin_line() -> None:
    cluster = _cluster()
    spec = for_worker(cluster.workers[0])
    line = encode(spec)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode(line.decode()) == spec
    assert (spec.host, spec.devices, spec.data_path, spec.env, spec.socket_ifname) == (
        "node-a",
        "0,1",
        "/data",
        {"A": "1"},
        "eth1",
    )
    assert spec.controller_host is None and spec.key is None  # a probe's spec dials nowhere


def test_the_fan_out_plan_carries_the_spec_with_where_to_dial_and_the_key() -> None:
    cluster = _cluster()
    key = bytes(range(16))  # the worker's host key (Controller.host_key)
    p = plan(cluster.workers[0], cluster, 7000, key)
    spec = decode(p.stdin.decode())
    assert (spec.controller_host, spec.controller_port, spec.host_key) == ("10.0.0.1", 7000, key.hex())
    assert spec.key is None  # the run's key never leaves the controller
    assert spec.host == "node-a" and spec.devices == "0,1"
    # open admission: no key at all (the salt comes back in Accept)
    assert decode(plan(cluster.workers[0], cluster, 7000, None).stdin.decode()).host_key is None


def test_a_spec_with_a_host_key_names_its_host() -> None:
    with pytest.raises(ValidationError, match="host_key is the key of one host name"):
        AgentSpec(host_key="ab" * 16)


@pytest.mark.parametrize(
    "bad",
    ["zz", "7b7d7b", AgentSpec().model_dump_json().replace("1337", "0").encode().hex()],
)
def test_anything_but_a_hex_encoded_spec_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="agent spec"):
        decode(bad)


def test_unknown_fields_from_a_newer_launcher_are_ignored() -> None:
    assert decode(b'{"host": "h", "future": 1}'.hex()).host == "h"


def test_a_workers_gpu_ram_share_travels_in_the_spec_and_stays_out_when_unset() -> None:
    builder = ClusterBuilder().controller("h").worker("apu", gpu_ram_share=0.75, nccl_socket_ifname="eth0")
    cluster = builder.worker("plain", nccl_socket_ifname="eth0").build()
    apu, plain = (decode(encode(for_worker(w)).decode()) for w in cluster.workers)
    assert apu.gpu_ram_share == 0.75
    assert plain.gpu_ram_share is None and "gpu_ram_share" not in plain.model_dump(exclude_unset=True)


def test_a_workers_arch_travels_as_the_specs_libtorch() -> None:
    cluster = ClusterBuilder().controller("10.0.0.1").worker("node-a", arch="precompiled/cu128").build()
    spec = decode(encode(for_worker(cluster.workers[0])).decode())
    assert spec.libtorch == "precompiled/cu128"
    unset = encode(for_worker(_cluster().workers[0]))
    assert b"libtorch" not in bytes.fromhex(unset.decode())  # no arch: the field stays out


def test_a_workers_docker_travels_in_the_spec() -> None:
    cluster = ClusterBuilder().controller("10.0.0.1").worker("node-a", docker="cuda").build()
    assert decode(encode(for_worker(cluster.workers[0])).decode()).docker == "cuda"
    assert for_worker(_cluster().workers[0]).docker is None
    with pytest.raises(ValueError, match="agent spec"):
        decode(AgentSpec().model_dump_json().replace("}", ', "docker": "-d"}').encode().hex())


@pytest.mark.parametrize("bad", ["/opt/flodl/libtorch/cu126", "../cu126", "cu126//x", ""])
def test_a_libtorch_that_is_not_a_variant_sub_path_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="agent spec"):
        decode(AgentSpec().model_dump_json().replace("}", f', "libtorch": "{bad}"}}').encode().hex())


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"env": {"A": "x\u0000y"}}, "env.A"),
        ({"env": {"A=B": "x"}}, "env.A=B"),
        ({"data_path": "/d\u0000"}, "data_path"),
        ({"socket_ifname": "eth0\u0000"}, "socket_ifname"),
    ],
)
def test_a_spec_no_process_could_be_started_from_is_refused_by_field(
    fields: dict[str, object], where: str
) -> None:
    with pytest.raises(ValueError, match="agent spec") as caught:
        decode(json.dumps(fields).encode().hex())
    assert f"({where}: " in str(caught.value)

"""The join: and publish: blocks of fdl.yml."""

from __future__ import annotations

import pytest

from flodl_agent.config import DeviceOffer
from tests.support import load, problems_of


def join_problem(body: str) -> tuple[str, str]:
    problems = problems_of("join:\n" + body)
    assert len(problems) == 1, problems
    return problems[0].path, problems[0].message


def test_every_join_field() -> None:
    config = load(
        """
        join:
          controller: 10.0.0.1:1337
          token: 0123456789abcdef0123456789abcdef
          host: box-7
          devices: 0,1
          bin: /opt/train/bin/train
          args: ["--model", "resnet"]
          persist: true
          data_path: /flodl/data
          data_source: sshfs://flodl-join@10.0.0.1:/flodl/data
          gpu_ram_share: 0.5
          libtorch: cu128
          nccl_socket_ifname: eth0
          env: {NCCL_DEBUG: INFO}
        """
    )
    join = config.join
    assert join is not None
    assert join.devices == DeviceOffer("gpus", gpus=(0, 1))
    assert (join.controller, join.host, join.persist, join.libtorch) == (
        "10.0.0.1:1337",
        "box-7",
        True,
        "cu128",
    )


@pytest.mark.parametrize("variant", ["auto", "cpu", "cu126", "cu128", "rocm6.4", "rocm7"])
def test_libtorch_variants(variant: str) -> None:
    assert problems_of(f"join:\n  libtorch: {variant}\n") == []


@pytest.mark.parametrize(
    ("body", "path", "fragment"),
    [
        ("  libtorch: cuda12\n", "join.libtorch", "is not a torch variant"),
        ("  bin: train\n  source: {from: 'file:///t'}\n", "join.bin", "are alternatives"),
        ("  data_source: sshfs://h:/d\n", "join.data_path", "required with data_source"),
        ("  data_path: /d\n  data_source: nfs://h/d\n", "join.data_source", "is not a data source"),
        ("  ssh: {user: flodl-join}\n", "join.ssh.target", "is required"),
        ("  source: {from: 'git+https://h/o/r'}\n", "join.source.from", "pins no ref"),
        ("  source: {cwd: x}\n", "join.source.from", "is required"),
        ("  controller: 'h:99999'\n", "join.controller", "`99999` is not a port (1-65535)"),
        ("  controller: 'http://h:1'\n", "join.controller", "drop the `http://`"),
        ("  controller: 'fd00::1'\n", "join.controller", "an IPv6 address goes in brackets"),
        ("  devices: cpu:0\n", "join.devices", "needs a CPU rank count"),
        ("  args: --model resnet\n", "join.args", "expected a list"),
        ("  persits: true\n", "join.persits", "unknown key `persits`"),
        ("  env: {ROCR_VISIBLE_DEVICES: '0'}\n", "join.env.ROCR_VISIBLE_DEVICES", "reserved"),
        (f"  host_key: {'ab' * 16}\n", "join.host_key", "join.host does not say which"),
        (f"  host: w1\n  host_key: {'ab' * 16}\n  token: {'cd' * 16}\n", "join.host_key", "are alternatives"),
    ],
)
def test_join_rules(body: str, path: str, fragment: str) -> None:
    got_path, message = join_problem(body)
    assert (got_path, fragment in message) == (path, True), message


def test_a_malformed_host_key_says_where_it_comes_from() -> None:
    [problem] = problems_of("join:\n  host: w1\n  host_key: abc\n")
    assert problem.path == "join.host_key" and "32 hex characters" in problem.message
    assert "re-run site.yml" in (problem.hint or "")


@pytest.mark.parametrize("address", ["10.0.0.1", "10.0.0.1:1337", "ctrl.example.com:7000", "[fd00::1]:1337"])
def test_controller_addresses(address: str) -> None:
    assert problems_of(f"join:\n  controller: '{address}'\n") == []


def test_publish_block() -> None:
    config = load(
        """
        publish:
          source: git+ssh://git@git.example.com/op/train.git#v3
          bin: train.py
          cwd: ddp
          build: pip install -e .
          to: /srv/flodl/run
          identity: /home/op/.ssh/publish_key
          args: ["--epochs", "20"]
        """
    )
    assert config.publish is not None and config.publish.args == ["--epochs", "20"]
    (p,) = problems_of("publish:\n  source: git+ssh://git@h/o/r.git\n")
    assert p.path == "publish.source" and "pins no ref" in p.message


def test_unknown_top_level_block_suggests_the_right_one() -> None:
    (p,) = problems_of("joins:\n  persist: true\n")
    assert p.path == "joins" and p.hint == "did you mean `join`?"

"""The agent's parts: specs, the offer as this box reads it, rank environments through an Attempt."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from flodl_agent.agent.agent import AgentFailure, Attempt
from flodl_agent.agent.box import box_offer
from flodl_agent.agent.options import AgentOptions
from flodl_agent.agent.prepare import Prepared
from flodl_agent.agent.spec import decode
from flodl_agent.config import DeviceOffer, Ssh
from flodl_agent.hardware.offer import Offer
from flodl_agent.protocol.messages import Hello, HostEnvelope, WorldFormed


def test_agent_spec_round_trip_and_refusals() -> None:
    raw = (
        json.dumps(
            {
                "host": "box",
                "controller_host": "10.0.0.1",
                "controller_port": 7000,
                "key": "ab" * 16,
                "devices": "cpu:2",
            }
        )
        .encode()
        .hex()
    )
    spec = decode(raw)
    assert (spec.host, spec.controller_port, spec.devices) == ("box", 7000, "cpu:2")
    for bad in ("zz", "7b7d7b", json.dumps({"controller_port": 0}).encode().hex()):
        with pytest.raises(ValueError, match="agent spec"):
            decode(bad)


def test_cpu_offers_need_no_gpu() -> None:
    offer = box_offer(DeviceOffer("cpu", cpus=3))
    assert offer.devices == ["cpu:0", "cpu:1", "cpu:2"] and offer.variant == "cpu"


def test_a_box_without_gpus_offering_gpus_is_a_permanent_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a box that has one
    with pytest.raises(AgentFailure) as caught:
        box_offer(DeviceOffer("all"))
    assert caught.value.code == 2 and "no usable GPU" in caught.value.message
    assert "--devices cpu:N" in caught.value.fix


def test_a_card_the_build_has_no_kernel_for_is_refused_before_the_dial(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No GPU here: torch answers for a box with an 8.6 card and a 12.0 card (the gate's
    verdicts over facts are tabled in test_offer.py; this is the reading of them)."""
    torch = pytest.importorskip("torch")
    cards = {0: ("NVIDIA A40", (8, 6)), 1: ("NVIDIA RTX PRO 6000", (12, 0))}
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: cards[i][0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: cards[i][1])
    monkeypatch.setattr(torch._C, "_cuda_getArchFlags", lambda: "sm_50 sm_80 sm_90", raising=False)
    with pytest.raises(AgentFailure) as caught:
        box_offer(DeviceOffer("all"))
    assert caught.value.code == 2
    assert "ships no kernel for part of what this box offers: GPU 1 (NVIDIA RTX PRO 6000, sm_120)" in (
        caught.value.message
    )
    assert "libtorch: auto" in caught.value.fix and "--devices" in caught.value.fix
    offer = box_offer(DeviceOffer("gpus", gpus=(0,)))  # scoped to the covered card
    assert offer.devices == ["cuda:0"] and offer.variant == "cu126"


def test_rank_env_uses_the_road_this_join_took() -> None:
    options = AgentOptions(host="b", data_path="/flodl/data", env={"NCCL_DEBUG": "INFO"})
    attempt = Attempt(options, Offer(["cuda:0", "cuda:3"], ["A100", "A100"], "cu128"), lambda _: None)
    world = WorldFormed(
        world_size=5,
        host=HostEnvelope(host="b", first_rank=3, count=2),
        group=1,
        hosts=2,
        controller="10.0.0.1:1337",  # the controller's view; this box came through a tunnel
        command=["/opt/a/train", "--epochs", "3"],
        env={"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "4"},
    )
    envs = attempt.rank_env(world, "127.0.0.1:40111", 45000)
    assert [(e["RANK"], e["LOCAL_RANK"], e["CUDA_VISIBLE_DEVICES"]) for e in envs] == [
        ("3", "0", "0"),
        ("4", "1", "3"),
    ]
    first = envs[0]
    assert (first["WORLD_SIZE"], first["LOCAL_WORLD_SIZE"], first["GROUP_RANK"]) == ("5", "2", "1")
    # every rank is a client of the agent's loopback store; the road is the controller's
    assert (first["MASTER_ADDR"], first["MASTER_PORT"]) == ("127.0.0.1", "45000")
    assert first["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert first["FLODL_CONTROLLER"] == "127.0.0.1:40111"
    assert first["NCCL_DEBUG"] == "INFO" and first["OMP_NUM_THREADS"] == "4"  # host env beats cluster env
    assert first["FLODL_DATA_PATH"] == "/flodl/data"


LAUNCH = ["python3", "rank.py", "--epochs", "3"]


@pytest.mark.parametrize(
    ("bin_", "args", "prepared", "expected"),
    [
        # no command of its own: the launch's, whole
        (None, [], None, LAUNCH),
        # --bin PATH -- ARGS is the whole command: nothing of the launch's survives
        ("/opt/b/train", ["--model", "resnet"], None, ["/opt/b/train", "--model", "resnet"]),
        ("/opt/b/train", [], None, ["/opt/b/train"]),
        ("./train", ["-v"], None, ["./train", "-v"]),  # as written: not `train`, which PATH would find
        # a .py entry that is not executable runs under this interpreter (the variant's venv)
        ("x.py", ["--flag", "v"], None, [sys.executable, "x.py", "--flag", "v"]),
        # a published run this box fetched is the authority over both
        (
            "/opt/b/train",
            ["--x"],
            Prepared(["/stage/train", "--y"], Path("/stage"), "ab" * 16),
            ["/stage/train", "--y"],
        ),
        (None, [], Prepared(["/stage/train"], Path("/stage"), ""), ["/stage/train"]),
    ],
)
def test_a_walk_ins_command_its_own_then_a_manifests_then_the_launchs(
    bin_: str | None, args: list[str], prepared: Prepared | None, expected: list[str]
) -> None:
    options = AgentOptions(host="a", bin=bin_, args=args)
    attempt = Attempt(options, Offer(["cpu:0"], ["cpu"], "cpu"), lambda _: None, prepared=prepared)
    world = alone(1).model_copy(update={"command": LAUNCH})
    assert attempt.command(world) == expected
    # the hello shows the controller what runs when it is not the launch's command
    own = attempt.hello()["command"]
    assert own == ("" if expected == LAUNCH else shlex.join(expected))


def test_an_executable_py_entry_runs_as_itself(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    attempt = Attempt(AgentOptions(host="a", bin=str(script)), Offer(["cpu:0"], ["cpu"], "cpu"), print)
    assert attempt.command(alone(1)) == [str(script)]


def test_the_hello_says_when_the_box_dials_through_a_tunnel() -> None:
    offer = Offer(["cpu:0"], ["cpu"], "cpu")
    direct = Attempt(AgentOptions(host="a"), offer, print).hello()
    forward = Attempt(AgentOptions(host="a", ssh=Ssh(target="door")), offer, print).hello()  # --ssh
    remote = Attempt(AgentOptions(host="a", tunnel=True), offer, print).hello()  # a launcher's ssh -R
    assert (direct["tunnel"], forward["tunnel"], remote["tunnel"]) == (False, True, True)


def test_a_shown_command_fits_the_hellos_bounds() -> None:
    from flodl_agent.protocol.messages import COMMAND_SHOWN, shown_command

    assert shown_command(["train", "--name", "a b"]) == "train --name 'a b'"
    assert shown_command(["train", "line\nbreak\x1b[31m"]) == "train 'line?break?[31m'"
    assert shown_command(["train", "ev\u202eil\x9b2J"]) == "train 'ev?il?2J'"  # bidi, C1: the hello's rule
    long = shown_command(["train", "x" * 5000])
    assert len(long) == COMMAND_SHOWN and long.endswith("…")
    # what the agent sends, the controller parses
    Hello.model_validate(
        {"nonce": b"n" * 16, "client_nonce": b"c" * 16, "host": "a", "devices": ["cpu:0"], "command": long}
    )


def test_child_output_becomes_lines_whatever_the_child_writes() -> None:
    import asyncio

    from flodl_agent.agent.rank_io import output_lines

    async def collect(data: bytes) -> list[str]:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return [line async for line in output_lines(reader, longest=10)]

    # progress bars end their lines with \r; a 100 KB line is cut, not fatal; no trailing newline is fine
    assert asyncio.run(collect(b"epoch 1\r 10%\r 20%\nok\r\n")) == ["epoch 1", " 10%", " 20%", "ok"]
    assert asyncio.run(collect(b"x" * 25)) == ["x" * 10, "x" * 10, "x" * 5]
    assert asyncio.run(collect(b"\xff\xfehalf")) == ["\ufffd\ufffdhalf"]


def alone(ranks: int) -> WorldFormed:
    """A world of one host, "a", running ``ranks`` ranks."""
    return WorldFormed(
        world_size=ranks,
        host=HostEnvelope(host="a", first_rank=0, count=ranks),
        group=0,
        hosts=1,
        controller="h:1",
        command=["x"],
    )


def test_ranks_get_no_credentials_or_internal_plumbing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FDL_TOKEN", "0" * 32)
    monkeypatch.setenv("FLODL_INTERNAL_AGENT_JSON", "7b7d")
    attempt = Attempt(AgentOptions(host="a"), Offer(["cpu:0"], ["cpu"], "cpu"), lambda _: None)
    world = alone(1)
    (env,) = attempt.rank_env(world, "[fd00::1]:7000", 45000)
    assert "FDL_TOKEN" not in env and "FLODL_INTERNAL_AGENT_JSON" not in env
    assert env["FLODL_CONTROLLER"] == "[fd00::1]:7000"


def test_socket_ifnames_give_nccl_its_syntax_and_gloo_a_concrete_interface() -> None:
    from flodl_agent.net import socket_ifnames

    ifs = ["docker0", "enp1s0", "enp2s0", "lo"]
    assert socket_ifnames("", ifs) == {}
    assert socket_ifnames("enp2s0", ifs) == {"NCCL_SOCKET_IFNAME": "enp2s0", "GLOO_SOCKET_IFNAME": "enp2s0"}
    assert socket_ifnames("enp", ifs)["GLOO_SOCKET_IFNAME"] == "enp1s0"  # a prefix: the first match
    assert socket_ifnames("=enp", ifs) == {"NCCL_SOCKET_IFNAME": "=enp"}  # exact, and no such interface
    assert socket_ifnames("^docker,lo", ifs) == {
        "NCCL_SOCKET_IFNAME": "^docker,lo",
        "GLOO_SOCKET_IFNAME": "enp1s0",
    }
    assert socket_ifnames("eth0,enp2s0", ifs)["GLOO_SOCKET_IFNAME"] == "enp2s0"


def test_ranks_get_gloo_and_nccl_interfaces_unless_the_env_names_them() -> None:
    options = AgentOptions(host="a", socket_ifname="lo", env={"GLOO_SOCKET_IFNAME": "eth9"})
    attempt = Attempt(options, Offer(["cpu:0"], ["cpu"], "cpu"), lambda _: None)
    world = alone(1)
    (env,) = attempt.rank_env(world, "h:1", 1)
    assert env["NCCL_SOCKET_IFNAME"] == "lo" and env["GLOO_SOCKET_IFNAME"] == "eth9"


def test_ranks_sharing_a_box_default_to_one_omp_thread_like_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    attempt = Attempt(AgentOptions(host="a"), Offer(["cpu:0", "cpu:1"], ["cpu"] * 2, "cpu"), lambda _: None)
    world = alone(2)
    assert [e["OMP_NUM_THREADS"] for e in attempt.rank_env(world, "h:1", 1)] == ["1", "1"]
    mine = world.model_copy(update={"env": {"OMP_NUM_THREADS": "8"}})
    assert attempt.rank_env(mine, "h:1", 1)[0]["OMP_NUM_THREADS"] == "8"


def test_a_command_python_cannot_hand_the_kernel_is_a_reported_rank_failure() -> None:
    """A NUL in a rank's argv, env or cwd raises ValueError, not OSError: still the run's
    failure with a shell's code and why (never the agent's internal error)."""
    from flodl_agent.agent.rank_io import CANNOT_EXECUTE, start_failure
    from flodl_agent.retry import Transient

    failure, code, why = start_failure(["train\x00x"], ValueError("embedded null byte"))
    assert isinstance(failure, Transient)
    assert code == CANNOT_EXECUTE
    assert why == "train\x00x: embedded null byte"

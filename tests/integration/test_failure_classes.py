"""Walk-in failures classed and worded as the troubleshooting guide has them, against the
real thing: sshd with a guardrailed key and sshfs, the controller's dial guard from a
non-loopback address, the resolver, the kernel's bind and permission checks, and ranks
that die."""

from __future__ import annotations

import asyncio
import grp
import json
import os
import pwd
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from flodl_agent.agent.agent import PERMANENT, TRANSIENT, join
from flodl_agent.agent.options import AgentOptions
from flodl_agent.agent.prepare import PrepareFailure, mount_data
from flodl_agent.config import ClusterBuilder, DeviceOffer
from flodl_agent.config.models import Ssh
from flodl_agent.controller.admission import DialGuard
from flodl_agent.controller.controller import Controller
from flodl_agent.fleet.launcher import LaunchError, LaunchOptions, launch
from flodl_agent.hardware.gpus import AmdAccess, amd_access
from flodl_agent.hardware.offer import amd_gaps
from flodl_agent.observe.status import Unreachable, request
from flodl_agent.protocol import preamble
from flodl_agent.protocol.tunnel import Tunnel
from flodl_agent.retry import Transient
from tests.support import free_port, remote_address
from tests.support.control_plane import OK, agent, run, settings, until, walk_in
from tests.support.sshd import Sshd

REMOTE = remote_address()
needs_remote = pytest.mark.skipif(REMOTE is None, reason="needs a non-loopback address on this box")
needs_sshfs = pytest.mark.skipif(
    not Path("/dev/fuse").exists() or shutil.which("sshfs") is None, reason="sshfs or /dev/fuse missing"
)
# The tunnel-only recipe of docs/guardrails.md: a forward, and nologin for anything else.
TUNNEL_ONLY = 'restrict,port-forwarding,command="/usr/sbin/nologin"'


def mount_failure(spec: str, where: Path, ssh: Ssh) -> PrepareFailure:
    with pytest.raises(PrepareFailure) as caught:
        mount_data(spec, where, ssh)
    return caught.value


# --- the data mount behind a tunnel-only key -----------------------------------------


@needs_sshfs
def test_a_tunnel_only_key_mounts_nothing_permanently_and_names_door_a(tmp_path: Path, sshd: Sshd) -> None:
    sshd.authorize(TUNNEL_ONLY)
    root = tmp_path / "data"
    root.mkdir()
    ssh = sshd.door()
    spec = f"sshfs://root@127.0.0.1:{sshd.port}:{root}"

    async def tunnel_works() -> None:  # the same key's ssh -N sails through
        async with Tunnel(ssh, "127.0.0.1", sshd.port) as tunnel:
            reader, writer = await asyncio.open_connection("127.0.0.1", tunnel.local_port)
            assert (await reader.readline()).startswith(b"SSH-2.0-")  # the far end, through the forward
            writer.close()

    run(tunnel_works)
    refused = mount_failure(spec, tmp_path / "mnt", ssh)
    assert refused.code == PERMANENT
    assert refused.message.startswith(f"mounting {spec}: permission denied: this box's key opens the door")
    assert "This account is currently not available" in refused.message  # the far side's own words
    assert 'restrict,command="internal-sftp -R"' in refused.fix and "bare join.data_path" in refused.fix

    # A persist unit stops on it instead of re-dialling forever (the door runs no window here).
    logs: list[str] = []
    options = AgentOptions(
        ssh=ssh,
        data_source=spec,
        data_path=str(tmp_path / "mnt"),
        host="box-a",
        devices=DeviceOffer("cpu", cpus=1),
    )
    code = asyncio.run(join(options, persist=True, log=logs.append, backoff_start=0.01, attempts=3))
    assert code == PERMANENT and not any("re-dialling" in line for line in logs), logs


@needs_sshfs
def test_a_door_that_does_not_answer_stays_transient(tmp_path: Path, sshd: Sshd) -> None:
    ssh = Ssh(identity_file=str(sshd.client_key), options=sshd.options)
    down = mount_failure(f"sshfs://root@127.0.0.1:{free_port()}:/data", tmp_path / "mnt", ssh)
    assert down.code == TRANSIENT and "is the door reachable?" in down.fix
    unknown = mount_failure("sshfs://root@no-such-door.invalid:/data", tmp_path / "mnt2", ssh)
    assert unknown.code == TRANSIENT
    assert "the door's name no-such-door.invalid does not resolve" in unknown.message
    assert "DNS may come back" in unknown.fix


# --- refused for rate limiting --------------------------------------------------------


@needs_remote
def test_a_rate_limited_box_is_told_so_for_the_cost_of_one_send_and_re_dials() -> None:
    async def scenario() -> None:
        ctl = Controller(settings(bind="0.0.0.0", quorum=1, target=1))
        ctl.listener.gate.guard = DialGuard(burst=3, rate=0.0)  # spent budget never refills here
        await ctl.start()
        for _ in range(3):  # bad dials: junk on the preamble
            reader, writer = await asyncio.open_connection(REMOTE, ctl.port)
            writer.write(b"xxxx")
            assert await reader.read() == b""  # cut without a word
            writer.close()
        await until(lambda: ctl.dropped["channel"] == 3)
        reader, writer = await asyncio.open_connection(REMOTE, ctl.port)
        assert await reader.read() == preamble.RATE_LIMITED  # the fixed marker, then the close
        writer.close()

        logs: list[str] = []
        box = replace(agent(ctl, "box-a"), controller_host=str(REMOTE))
        code = await join(box, persist=True, log=logs.append, backoff_start=0.01, attempts=2)
        assert code == TRANSIENT
        said = [line for line in logs if "rate-limited" in line]
        assert len(said) == 2 and any("re-dialling" in line for line in logs), logs
        assert said[0] == (
            "refused: rate-limited by the controller after bad dials (wrong token?)\n"
            "    fix: wait; --persist backs off"
        )
        assert ctl.dropped["rate_limited"] == 3 and not ctl.links
        with pytest.raises(Unreachable, match="rate-limits this address after bad requests"):
            await asyncio.to_thread(request, f"{REMOTE}:{ctl.port}", "GET", "/state.json")  # fdl status
        # Loopback is exempt: the same box through a tunnel's address is served.
        assert await walk_in(agent(ctl, "box-a", key=ctl.key)) == 0
        await ctl.close()

    run(scenario)


# --- names that do not resolve ------------------------------------------------------


def test_a_controller_name_that_does_not_resolve_is_not_called_a_closed_window() -> None:
    box = AgentOptions(
        controller_host="no-such-controller.invalid", host="box-a", devices=DeviceOffer("cpu", cpus=1)
    )

    async def scenario() -> None:
        unknown = await walk_in(box)
        assert isinstance(unknown, Transient)
        assert unknown.message.startswith("the controller's name no-such-controller.invalid does not resolve")
        assert "is a window open" not in unknown.fix and "by its IP" in unknown.fix
        nobody = await walk_in(replace(box, controller_host="127.0.0.1", controller_port=free_port()))
        assert isinstance(nobody, Transient) and "is a window open?" in nobody.fix  # a port nobody holds

    run(scenario)


def test_a_door_name_that_does_not_resolve_is_said_by_the_tunnel() -> None:
    async def scenario() -> None:
        with pytest.raises(Transient) as caught:
            async with Tunnel(Ssh(target="no-such-door.invalid"), "127.0.0.1", 1337):
                pass
        assert "Could not resolve hostname" in caught.value.message
        assert "the door's name no-such-door.invalid does not resolve" in caught.value.fix

    run(scenario)


# --- the controller's bind ----------------------------------------------------------


def bind_refusal(bind: str, port: int) -> LaunchError:
    # A token: a network discovery window must let walk-ins verify (else the file is refused first).
    join = {"discovery": True, "min_rank_start": 1, "token": "ab" * 16}
    cluster = ClusterBuilder().controller(bind, port=port).join(**join).build()
    with pytest.raises(LaunchError) as caught:
        asyncio.run(launch(cluster, LaunchOptions(command=OK), lambda _: None))
    return caught.value


def test_a_bind_to_an_address_not_on_this_host_says_so() -> None:
    port = free_port()
    elsewhere = "203.0.113.77"  # TEST-NET-3: never one of this box's addresses
    refused = bind_refusal(elsewhere, port)
    assert (
        refused.message
        == f"cannot open the join window on {elsewhere}:{port}: address {elsewhere} is not on this host"
    )
    assert refused.fix.startswith("bind one of its addresses, 0.0.0.0, or fix cluster.controller.host")
    with socket.socket() as held:  # only a port in use is called another controller's
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = bind_refusal("127.0.0.1", held.getsockname()[1])
    assert taken.message.endswith("is already in use") and "another controller may hold the port" in taken.fix


# --- a rank failed: which, where, how --------------------------------------------------

# Rank 0 exits 3, rank 1 aborts (SIGABRT): both on one host.
DYING = [
    sys.executable,
    "-c",
    "import os, sys\nif os.environ['RANK'] == '1':\n    os.abort()\nsys.exit(3)",
]


def test_the_agent_names_each_failed_rank_its_host_and_how_it_ended() -> None:
    async def scenario() -> None:
        # Both losses within max_failure: no Abort, the ranks' own exits end the run.
        ctl = Controller(settings(DYING, quorum=2, target=2, max_failure="2"))
        await ctl.start()
        logs: list[str] = []
        assert await walk_in(agent(ctl, "box-a", 2), logs) == TRANSIENT
        assert (
            "ranks failed on box-a: rank 0 exited with code 3, rank 1 was killed by SIGABRT (-6); "
            "the run ended with errors"
        ) in logs, logs
        await ctl.finished.wait()
        assert ctl.exits == {"box-a": {0: 3, 1: -6}}
        await ctl.close()

    run(scenario)


def test_fdl_join_says_it_once_and_exits_transient() -> None:
    async def scenario() -> None:
        ctl = Controller(settings([sys.executable, "-c", "raise SystemExit(3)"], quorum=1, target=1))
        await ctl.start()
        logs: list[str] = []
        assert await join(agent(ctl, "box-a"), persist=False, log=logs.append) == TRANSIENT
        said = [line for line in logs if "rank failed" in line]
        assert said == ["a rank failed on box-a: rank 0 exited with code 3; the run ended with errors"], logs
        await ctl.close()

    run(scenario)


# --- a run's own failure: its ranks cannot start -----------------------------------


@pytest.mark.parametrize(
    ("entry", "code", "cause"),
    [("/nonexistent/entry", 127, "No such file or directory"), ("not-executable", 126, "Permission denied")],
)
def test_a_rank_that_cannot_start_is_the_runs_failure_said_to_the_controller(
    tmp_path: Path, entry: str, code: int, cause: str
) -> None:
    if entry == "not-executable":
        entry = str(tmp_path / "train")
        Path(entry).write_text("#!/bin/sh\nexit 0\n")
        Path(entry).chmod(0o644)  # there, but no x bit: the kernel refuses it (root too)

    async def scenario() -> None:
        said: list[str] = []
        ctl = Controller(settings([entry, "--epochs", "1"], quorum=2, target=2), log=said.append)
        await ctl.start()
        logs: list[str] = []
        # The run's failure is transient: a --persist walk-in stays for the next launch.
        assert await join(agent(ctl, "box-a", 2), persist=False, log=logs.append) == TRANSIENT
        assert f"cannot start the entry point {entry}: {cause}" in logs[-1], logs
        await ctl.finished.wait()
        # The controller heard each rank's end as a shell gives it, and why: never a lost host.
        assert ctl.exits == {"box-a": {0: code, 1: code}}
        assert ctl.reason.startswith(f"rank 0 on box-a could not start: {entry}: {cause}"), ctl.reason
        assert f"rank 1 on box-a could not start: {entry}: {cause}" in said
        assert not [line for line in said if "still running" in line], said
        await ctl.close()

    run(scenario)


# --- an AMD box this user cannot reach ------------------------------------------------


@pytest.fixture
def amd_box() -> Iterator[Path]:
    """A root as the AMD facts are read from it: one GPU in the KFD topology, /dev/kfd and a
    render node owned root:render 0660, as udev makes them. Traversable by any user."""
    with tempfile.TemporaryDirectory() as where:
        root = Path(where)
        node = root / "sys/class/kfd/kfd/topology/nodes/1"
        node.mkdir(parents=True)
        (node / "properties").write_text("gfx_target_version 90402\n")
        (root / "dev/dri").mkdir(parents=True)
        try:
            render = grp.getgrnam("render").gr_gid
        except KeyError:  # a box without the group: root's stands in, nobody is in it either
            render = 0
        for device in (root / "dev/kfd", root / "dev/dri/renderD128"):
            device.write_bytes(b"")
            os.chown(device, 0, render)
            device.chmod(0o660)
        for path in [root, *root.rglob("*")]:
            if path.is_dir():
                path.chmod(0o755)
        yield root


def facts_as_outsider(root: Path) -> AmdAccess:
    """``amd_access`` as a user in none of the devices' groups (nobody, when this runs as root):
    the kernel's own permission check decides what opens."""
    if os.geteuid() != 0:
        return amd_access(root, path="")
    nobody = pwd.getpwnam("nobody")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child drops to nobody, reads the facts, hands them back and leaves
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            os.write(write, json.dumps(asdict(amd_access(root, path=""))).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    data = b""
    while chunk := os.read(read, 65536):
        data += chunk
    os.close(read)
    assert os.waitpid(pid, 0)[1] == 0
    return AmdAccess(**json.loads(data))


def test_an_amd_box_whose_devices_this_user_cannot_open_names_the_membership_fix(amd_box: Path) -> None:
    facts = facts_as_outsider(amd_box)
    assert facts.gpus == ["gfx942"]
    assert facts.kfd == "Permission denied" and facts.render == {"renderD128": "Permission denied"}
    no_runtime, denied = amd_gaps(facts)
    assert "no ROCm userspace runtime" in no_runtime.message and "amdgpu-install" in no_runtime.fix
    assert "/dev/kfd (Permission denied), /dev/dri/renderD128 (Permission denied)" in denied.message
    assert denied.fix.startswith(f"sudo usermod -aG render,video {facts.user}, then log in again")
    (amd_box / ".dockerenv").write_text("")  # the same box inside a container: pass the devices
    assert "--device /dev/kfd --device /dev/dri" in amd_gaps(facts_as_outsider(amd_box))[1].fix


def test_a_watched_launch_stopped_by_the_operator_does_not_linger_and_frees_its_port() -> None:
    # A page or `fdl status --watch` keeps a finished launch serving its final phase (the
    # linger); a signal means now: systemd's stop, or a relaunch that wants the port.
    port = free_port()
    join = {"discovery": True, "min_rank_start": 1, "target_ranks": 2, "join_timeout": 120}
    cluster = ClusterBuilder().controller("127.0.0.1", port=port).join(**join).build()

    async def scenario() -> int:
        task = asyncio.ensure_future(launch(cluster, LaunchOptions(command=OK, linger=600.0), lambda _: None))
        addr = f"127.0.0.1:{port}"

        def watched() -> bool:
            try:
                return request(addr, "GET", "/state.json").status == 200
            except Unreachable:
                return False

        deadline = time.monotonic() + 30
        while not await asyncio.to_thread(watched):  # polled: the launch counts as watched
            assert not task.done() and time.monotonic() < deadline, "the launch never served its status"
            await asyncio.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # the launch's own handler takes it
        return await asyncio.wait_for(task, 60)  # well inside the 600 s it would linger

    assert asyncio.run(scenario()) == 128 + signal.SIGTERM
    with socket.socket() as again:  # the port is free at once for the next launch (which reuses
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # addresses in TIME_WAIT, as it does)
        again.bind(("127.0.0.1", port))
        again.listen()

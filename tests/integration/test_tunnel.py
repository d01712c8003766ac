"""Walking in through real OpenSSH: an ssh -L forward, and the guardrailed door."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import yaml

from flodl_agent.agent.agent import PERMANENT, AgentFailure
from flodl_agent.agent.options import AgentOptions
from flodl_agent.config import DeviceOffer
from flodl_agent.controller.controller import Controller
from tests.support.control_plane import run, settings, walk_in
from tests.support.sshd import Sshd


def _through(server: Sshd, ctl: Controller, host: str) -> AgentOptions:
    return AgentOptions(
        controller_host="127.0.0.1",  # the controller as seen from the ssh host
        controller_port=ctl.port,
        host=host,
        devices=DeviceOffer("cpu", cpus=1),
        ssh=server.door(),
    )


def _env_dump(out: Path) -> list[str]:
    code = (
        "import json, os; "
        f"open(r'{out}', 'w').write(json.dumps({{k: os.environ[k] for k in "
        "['MASTER_ADDR', 'MASTER_PORT', 'FLODL_CONTROLLER']}))"
    )
    return [sys.executable, "-c", code]


def test_walk_in_through_an_ssh_forward_rewrites_the_controller_address(sshd: Sshd, tmp_path: Path) -> None:
    out = tmp_path / "env.json"
    ctl_port: list[int] = []

    async def scenario() -> None:
        ctl = Controller(settings(_env_dump(out), quorum=1, target=1))
        await ctl.start()
        ctl_port.append(ctl.port)
        logs: list[str] = []
        assert await walk_in(_through(sshd, ctl, "tunnelled"), logs) == 0, logs
        await ctl.finished.wait()
        assert ctl.exit_code == 0
        await ctl.close()

    run(scenario)
    env = json.loads(out.read_text())
    # the rank got the address this join used (the ephemeral local forward), not the controller's own
    assert env["MASTER_ADDR"] == "127.0.0.1"  # the rendezvous store (or its relay), on loopback
    host, port = env["FLODL_CONTROLLER"].rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) not in (0, ctl_port[0])


def test_a_guardrailed_nologin_door_carries_the_join_and_nothing_else(sshd: Sshd) -> None:
    async def scenario() -> None:
        ctl = Controller(settings(quorum=1, target=1))
        await ctl.start()
        sshd.authorize(
            f'restrict,port-forwarding,permitopen="127.0.0.1:{ctl.port}",command="/usr/sbin/nologin"'
        )
        # the door refuses a shell ...
        shell = await asyncio.to_thread(sshd.ssh, "id")
        assert "uid=" not in shell.stdout
        # ... and a forward anywhere but the controller port
        elsewhere = _through(sshd, ctl, "sneaky")
        elsewhere.controller_port = ctl.port + 1 if ctl.port < 65535 else ctl.port - 1
        refused = await walk_in(elsewhere)
        assert isinstance(refused, AgentFailure)
        # ... but carries the join
        assert await walk_in(_through(sshd, ctl, "door")) == 0
        await ctl.finished.wait()
        assert ctl.exit_code == 0
        await ctl.close()

    run(scenario)


def test_a_host_key_that_does_not_match_the_pin_stops_the_tunnel(sshd: Sshd) -> None:
    sshd.known_hosts.write_text(
        f"[127.0.0.1]:{sshd.port} ssh-ed25519 "
        "AAAAC3NzaC1lZDI1NTE5AAAAIBu6b4Y0N8fS3z5mXq3m0o6Pp3b0n3b0n3b0n3b0n3b0\n"
    )

    async def scenario() -> None:
        ctl = Controller(settings(quorum=1, target=1))
        await ctl.start()
        result = await walk_in(_through(sshd, ctl, "mitm"))
        # Permanent: flodl-join.service must not re-dial a man in the middle forever.
        assert isinstance(result, AgentFailure) and result.code == PERMANENT
        assert result.message == (
            "the ssh tunnel to 127.0.0.1: the host key does not match the one pinned in known_hosts "
            "(ssh: Host key verification failed)"
        )
        assert "pin its new key" in result.fix and "Never turn StrictHostKeyChecking off" in result.fix
        await ctl.close()

    run(scenario)


def test_an_nccl_window_refuses_a_walk_in_through_the_door_for_good(sshd: Sshd, tmp_path: Path) -> None:
    """The real `fdl join` through the guardrailed door: its hello says it rides a tunnel, and
    an NCCL plane (which a port forward cannot carry) refuses it permanently, naming the CPU modes."""
    said: list[str] = []
    ended: list[tuple[int | None, str]] = []

    async def scenario() -> None:
        ctl = Controller(settings(quorum=1, target=1, plane="nccl"), log=said.append)
        await ctl.start()
        sshd.authorize(
            f'restrict,port-forwarding,permitopen="127.0.0.1:{ctl.port}",command="/usr/sbin/nologin"'
        )
        door = {"target": "127.0.0.1", "port": sshd.port, "user": "root"}
        door |= {"identity_file": str(sshd.client_key), "options": sshd.options}
        (tmp_path / "fdl.yml").write_text(yaml.safe_dump({"join": {"ssh": door}}))  # what --ssh sets
        agent = await asyncio.create_subprocess_exec(
            *("fdl", "join", f"127.0.0.1:{ctl.port}", "--devices", "cpu:1", "--host", "door"),
            cwd=tmp_path,
            env={**os.environ, "NO_COLOR": "1"},
            stderr=asyncio.subprocess.PIPE,
        )
        _, stderr = await agent.communicate()
        ended.append((agent.returncode, stderr.decode()))
        assert ctl.refused == {"tunnel_under_nccl": 1} and ctl.window.joined_ranks == 0
        await ctl.close()

    run(scenario)
    ((returncode, stderr),) = ended
    assert returncode == 1, stderr  # this launch's plane, not the box: --persist re-dials the next
    assert "refused: this box dials through an ssh tunnel" in stderr
    assert "a port forward cannot carry" in stderr and "CPU mode" in stderr and "--plane cpu" in stderr
    assert any(line.startswith("refused door: this box dials through an ssh tunnel") for line in said)

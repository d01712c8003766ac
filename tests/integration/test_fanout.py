"""Fan-out over real OpenSSH: fdl launch starts one agent per configured worker.

Both "workers" are this machine reached through a private sshd on loopback,
under two roster names; the agents run the repository's own fdl.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flodl_agent.agent.spec import decode
from flodl_agent.config import Cluster, ClusterBuilder
from flodl_agent.fleet.fanout import orphan_tag, plan, remote_command
from flodl_agent.protocol.tls import generate
from tests.support import free_port
from tests.support.sshd import Sshd, loopback_cluster

ROOT = Path(__file__).parents[2]


TOKEN = {"token": "00112233445566778899aabbccddeeff"}


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "fdl").exists(), reason="needs the repository's .venv")
@pytest.mark.parametrize(
    ("join", "tls"), [({}, False), (TOKEN, False), (TOKEN, True)], ids=["open", "token", "tls"]
)
def test_launch_fans_out_over_ssh_and_runs_to_done(
    sshd: Sshd, tmp_path: Path, join: dict[str, str], tls: bool
) -> None:
    """Open (loopback, no token) or with a token: then each agent gets its own name's key on
    stdin, and over TLS the certificate's pin with it."""
    out = tmp_path / "ranks"
    out.mkdir()
    pair = (tmp_path / "c.pem", tmp_path / "c.key")
    if tls:
        generate(*pair, ["127.0.0.1"])
    config = loopback_cluster(tmp_path, sshd, free_port(), tls=pair if tls else None, **join)
    rank = [
        sys.executable,
        "-c",
        f"import os; open(os.path.join(r'{out}', os.environ['RANK']), 'w').write('x')",
    ]
    proc = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "fdl"), "launch", "--config", str(config), "--", *rank],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_COLOR": "1"},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["0", "1"]
    assert "fan-out: started the agent on fan-a" in proc.stderr
    assert "admitted fan-b" in proc.stderr and "run complete" in proc.stderr
    assert ("admission credential-checked" in proc.stderr) is bool(join)


def test_the_host_key_travels_on_stdin_never_in_argv() -> None:
    cluster = (
        ClusterBuilder()
        .controller("10.0.0.1", path="/opt/flodl")
        .worker("node-a", ssh={"target": "a.example", "user": "ops", "port": 2222}, local_devices=[0, 1])
        .build()
    )
    key = bytes(range(16))
    p = plan(cluster.workers[0], cluster, 1337, key)
    assert key.hex() not in " ".join(p.argv)
    assert key.hex() in bytes.fromhex(p.stdin.decode().strip()).decode()
    assert p.argv[-2] == "ops@a.example" and p.argv[p.argv.index("-p") : p.argv.index("-p") + 2] == [
        "-p",
        "2222",
    ]
    assert "BatchMode=yes" in p.argv


def test_remote_command_cleans_orphans_without_matching_itself() -> None:
    cluster = ClusterBuilder().controller("10.0.0.1").worker("node-a").build()
    tag = orphan_tag("10.0.0.1:1337", cluster.workers[0])
    assert tag == orphan_tag("10.0.0.1:1337", cluster.workers[0])  # stable across launches
    line = remote_command(tag, "/opt/flodl")
    assert f"--tag {tag}" not in line  # the value only in the assignment: pkill cannot match itself
    # run the cleanup for real: a fake orphan with the tag dies, the shell running it survives
    orphan = subprocess.Popen(["bash", "-c", f"exec -a 'fdl join --spec-stdin --tag {tag}' sleep 60"])
    try:
        done = subprocess.run(
            ["bash", "-c", line.split("; cd ")[0] + "; echo survived"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        assert "survived" in done.stdout
        assert orphan.wait(timeout=10) != 0
    finally:
        if orphan.poll() is None:
            orphan.kill()


def test_tunnel_workers_dial_through_a_remote_forward() -> None:
    cluster = ClusterBuilder().controller("10.0.0.1").worker("node-a", tunnel=True).build()
    p = plan(cluster.workers[0], cluster, 7000, bytes(16))
    # the worker's loopback, forwarded back to where the controller listens on its box
    assert "-R" in p.argv and p.argv[p.argv.index("-R") + 1] == "127.0.0.1:7000:10.0.0.1:7000"
    assert b"127.0.0.1" in bytes.fromhex(p.stdin.decode().strip())
    # the spec tells the agent it rides the forward: its hello says so (an NCCL plane refuses it)
    assert decode(p.stdin.decode()).tunnel
    direct = ClusterBuilder().controller("10.0.0.1").worker("node-a").build()
    assert not decode(plan(direct.workers[0], direct, 7000, bytes(16)).stdin.decode()).tunnel


def test_bind_all_controller_cannot_be_dialled() -> None:
    from flodl_agent.fleet.fanout import FanoutError

    cluster = ClusterBuilder().controller("0.0.0.0").worker("node-a").build()
    with pytest.raises(FanoutError, match="bind-all"):
        plan(cluster.workers[0], cluster, 1337, bytes(16))


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "fdl").exists(), reason="needs the repository's .venv")
def test_a_worker_that_cannot_be_reached_fails_the_launch_at_once(sshd: Sshd, tmp_path: Path) -> None:
    config = loopback_cluster(tmp_path, sshd, free_port(), join_timeout=300, max_join_timeout=600)
    sshd.authorized_keys.write_text("")  # nobody may log in any more
    proc = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "fdl"), "launch", "--config", str(config), "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "NO_COLOR": "1"},
        check=False,
    )
    assert proc.returncode == 1
    assert "fan-out to fan-" in proc.stderr and "quorum 2 is out of reach" in proc.stderr
    assert "Permission denied" in proc.stderr  # the ssh client's own words, forwarded


def test_tunnel_only_binds_loopback_and_tunnels_every_worker() -> None:
    from flodl_agent.fleet.launcher import LaunchOptions, controller_for

    cluster = (
        ClusterBuilder()
        .controller("10.0.0.1")
        .join(discovery=True, tunnel_only=True, min_rank_start=1)
        .worker("node-a")
        .build()
    )
    logs: list[str] = []
    ctl = controller_for(cluster, LaunchOptions(command=["true"]), logs.append)
    assert ctl.settings.bind == "127.0.0.1" and ctl.open  # loopback: reachability is the credential
    assert any("tunnel_only: binding 127.0.0.1 instead of 10.0.0.1" in line for line in logs)
    p = plan(cluster.workers[0], cluster, 1337, bytes(16), ctl.settings.bind)
    assert p.argv[p.argv.index("-R") + 1] == "127.0.0.1:1337:127.0.0.1:1337"


def test_the_plane_comes_from_the_flag_then_the_file_and_nccl_refuses_a_tunnel_at_launch() -> None:
    from flodl_agent.fleet.launcher import LaunchError, LaunchOptions, controller_for

    def cluster(plane: str = "", **worker: object) -> Cluster:
        builder = ClusterBuilder().controller("10.0.0.1").worker("node-a", local_devices=[0], **worker)
        return (builder.plane(plane) if plane else builder).build()

    nccl_file = cluster("nccl")
    assert controller_for(cluster(), LaunchOptions(command=["true"]), print).settings.plane == "cpu"
    assert controller_for(nccl_file, LaunchOptions(command=["true"]), print).settings.plane == "nccl"
    assert controller_for(nccl_file, LaunchOptions(["true"], plane="cpu"), print).settings.plane == "cpu"
    # --plane nccl over a file whose worker tunnels: refused before the window opens or anyone dials
    with pytest.raises(LaunchError) as caught:
        controller_for(cluster(tunnel=True), LaunchOptions(["true"], plane="nccl"), print)
    assert (
        "--plane nccl: cluster.workers[0].tunnel a tunnel carries only the CPU plane" in caught.value.message
    )
    assert "CPU mode" in caught.value.fix

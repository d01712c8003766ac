"""The shell line fan-out runs on a worker: which fdl it execs (``arch``'s variant first),
with paths quoted so that odd checkouts stay one word. The lines run for real under sh."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from flodl_agent.agent.spec import decode
from flodl_agent.config import ClusterBuilder
from flodl_agent.fleet.fanout import fdl_candidates, plan, remote_command, run_fdl
from flodl_agent.hardware import variants

ODD = "it's a $HOME; `x` \\n dir"


def _fake_fdl(where: Path, name: str) -> Path:
    """An fdl that says which one it is and what it was asked."""
    fdl = where / "bin" / "fdl"
    fdl.parent.mkdir(parents=True, exist_ok=True)
    fdl.write_text(f'#!/bin/sh\necho "{name}: $*"\n')
    fdl.chmod(0o755)
    return fdl


def _run(line: str, on_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{on_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(
        ["sh", "-c", line], capture_output=True, text=True, env=env, timeout=10, check=False
    )


@pytest.fixture
def world(tmp_path: Path) -> Path:
    _fake_fdl(tmp_path / "global", "path")
    return tmp_path


def test_the_arch_variant_comes_first_then_the_checkout_venvs() -> None:
    assert fdl_candidates("/srv/flodl", "cu126") == [
        "/srv/flodl/libtorch/cu126/bin/fdl",
        "/srv/flodl/venv/bin/fdl",
        "/srv/flodl/.venv/bin/fdl",
    ]
    assert fdl_candidates("/srv/flodl") == ["/srv/flodl/venv/bin/fdl", "/srv/flodl/.venv/bin/fdl"]
    # no checkout named anywhere: the worker role's layout
    assert fdl_candidates(None, "precompiled/cu128") == ["/opt/flodl/libtorch/precompiled/cu128/bin/fdl"]
    assert fdl_candidates(None) == []


def test_a_worker_with_arch_runs_its_variants_fdl(world: Path) -> None:
    checkout = world / ODD
    _fake_fdl(checkout / "libtorch" / "rocm6.4", "variant")
    _fake_fdl(checkout / ".venv", "venv")
    line = run_fdl(str(checkout), "join --spec-stdin", "rocm6.4")
    done = _run(line, world / "global")
    assert done.stdout == "variant: join --spec-stdin\n" and done.stderr == ""


def test_a_missing_variant_falls_back_to_the_checkout_venv_and_says_so(world: Path) -> None:
    checkout = world / ODD
    _fake_fdl(checkout / ".venv", "venv")
    done = _run(run_fdl(str(checkout), "probe --json", "cu128"), world / "global")
    assert done.stdout == "venv: probe --json\n"
    assert f"fdl: no {checkout}/libtorch/cu128/bin/fdl: falling back (not the cu128 variant)" in done.stderr


def test_without_arch_nothing_changes(world: Path) -> None:
    checkout = world / ODD
    _fake_fdl(checkout / "libtorch" / "cu126", "variant")  # present, but no arch asks for it
    _fake_fdl(checkout / "venv", "venv")
    assert _run(run_fdl(str(checkout), "probe"), world / "global").stdout == "venv: probe\n"
    assert _run(run_fdl(None, "probe"), world / "global").stdout == "path: probe\n"


def test_without_a_path_arch_means_the_roles_layout(world: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = world / "opt flodl"
    monkeypatch.setattr(variants, "ROLE_HOME", str(home))
    done = _run(run_fdl(None, "probe", "cpu"), world / "global")
    assert done.stdout == "path: probe\n" and "falling back" in done.stderr  # not provisioned there
    _fake_fdl(home / "libtorch" / "cpu", "role")
    assert _run(run_fdl(None, "probe", "cpu"), world / "global").stdout == "role: probe\n"


@pytest.mark.parametrize("arch", ["cu126", "odd variant/$(touch pwned)", "it's/`id`"])
def test_odd_paths_and_variants_stay_single_quoted_words(world: Path, arch: str) -> None:
    checkout = world / ODD
    _fake_fdl(checkout / "libtorch" / arch, "variant")
    tag = "0123456789ab"
    line = remote_command(tag, str(checkout), arch)
    # every candidate appears exactly as shlex quotes it, and nothing in it was expanded
    assert shlex.quote(f"{checkout}/libtorch/{arch}/bin/fdl") in line
    env_line = line.replace('pkill -f "fdl join --spec-stdin --tag $T"', "true")  # leave real agents be
    done = _run(env_line, world / "global")
    assert done.stdout == f"variant: join --spec-stdin --tag {tag}\n", done.stderr
    assert not (world / "pwned").exists() and not Path("pwned").exists()


def test_the_plan_passes_the_workers_arch_and_path_and_the_spec_names_the_variant() -> None:
    cluster = (
        ClusterBuilder()
        .controller("10.0.0.1", path="/opt/flodl")
        .worker("node-a", arch="cu126", path="/srv/a b", nccl_socket_ifname="eth0")
        .worker("node-b", arch="precompiled/cu128", nccl_socket_ifname="eth0")
        .worker("node-c", nccl_socket_ifname="eth0")
        .build()
    )
    a, b, c = (plan(w, cluster, 1337, bytes(16)) for w in cluster.workers)
    assert "exec '/srv/a b/libtorch/cu126/bin/fdl' join" in a.argv[-1]
    assert "exec /opt/flodl/libtorch/precompiled/cu128/bin/fdl join" in b.argv[-1]  # the controller's path
    assert "libtorch" not in c.argv[-1]
    assert decode(a.stdin.decode()).libtorch == "cu126"
    assert decode(b.stdin.decode()).libtorch == "precompiled/cu128"
    assert decode(c.stdin.decode()).libtorch is None


def test_an_ssh_session_cancelled_or_timed_out_leaves_no_process_behind(tmp_path: Path) -> None:
    import asyncio
    import sys

    from flodl_agent.fleet.fanout import ask

    pid = tmp_path / "pid"
    writes = f"import os, time; open({str(pid)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    hangs = [sys.executable, "-c", writes]

    async def cancelled() -> None:
        task = asyncio.ensure_future(ask(hangs, None, 60))
        while not pid.exists() or not pid.read_text():
            await asyncio.sleep(0.01)  # the session writes its pid when it runs
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    def gone() -> None:
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid.read_text()), 0)

    asyncio.run(cancelled())
    gone()
    pid.unlink()
    with pytest.raises(TimeoutError):
        asyncio.run(ask(hangs, b"", 2.0))
    gone()

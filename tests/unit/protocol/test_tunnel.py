"""The ssh forward's process: whatever ends the wait for it, nothing of it stays behind."""

from __future__ import annotations

import asyncio
import gc
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from flodl_agent.config.models import Ssh
from flodl_agent.protocol.tunnel import Tunnel
from flodl_agent.retry import Transient


def fake_ssh(bin_dir: Path, body: str) -> None:
    script = bin_dir / "ssh"
    script.write_text(f"#!{sys.executable}\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def unraisable(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What the collector could not report (a transport finalized after its loop closed)."""
    seen: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    return seen


def test_an_ssh_that_exits_says_why_and_leaves_no_pipe_for_the_collector(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unraisable: list[Any]
) -> None:
    fake_ssh(
        tmp_path, "import sys; sys.stderr.write('ssh: connect to host door port 22: refused'); sys.exit(255)"
    )
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")

    async def dial() -> Tunnel:
        async with Tunnel(Ssh(target="door"), "127.0.0.1", 1337, timeout=10) as tunnel:
            return tunnel

    with pytest.raises(Transient, match="connect to host door port 22: refused"):
        asyncio.run(dial())
    gc.collect()
    assert unraisable == []


def test_a_wait_cancelled_ends_the_ssh_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unraisable: list[Any]
) -> None:
    # An ssh that never opens its forward (a door that hangs): the agent is stopped meanwhile.
    pid = tmp_path / "pid"
    fake_ssh(tmp_path, f"import os, time; open({str(pid)!r}, 'w').write(str(os.getpid())); time.sleep(600)")
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    tunnel = Tunnel(Ssh(target="door"), "127.0.0.1", 1337, timeout=60, grace=5)

    async def stopped() -> None:
        task = asyncio.ensure_future(tunnel.__aenter__())
        while not pid.exists() or not pid.read_text():
            await asyncio.sleep(0.01)  # the fake ssh writes its pid when it runs
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(stopped())
    assert tunnel.proc is not None and tunnel.proc.returncode is not None  # terminated, reaped
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid.read_text()), 0)
    gc.collect()
    assert unraisable == []

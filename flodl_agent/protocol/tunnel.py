"""The ``ssh -N -L`` forward a walk-in dials through when its join has an ``ssh:`` block."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import time
from pathlib import Path

from ..config.models import Ssh
from ..errors import host_key_mismatch
from ..net import ssh_argv
from ..retry import Permanent, Transient

TUNNEL_TIMEOUT = 20.0  # seconds for ssh to open the forward
KILL_GRACE = 5.0  # seconds between SIGTERM and SIGKILL when the tunnel closes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Tunnel:
    """``ssh -N -L`` to the controller box; a fresh ephemeral local port per attempt."""

    def __init__(
        self,
        ssh: Ssh,
        remote_host: str,
        remote_port: int,
        timeout: float = TUNNEL_TIMEOUT,
        grace: float = KILL_GRACE,
    ) -> None:
        self.ssh = ssh
        self.remote = (remote_host, remote_port)
        self.timeout = timeout
        self.grace = grace
        self.local_port = 0
        self.proc: asyncio.subprocess.Process | None = None

    def argv(self, local_port: int) -> list[str]:
        assert self.ssh.target is not None
        forward = f"127.0.0.1:{local_port}:{self.remote[0]}:{self.remote[1]}"
        return ssh_argv(
            self.ssh.target,
            user=self.ssh.user,
            port=self.ssh.port,
            identity_file=str(Path(self.ssh.identity_file).expanduser()) if self.ssh.identity_file else None,
            options=self.ssh.options,
            extra=["-N", "-o", "ExitOnForwardFailure=yes", "-L", forward],
        )

    async def __aenter__(self) -> Tunnel:
        if shutil.which("ssh") is None:
            raise Permanent("ssh is not installed", "apt-get install openssh-client")
        self.local_port = _free_port()
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv(self.local_port),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            await self._forwarding(self.proc)
        except BaseException:
            # Failed, timed out or cancelled (the agent stopping): never leave an ssh, or its
            # pipes for the collector to find after the loop closed, behind.
            await self.__aexit__()
            raise
        return self

    async def _forwarding(self, proc: asyncio.subprocess.Process) -> None:
        """Until ssh's forward takes a connection; why not, when ssh exits or the time runs out."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                err = (await proc.stderr.read()).decode(errors="replace").strip() if proc.stderr else ""
                if mismatch := host_key_mismatch(f"the ssh tunnel to {self.ssh.target}", err):
                    raise Permanent(mismatch.message, mismatch.fix)  # never re-dial a man in the middle
                raise Transient(
                    f"the ssh tunnel did not come up: {err or 'ssh exited'}",
                    f"the door's name {self.ssh.target} does not resolve: check join.ssh.target, or name "
                    "the door by its IP; DNS may come back, so --persist re-dials"
                    if "Could not resolve hostname" in err
                    else "check the ssh: block (target, user, identity_file) and the host key",
                )
            try:
                _, w = await asyncio.open_connection("127.0.0.1", self.local_port)
            except OSError:
                await asyncio.sleep(0.05)  # polling a port that ssh opens when ready; nothing to wait on
                continue
            w.close()
            return
        raise Transient("the ssh tunnel did not come up in time", "check that the ssh host is reachable")

    async def __aexit__(self, *_: object) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), self.grace)
            except TimeoutError:
                proc.kill()
        await proc.wait()
        if proc.stderr is not None:  # to its end: the pipe closes, and with it the transport
            with contextlib.suppress(TimeoutError):  # a child of ssh's may still hold it open
                await asyncio.wait_for(proc.stderr.read(), self.grace)

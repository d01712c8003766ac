"""Fan-out: start one agent per configured worker over OpenSSH.

Sugar over the join protocol: each agent dials back in like any walk-in. The
agent spec — and with it the agent's host key, derived from the run key for
that worker's name alone — travels on the ssh session's stdin, never in argv
(argv is visible to every user of both boxes). Before starting,
the remote side kills orphans of an earlier launch of the same cluster on
that host (a kill -9 on a launcher skips its clean-up).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import shlex
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..address import is_bind_all, join_address, local_address
from ..agent.rank_io import output_lines
from ..agent.spec import encode, for_worker
from ..config.models import Cluster, Worker
from ..hardware.variants import variant_venv
from ..net import ssh_argv
from ..protocol.tls import cert_fingerprint


class FanoutError(ValueError):
    pass


def orphan_tag(controller: str, worker: Worker) -> str:
    """Stable across launches of the same cluster, distinct per worker host."""
    return hashlib.sha256(f"{controller}/{worker.host}".encode()).hexdigest()[:12]


def dial_address(cluster: Cluster) -> str:
    host = cluster.controller.host
    if is_bind_all(host):
        raise FanoutError(
            f"cluster.controller.host is {host!r}, a bind-all address workers cannot dial; "
            "set it to the controller's address on the workers' network"
        )
    return host


@dataclass(frozen=True)
class Plan:
    """What to run for one worker: the ssh argv and the spec for its stdin."""

    host: str
    argv: list[str]
    stdin: bytes


def plan(worker: Worker, cluster: Cluster, port: int, key: bytes | None, bind: str | None = None) -> Plan:
    """``key``: the worker's host key (None under open admission); ``bind`` is where the
    controller actually listens (it can differ from ``cluster.controller.host``, e.g. under
    tunnel_only)."""
    ctl_host = dial_address(cluster)
    dial_host, extra = ctl_host, []
    # Under tunnel_only the controller binds loopback: every worker must come through ssh.
    if worker.tunnel or cluster.controller.join.tunnel_only:
        # The worker's traffic rides this session: the worker's loopback, forwarded back
        # to wherever the controller listens on its own box.
        listen = bind or cluster.controller.host
        far = local_address(listen)
        extra = ["-o", "ExitOnForwardFailure=yes", "-R", f"127.0.0.1:{port}:{join_address(far, port)}"]
        dial_host = "127.0.0.1"
    tag = orphan_tag(f"{ctl_host}:{port}", worker)
    tls = cluster.controller.tls
    spec = for_worker(
        worker,
        controller_host=dial_host,
        controller_port=port,
        tunnel=bool(extra),
        **({"host_key": key.hex()} if key is not None else {}),
        **({"tls_fingerprint": cert_fingerprint(Path(tls.cert))} if tls else {}),  # the launch loaded it
    )
    argv = worker_ssh(worker, extra)
    argv.append(remote_command(tag, worker.path or cluster.controller.path, worker.arch))
    return Plan(worker.host, argv, encode(spec))


def worker_ssh(worker: Worker, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """ssh to a worker as its ``ssh:`` block says (the host name when it has none)."""
    ssh = worker.ssh
    return ssh_argv(
        (ssh.target if ssh and ssh.target else None) or worker.host,
        user=ssh.user if ssh else None,
        port=ssh.port if ssh else None,
        identity_file=ssh.identity_file if ssh else None,
        options=ssh.options if ssh else (),
        extra=extra,
    )


async def ask(argv: list[str], stdin: bytes | None, timeout: float) -> tuple[int, bytes, bytes]:
    """Run one ssh session to its end: (exit code, stdout, stderr). Raises OSError when ssh
    cannot start, TimeoutError (the session killed) when it does not end within ``timeout``."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, errout = await asyncio.wait_for(proc.communicate(stdin), timeout)
    except BaseException:  # timed out, or cancelled (a probe stopped): no ssh stays behind
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, out, errout


def fdl_candidates(path: str | None, arch: str | None = None) -> list[str]:
    """The fdl executables a worker tries, in order, before the one on PATH.

    - ``arch`` with ``path``: ``<path>/libtorch/<arch>/bin/fdl`` (the variant's venv under
      the checkout, as ``cluster.workers[].arch`` documents), then the checkout's
      ``venv``/``.venv``.
    - ``arch`` without ``path`` (neither the worker nor the controller names one): the worker
      role's layout, ``/opt/flodl/libtorch/<arch>/bin/fdl``. The role's home is configurable
      (``flodl_worker_home``); a box provisioned with another home sets ``path`` to it.
    - ``path`` without ``arch``: the checkout's ``venv``/``.venv``, as before ``arch`` counted.

    Each candidate is a plain, unquoted path; :func:`run_fdl` quotes it.
    """
    candidates = []
    if arch:
        candidates.append(f"{variant_venv(path, arch)}/bin/fdl")
    if path:
        candidates += [f"{path}/venv/bin/fdl", f"{path}/.venv/bin/fdl"]
    return candidates


def run_fdl(path: str | None, subcommand: str, arch: str | None = None) -> str:
    """The shell line that runs ``fdl SUBCOMMAND`` on a worker: the first executable of
    :func:`fdl_candidates` (the ``arch`` variant's venv first), else the fdl on PATH.

    The agent's ranks run with its interpreter's venv first on PATH, so exec-ing the
    variant's fdl is what makes the rank children use that variant. When ``arch`` is set
    but its fdl is missing, the line says so on stderr (the fan-out log shows it) and falls
    back; the spec's ``libtorch`` field still names the variant for the agent to act on.
    ``subcommand`` is shell text the caller owns (it may use ``$T``); every path is quoted.
    """
    lines = []
    if path:
        lines.append(f"cd {shlex.quote(path)} 2>/dev/null")
    steps = []
    for i, candidate in enumerate(fdl_candidates(path, arch)):
        quoted = shlex.quote(candidate)
        steps.append(f"[ -x {quoted} ] && exec {quoted} {subcommand}")
        if arch and i == 0:
            warning = shlex.quote(f"fdl: no {candidate}: falling back (not the {arch} variant)")
            steps.append(f"printf '%s\\n' {warning} >&2")  # printf: no escapes read in it
    lines += [*steps, f"exec fdl {subcommand}"]
    return "; ".join(lines)


def remote_command(tag: str, path: str | None, arch: str | None = None) -> str:
    """The shell line the worker runs: kill orphans, find fdl (``arch``'s variant first:
    see :func:`fdl_candidates`), read the spec from stdin.

    The tag's value appears only in the assignment, never after ``--tag``: a
    pkill pattern must not match the very shell (or ssh client) carrying it.
    """
    orphans = [f"T={tag}", 'pkill -f "fdl join --spec-stdin --tag $T" 2>/dev/null']
    return "; ".join([*orphans, run_fdl(path, 'join --spec-stdin --tag "$T"', arch)])


class Fanout:
    """The running ssh sessions of one launch."""

    def __init__(
        self, log: Callable[[str], None], on_exit: Callable[[str, int, str], None] = lambda *_: None
    ) -> None:
        self.log = log
        self.on_exit = on_exit  # (host, exit code, last output lines)
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self._pumps: list[asyncio.Task[None]] = []

    async def start(self, plans: list[Plan]) -> None:
        for p in plans:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *p.argv,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as exc:
                raise FanoutError(f"cannot run ssh for {p.host}: {exc.strerror}") from None
            assert proc.stdin is not None
            proc.stdin.write(p.stdin)
            with contextlib.suppress(ConnectionError):  # ssh already gone: _pump reports why
                await proc.stdin.drain()
            proc.stdin.close()
            self.procs[p.host] = proc
            self._pumps.append(asyncio.ensure_future(self._pump(p.host, proc)))
            self.log(f"fan-out: started the agent on {p.host}")

    def alive(self, host: str) -> bool:
        proc = self.procs.get(host)
        return proc is not None and proc.returncode is None

    async def _pump(self, host: str, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        tail: deque[str] = deque(maxlen=3)
        async for line in output_lines(proc.stdout):
            tail.append(line)
            self.log(f"[{host}] {line}")
        code = await proc.wait()
        if code != 0:
            self.log(f"fan-out: the session to {host} ended with code {code}")
        self.on_exit(host, code, " / ".join(tail))

    async def stop(self, grace: float = 10.0) -> None:
        """Let agents finish (they exit once the run ends), then end what is left."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*self._pumps, return_exceptions=True), grace)
        for proc in self.procs.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
                await proc.wait()
        for task in self._pumps:
            task.cancel()

"""The agent: a box walking into a join window and running its ranks.

``fdl join`` is a loop around one attempt: prepare the box, dial (direct, or
through an ``ssh -N -L`` forward to the controller box), hello, wait for the
world, spawn one rank per offered device, report exits, and leave. Exit codes
say what the caller should do: 0 clean, 1 transient (re-dial), 2 permanent
(stop; the systemd unit pairs it with RestartPreventExitStatus=2).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import ssl
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from . import wire
from .averaging import DATA_MAX, AverageRelay
from .config.devices import DeviceOffer
from .config.models import Source, Ssh
from .errors import CLEAN, PERMANENT, TRANSIENT, Failure
from .messages import Abort, Accept, Averaged, BadMessage, Challenge, Hello, Reject, Stream, WorldFormed
from .messages import parse as parse_message
from .metrics import ENV as METRICS_ENV
from .metrics import read_reports
from .net import DEAD_MOUNT, join_address, keepalive, socket_ifnames, ssh_argv
from .prepare import Prepared, PrepareFailure, mount_data, prepare, ready_dir
from .probe import kernel_gap
from .publish import rank_path
from .rendezvous import StreamRelay, serve_store
from .signature import ProbeFailed, dataset_signature, probe_model
from .tls import PinMismatch, check_pin, client_context

DIAL_TIMEOUT = 10.0
TUNNEL_TIMEOUT = 20.0
KILL_GRACE = 5.0
HEARTBEAT_EVERY = 5.0  # seconds between beats while ranks train (the controller waits 30 by default)
CLOSE_TIMEOUT = 10.0

BACKOFF_START = 5.0
BACKOFF_MAX = 60.0
LONG_ATTEMPT = 120.0


class AgentFailure(Failure):
    """An attempt that failed: transient (re-dial) or permanent (stop)."""

    def __init__(self, message: str, fix: str = "", code: int = TRANSIENT) -> None:
        super().__init__(message, fix)
        self.code = code


def next_backoff(previous: float | None, attempt_seconds: float, start: float = BACKOFF_START) -> float:
    """5 s doubling to 60 s; an attempt that ran long (a real run) resets it."""
    if previous is None or attempt_seconds >= LONG_ATTEMPT:
        return start
    return min(BACKOFF_MAX, previous * 2)


def signature_cache() -> Path:
    return Path.home() / ".flodl" / "cache" / "dataset-signatures.json"


@dataclass
class AgentOptions:
    controller_host: str = "127.0.0.1"
    controller_port: int = 1337
    key: bytes | None = None  # join.token or the fan-out salt; None under open admission
    host: str = field(default_factory=socket.gethostname)
    devices: DeviceOffer = field(default_factory=lambda: DeviceOffer("all"))
    bin: str | None = None  # replaces the entry point with this box's local path
    ssh: Ssh | None = None
    data_path: str = ""
    env: dict[str, str] = field(default_factory=dict)
    model_sig: str = ""
    dataset_sig: str = ""
    run_id: str = ""
    socket_ifname: str = ""  # nccl_socket_ifname: NCCL's syntax; gloo gets one concrete interface
    source: Source | None = None  # join.source: fetch, check and build the run before every dial
    data_source: str = ""  # join.data_source: mount data_path read-only from here (sshfs, door A)
    stage: str = "~/.flodl/stage"  # node-local: where the fetched tree and its build live
    args: list[str] = field(default_factory=list)  # local args (a published manifest's replace them)
    tls_fingerprint: str = ""  # the controller port speaks TLS: its certificate's pinned fingerprint


@dataclass(frozen=True)
class Offer:
    devices: list[str]
    labels: list[str]
    variant: str
    nccl: str = ""


def resolve_offer(offer: DeviceOffer) -> Offer:
    """The GPU gate: what this box actually offers. Nothing usable is permanent."""
    if offer.kind == "cpu":
        return Offer([f"cpu:{i}" for i in range(offer.cpus)], ["cpu"] * offer.cpus, "cpu")
    try:
        import torch
    except ImportError:
        raise AgentFailure(
            "no usable GPU: torch is not installed on this box",
            "install a torch variant, or offer CPU ranks with --devices cpu:N",
            PERMANENT,
        ) from None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise AgentFailure(
            "no usable GPU on this box",
            "check the driver and device permissions (fdl probe), or offer CPU ranks with --devices cpu:N",
            PERMANENT,
        )
    indices = list(range(count)) if offer.kind == "all" else list(offer.gpus)
    missing = [i for i in indices if i >= count]
    if missing:
        raise AgentFailure(
            f"GPU {missing[0]} is not on this box ({count} visible)",
            f"offer devices 0..{count - 1} with --devices",
            PERMANENT,
        )
    hip = getattr(torch.version, "hip", None)
    variant = (
        f"rocm{hip.split('.')[0]}.{hip.split('.')[1]}"
        if hip
        else f"cu{(torch.version.cuda or '').replace('.', '')}"
    )
    labels = [torch.cuda.get_device_name(i) for i in indices]
    flags: list[str] = []
    with contextlib.suppress(Exception):
        flags = list(torch.cuda.get_arch_list())
    devices = [
        (i, label, _device_arch(torch, i, bool(hip))) for i, label in zip(indices, labels, strict=True)
    ]
    gap = kernel_gap(f"torch {torch.__version__} ({variant})", flags, devices)
    if gap is not None:  # the first GPU op would die: "no kernel image is available"
        raise AgentFailure(gap.message, gap.fix, PERMANENT)
    nccl = ""
    with contextlib.suppress(Exception):
        version = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return Offer([f"cuda:{i}" for i in indices], labels, variant, nccl)


def _device_arch(torch: Any, index: int, hip: bool) -> str:
    if hip:
        return str(torch.cuda.get_device_properties(index).gcnArchName).split(":")[0]
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


def box_env(options: AgentOptions) -> dict[str, str]:
    """What every child of this agent starts from: our environment less the credential
    and our plumbing, the variant's venv first on PATH, the box's own env: entries."""
    env = {k: v for k, v in os.environ.items() if k != "FDL_TOKEN" and not k.startswith("FLODL_INTERNAL_")}
    env["PATH"] = rank_path()
    if options.data_path:
        env["FLODL_DATA_PATH"] = options.data_path
    return env


def _probe_model(prepared: Prepared, options: AgentOptions, log: Callable[[str], None]) -> str:
    """The model this box builds, for the hello; "" (no signature) when the probe fails:
    the formation check is then the backstop."""
    try:
        cache = Path(options.stage).expanduser() / "model-signature.json"
        sig = probe_model(prepared.command, prepared.cwd, box_env(options) | options.env, cache)
    except ProbeFailed as exc:
        log(f"model probe: {exc}; dialling without a model signature")
        return ""
    log(f"model probe: this box builds {sig[:12]}")
    return sig


def data_signature(data_path: str) -> str:
    """The data root's signature for the hello (cached in ~/.flodl between dials)."""
    try:
        return dataset_signature(data_path, signature_cache())
    except OSError as exc:
        if exc.errno in DEAD_MOUNT:
            raise AgentFailure(
                f"the data mount at {data_path} is not connected (its sshfs died)",
                "restart it (systemctl restart flodl-join.service remounts it), then --persist re-dials",
            ) from None
        raise AgentFailure(
            f"data_path {data_path} cannot be read: {exc.strerror or exc}",
            "mount the data root there (flodl_worker_data_mount) or fix join.data_path; --persist re-dials",
        ) from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Tunnel:
    """``ssh -N -L`` to the controller box; a fresh ephemeral local port per attempt."""

    def __init__(self, ssh: Ssh, remote_host: str, remote_port: int) -> None:
        self.ssh = ssh
        self.remote = (remote_host, remote_port)
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
            raise AgentFailure("ssh is not installed", "apt-get install openssh-client", PERMANENT)
        self.local_port = _free_port()
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv(self.local_port),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        deadline = time.monotonic() + TUNNEL_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.returncode is not None:
                err = (
                    (await self.proc.stderr.read()).decode(errors="replace").strip()
                    if self.proc.stderr
                    else ""
                )
                raise AgentFailure(
                    f"the ssh tunnel did not come up: {err or 'ssh exited'}",
                    "check the ssh: block (target, user, identity_file) and the host key",
                )
            try:
                _, w = await asyncio.open_connection("127.0.0.1", self.local_port)
            except OSError:
                await asyncio.sleep(0.05)  # polling a port that ssh opens when ready; nothing to wait on
                continue
            w.close()
            return self
        await self.__aexit__()  # never leave an ssh behind for the next attempt to trip over
        raise AgentFailure("the ssh tunnel did not come up in time", "check that the ssh host is reachable")

    async def __aexit__(self, *_: object) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), KILL_GRACE)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


class Attempt:
    """One dial: hello, admission, the formed world, the ranks."""

    def __init__(
        self,
        options: AgentOptions,
        offer: Offer,
        log: Callable[[str], None],
        on_wait: Callable[[bool], None] = lambda _: None,
        prepared: Prepared | None = None,
    ) -> None:
        self.options = options
        self.prepared = prepared  # the published run this box fetched and built
        self.offer = offer
        self.log = log
        self.on_wait = on_wait  # True while admitted and waiting for the world (a spinner's cue)
        self.children: list[asyncio.subprocess.Process] = []

    async def _frame(
        self, reader: asyncio.StreamReader, codec: wire.Codec, timeout: float | None
    ) -> wire.Frame:
        while True:
            frame = codec.next_frame()
            if frame is not None:
                return frame
            # A frame's size is known from its header: read it in large pieces.
            data = await asyncio.wait_for(reader.read(max(65536, min(codec.wanted, 1 << 24))), timeout)
            if not data:
                raise AgentFailure("the controller closed the connection")
            codec.feed(data)

    async def run(self, dial_host: str, dial_port: int) -> int:
        try:
            pin = self.options.tls_fingerprint
            reader, writer = await asyncio.wait_for(
                # A large buffer: the link brings the CPU plane's averages, hundreds of MB a round.
                asyncio.open_connection(
                    dial_host, dial_port, limit=1 << 22, ssl=client_context() if pin else None
                ),
                DIAL_TIMEOUT,
            )
        except (OSError, asyncio.IncompleteReadError) as exc:
            if pin and isinstance(exc, ssl.SSLError | ConnectionResetError | asyncio.IncompleteReadError):
                # Something listens, but the handshake died: a port that does not speak TLS hangs up.
                raise AgentFailure(
                    f"the TLS handshake with {dial_host}:{dial_port} failed ({type(exc).__name__}: {exc})",
                    "join.tls_fingerprint is set: does this controller serve TLS (cluster.controller.tls)?",
                ) from None
            raise AgentFailure(
                f"cannot reach the controller at {dial_host}:{dial_port}: {exc}",
                "is a window open? --persist re-dials until one is",
            ) from None
        if pin:
            try:
                ssl_object = writer.get_extra_info("ssl_object")
                der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
                check_pin(der, pin, f"the controller at {join_address(dial_host, dial_port)}")
            except PinMismatch as exc:
                writer.close()
                raise AgentFailure(exc.message, exc.fix, PERMANENT) from None
        keepalive(writer)
        try:
            return await self._session(reader, writer, join_address(dial_host, dial_port))
        except wire.Dropped as exc:
            raise AgentFailure(f"the controller sent a frame that does not verify ({exc})") from None
        except BadMessage as exc:
            raise AgentFailure(f"the controller sent a malformed message ({exc})") from None
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            raise AgentFailure(
                f"the connection to the controller broke ({exc.__class__.__name__})",
                "through a tunnel: does the door permit a forward to the controller port "
                "(permitopen)? Otherwise the controller went away; --persist re-dials",
            ) from None
        except TimeoutError:
            raise AgentFailure(
                "the controller did not answer in time", "is that port a flodl controller?"
            ) from None
        finally:
            writer.close()
            await self._kill_children()

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, road: str) -> int:
        writer.write(wire.Channel.JOIN.value)
        own = self.options.key
        # The challenge is tagged with the run key, or with zeros under open admission:
        # read it whole, then see which key this box holds verifies it.
        header = await asyncio.wait_for(reader.readexactly(wire.HEADER.size), DIAL_TIMEOUT)
        length = wire.HEADER.unpack(header)[3]
        if length > wire.PRE_ADMISSION_MAX:
            raise AgentFailure("the controller's first frame is not a challenge (is this a flodl port?)")
        data = header + await asyncio.wait_for(reader.readexactly(length), DIAL_TIMEOUT)
        first: wire.Frame | None = None
        for candidate in [k for k in (own, wire.OPEN_KEY) if k is not None]:
            codec = wire.Codec(candidate)
            codec.feed(data)
            with contextlib.suppress(wire.Dropped):
                first = codec.next_frame()
                break
        if first is None:
            raise AgentFailure(
                "the controller's challenge does not verify with this box's join key"
                if own is not None
                else "the controller requires a join key and this box has none",
                "pass the run's join.token (FDL_TOKEN, --token -, or join.token in fdl.yml)",
                PERMANENT,
            )
        challenge = parse_message(first)
        if not isinstance(challenge, Challenge):
            raise AgentFailure("the controller did not open with a challenge")
        client_nonce = wire.new_nonce()
        hello = Hello(
            nonce=challenge.nonce,
            client_nonce=client_nonce,
            host=self.options.host,
            devices=self.offer.devices,
            device_labels=self.offer.labels,
            variant=self.offer.variant,
            nccl=self.offer.nccl,
            model_sig=self.options.model_sig,
            dataset_sig=self.options.dataset_sig,
            run_id=self.options.run_id,
            data_path=self.options.data_path,
            pid=os.getpid(),
        )
        writer.write(codec.encode(wire.Kind.HELLO, hello.model_dump()))
        await writer.drain()
        try:
            reply = parse_message(await self._frame(reader, codec, DIAL_TIMEOUT))
        except AgentFailure:
            raise AgentFailure(
                "the controller dropped the hello without a reply",
                "wrong join.token, or this box is rate-limited after bad dials",
            ) from None
        if isinstance(reply, Reject):
            raise AgentFailure(
                f"refused: {reply.reason}", reply.fix, PERMANENT if reply.permanent else TRANSIENT
            )
        if not isinstance(reply, Accept):
            raise AgentFailure("the controller answered the hello with something other than Accept")
        key = reply.salt if reply.salt is not None else (own or wire.OPEN_KEY)
        codec.rekey(wire.connection_key(key, challenge.nonce, client_nonce))
        codec.max_payload = DATA_MAX  # the admitted link carries the CPU plane's rounds
        first_rank, count = reply.ranks
        self.log(
            f"admitted as {self.options.host}: ranks [{first_rank}..{first_rank + count}) (provisional); "
            "waiting for the world to form"
        )
        self.on_wait(True)
        try:
            while True:
                message = parse_message(await self._frame(reader, codec, None))
                if isinstance(message, Abort):
                    raise AgentFailure(f"the controller aborted the run: {message.reason}")
                if isinstance(message, WorldFormed):
                    break
        finally:
            self.on_wait(False)
        return await self._train(message, road, reader, writer, codec)

    def rank_env(
        self,
        world: WorldFormed,
        road: str,
        store_port: int,
        plane: dict[str, str] | None = None,
        reports: dict[int, Path] | None = None,
    ) -> list[dict[str, str]]:
        """Per-rank environments: torchrun's variables plus what only this box knows.

        ``road`` is the controller address this join used (the controller's own idea
        of it is wrong behind a tunnel or NAT); ``store_port`` is the loopback port of
        the rendezvous store (the store itself on rank 0's host, a relay elsewhere).
        """
        mine, group = world.host, world.group
        ifnames = socket_ifnames(self.options.socket_ifname)
        # Ranks run with this agent's environment's bin/ first: the torch variant's venv.
        envs = []
        for local, device in enumerate(self.offer.devices):
            # The rank is the user's code: it gets no credential and none of our plumbing.
            env = box_env(self.options)
            env.update(world.env)
            env.update(self.options.env)
            env.update(
                RANK=str(mine.first_rank + local),
                WORLD_SIZE=str(world.world_size),
                LOCAL_RANK=str(local),
                LOCAL_WORLD_SIZE=str(mine.count),
                GROUP_RANK=str(group),
                # Every rank is a client of the agent's store, as under torchrun's agent.
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(store_port),
                TORCHELASTIC_USE_AGENT_STORE="True",
                TORCHELASTIC_RESTART_COUNT="0",
                TORCHELASTIC_RUN_ID=world.run or "flodl",
                FLODL_CONTROLLER=road,
                **(plane or {}),
                FLODL_DEVICE=device,
                FLODL_RUN=world.run,
            )
            for key, value in ifnames.items():
                env.setdefault(key, value)  # an explicit env: entry wins
            if mine.count > 1:  # torchrun's default: ranks sharing a box must not oversubscribe it
                env.setdefault("OMP_NUM_THREADS", "1")
            if device.startswith("cuda:"):
                env["CUDA_VISIBLE_DEVICES"] = device.split(":")[1]
            if reports is not None:
                env[METRICS_ENV] = str(reports[mine.first_rank + local])
            envs.append(env)
        return envs

    def command(self, world: WorldFormed) -> list[str]:
        if self.prepared is not None:
            return list(self.prepared.command)  # the manifest is the authority over what runs
        command = list(world.command)
        if self.options.bin:
            command[0] = self.options.bin  # only the entry point is local; the args are the run's
        return command

    async def _train(
        self,
        world: WorldFormed,
        road: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        codec: wire.Codec,
    ) -> int:
        mine = world.host
        if mine.host != self.options.host:
            raise AgentFailure(f"the formed world was addressed to {mine.host}, not this host")
        command = self.command(world)
        self.log(
            f"world formed: {world.world_size} ranks; this host runs "
            f"[{mine.first_rank}..{mine.first_rank + mine.count})"
        )
        relay, store, store_port = await self._rendezvous(world, writer, codec)

        def push(body: dict[str, Any], blob: wire.Blob) -> None:
            for part in codec.encode_parts(wire.Kind.AVERAGE, body, blob):
                writer.write(part)  # one write per part: the parameters are never joined into a copy

        averager = AverageRelay(list(range(mine.first_rank, mine.first_rank + mine.count)), push)
        plane = averager.env(await averager.listen())
        # Progress reports live beside the plane's segments: the run's private directory.
        reports = {
            r: averager.directory / f"metrics-{r}.json"
            for r in range(mine.first_rank, mine.first_rank + mine.count)
        }
        ranks = []
        for local, env in enumerate(self.rank_env(world, road, store_port, plane, reports)):
            try:
                proc = await asyncio.create_subprocess_exec(
                    *command,
                    env=env,
                    cwd=self.prepared.cwd if self.prepared is not None else None,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as exc:
                await relay.close()
                await averager.close()  # its shared-memory directory goes with it
                raise AgentFailure(
                    f"cannot start the entry point {command[0]}: {exc.strerror}",
                    "check --bin / the launch command on this box",
                    PERMANENT,
                ) from None
            self.children.append(proc)
            ranks.append(
                asyncio.ensure_future(self._rank(proc, mine.first_rank + local, writer, codec, averager))
            )
        abort = asyncio.ensure_future(self._watch_link(reader, codec, relay, averager))
        beat = asyncio.ensure_future(_heartbeat(writer, codec, reports))
        try:
            pending: set[asyncio.Future[Any]] = {abort, *ranks}
            while abort in pending and len(pending) > 1:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if abort.done():
                for task in ranks:
                    task.cancel()
                await asyncio.gather(*ranks, return_exceptions=True)
                raise AgentFailure(abort.result())
            codes = [t.result() for t in ranks]
            if store is not None:
                # Other hosts' ranks may still talk to the store (a last barrier):
                # serve it until their connections close or the run ends.
                drained = asyncio.ensure_future(relay.drained())
                await asyncio.wait({abort, drained}, return_when=asyncio.FIRST_COMPLETED)
                drained.cancel()
        finally:
            abort.cancel()
            beat.cancel()
            await relay.close()
            await averager.close()
            del store
        # Half-close and wait for the controller to close in turn: only then are the
        # exit reports known to have crossed every hop (a tunnel torn down early loses them).
        await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        with contextlib.suppress(TimeoutError, ConnectionError):
            await asyncio.wait_for(_until_eof(reader), CLOSE_TIMEOUT)
        return CLEAN if all(c == 0 for c in codes) else TRANSIENT

    async def _rank(
        self,
        proc: asyncio.subprocess.Process,
        rank: int,
        writer: asyncio.StreamWriter,
        codec: wire.Codec,
        averager: AverageRelay,
    ) -> int:
        assert proc.stdout is not None
        async for line in output_lines(proc.stdout):
            sys.stdout.write(f"[rank {rank}] {line}\n")
            sys.stdout.flush()
        code = await proc.wait()
        averager.rank_exited(rank)
        writer.write(codec.encode(wire.Kind.RANK_EXITED, {"rank": rank, "code": code}))
        return code

    async def _rendezvous(
        self, world: WorldFormed, writer: asyncio.StreamWriter, codec: wire.Codec
    ) -> tuple[StreamRelay, Any, int]:
        """The store (on rank 0's host) or a relay to it: the relay, the store, the ranks' port."""

        def send(sid: int, data: bytes, end: bool) -> None:
            writer.write(codec.encode(wire.Kind.STREAM, {"id": sid, "data": data, "end": end}))

        if world.host.first_rank != 0:
            relay = StreamRelay(send)
            return relay, None, await relay.listen()
        try:
            store, port = await asyncio.get_running_loop().run_in_executor(None, serve_store)
        except (ImportError, RuntimeError, OSError) as exc:
            # Scripts that never rendezvous (no torch.distributed) still run.
            self.log(f"note: no rendezvous store on this host ({exc}); env:// rendezvous will fail")
            relay = StreamRelay(send)
            return relay, None, await relay.listen()
        return StreamRelay(send, store_port=port), store, port

    async def _watch_link(
        self, reader: asyncio.StreamReader, codec: wire.Codec, relay: StreamRelay, averager: AverageRelay
    ) -> str:
        while True:
            try:
                frame = await self._frame(reader, codec, None)
                message = parse_message(frame)
            except (AgentFailure, ConnectionError, BadMessage):
                return "the controller went away mid-run"
            except wire.Dropped as exc:
                return f"the controller link broke ({exc})"
            if isinstance(message, Stream):
                relay.feed(message.id, message.data, message.end)
            elif isinstance(message, Averaged):
                averager.deliver(message.model_dump(), frame.blob)
            elif isinstance(message, Abort):
                return f"the controller aborted the run: {message.reason}"

    async def _kill_children(self) -> None:
        alive = [p for p in self.children if p.returncode is None]
        for proc in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in alive:
            try:
                await asyncio.wait_for(proc.wait(), KILL_GRACE)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()


async def _heartbeat(writer: asyncio.StreamWriter, codec: wire.Codec, reports: dict[int, Path]) -> None:
    """Tell the controller this host is alive while its ranks train (its watchdog's input),
    with the ranks' latest progress reports (the status page's and /metrics' input)."""
    while True:
        await asyncio.sleep(HEARTBEAT_EVERY)  # the beat's period
        # msgpack maps take string keys only: the controller reads the ranks back as ints.
        ranks = {str(rank): body for rank, body in read_reports(reports).items()}
        writer.write(codec.encode(wire.Kind.HEARTBEAT, {"ranks": ranks}))


async def output_lines(stream: asyncio.StreamReader, longest: int = 16384) -> AsyncIterator[str]:
    """A child's output as lines, whatever it writes: progress bars end lines with
    \r, and a line longer than ``longest`` is cut rather than fatal."""
    pending = b""
    while chunk := await stream.read(65536):
        pending += chunk
        *complete, pending = re.split(rb"\r\n|\r|\n", pending)
        for line in complete:
            yield line.decode(errors="replace")
        while len(pending) > longest:
            yield pending[:longest].decode(errors="replace")
            pending = pending[longest:]
    if pending:
        yield pending.decode(errors="replace")


async def _until_eof(reader: asyncio.StreamReader) -> None:
    while await reader.read(65536):
        pass


async def join_once(
    options: AgentOptions, log: Callable[[str], None], on_wait: Callable[[bool], None] = lambda _: None
) -> int:
    offer = resolve_offer(options.devices)
    if options.data_source and options.data_path:
        try:
            await asyncio.to_thread(
                mount_data, options.data_source, Path(options.data_path), options.ssh, log
            )
        except PrepareFailure as exc:
            raise AgentFailure(exc.message, exc.fix, exc.code) from None
    if options.data_path and not options.dataset_sig:
        # Before the dial: admission starts a deadline, and refuses a box whose data differs.
        try:
            ready_dir(signature_cache().parent, log)
        except PrepareFailure as exc:
            raise AgentFailure(exc.message, exc.fix, exc.code) from None
        options = replace(options, dataset_sig=await asyncio.to_thread(data_signature, options.data_path))
    prepared = None
    if options.source is not None:
        try:
            prepared = await asyncio.to_thread(
                prepare, options.source, Path(options.stage).expanduser(), options.ssh, options.args, log
            )
        except PrepareFailure as exc:
            raise AgentFailure(exc.message, exc.fix, exc.code) from None
        options = replace(options, run_id=prepared.run or options.run_id)
        if prepared.model_probe and not options.model_sig:
            sig = await asyncio.to_thread(_probe_model, prepared, options, log)
            options = replace(options, model_sig=sig)
    attempt = Attempt(options, offer, log, on_wait, prepared)
    if options.ssh is None:
        return await attempt.run(options.controller_host, options.controller_port)
    async with Tunnel(options.ssh, options.controller_host, options.controller_port) as tunnel:
        return await attempt.run("127.0.0.1", tunnel.local_port)


async def join(
    options: AgentOptions,
    *,
    persist: bool,
    log: Callable[[str], None],
    backoff_start: float = BACKOFF_START,
    attempts: int | None = None,
    on_wait: Callable[[bool], None] = lambda _: None,
) -> int:
    """``fdl join``: one attempt, or with ``persist`` a loop that stops only on a permanent failure.

    SIGUSR1 cuts a backoff short ("a window just opened: dial now"); during a run it does nothing.
    """
    dial_now = asyncio.Event()
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGUSR1, dial_now.set)
        handled = True
    except (ValueError, NotImplementedError, RuntimeError):  # not the main thread
        handled = False
    try:
        return await _join_loop(options, persist, log, backoff_start, attempts, on_wait, dial_now)
    finally:
        if handled:
            loop.remove_signal_handler(signal.SIGUSR1)


async def _join_loop(
    options: AgentOptions,
    persist: bool,
    log: Callable[[str], None],
    backoff_start: float,
    attempts: int | None,
    on_wait: Callable[[bool], None],
    dial_now: asyncio.Event,
) -> int:
    delay: float | None = None
    tries = 0
    while True:
        tries += 1
        started = time.monotonic()
        dial_now.clear()  # a nudge during this attempt cuts the backoff after it
        try:
            code = await join_once(options, log, on_wait)
            if code == CLEAN:
                log(f"run finished cleanly on {options.host}")
            else:
                log("a rank failed; the run ended with errors")
        except AgentFailure as exc:
            log(exc.render())
            code = exc.code
        if not persist or code == PERMANENT or (attempts is not None and tries >= attempts):
            return code
        delay = next_backoff(delay, time.monotonic() - started, backoff_start)
        log(f"re-dialling in {delay:.0f}s")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(dial_now.wait(), delay)  # the backoff itself, or a nudge
            log("nudged (SIGUSR1): re-dialling now")


class AgentSpec(BaseModel):
    """What a launcher tells an agent it starts: FLODL_INTERNAL_AGENT_JSON, or the
    fan-out session's stdin (hex-encoded JSON either way; never argv)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    host: str | None = None
    controller_host: str | None = None
    controller_port: int = Field(1337, ge=1, le=65535)
    key: str | None = Field(None, pattern=r"^([0-9a-f]{32}|[0-9a-f]{64})$")
    devices: str | None = None
    data_path: str = ""
    env: dict[str, str] = Field(default_factory=dict)
    socket_ifname: str = Field("", max_length=256)


def parse_agent_spec(text: str) -> AgentSpec:
    try:
        return AgentSpec.model_validate_json(bytes.fromhex(text.strip()))
    except ValueError as exc:  # bad hex, bad JSON, or a field out of bounds
        raise ValueError(
            f"the agent spec is not a hex-encoded JSON spec ({exc.__class__.__name__})"
        ) from None

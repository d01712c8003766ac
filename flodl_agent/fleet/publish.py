"""`fdl publish`: the controller is the authority over what a standing fleet runs.

A source spec (``file://``, ``rsync://``, ``git+…#ref``) is fetched into
``<served>/incoming``, checked (no symlink leads out of it: :mod:`.confine`),
and mirrored into ``<served>/tree``, the one directory door B serves; a digest
sidecar in ``sha256sum`` format is written at the tree's root
(``.fdl-tree.sha256``: ``sha256sum -c`` checks a copy by hand); the build line
runs once, as a gate, in a scratch copy (``<served>/gate``) with this box's own
environment; and only then is the run manifest (``.fdl-run.yml``) written at the
tree's root. A git source is fetched shallow, exactly the pinned ref, into
``<served>/checkout``: no history and no other branch is ever beside the tree.

The manifest's presence is the commit point. Publish removes it before it
touches the tree and writes it (atomically) only after the gate passed, so a
box fetching mid-publish finds no manifest and re-dials, and a failed gate
publishes nothing. Every publish mints a fresh run identity that rides each
worker's hello: boxes that fetched across a publish boundary never form one
world.

The manifest and the digest are :mod:`.manifest`'s. Here: rsync, git, the gate.
"""

from __future__ import annotations

import os
import secrets
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import yaml

from ..agent.containers import ComposeError, run_in_service
from ..sources.build import Build, entry_command, rank_path, run_build
from ..sources.confine import describe_links, entry_outside, escaping_links, overlapping
from ..sources.fetch import CHECKOUT, fetch_git, mirror, pinned_ssh
from ..sources.manifest import DIGEST_FILE, MANIFEST, Manifest, PublishError, digest_lines, digest_of
from ..sources.spec import SourceSpec
from ..train.signature import ProbeFailed, probe_model

# <served>: tree/ is door B's root; the rest is the publish's own scratch, outside what any key reads.
TREE, GATE, INCOMING = "tree", "gate", "incoming"


@dataclass(frozen=True)
class PublishRequest:
    source: SourceSpec
    served: Path
    bin: str | None = None
    cwd: str = "."
    build: str | None = None
    args: list[str] = field(default_factory=list)
    no_build: bool = False
    model_probe: bool = False  # probe the entry's model here; every box then probes before it dials
    identity: str | None = None  # ssh key for rsync:// and git+ssh://
    ssh_options: tuple[str, ...] = ()  # extra `-o` options for ssh (the user's ssh config applies too)
    gate_docker: str | None = None  # cluster.controller.docker: the gate builds in this compose service
    gate_venv: str | None = None  # cluster.controller.arch's venv: the gate builds with that variant


@dataclass(frozen=True)
class PublishReport:
    tree: Path
    manifest: Manifest
    files: int
    build_output: str = ""

    def spellings(self, host: str, user: str = "flodl-join") -> dict[str, str]:
        """How a worker names this tree: plain (a key without a forced command) and through door B,
        whose root is the tree itself."""
        return {"plain": f"rsync://{user}@{host}:{self.tree}", "rrsync": f"rsync://{user}@{host}:/"}


def _ssh_command(request: PublishRequest, port: int | None) -> list[str]:
    return pinned_ssh(port, request.identity, request.ssh_options)


def _fetch(request: PublishRequest, incoming: Path) -> str:
    """Mirror the source into ``incoming`` (outside the door's reach); the origin to record."""
    spec = request.source
    if spec.scheme == "file":
        if not Path(spec.path).is_dir():
            raise PublishError(f"{spec}: no such directory on this box", "name a directory that exists here")
        mirror(spec.path, incoming)
        return str(spec)
    if spec.scheme == "rsync":
        destination = spec.ssh_destination
        assert destination is not None
        mirror(f"{destination}:{spec.path}", incoming, rsh=_ssh_command(request, spec.port))
        return str(spec)
    commit = fetch_git(spec, request.served / CHECKOUT, _ssh_command(request, None))
    mirror(str(request.served / CHECKOUT), incoming)
    return f"{spec} ({commit})"


def _self_contained(incoming: Path) -> None:
    """Refuse a fetched source whose symlinks lead out of it, before any of it is served."""
    links = escaping_links(incoming)
    if links:
        raise PublishError(
            f"the source holds {len(links)} symlink(s) that lead out of it: {describe_links(links)}",
            "a published tree is self-contained (door B serves nothing outside it): replace each link "
            "with what it names, or point it inside the tree; nothing was published",
        )


def _confined_bin(root: Path, request: PublishRequest) -> None:
    why = entry_outside(root, request.cwd, request.bin) if request.bin else None
    if why is not None:
        raise PublishError(
            f"bin: {request.bin} {why} (cwd {request.cwd})",
            "bin names the entry point inside the tree, relative to cwd; nothing was published",
        )


# The controller's own environment builds and probes: its venv, the CPU variant.
_GATE_ENV = {"FDL_TORCH_VARIANT": "cpu"}
DOCKER_FIELD, ARCH_FIELD = "cluster.controller.docker", "cluster.controller.arch"


@dataclass(frozen=True)
class _Where:
    """Where the gate builds and probes: PATH, python and environment (and the service)."""

    path: str
    python: str
    env: dict[str, str]
    service: str | None = None

    def build(self, line: str, workdir: Path, gate: Path) -> Build:
        if self.service is None:
            return run_build(line, workdir, self.env, self.path)
        code, output = _in_service(self.service, ["sh", "-c", line], workdir, (gate,), self.env)
        return Build(line, code, output)


def _in_service(
    service: str, command: list[str], workdir: Path, mounts: tuple[Path, ...], env: dict[str, str],
    timeout: float | None = None,
) -> tuple[int, str]:  # fmt: skip
    try:
        return run_in_service(service, command, workdir, mounts, env, DOCKER_FIELD, timeout)
    except ComposeError as exc:
        raise PublishError(f"{exc.message}; nothing was published", exc.fix) from None


def _where(request: PublishRequest) -> _Where:
    if request.gate_docker:  # the service's image brings its own torch and python
        return _Where("", "python3", {}, request.gate_docker)
    if request.gate_venv:
        bin_dir = Path(request.gate_venv) / "bin"
        if not os.access(bin_dir / "python", os.X_OK):
            raise PublishError(
                f"{ARCH_FIELD}: no variant venv at {request.gate_venv} ({bin_dir / 'python'} is not there)",
                "install the variant there (python3 -m venv, then its torch), point cluster.controller.path "
                "at the root that holds libtorch/<arch>, or drop arch to build with this venv",
            )
        env = {"FDL_TORCH_VARIANT": Path(request.gate_venv).name}
        return _Where(
            os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")]), str(bin_dir / "python"), env
        )
    return _Where(rank_path(), sys.executable, _GATE_ENV)


def _gate(request: PublishRequest, tree: Path, log: Callable[[str], None]) -> tuple[str, str | None]:
    """Build (and probe) once in a scratch copy of the tree; the build's output and the signature."""
    where = _where(request)
    gate = request.served / GATE
    gate.mkdir(parents=True, exist_ok=True)
    mirror(str(tree), gate)
    workdir = gate / request.cwd
    output = ""
    if request.build is not None and not request.no_build:
        place = f"in the {where.service} service, " if where.service else ""
        log(f"gate: {request.build}  ({place}in {workdir})")
        build = where.build(request.build, workdir, gate)
        if build.returncode != 0:
            raise PublishError(
                build.failure(f" in {request.cwd}"), "fix the build and publish again; nothing was published"
            )
        output = build.output
        _confined_bin(gate, request)  # again: the build may have made a directory link on the way
        entry = workdir / request.bin if request.bin else None
        if entry is not None and not entry.exists():
            raise PublishError(
                f"the build succeeded but bin: {request.bin} is not there (looked in {request.cwd}/)",
                "bin is relative to cwd: point it at what the build produces",
            )
    if not request.model_probe:
        return output, None
    if not request.bin:
        raise PublishError("--model-probe needs the entry point", "name it with --bin (or publish.bin)")
    command = entry_command(workdir / request.bin, request.args, where.python)
    log(f"model probe: {shlex.join(command)}")
    try:
        if where.service is None:
            sig = probe_model(command, workdir, dict(os.environ) | where.env | {"PATH": where.path})
        else:
            service = where.service

            def run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
                try:
                    return _in_service(service, argv, cwd, (gate,), env, timeout)
                except TimeoutError:
                    raise ProbeFailed(
                        f"the entry did not answer the model probe within {timeout:.0f}s"
                    ) from None

            sig = probe_model(command, workdir, where.env, run=run, scratch=gate)
    except ProbeFailed as exc:
        raise PublishError(
            f"{exc}; nothing was published",
            "the entry must build its model through flodl_agent.train.Trainer (or call "
            "flodl_agent.train.answer_probe(model) once built); or publish without --model-probe",
        ) from None
    return output, sig


def publish(request: PublishRequest, log: Callable[[str], None] = lambda _: None) -> PublishReport:
    """Fetch, check, digest, gate, then commit the manifest. Raises PublishError (nothing published)."""
    served = request.served
    spec = request.source
    if spec.scheme == "file" and overlapping(Path(spec.path), served):
        raise PublishError(
            f"the served directory {served} and the source {spec} hold one another: every publish "
            "would copy the tree into itself",
            "serve from a directory outside the source (--to, publish.to; the default is ~/.flodl/run)",
        )
    tree = served / TREE
    tree.mkdir(parents=True, exist_ok=True)
    # The commit point goes first: from here until the end, a box that fetches finds no run.
    (tree / MANIFEST).unlink(missing_ok=True)
    log(f"fetching {request.source} into {tree}")
    incoming = served / INCOMING
    incoming.mkdir(exist_ok=True)
    origin = _fetch(request, incoming)
    _self_contained(incoming)  # before any of it reaches the door
    _confined_bin(incoming, request)
    mirror(str(incoming), tree)
    cwd = tree / request.cwd
    if not cwd.is_dir() or not cwd.resolve().is_relative_to(tree.resolve()):
        raise PublishError(
            f"cwd: {request.cwd} names no directory in the fetched source",
            "cwd is a path inside the tree, not on this box",
        )
    lines = digest_lines(tree)
    (tree / DIGEST_FILE).write_text(lines)
    built = request.build is not None and not request.no_build
    if not built and request.bin and not (cwd / request.bin).exists():
        raise PublishError(
            f"bin: {request.bin} is not in the fetched source (looked in {request.cwd}/)",
            "name the entry point relative to cwd, or give --build to produce it",
        )
    output, sig = _gate(request, tree, log) if built or request.model_probe else ("", None)
    manifest = Manifest(
        run=secrets.token_hex(16),
        cwd=request.cwd,
        build=request.build,
        bin=request.bin,
        args=list(request.args),
        origin=origin,
        published=datetime.now(UTC).isoformat(timespec="seconds"),
        built=built,
        digest=digest_of(lines),
        model_probe=sig is not None,
        model_sig=sig,
    )
    staged = served / f".{MANIFEST}.tmp"  # beside the tree, same filesystem: the rename is atomic
    staged.write_text(yaml.safe_dump(manifest.model_dump(), sort_keys=False))
    staged.replace(tree / MANIFEST)  # the commit point
    return PublishReport(tree, manifest, lines.count("\n"), output)

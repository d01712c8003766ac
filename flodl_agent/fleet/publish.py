"""`fdl publish`: the controller is the authority over what a standing fleet runs.

A publish either replaces the served run whole or leaves it exactly as it was.
In order:

1. Everything that needs no fetch is checked first: the spec against the served
   directory, the text of ``cwd`` and ``bin`` (no absolute path, no ``..`` out),
   ``<served>`` and ``<served>/tree`` being directories, where the gate builds.
2. The source (``file://``, ``rsync://``, ``git+…#ref``) is fetched into
   ``<served>/incoming`` and checked there: no symlink leads out of it
   (:mod:`.confine`), ``cwd`` is one of its directories, ``bin`` is inside it. A
   git source is fetched shallow, exactly the pinned ref, into
   ``<served>/checkout``: no history and no other branch is ever beside the tree.
3. The new tree is made in ``<served>/staging`` (a file the served tree holds
   unchanged is hard-linked from it, not copied), with its digest sidecar
   (``.fdl-tree.sha256``, ``sha256sum -c`` checks a copy by hand).
4. The build line runs once, as a gate, in a scratch copy (``<served>/gate``)
   with this box's own environment (and the model probe, with --model-probe).
5. The run manifest (``.fdl-run.yml``) is written into the staging tree, its
   last file, and the staging tree is swapped in at ``<served>/tree`` in one
   rename (the commit point); the tree it replaced moves to ``<served>/previous``
   and stays there until the next publish.

Until the swap nothing under ``<served>/tree`` changes, so a refused or failed
publish leaves the served run as it was, and says which run that is. A box
fetching across the swap reads the old tree whole: door B's rrsync has changed
into the tree's directory, which the swap moves but never empties (a pull that
mixes both is caught by the digest check on the box, which re-dials). Every
publish mints a fresh run identity that rides each worker's hello: boxes that
fetched across a publish boundary never form one world.

The manifest and the digest are :mod:`.manifest`'s. Here: rsync, git, the gate, the swap.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shlex
import shutil
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import yaml

from ..agent.containers import ComposeError, run_in_service
from ..hardware.variants import variant_env
from ..sources.build import Build, entry_command, rank_path, run_build
from ..sources.confine import describe_links, entry_outside, escaping_links, overlapping, path_outside
from ..sources.fetch import CHECKOUT, fetch_git, mirror, pinned_ssh
from ..sources.manifest import (
    DIGEST_FILE,
    MANIFEST,
    Manifest,
    PublishError,
    digest_lines,
    digest_of,
    read_manifest,
)
from ..sources.spec import SourceSpec
from ..train.signature import ProbeFailed, probe_model

# <served>: tree/ is door B's root; the rest is the publish's own, outside what any key reads.
TREE, GATE, INCOMING, STAGING, PREVIOUS = "tree", "gate", "incoming", "staging", "previous"


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
            "with what it names, or point it inside the tree",
        )


def _confined_bin(root: Path, request: PublishRequest) -> None:
    why = entry_outside(root, request.cwd, request.bin) if request.bin else None
    if why is not None:
        raise PublishError(
            f"bin: {request.bin} {why} (cwd {request.cwd})",
            "bin names the entry point inside the tree, relative to cwd",
        )


def _checked_served(served: Path) -> None:
    """The served directory is one, and its tree/ a directory of its own (not a link elsewhere):
    the swap replaces that path, and door B names it."""
    if served.exists() and not served.is_dir():
        raise PublishError(
            f"--to: {served} is not a directory", "name the publish directory (--to, publish.to)"
        )
    tree = served / TREE
    if tree.is_symlink() or (tree.exists() and not tree.is_dir()):
        raise PublishError(
            f"--to: {tree} is not a directory of its own (a link or a file)",
            f"move it aside: publish makes {tree} itself, the path door B serves",
        )


def _checked(request: PublishRequest) -> _Where:
    """Everything a publish can check before it fetches; where the gate builds."""
    spec, served = request.source, request.served
    if spec.scheme == "file" and overlapping(Path(spec.path), served):
        raise PublishError(
            f"the served directory {served} and the source {spec} hold one another: every publish "
            "would copy the tree into itself",
            "serve from a directory outside the source (--to, publish.to; the default is ~/.flodl/run)",
        )
    if why := path_outside(request.cwd):
        raise PublishError(f"cwd: {request.cwd} {why}", "cwd is a path inside the tree, not on this box")
    if request.bin and (why := path_outside(str(Path(request.cwd) / request.bin))):
        raise PublishError(
            f"bin: {request.bin} {why} (cwd {request.cwd})",
            "bin names the entry point inside the tree, relative to cwd",
        )
    if request.model_probe and not request.bin:
        raise PublishError("--model-probe needs the entry point", "name it with --bin (or publish.bin)")
    _checked_served(served)
    return _where(request)


def _runnable(root: Path, request: PublishRequest) -> None:
    """The fetched tree holds cwd, and bin too when no build is to make it."""
    cwd = root / request.cwd
    if not cwd.is_dir() or not cwd.resolve().is_relative_to(root.resolve()):
        raise PublishError(
            f"cwd: {request.cwd} names no directory in the fetched source",
            "cwd is a path inside the tree, not on this box",
        )
    built = request.build is not None and not request.no_build
    if not built and request.bin and not (cwd / request.bin).exists():
        raise PublishError(
            f"bin: {request.bin} is not in the fetched source (looked in {request.cwd}/)",
            "name the entry point relative to cwd, or give --build to produce it",
        )


# The controller's own environment builds and probes: its venv, the CPU variant.
_GATE_ENV = variant_env("cpu")
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
        raise PublishError(exc.message, exc.fix) from None


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
        env = variant_env(Path(request.gate_venv).name)
        return _Where(
            os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")]), str(bin_dir / "python"), env
        )
    return _Where(rank_path(), sys.executable, _GATE_ENV)


def _gate(
    request: PublishRequest, tree: Path, where: _Where, log: Callable[[str], None]
) -> tuple[str, str | None]:
    """Build (and probe) once in a scratch copy of the tree; the build's output and the signature."""
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
            raise PublishError(build.failure(f" in {request.cwd}"), "fix the build and publish again")
        output = build.output
        _confined_bin(gate, request)  # again: the build may have made a directory link on the way
        entry = workdir / request.bin if request.bin else None
        if entry is not None and not entry.exists():
            raise PublishError(
                f"the build succeeded but bin: {request.bin} is not there (looked in {request.cwd}/)",
                "bin is relative to cwd: point it at what the build produces",
            )
    if not request.model_probe or not request.bin:  # _checked refused a probe without a bin
        return output, None
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
            str(exc),
            "the entry must build its model through flodl_agent.train.Trainer (or call "
            "flodl_agent.train.answer_probe(model) once built); or publish without --model-probe",
        ) from None
    return output, sig


def _remove(path: Path) -> None:
    """Remove a tree of ours, read-only directories too (rsync -a keeps a source's modes)."""
    if not path.exists() and not path.is_symlink():
        return
    try:
        shutil.rmtree(path)
    except PermissionError:
        for root, dirs, _ in os.walk(path):
            for name in dirs:
                child = Path(root, name)
                if not child.is_symlink():
                    child.chmod(child.stat().st_mode | stat.S_IRWXU)
        shutil.rmtree(path)


def _stage(served: Path, incoming: Path) -> Path:
    """The new tree, beside the served one: a copy of the fetched source in which each file the
    served tree holds unchanged is a hard link to it. Nothing writes a file of it in place (the
    gate builds in its own copy; the manifest and sidecar are new files), so the links never
    change a file the served tree holds."""
    staging, tree = served / STAGING, served / TREE
    _remove(staging)  # a publish cut short left it; it was never served
    mirror(str(incoming), staging, link_dest=tree if tree.is_dir() else None)
    if tree.is_dir():  # the role made tree/ with an owner and mode door B reads through: keep them
        was = tree.stat()
        staging.chmod(stat.S_IMODE(was.st_mode))
        now = staging.stat()
        if (now.st_uid, now.st_gid) != (was.st_uid, was.st_gid):
            try:
                os.chown(staging, was.st_uid, was.st_gid)
            except PermissionError:
                raise PublishError(
                    f"--to: {tree} belongs to uid {was.st_uid} (gid {was.st_gid}), and this user cannot "
                    "hand the new tree to them",
                    "publish as the tree's owner (for the role's: sudo -u flodl fdl publish), or as root",
                ) from None
    return staging


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
# renameat2 answers these where the kernel, the filesystem (NFS) or a system-call filter has no
# RENAME_EXCHANGE: the swap falls back to two renames.
_NO_EXCHANGE = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM})


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths in one step (Linux renameat2, RENAME_EXCHANGE); False where this box cannot."""
    try:
        import ctypes  # here: its import fails where writable code is refused (MemoryDenyWriteExecute)

        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (ImportError, MemoryError, OSError, AttributeError):  # not glibc 2.28+, not Linux
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_EXCHANGE:
        return False
    raise OSError(code, os.strerror(code), str(second))


def _swap(served: Path, staging: Path, log: Callable[[str], None]) -> None:
    """Put ``staging`` at ``<served>/tree`` (the commit point); the tree it replaces becomes
    ``<served>/previous``.

    The served path stays the one door B names, and the directory it replaced is moved, not
    emptied: a pull that already changed into it (rrsync does, before it reads a file) reads the
    old run whole. It stays until the next publish, so a pull has a whole publish's time to end.
    """
    tree, previous = served / TREE, served / PREVIOUS
    _remove(previous)
    if not tree.is_dir():
        staging.rename(tree)  # the first publish: nothing was served
    elif _exchange(staging, tree):
        try:
            staging.rename(previous)
        except OSError as exc:  # committed already: the next publish removes what is left
            log(f"note: the replaced tree stays at {staging}: {exc.strerror}")
    else:
        # Two renames: between them no tree at all, which a fetch meets as nothing served and
        # re-dials; never a tree of two runs.
        tree.rename(previous)
        try:
            staging.rename(tree)
        except OSError:
            previous.rename(tree)  # the served run back, unchanged
            raise


def _served_run(tree: Path) -> str:
    """The run ``tree`` serves now, as a refusal names it."""
    try:
        manifest = read_manifest(tree)
    except PublishError:
        return f"{tree / MANIFEST} holds no valid run manifest"
    except OSError as exc:
        return f"{tree} cannot be read ({exc.strerror})"
    if manifest is None:
        return "nothing is served"
    return f"run {manifest.run} ({manifest.origin}, published {manifest.published})"


def _unchanged(exc: PublishError, request: PublishRequest, served: str) -> PublishError:
    """``exc`` saying the served run is as it was; the staging tree it left goes (never served)."""
    with contextlib.suppress(OSError):
        _remove(request.served / STAGING)
    exc.unchanged = served
    return exc


def publish(request: PublishRequest, log: Callable[[str], None] = lambda _: None) -> PublishReport:
    """Check, fetch, stage, gate, then swap the new tree in. Raises PublishError: nothing was
    published, and the served run is as it was (the error says which it is)."""
    served = _served_run(request.served / TREE)
    try:
        return _publish(request, log)
    except PublishError as exc:
        raise _unchanged(exc, request, served) from None
    except OSError as exc:
        failed = PublishError(
            f"{exc.filename or request.served}: {exc.strerror or exc}",
            f"check that this user can write {request.served} (--to, publish.to) and that it has room",
        )
        raise _unchanged(failed, request, served) from None


def _publish(request: PublishRequest, log: Callable[[str], None]) -> PublishReport:
    served, tree = request.served, request.served / TREE
    where = _checked(request)  # before anything under <served> changes
    incoming = served / INCOMING
    incoming.mkdir(parents=True, exist_ok=True)
    log(f"fetching {request.source} into {incoming}")
    origin = _fetch(request, incoming)
    _self_contained(incoming)  # before any of it reaches the door
    _confined_bin(incoming, request)
    _runnable(incoming, request)
    staging = _stage(served, incoming)
    lines = digest_lines(staging)
    (staging / DIGEST_FILE).write_text(lines)
    built = request.build is not None and not request.no_build
    output, sig = _gate(request, staging, where, log) if built or request.model_probe else ("", None)
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
    (staging / MANIFEST).write_text(yaml.safe_dump(manifest.model_dump(), sort_keys=False))  # its last file
    _swap(served, staging, log)  # the commit point
    return PublishReport(tree, manifest, lines.count("\n"), output)

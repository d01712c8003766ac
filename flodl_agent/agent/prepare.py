"""Preparing a box before every dial: fetch the published run, check it, build it.

Admission starts a window deadline, so a box gets ready first — and again on
every attempt, which makes ``fdl join --persist`` a provisioning loop: a new
publish is picked up on the next dial with nothing edited on the box.

With ``join.source``, the agent mirrors ``source.from`` into
``<stage>/tree`` (the manifest and the digest sidecar come along), checks it
against the published digest, and copies it into ``<stage>/build`` where the
build runs — only when the digest or the build line changed since the last
good build, so a re-dial into the same run costs a checksum pass. The
manifest is the authority: its cwd, build, bin and args replace the local
ones (said in the log when they differ), and its run identity rides the
hello. Without a manifest, a box that names its own artifact (``source.bin``)
runs it with its local settings; one that does not waits for a publish.

Every failure is classed as the troubleshooting guide words it: transient
failures re-dial (nothing published yet, a publish in flight, a build or a
manifest that a push will fix), permanent ones stop (a path that cannot exist
in this tree, a door that will never serve the fetch, a missing system package).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..config.models import Source, Ssh
from ..errors import PERMANENT, TRANSIENT, Failure, host_key_mismatch
from ..hardware.variants import variant_env
from ..net import DEAD_MOUNT, ssh_argv
from ..probing.probe import dir_facts, dir_findings
from ..sources.build import entry_command, run_build
from ..sources.confine import entry_outside
from ..sources.fetch import CHECKOUT, EXCLUDES, fetch_git, mirror_argv, pinned_ssh
from ..sources.manifest import (
    DIGEST_FILE,
    MANIFEST,
    Manifest,
    PublishError,
    digest_lines,
    digest_of,
    read_manifest,
    verify,
)
from ..sources.spec import SourceSpec, parse_data_source, parse_source

STAMP = ".fdl-built"  # in <stage>/build: the digest and build line of the last good build
# What the fetch leaves out: caches and virtualenvs, never the run's manifest or sidecar.
FETCH_EXCLUDES = tuple(e for e in EXCLUDES if e not in (f"/{MANIFEST}", f"/{DIGEST_FILE}"))
# Tools a build may need that re-dialling cannot install: the Debian package that has each.
SYSTEM_PACKAGES = {
    "gcc": "gcc",
    "cc": "gcc",
    "g++": "g++",
    "c++": "g++",
    "make": "make",
    "cmake": "cmake",
    "ninja": "ninja-build",
    "pkg-config": "pkg-config",
    "nvcc": "nvidia-cuda-toolkit",
    "hipcc": "hipcc",
    "git": "git",
    "cargo": "cargo",
}
# sh/bash: "sh: 1: cmake: not found", "bash: cmake: command not found"; zsh: "command not found: cmake".
_NOT_FOUND = (
    re.compile(r"(?:^|[\s:])([\w.+-]+): (?:command )?not found", re.M),
    re.compile(r"command not found: ([\w.+-]+)"),
)


class PrepareFailure(Failure):
    """A box that is not ready: ``code`` says whether re-dialling can help."""

    def __init__(self, message: str, fix: str = "", code: int = TRANSIENT) -> None:
        super().__init__(message, fix)
        self.code = code


@dataclass(frozen=True)
class Prepared:
    command: list[str]  # the entry point (absolute) and the run's arguments
    cwd: Path  # where the ranks run
    run: str  # the manifest's run identity ("" without a manifest)
    model_probe: bool = False  # the run's entry answers the model probe (fdl publish --model-probe)


def missing_package(output: str) -> tuple[str, str] | None:
    """(tool, Debian package) when a build's output says a known system tool is missing."""
    for pattern in _NOT_FOUND:
        for match in pattern.finditer(output):
            if match.group(1) in SYSTEM_PACKAGES:
                return match.group(1), SYSTEM_PACKAGES[match.group(1)]
    return None


def _host_key_failure(doing: str, ssh_output: str) -> PrepareFailure | None:
    mismatch = host_key_mismatch(doing, ssh_output)
    return PrepareFailure(mismatch.message, mismatch.fix, PERMANENT) if mismatch else None


def _fetch_failure(spec: SourceSpec, output: str) -> PrepareFailure:
    text = output.strip()
    last = " / ".join(text.splitlines()[-3:]) or "no output"
    if refused := _host_key_failure(f"fetching {spec}", text):
        return refused
    if "not available" in text or "protocol version mismatch" in text or "This service allows sftp" in text:
        return PrepareFailure(
            f"fetching {spec} refused: this box's key opens the join door for the tunnel only ({last})",
            "give the key door B's line (flodl_controller_door_mode: rrsync, the controller role's "
            "door-fetch as its command), and fetch rsync://<user>@<controller>:/",
            PERMANENT,
        )
    if "No such file or directory" in text or "change_dir" in text:
        hint = (
            "nothing is published yet: run fdl publish on the controller"
            if spec.path == "/"
            else "door B serves the published tree itself, at /: fetch rsync://<user>@<controller>:/ "
            "(or, with a key that has no forced command, the tree's own path)"
        )
        return PrepareFailure(f"fetching {spec}: no such directory there ({last})", hint)
    return PrepareFailure(
        f"fetching {spec} failed: {last}", "re-dials on its own; check the source is reachable"
    )


def _run(
    argv: list[str], cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        tool = argv[0]
        raise PrepareFailure(
            f"`{tool}` is not installed on this box",
            f"apt-get install {SYSTEM_PACKAGES.get(tool, tool)} (the worker role installs it)",
            PERMANENT,
        ) from None


def fetch(source: Source, stage: Path, ssh: Ssh | None) -> Path:
    """Mirror ``source.from`` into ``<stage>/tree``; the tree."""
    spec = parse_source(source.from_)
    tree = stage / "tree"
    tree.mkdir(parents=True, exist_ok=True)
    if spec.scheme == "file":
        origin, rsh = spec.path, None
    elif spec.scheme == "rsync":
        # The join's ssh block carries the key and options; the spec names where.
        ssh = ssh or Ssh()
        rsh = pinned_ssh(spec.port or ssh.port, ssh.identity_file, ssh.options)
        user = spec.user or ssh.user
        origin = f"{user + '@' if user else ''}{spec.host}:{spec.path}"
    else:
        try:
            # The ssh block's options come along: its known_hosts pin above all.
            ssh = ssh or Ssh()
            command = pinned_ssh(None, ssh.identity_file, ssh.options)
            fetch_git(spec, stage / CHECKOUT, command)
        except PublishError as exc:
            raise _host_key_failure(f"fetching {spec}", exc.output) or PrepareFailure(
                exc.message, exc.fix
            ) from None
        origin, rsh = str(stage / CHECKOUT), None
    proc = _run(mirror_argv(origin, tree, rsh, FETCH_EXCLUDES))
    if proc.returncode != 0:
        raise _fetch_failure(spec, proc.stderr or proc.stdout)
    return tree


def _readable(path: Path) -> OSError | None:
    try:
        next(os.scandir(path), None)
    except OSError as exc:
        return exc
    return None


def mount_state(data_path: Path, broken: OSError | None) -> Literal["live", "dead"]:
    """What a mount already at ``data_path`` is, from reading its root (``broken``: the error):
    live to reuse, dead to clear and mount again; one this agent cannot read stops for good."""
    if broken is None:
        return "live"
    if broken.errno not in DEAD_MOUNT:
        raise PrepareFailure(
            f"the data mount at {data_path} cannot be read: {broken.strerror}",
            "a door A mount needs allow_other when another user mounted it",
            PERMANENT,
        )
    return "dead"


def sshfs_options(spec: SourceSpec, ssh: Ssh) -> str:
    """sshfs's ``-o``: read-only and reconnecting, host keys as pinned, then the join's ssh block."""
    options = ["ro", "reconnect", "ServerAliveInterval=15", "ServerAliveCountMax=3", "BatchMode=yes"]
    options += ["StrictHostKeyChecking=yes", *ssh.options]
    if spec.port or ssh.port:
        options.append(f"port={spec.port or ssh.port}")
    if ssh.identity_file:
        options += [f"IdentityFile={ssh.identity_file}", "IdentitiesOnly=yes"]
    return ",".join(options)


def data_remote(spec: SourceSpec, ssh: Ssh) -> str:
    """``[user@]host:/path`` for sshfs: the spec's user, else the ssh block's."""
    user = spec.user or ssh.user
    return f"{user + '@' if user else ''}{spec.host}:{spec.path}"


def mount_words(
    proc: subprocess.CompletedProcess[str], said: subprocess.CompletedProcess[str] | None
) -> tuple[str, str]:
    """What a failed mount said, all of it and its last lines: ssh's own words (``said``) over
    sshfs's, which hide them."""
    text = (proc.stderr or proc.stdout).strip()
    last = " / ".join(text.splitlines()[-3:]) or f"sshfs exited {proc.returncode}"
    if said is not None:
        text += "\n" + said.stderr
        last = " / ".join(said.stderr.strip().splitlines()[-2:]) or last
    return text, last


def mount_failure(
    data_source: str, host: str | None, text: str, last: str, said: subprocess.CompletedProcess[str] | None
) -> PrepareFailure:
    """A failed mount classed as the troubleshooting guide words it (``mount_words``'s text and
    last lines; ``said``: ssh's own try at sftp, None when it could not run)."""
    if "Permission denied" in text:
        return PrepareFailure(
            f"mounting {data_source}: permission denied ({last})",
            "door A: the data account must hold this box's key as "
            'restrict,command="internal-sftp -R" <key> (flodl_controller_data_door_enabled, '
            "and the worker's key in the door's keys)",
            PERMANENT,
        )
    if refused := _host_key_failure(f"mounting {data_source}", text):
        return refused
    if "fuse" in text.lower() and ("device" in text or "permitted" in text):
        return PrepareFailure(
            f"mounting {data_source}: this box cannot mount FUSE filesystems ({last})",
            "apt-get install sshfs fuse3, and give containers /dev/fuse",
            PERMANENT,
        )
    if said is not None and said.returncode not in (0, 255):
        # The key got in and its forced command ran instead of sftp: a forced command covers
        # subsystem requests too, so a tunnel-only (nologin) key refuses every mount.
        words = " / ".join((said.stdout + said.stderr).strip().splitlines()[-2:])
        return PrepareFailure(
            f"mounting {data_source}: permission denied: this box's key opens the door for the tunnel "
            f"only (its forced command ran instead of sftp: {words or f'exit {said.returncode}'})",
            'mount through door A: the data account holds the key as restrict,command="internal-sftp -R" '
            "<key> (flodl_controller_data_door_enabled); or mount the data during provisioning and "
            "declare a bare join.data_path",
            PERMANENT,
        )
    if "Could not resolve hostname" in text:
        return PrepareFailure(
            f"mounting {data_source}: the door's name {host} does not resolve ({last})",
            "check the host in join.data_source, or name the door by its IP; DNS may come back, "
            "so --persist re-dials",
        )
    return PrepareFailure(
        f"mounting {data_source} failed: {last}", "re-dials on its own; is the door reachable?"
    )


def _clear_dead_mount(data_path: Path, log: Callable[[str], None]) -> None:
    log(f"the data mount at {data_path} is not connected (its sshfs died): mounting it again")
    _run(["fusermount", "-uz", str(data_path)])


def _mount_point(data_path: Path) -> None:
    try:
        data_path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PrepareFailure(
            f"data_path {data_path} cannot be created: {exc.strerror}",
            "create it for the service user, or point join.data_path somewhere it can write",
            PERMANENT,
        ) from None


def _ask_ssh(spec: SourceSpec, ssh: Ssh) -> subprocess.CompletedProcess[str] | None:
    """ssh's own try at the door's sftp; None when ssh could not run or answer in time."""
    ask = ssh_argv(
        spec.host,
        user=spec.user or ssh.user,
        port=spec.port or ssh.port,
        identity_file=ssh.identity_file,
        options=ssh.options,
        extra=["-o", "StrictHostKeyChecking=yes", "-o", "ConnectTimeout=10"],
    )
    try:
        return subprocess.run(
            [*ask, "-s", "sftp"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None


def mount_data(
    data_source: str, data_path: Path, ssh: Ssh | None, log: Callable[[str], None] = lambda _: None
) -> None:
    """The data root, read-only over sshfs through door A: reuse a live mount, replace a dead one."""
    spec = parse_data_source(data_source)
    if os.path.ismount(data_path):
        if mount_state(data_path, _readable(data_path)) == "live":
            return  # mounted and answering (by this agent earlier, or by the box's mount unit)
        _clear_dead_mount(data_path, log)
    _mount_point(data_path)
    ssh = ssh or Ssh()
    proc = _run(["sshfs", "-o", sshfs_options(spec, ssh), data_remote(spec, ssh), str(data_path)])
    if proc.returncode == 0:
        log(f"mounted {data_source} read-only at {data_path}")
        return
    # sshfs hides ssh's own words ("read: Connection reset by peer" for every cause): ask ssh.
    said = _ask_ssh(spec, ssh)
    raise mount_failure(data_source, spec.host, *mount_words(proc, said), said)


def ready_dir(path: Path, log: Callable[[str], None]) -> None:
    """Prove a node-local directory writable (a failure otherwise); say when it is on
    tmpfs or nearly full, without refusing."""
    for finding in dir_findings(dir_facts(path)):
        if finding.level == "fail":
            raise PrepareFailure(finding.message, finding.fix, PERMANENT)
        if finding.level == "warn":
            log(f"note: {finding.message}")


def _differs(name: str, local: object, run: object, log: Callable[[str], None]) -> None:
    if local not in (None, [], run):
        log(f"note: the run manifest's {name} ({run!r}) replaces this box's ({local!r})")


def _build(
    tree: Path, stage: Path, cwd: str, build: str | None, digest: str, log: Callable[[str], None],
    variant: str,
) -> Path:  # fmt: skip
    """Copy the tree to ``<stage>/build`` and run the build there for ``variant`` (its
    FDL_TORCH_VARIANT and FDL_GPU_FEATURE), unless the last good build was of this very
    digest, line and variant; the build directory."""
    built = stage / "build"
    stamp = f"{digest}\n{build or ''}\n{variant}\n"
    if (built / STAMP).is_file() and (built / STAMP).read_text() == stamp:
        return built
    built.mkdir(parents=True, exist_ok=True)
    (built / STAMP).unlink(missing_ok=True)
    proc = _run(mirror_argv(str(tree), built, excludes=(*FETCH_EXCLUDES, f"/{STAMP}")))
    if proc.returncode != 0:
        raise PrepareFailure(
            f"staging the build failed: {proc.stderr.strip()}", "check the stage directory's disk"
        )
    if build:
        log(f"building: {build}  (in {built / cwd})")
        done = run_build(build, built / cwd, variant_env(variant))
        if done.returncode != 0:
            message = done.failure()
            missing = missing_package(done.output)
            if missing is not None:
                tool, package = missing
                raise PrepareFailure(
                    message, f"`{tool}` is missing on this box: apt-get install {package}", PERMANENT
                )
            raise PrepareFailure(
                message, "fix the build and publish again; this box picks it up on its next dial"
            )
    (built / STAMP).write_text(stamp)
    return built


def _manifest(tree: Path, source: Source) -> Manifest | None:
    """The fetched tree's manifest; None when this box runs its own artifact without one."""
    try:
        manifest: Manifest | None = read_manifest(tree)
    except PublishError as exc:
        raise PrepareFailure(exc.message, "re-dials on its own: a publish rewrites it") from None
    if manifest is None and source.bin is None:
        raise PrepareFailure(
            "the fetched source carries no run manifest and this box declares no artifact",
            "run fdl publish on the controller (a publish in flight commits it when its gate passes), "
            "or name a local artifact in join.source.bin",
        )
    return manifest


def _settings(
    tree: Path,
    manifest: Manifest | None,
    source: Source,
    local_args: list[str] | None,
    log: Callable[[str], None],
) -> tuple[str, str | None, str | None, list[str], str]:
    """The run's cwd, build, bin, args and digest: the manifest's once the tree matches it,
    else this box's own."""
    if manifest is None:
        cwd, build, entry, args = source.cwd or ".", source.build, source.bin, list(local_args or [])
        return cwd, build, entry, args, digest_of(digest_lines(tree))
    changed = verify(tree, manifest)
    if changed:
        raise PrepareFailure(
            f"the fetched tree differs from the published digest ({', '.join(changed[:5])})",
            "a publish was in flight: this box re-fetches on its next dial",
        )
    for name, local, run in (
        ("cwd", source.cwd, manifest.cwd),
        ("build", source.build, manifest.build),
        ("bin", source.bin, manifest.bin),
        ("args", local_args, manifest.args),
    ):
        _differs(name, local, run, log)
    return manifest.cwd, manifest.build, manifest.bin, manifest.args, manifest.digest


def _entry_path(built: Path, cwd: str, entry: str | None, build: str | None, published: bool) -> Path:
    """The built entry point, checked: named, inside the tree, and there."""
    if entry is None:
        raise PrepareFailure(  # the published run's own failure: a publish with --bin fixes it
            "the run names no entry point (bin)", "publish with --bin; this box picks it up on its next dial"
        )
    outside = entry_outside(built, cwd, entry)  # a manifest comes over the network: check it here too
    if outside is not None:  # the published run's own failure (a publish fixes it), or this box's join.source
        raise PrepareFailure(
            f"bin: {entry} {outside} (cwd {cwd}): this box runs nothing outside the fetched tree",
            "bin names the entry point inside the tree, relative to cwd: "
            + (
                "publish again with it; this box picks it up on its next dial"
                if published
                else "fix join.source.bin"
            ),
            TRANSIENT if published else PERMANENT,
        )
    path = built / cwd / entry
    if not path.exists():
        raise PrepareFailure(
            f"the build succeeded but bin: {entry} is not there (looked in {cwd}/)"
            if build
            else f"bin: {entry} is not in the fetched source (looked in {cwd}/)",
            "bin is relative to cwd: point it at what the build produces (a workspace may build elsewhere)",
            PERMANENT,
        )
    return path


def prepare(
    source: Source,
    stage: Path,
    ssh: Ssh | None = None,
    local_args: list[str] | None = None,
    log: Callable[[str], None] = lambda _: None,
    variant: str = "cpu",
) -> Prepared:
    """Fetch, check against the manifest, build for the torch ``variant`` the ranks run in;
    what the ranks run. Raises PrepareFailure."""
    ready_dir(stage, log)
    tree = fetch(source, stage, ssh)
    manifest = _manifest(tree, source)
    cwd, build, entry, args, digest = _settings(tree, manifest, source, local_args, log)
    where = tree / cwd
    if not where.is_dir() or not where.resolve().is_relative_to(tree.resolve()):
        raise PrepareFailure(
            f"cwd: {cwd} names no directory in the fetched source",
            "cwd is a path inside the tree, not on this box: fix it where the run is published",
            PERMANENT,
        )
    built = _build(tree, stage, cwd, build, digest, log, variant)
    path = _entry_path(built, cwd, entry, build, manifest is not None)
    command = entry_command(path, args)
    log(f"prepared run {manifest.run if manifest else '(no manifest)'}: {shlex.join(command)}")
    if manifest is None:
        return Prepared(command, built / cwd, "")
    return Prepared(command, built / cwd, manifest.run, manifest.model_probe)

"""Fetching a tree: a mirror with rsync (here, or over ssh with the host key pinned), and a
git ref checked out shallow, exactly that commit.

``fdl publish`` fetches into the served directory; a box's preparation fetches
from the published tree into its stage. Both with this code.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

from ..net import ssh_argv
from .manifest import DIGEST_FILE, MANIFEST, PublishError
from .spec import SourceSpec

CHECKOUT = "checkout"  # a git source is checked out here, beside the tree it is mirrored into
# Never published: our own files at the root, version control, caches, virtualenvs.
EXCLUDES = (
    f"/{MANIFEST}",
    f"/{DIGEST_FILE}",
    ".git/",
    "__pycache__/",
    "*.pyc",
    ".venv/",
    "venv/",
    ".mypy_cache/",
    ".pytest_cache/",
    ".ruff_cache/",
    ".tox/",
)
# A hex word too short for a commit id: a fetch cannot name it without pulling every ref.
ABBREVIATED = re.compile(r"[0-9a-f]{4,39}")


def pinned_ssh(port: int | None, identity: str | None, options: tuple[str, ...] | list[str]) -> list[str]:
    """ssh for a fetch. Host keys stay pinned: BatchMode, and never a relaxed StrictHostKeyChecking."""
    return ssh_argv(
        None, port=port, identity_file=identity, options=options, extra=["-o", "StrictHostKeyChecking=yes"]
    )


def _run(
    argv: list[str], what: str, fix: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> str:
    try:
        proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise PublishError(
            f"{what}: `{argv[0]}` is not installed", f"install {argv[0]} on this box"
        ) from None
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        error = PublishError(f"{what} failed (exit {proc.returncode}): {' / '.join(detail)}", fix)
        error.output = proc.stderr
        raise error
    return proc.stdout


def mirror_argv(
    source: str,
    tree: Path,
    rsh: list[str] | None = None,
    excludes: tuple[str, ...] = EXCLUDES,
    link_dest: Path | None = None,
) -> list[str]:
    """rsync making ``tree`` a copy of ``source`` (deletions too; ``rsh``: over ssh; a file
    that ``link_dest`` holds unchanged is hard-linked from there, not copied)."""
    # --checksum: size and mtime miss an edit of the same length within the same second
    # (a git checkout, an editor's quick save), and a stale file would publish as new.
    argv = ["rsync", "-a", "--checksum", "--delete", *(f"--exclude={e}" for e in excludes)]
    if link_dest is not None:
        argv.append(f"--link-dest={link_dest.absolute()}")  # relative, rsync reads it from tree
    if rsh is not None:
        argv += ["-e", shlex.join(rsh)]
    return [*argv, source.rstrip("/") + "/", f"{tree}/"]


def mirror(source: str, tree: Path, rsh: list[str] | None = None, link_dest: Path | None = None) -> None:
    _run(
        mirror_argv(source, tree, rsh, link_dest=link_dest),
        f"fetching {source}",
        "check the path exists and this box can read it (for rsync://: the ssh key and the host key pin)",
    )


def fetch_git(spec: SourceSpec, checkout: Path, ssh: list[str]) -> str:
    """Check the pinned ref out into ``checkout``, shallow: that one commit and no other ref
    (``ssh``: the command a ``git+ssh`` fetch runs); the commit it resolved to."""
    assert spec.url is not None and spec.ref is not None
    env = dict(os.environ)
    if spec.scheme == "git+ssh":
        env["GIT_SSH_COMMAND"] = shlex.join(ssh)
    env["GIT_TERMINAL_PROMPT"] = "0"  # credentials come from the environment, never a prompt
    fix = "check the URL, that the ref exists there, and this box's credentials for it"
    if not (checkout / ".git").is_dir():
        checkout.mkdir(parents=True, exist_ok=True)
        _run(["git", "init", "-q", str(checkout)], "preparing the checkout", "check the served directory")
    git = ["git", "-C", str(checkout)]
    fetch = [*git, "fetch", "-q", "--force", "--no-tags", "--depth", "1", spec.url, spec.ref]
    try:
        _run(fetch, f"fetching {spec}", fix, env=env)
    except PublishError as exc:
        if ABBREVIATED.fullmatch(spec.ref):
            raise PublishError(
                f"{spec}: `{spec.ref}` is an abbreviated commit id: a fetch names a commit only in full",
                f"pin the full id (git rev-parse {spec.ref}), a tag or a branch",
            ) from None
        if any(words in exc.message for words in ("remote ref", "not our ref", "unadvertised")):
            raise PublishError(
                f"{spec}: `{spec.ref}` is not a branch, tag or commit of that repository",
                "pin a ref that exists there (git ls-remote lists them; a commit id in full)",
            ) from None
        raise
    commit = _run([*git, "rev-parse", "FETCH_HEAD^{commit}"], "resolving the ref", fix).strip()
    _run(
        [*git, "-c", "advice.detachedHead=false", "checkout", "-q", "--force", "--detach", commit],
        "checkout",
        fix,
    )
    _run([*git, "clean", "-q", "-ffdx"], "cleaning the checkout", fix)
    return commit

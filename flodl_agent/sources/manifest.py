"""A published tree's run manifest (``.fdl-run.yml``) and its digest sidecar (``.fdl-tree.sha256``).

Pure: what a tree says it runs and whether its files are what was published. Written by
``fdl publish`` (:mod:`.publish`), read by every box that fetches the tree (:mod:`.prepare`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import Failure

MANIFEST = ".fdl-run.yml"
DIGEST_FILE = ".fdl-tree.sha256"
# Never digested, as never published (publish.EXCLUDES): version control, caches, virtualenvs.
SKIP_DIRS = frozenset(
    {".git", "__pycache__", ".venv", "venv", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".tox"}
)


class PublishError(Failure):
    """A publish that did not happen, or a fetch of one that failed on a worker."""

    output = ""  # the failed tool's whole stderr (the message keeps its last lines): for classifying it
    unchanged = ""  # a refused publish: the run the served tree still serves, as the refusal says it

    def render(self) -> str:
        said = self.message
        if self.unchanged:
            said += f"\n    nothing was published; the served run is unchanged: {self.unchanged}"
        return f"{said}\n    fix: {self.fix}" if self.fix else said


class Manifest(BaseModel):
    """The run a published tree carries: what every worker runs, and which run it is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run: str = Field(pattern=r"^[0-9a-f]{32}$", description="the run identity (16 random bytes)")
    cwd: str = Field(".", description="project directory inside the tree; the build and the ranks run here")
    build: str | None = Field(None, description="the build line every worker runs")
    bin: str | None = Field(None, description="the entry point, relative to cwd")
    args: list[str] = Field(default_factory=list, description="the run's arguments")
    origin: str = Field(description="the source spec (for git, with the commit it resolved to)")
    published: str = Field(description="when, ISO 8601 UTC")
    built: bool = Field(description="the build passed the gate (false: --no-build)")
    digest: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the tree's digest sidecar")
    model_probe: bool = Field(False, description="the entry answers the model probe: every box probes it")
    model_sig: str | None = Field(None, description="the signature of the model the gate's probe built")


def read_manifest(tree: Path) -> Manifest | None:
    """The tree's manifest, or None when there is none (nothing published, or mid-publish)."""
    path = tree / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return Manifest.model_validate(yaml.safe_load(text))
    except (yaml.YAMLError, ValidationError, RecursionError) as exc:  # a served tree is a peer's
        raise PublishError(
            f"{path} is not a run manifest: {exc}", "publish again (fdl publish) to rewrite it"
        ) from None


def _files(tree: Path) -> Iterator[Path]:
    for root, dirs, names in os.walk(tree):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for name in sorted(names):
            path = Path(root, name)
            if path.parent == tree and name in (MANIFEST, DIGEST_FILE):
                continue
            if name.endswith(".pyc"):
                continue
            yield path


def digest_lines(tree: Path) -> str:
    """The tree's files in ``sha256sum`` format (sorted; a symlink counts as its target's text)."""
    lines = []
    for path in _files(tree):
        hasher = hashlib.sha256()
        if path.is_symlink():
            hasher.update(str(path.readlink()).encode())
        else:
            with path.open("rb") as handle:
                while chunk := handle.read(1 << 20):
                    hasher.update(chunk)
        lines.append(f"{hasher.hexdigest()}  ./{path.relative_to(tree).as_posix()}\n")
    return "".join(lines)


def digest_of(lines: str) -> str:
    return hashlib.sha256(lines.encode()).hexdigest()


def verify(tree: Path, manifest: Manifest) -> list[str]:
    """Files of ``tree`` that differ from what was published (empty: it matches)."""
    lines = digest_lines(tree)
    if digest_of(lines) == manifest.digest:
        return []
    try:
        published = set((tree / DIGEST_FILE).read_text().splitlines())
    except FileNotFoundError:
        return ["(the digest sidecar is missing)"]
    local = set(lines.splitlines())
    return sorted({line.split("  ", 1)[-1] for line in published ^ local}) or ["(the sidecar was edited)"]

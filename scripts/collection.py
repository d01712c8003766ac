#!/usr/bin/env python3
"""Assemble the flodl.cluster collection from its sources of truth.

The collection ships the roles and the playbooks, but they are written once, at the
top of the repository (`roles/flodl_controller`, `roles/flodl_worker`, `playbooks/`),
where `ansible-playbook site.yml`, molecule and ansible-lint use them. The assembly
copies them into a collection tree beside the collection's own files
(`collections/ansible_collections/flodl/cluster`: plugins, meta, changelogs) and the
LICENSE, names the roles as a collection does (`flodl.cluster.controller`,
`flodl.cluster.worker`), points the playbooks at those names, and takes the version
from pyproject.toml, so the wheel and the collection never disagree. Nothing is kept
twice in the repository: `check` says where an assembled tree has drifted from its
sources.

    scripts/collection.py assemble OUT   # OUT/ansible_collections/flodl/cluster
    scripts/collection.py check TREE     # exit 1, naming each file that drifted
"""

from __future__ import annotations

import re
import shutil
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OWN = Path("collections/ansible_collections/flodl/cluster")  # plugins, meta, changelogs, galaxy.yml
ROLES = {
    "flodl_controller": "controller",
    "flodl_worker": "worker",
}  # the repository's name: the collection's
PLAYBOOKS = ("site.yml", "run.yml", "golden_image.yml", "probe.yml")
LICENSE = "LICENSE"
# Development only: the roles' molecule scenarios, caches, and what a build leaves.
SKIP = frozenset({"molecule", "__pycache__", ".pytest_cache", "tests"})
OWN_SKIP = SKIP - {"tests"}  # the collection's own tests/ holds its sanity ignore file
# A role named in a playbook: `name: flodl_worker` (include_role), `role: …`, or an item of `roles:`.
_ROLE_REF = re.compile(
    r"^(?P<lead>\s*(?:-\s+)?(?:(?:name|role):\s+)?)(?P<role>" + "|".join(ROLES) + r")(?P<tail>\s*(?:#.*)?)$",
    re.MULTILINE,
)


def version(root: Path = ROOT) -> str:
    return str(tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"])


def fqcn_roles(text: str) -> str:
    """A playbook's role names as the collection's: ``flodl_worker`` is ``flodl.cluster.worker``."""
    return _ROLE_REF.sub(lambda m: f"{m['lead']}flodl.cluster.{ROLES[m['role']]}{m['tail']}", text)


def galaxy(text: str, release: str) -> str:
    """galaxy.yml with pyproject.toml's version."""
    out, count = re.subn(r"^version: .*$", f"version: {release}", text, count=1, flags=re.MULTILINE)
    if count != 1:
        raise SystemExit(f"{OWN}/galaxy.yml has no `version:` line")
    return out


def _files(top: Path, skip: frozenset[str] = SKIP) -> Iterator[Path]:
    for path in sorted(top.rglob("*")):
        if path.is_file() and not skip & set(path.relative_to(top).parts):
            yield path


def sources(root: Path = ROOT) -> Iterator[tuple[str, Path]]:
    """Each file of the collection (its path inside it) and the repository file it comes from."""
    for path in _files(root / OWN, OWN_SKIP):
        yield path.relative_to(root / OWN).as_posix(), path
    for repo_name, name in ROLES.items():
        for path in _files(root / "roles" / repo_name):
            yield f"roles/{name}/{path.relative_to(root / 'roles' / repo_name).as_posix()}", path
    for playbook in PLAYBOOKS:
        yield f"playbooks/{playbook}", root / "playbooks" / playbook
    yield LICENSE, root / LICENSE


def expected(inside: str, source: Path, root: Path = ROOT) -> bytes:
    """What ``inside`` holds in the assembled collection."""
    if inside == "galaxy.yml":
        return galaxy(source.read_text(), version(root)).encode()
    if inside.startswith("playbooks/"):
        return fqcn_roles(source.read_text()).encode()
    return source.read_bytes()


def assemble(out: Path, root: Path = ROOT) -> Path:
    """The collection at ``out/ansible_collections/flodl/cluster``, made afresh."""
    tree = out / "ansible_collections" / "flodl" / "cluster"
    if tree.exists():
        shutil.rmtree(tree)
    for inside, source in sources(root):
        target = tree / inside
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(expected(inside, source, root))
        shutil.copymode(source, target)  # the door program and scripts stay executable
    return tree


def drift(tree: Path, root: Path = ROOT) -> list[str]:
    """Every file of an assembled ``tree`` that differs from its source, is missing, or has none."""
    want = dict(sources(root))
    problems = [f"{inside}: missing" for inside in want if not (tree / inside).is_file()]
    for inside, source in want.items():
        if (tree / inside).is_file() and (tree / inside).read_bytes() != expected(inside, source, root):
            problems.append(f"{inside}: differs from {source.relative_to(root)}")
    have = {p.relative_to(tree).as_posix() for p in _files(tree, OWN_SKIP)}
    problems += [f"{inside}: comes from no source" for inside in sorted(have - set(want))]
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("assemble", "check"):
        print("usage: scripts/collection.py assemble OUT | check TREE", file=sys.stderr)
        return 2
    if argv[0] == "assemble":
        print(assemble(Path(argv[1])))
        return 0
    problems = drift(Path(argv[1]))
    for problem in problems:
        print(f"collection drift: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

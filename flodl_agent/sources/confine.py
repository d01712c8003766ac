"""A published tree holds nothing that leads out of it, and names nothing outside it.

Door B serves the published tree and nothing else, and every box runs what the
manifest names, so three rules keep both inside the tree:

- every symlink in the tree resolves inside it: relative, and through the
  tree's own directories (a client can ask the door's rsync to follow links,
  and a link that leaves the tree would hand out the controller's files);
- the entry point, ``cwd/bin``, is a path inside the tree: not absolute, no
  ``..`` past its root, no directory on the way that leads out (its last
  component may be a link a build made, such as a venv's ``python``);
- a ``file://`` source and the served directory do not hold one another.

The publish checks the text of ``cwd`` and ``bin`` before it fetches anything
(:func:`path_outside`), the links and the way to the entry once the fetch is
in, and all of it before anything lands in the served tree; the worker checks
the entry point again, since its manifest came over the network.
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path

SHOWN = 5  # escaping links named in a refusal


def _inside(path: Path, base: Path) -> bool:
    """Whether ``path``, resolved, is ``base`` or under it (a link loop is not inside anything)."""
    try:
        return path.resolve().is_relative_to(base)
    except (RuntimeError, OSError):  # pathlib's "Symlink loop", an unreadable link
        return False


def escaping_links(root: Path) -> list[tuple[str, str]]:
    """``(path, target)`` of each symlink under ``root`` that is absolute or resolves outside it,
    paths relative to ``root``, sorted."""
    base = root.resolve()
    found = []
    for top, dirs, files in os.walk(root):  # a link to a directory is listed, never entered
        for name in (*dirs, *files):
            path = Path(top, name)
            if not path.is_symlink():
                continue
            target = path.readlink()
            if target.is_absolute() or not _inside(path, base):
                found.append((path.relative_to(root).as_posix(), str(target)))
    return sorted(found)


def describe_links(links: list[tuple[str, str]]) -> str:
    """``a -> ../../x, b -> /etc`` (and how many more)."""
    shown = ", ".join(f"{path} -> {target}" for path, target in links[:SHOWN])
    return shown + (f" (and {len(links) - SHOWN} more)" if len(links) > SHOWN else "")


def path_outside(path: str) -> str | None:
    """Why ``path`` leads out of a tree by its text alone, before any tree is there to look
    at (None: it stays inside, unless a directory link on the way leads out)."""
    if Path(path).is_absolute():
        return "is an absolute path"
    named = posixpath.normpath(path)
    if named == ".." or named.startswith("../"):
        return "leads out of the tree"
    return None


def entry_outside(root: Path, cwd: str, entry: str) -> str | None:
    """Why ``cwd/entry`` does not name a path inside ``root`` (None: it does)."""
    if why := path_outside(posixpath.join(cwd, entry)):
        return why
    # resolve() follows each link before the `..` after it, as the kernel does.
    if not _inside(root / cwd / Path(entry).parent, root.resolve()):
        return "leads out of the tree through a symlink"
    return None


def overlapping(first: Path, second: Path) -> bool:
    """Whether either directory holds the other (or they are one)."""
    a, b = first.resolve(), second.resolve()
    return a.is_relative_to(b) or b.is_relative_to(a)

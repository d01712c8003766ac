"""A digest of local files' names, sizes and modification times (on the control machine)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

DOCUMENTATION = r"""
name: files_digest
short_description: Digest a list of files on the control machine
description:
  - Hashes each file's name, size and modification time (not its content), so a role can tell that a
    wheelhouse changed without comparing every file on every host - a copy per wheel costs a module run
    per host even when nothing changed.
positional: _input
options:
  _input:
    description: Paths on the control machine, e.g. C(query('ansible.builtin.fileglob', dir ~ '/*.whl')).
    type: list
    elements: path
    required: true
"""

EXAMPLES = r"""
- ansible.builtin.debug:
    msg: "{{ query('ansible.builtin.fileglob', '/srv/wheels/*.whl') | flodl.cluster.files_digest }}"
"""

RETURN = r"""
_value:
  description: A sha256 hex digest; the same list in any order gives the same digest.
  type: str
"""


def files_digest(paths: list[str]) -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(p) for p in paths):
        st = path.stat()
        digest.update(f"{path.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"files_digest": files_digest}

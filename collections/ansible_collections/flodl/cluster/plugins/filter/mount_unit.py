"""The systemd unit name of a mount point (what `systemd-escape --path --suffix=mount` prints)."""

from __future__ import annotations

import string
from typing import Any

DOCUMENTATION = r"""
name: mount_unit
short_description: Name the systemd mount unit of a path
description:
  - Escapes an absolute path the way C(systemd-escape --path --suffix=mount) does, so a role can write
    the C(.mount) unit that systemd requires to be named after its C(Where=).
positional: _input
options:
  _input:
    description: An absolute path.
    type: path
    required: true
"""

EXAMPLES = r"""
- ansible.builtin.debug:
    msg: "{{ '/flodl/data' | flodl.cluster.mount_unit }}"  # flodl-data.mount
"""

RETURN = r"""
_value:
  description: The unit name, for example C(flodl-data.mount).
  type: str
"""

_KEEP = set(string.ascii_letters + string.digits + ":_.")


def mount_unit(path: str) -> str:
    if not str(path).startswith("/"):
        raise ValueError(f"mount_unit: {path!r} is not an absolute path")
    parts = [p for p in str(path).split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise ValueError(f"mount_unit: {path!r} is not a normalized path")
    if not parts:
        return "-.mount"
    out = []
    for i, ch in enumerate("/".join(parts)):
        if ch == "/":
            out.append("-")
        elif ch in _KEEP and not (i == 0 and ch == "."):
            out.append(ch)
        else:
            out.append("".join(f"\\x{b:02x}" for b in ch.encode()))
    return "".join(out) + ".mount"


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"mount_unit": mount_unit}

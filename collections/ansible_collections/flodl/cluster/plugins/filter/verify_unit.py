"""The `validate:` command of a unit template write: systemd-analyze verify under the unit's name."""

from __future__ import annotations

import re
from typing import Any

DOCUMENTATION = r"""
name: verify_unit
short_description: A template C(validate) command that runs C(systemd-analyze verify) on a unit
description:
  - C(systemd-analyze verify) reads the unit type from the file name, and C(validate) hands over a temporary
    file without it, so the command copies the file under the unit's own name into a scratch directory first.
positional: _input
options:
  _input:
    description: The unit's name, e.g. C(flodl-join.service).
    type: str
    required: true
"""

EXAMPLES = r"""
- ansible.builtin.template:
    src: flodl-join.service.j2
    dest: /etc/systemd/system/flodl-join.service
    mode: "0644"
    validate: "{{ 'flodl-join.service' | flodl.cluster.verify_unit }}"
"""

RETURN = r"""
_value:
  description: The command, with C(%s) where the template module puts the temporary file.
  type: str
"""

_UNIT = re.compile(r"[A-Za-z0-9:_.\\@-]+\.(service|mount|socket|timer|path|target)")


def verify_unit(name: str) -> str:
    if not _UNIT.fullmatch(str(name)):
        raise ValueError(f"verify_unit: {name!r} is not a systemd unit file name")
    script = 'd=$(mktemp -d) && cp "$1" "$d/$2" && systemd-analyze verify "$d/$2"; r=$?; rm -rf "$d"; exit $r'
    return f"/bin/sh -c '{script}' verify-unit %s {name}"


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"verify_unit": verify_unit}

"""The `validate:` command of an authorized_keys write: every key line parses."""

from __future__ import annotations

from typing import Any

DOCUMENTATION = r"""
name: verify_authorized_keys
short_description: A template C(validate) command that checks every key line of an C(authorized_keys) file
description:
  - Runs C(ssh-keygen -l) on each line that is not a comment, so one mangled key fails the write
    (C(ssh-keygen -l -f) on the whole file passes as long as one line parses). Options before the key are
    allowed; a file of comments only passes.
positional: _input
options:
  _input:
    description: Ignored (a filter needs an input), e.g. the file's name.
    type: raw
    required: false
"""

EXAMPLES = r"""
- ansible.builtin.template:
    src: authorized_keys.j2
    dest: /etc/flodl-door/authorized_keys.flodl-join
    mode: "0644"
    validate: "{{ 'authorized_keys' | flodl.cluster.verify_authorized_keys }}"
"""

RETURN = r"""
_value:
  description: The command, with C(%s) where the template module puts the temporary file.
  type: str
"""


def verify_authorized_keys(_value: Any = None) -> str:
    script = (
        'grep -v "^#" "$1" | while read -r line; do '
        'echo "$line" | ssh-keygen -l -f - >/dev/null || exit 1; done'
    )
    return f"/bin/sh -c '{script}' verify-keys %s"


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"verify_authorized_keys": verify_authorized_keys}

"""A worker's own join key: derived from the run's token for its host name."""

from __future__ import annotations

import re
from typing import Any

DOCUMENTATION = r"""
name: host_key
short_description: Derive a worker's join key from the run's token for its host name
description:
  - HKDF-SHA256 of the run's C(join.token) with the info C(flodl host <name>), 16 bytes as 32 hex
    characters - the key the controller derives for the name a hello gives, so a box holding it can
    walk in as that name and no other. HKDF is one-way - the key reveals neither the token nor
    another host's key - so each box is written only its own (C(join.host_key) in C(fdl.yml)).
positional: _input, host
options:
  _input:
    description: The run's join token, 32 hex characters.
    type: str
    required: true
  host:
    description: The host name the key is for (the worker's C(join.host)).
    type: str
    required: true
"""

EXAMPLES = r"""
- ansible.builtin.set_fact:
    key: "{{ flodl_worker_token | flodl.cluster.host_key(flodl_worker_host_name) }}"
  no_log: true
"""

RETURN = r"""
_value:
  description: The host's key, 32 lower-case hex characters.
  type: str
"""

_TOKEN = re.compile(r"[0-9a-fA-F]{32}")


def host_key(token: str, host: str) -> str:
    # The same derivation as flodl_agent.protocol.wire.host_key (a unit test holds the two together); the
    # collection does not import the package, which the control machine need not have.
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    if not _TOKEN.fullmatch(str(token)):
        raise ValueError("host_key: the token is not 32 hex characters (check flodl_worker_token)")
    if not host:
        raise ValueError("host_key: no host name to derive the key for")
    info = b"flodl host " + str(host).encode()
    key = HKDF(algorithm=hashes.SHA256(), length=16, salt=None, info=info).derive(bytes.fromhex(token))
    return key.hex()


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"host_key": host_key}

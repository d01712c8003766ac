"""Keys (pure): the run key is ``join.token`` when one is configured, else a fresh
128-bit session salt. No box dials with the run key itself: each holds the
*host key* derived from it for its own name (``host_key``: HKDF, so a host key
reveals neither the run key nor any other host's), and tags its hello with it;
the controller derives the key of the name a hello claims and verifies the tag
under it, so a name is as good as the credential that proves it. The challenge
goes out under the all-zeros key (the controller cannot know which host is
dialling yet); the controller proves itself with its answer, tagged under the
host key. Under open admission every pre-admission frame is under zeros and
Accept hands the salt out. Each connection opens with a server challenge (a
fresh nonce) that the hello must echo, and after admission both sides switch
to a connection key derived from the host key (open: the salt) and both
nonces, so a captured hello or frame is useless on any other connection.
"""

from __future__ import annotations

import secrets

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_BYTES = 16


def new_salt() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def new_nonce() -> bytes:
    return secrets.token_bytes(16)


def run_key(token: str | None, salt: bytes) -> bytes:
    """The token replaces the salt when one is configured."""
    return bytes.fromhex(token) if token else salt


HOST_KEY_INFO = b"flodl host "  # HKDF info: these bytes, then the host name (UTF-8)


def host_key(run_key: bytes, host: str) -> bytes:
    """The key of one host name, derived from the run key: what that host tags its hello with.

    HKDF is one-way: a host key gives its holder neither the run key nor another host's key.
    The worker role derives the same bytes (the collection's ``host_key`` filter)."""
    info = HOST_KEY_INFO + host.encode()
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(run_key)


def connection_key(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return HKDF(
        algorithm=hashes.SHA256(), length=32, salt=server_nonce + client_nonce, info=b"flodl connection"
    ).derive(key)

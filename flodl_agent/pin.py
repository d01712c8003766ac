"""The controller certificate's pin: SHA-256 fingerprints, their spellings, the check.

Pure (bytes and text in, no ssl contexts): the config schema normalizes
``join.tls_fingerprint`` with it, and a client checks the peer's DER certificate
right after the handshake. The contexts and certificate files are :mod:`.tls`.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import re

from .errors import Failure

FINGERPRINT = re.compile(r"^sha256:[0-9a-f]{64}$")


class PinMismatch(Failure):
    def __init__(self, where: str, expected: str, got: str) -> None:
        super().__init__(
            f"{where} presented TLS certificate {got}, not the pinned {expected}",
            "a certificate that does not match its pin is a different server, or a regenerated one: "
            "re-distribute the controller's fingerprint (fdl tls fingerprint CERT); never drop the pin",
        )


def fingerprint(der: bytes) -> str:
    return "sha256:" + hashlib.sha256(der).hexdigest()


def normalize(text: str) -> str:
    """``sha256:ab..``, ``AB:CD:..`` (openssl, community.crypto) or bare hex, as ``sha256:<hex>``."""
    hexes = text.strip().lower().removeprefix("sha256:").replace(":", "")
    value = f"sha256:{hexes}"
    if not FINGERPRINT.match(value):
        raise ValueError(
            f"`{text}` is not a SHA-256 fingerprint (sha256:<64 hex>, or AB:CD:… as openssl prints)"
        )
    return value


def check_pin(der: bytes | None, expected: str, where: str) -> None:
    got = fingerprint(der) if der else "(none)"
    if not hmac.compare_digest(got, expected):
        raise PinMismatch(where, expected, got)


@functools.lru_cache(maxsize=4096)  # asked of every connection's peer
def cleartext_warning(peer: str) -> bool:
    """Should a cleartext connection from ``peer`` be called out? (outside private ranges)"""
    try:
        address = ipaddress.ip_address(peer.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    address = mapped or address
    return not (address.is_private or address.is_loopback or address.is_link_local)

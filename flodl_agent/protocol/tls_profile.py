"""The controller port's TLS profile: Mozilla's "intermediate" configuration, on both ends.

TLS 1.2 and 1.3 only. For TLS 1.2 the ECDHE suites with an AEAD cipher (AES-GCM,
ChaCha20-Poly1305), nothing in CBC mode (Python's default list still has the SHA-256/384
CBC suites, LUCKY13's targets) and no finite-field DHE (no parameters are loaded). TLS 1.3's
suites are AEAD by construction and OpenSSL's three are the profile's. Key exchange on
X25519, P-256 and P-384 only: OpenSSL's default list adds X448 and P-521.

Python 3.11's ``ssl`` names one curve at most (``set_ecdh_curve``), so the group list goes
through OpenSSL's own ``SSL_CTX_set1_groups_list`` on the context's ``SSL_CTX``:
``SSLContext.set_groups`` where Python has it, else ctypes into the libssl that ``_ssl``
itself loaded. Where neither works, P-256 alone: narrower than the profile, never wider.
"""

from __future__ import annotations

import ctypes
import functools
import ssl
import sys
from typing import Any

# Mozilla's intermediate TLS 1.2 suites (ssl-config.mozilla.org, profile 5.7) less DHE-RSA.
TLS12_CIPHERS = (
    "ECDHE-ECDSA-AES128-GCM-SHA256",
    "ECDHE-RSA-AES128-GCM-SHA256",
    "ECDHE-ECDSA-AES256-GCM-SHA384",
    "ECDHE-RSA-AES256-GCM-SHA384",
    "ECDHE-ECDSA-CHACHA20-POLY1305",
    "ECDHE-RSA-CHACHA20-POLY1305",
)
GROUPS = ("X25519", "P-256", "P-384")
FALLBACK_CURVE = "prime256v1"  # P-256: what set_ecdh_curve can name alone
_SET_GROUPS_LIST = 92  # SSL_CTRL_SET_GROUPS_LIST (ssl.h; SSL_CTX_set1_groups_list is a macro)


def apply(ctx: ssl.SSLContext) -> str:
    """Put ``ctx`` on the profile; the route the groups took (``set_groups``, ``libssl`` or
    ``P-256 only``), for the tests and for a log line."""
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_ciphers(":".join(TLS12_CIPHERS))
    return _restrict_groups(ctx)


def _restrict_groups(ctx: ssl.SSLContext) -> str:
    set_groups = getattr(ctx, "set_groups", None)  # newer Pythons than 3.11
    if set_groups is not None:
        set_groups(":".join(GROUPS))
        return "set_groups"
    if _set_groups_through_libssl(ctx, ":".join(GROUPS).encode()):
        return "libssl"
    ctx.set_ecdh_curve(FALLBACK_CURVE)
    return "P-256 only"


def _set_groups_through_libssl(ctx: ssl.SSLContext, groups: bytes) -> bool:
    """``SSL_CTX_set1_groups_list`` on the context's own ``SSL_CTX``; False where that cannot
    be reached safely (not CPython, OpenSSL linked into ``_ssl`` without its symbols)."""
    calls = _libssl()
    if calls is None:
        return False
    ctrl, get_options = calls
    # CPython's PySSLContext (Modules/_ssl.c) is PyObject_HEAD, then the SSL_CTX pointer.
    handle = ctypes.c_void_p.from_address(id(ctx) + object.__basicsize__).value
    # The options read through that pointer must be the ones ssl reports, else hands off.
    if not handle or get_options(handle) != ctx.options:
        return False
    return bool(ctrl(handle, _SET_GROUPS_LIST, 0, groups))


@functools.cache
def _libssl() -> tuple[Any, Any] | None:
    """``SSL_CTX_ctrl`` and ``SSL_CTX_get_options`` from the libssl ``_ssl`` uses, once."""
    if sys.implementation.name != "cpython":
        return None
    import _ssl

    try:
        # dlsym on _ssl's handle searches its dependencies: the libssl this process uses.
        lib = ctypes.CDLL(_ssl.__file__)
        ctrl, get_options = lib.SSL_CTX_ctrl, lib.SSL_CTX_get_options
    except (OSError, AttributeError):  # no such file (built in), or no such symbols (static)
        return None
    ctrl.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_char_p]
    ctrl.restype = ctypes.c_long
    get_options.argtypes = [ctypes.c_void_p]
    get_options.restype = ctypes.c_uint64
    return ctrl, get_options

"""The controller port's TLS as an auditor scores it: sslyze against Mozilla's "intermediate"
profile, on a real TLS controller port serving a certificate from `fdl tls generate`; and each
end's profile (groups, suites) checked by handshakes against peers that want something else.

A pinned self-signed certificate cannot chain to a public root: that one item is named, so
any other finding fails the test.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import ssl
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import ExtendedKeyUsageOID

from flodl_agent.controller.controller import Controller
from flodl_agent.pin import fingerprint
from flodl_agent.protocol import tls_profile
from flodl_agent.protocol.tls import client_context, server_context
from tests.support.control_plane import run, settings

FDL = Path(sys.executable).with_name("fdl")
# sslyze pins cryptography below flodl's: `make setup` gives it a venv of its own.
SSLYZE = Path(__file__).parents[2] / "build" / "audit-venv" / "bin" / "sslyze"
# What a self-signed certificate, trusted by its pin alone, fails and always will.
PINNED_CHAIN = {"certificate_path_validation"}
AEAD_TLS12 = {
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256",
}


@pytest.fixture
def cert(tmp_path: Path) -> tuple[Path, Path, str]:
    c, k = tmp_path / "controller.pem", tmp_path / "controller.key"
    made = subprocess.run(
        [str(FDL), "tls", "generate", "--cert", str(c), "--key", str(k), "--name", "127.0.0.1"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    return c, k, made.stdout.strip()


def scan(port: int, out: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """sslyze's CLI, as an auditor runs it: its Mozilla verdict (stdout, exit status) and its
    whole scan (--json_out)."""
    done = subprocess.run(
        [str(SSLYZE), "--mozilla_config=intermediate", f"--json_out={out}", f"127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    (server,) = json.loads(out.read_text())["server_scan_results"]
    return done, server


@pytest.mark.skipif(
    not SSLYZE.exists() and not os.environ.get("CI"), reason=f"no {SSLYZE}: make setup installs it"
)
def test_sslyze_passes_mozilla_intermediate_but_for_the_pinned_chain(
    cert: tuple[Path, Path, str], tmp_path: Path
) -> None:
    c, k, pin = cert
    result: list[tuple[subprocess.CompletedProcess[str], dict[str, Any]]] = []

    async def scenario() -> None:
        ctl = Controller(settings(tls=(str(c), str(k))))
        await ctl.start()
        result.append(await asyncio.to_thread(scan, ctl.port, tmp_path / "scan.json"))
        await ctl.close()

    run(scenario)
    ((verdict, scanned),) = result
    assert scanned["scan_status"] == "COMPLETED", scanned
    # The verdict: non-compliant (exit 1) on the one item a pinned certificate always fails.
    assert verdict.returncode == 1 and "FAILED - Not compliant" in verdict.stdout, verdict.stdout[-3000:]
    assert set(re.findall(r"^\s+\* (\w+):", verdict.stdout, re.M)) == PINNED_CHAIN, verdict.stdout[-3000:]

    found = scanned["scan_result"]
    versions = {
        name: found[f"{name}_cipher_suites"]["result"]
        for name in ("ssl_2_0", "ssl_3_0", "tls_1_0", "tls_1_1", "tls_1_2", "tls_1_3")
    }
    assert {name for name, v in versions.items() if v["is_tls_version_supported"]} == {"tls_1_2", "tls_1_3"}
    tls12 = {s["cipher_suite"]["name"] for s in versions["tls_1_2"]["accepted_cipher_suites"]}
    assert tls12 == AEAD_TLS12 and not any("_CBC_" in name for name in tls12)
    curves = found["elliptic_curves"]["result"]
    assert {curve["name"] for curve in curves["supported_curves"]} == {"X25519", "secp256r1", "secp384r1"}
    assert {"X448", "secp521r1"} <= {curve["name"] for curve in curves["rejected_curves"]}

    deployment = found["certificate_info"]["result"]["certificate_deployments"][0]
    leaf = x509.load_pem_x509_certificate(deployment["received_certificate_chain"][0]["as_pem"].encode())
    assert fingerprint(leaf.public_bytes(Encoding.DER)) == pin  # the port served what the CLI made
    _assert_usual_extensions(leaf)
    assert leaf.not_valid_after_utc - leaf.not_valid_before_utc == timedelta(days=365)


def _assert_usual_extensions(leaf: x509.Certificate) -> None:
    ext = leaf.extensions
    ski = ext.get_extension_for_class(x509.SubjectKeyIdentifier).value
    aki = ext.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    own = x509.SubjectKeyIdentifier.from_public_key(leaf.public_key())
    assert aki.key_identifier == ski.digest == own.digest  # self-signed: issuer and subject are one key
    assert ext.get_extension_for_class(x509.BasicConstraints).value.ca is False
    usage = ext.get_extension_for_class(x509.KeyUsage).value
    assert usage.digital_signature and not usage.key_cert_sign
    assert list(ext.get_extension_for_class(x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.SERVER_AUTH]
    names = ext.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]


def handshake(client: ssl.SSLContext, server: ssl.SSLContext) -> str | None:
    """A TLS handshake through memory between two real OpenSSL ends: the cipher agreed, or
    None when either end refused."""
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    ends = (
        client.wrap_bio(to_client, to_server, server_side=False),
        server.wrap_bio(to_server, to_client, server_side=True),
    )
    done = [False, False]
    for _ in range(8):  # TLS 1.2 takes two round trips, 1.3 one and a half
        for i, end in enumerate(ends):
            try:
                end.do_handshake()
                done[i] = True
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError:
                return None
        if all(done):
            cipher = ends[0].cipher()
            return cipher[0] if cipher else None
    raise AssertionError("the handshake neither ended nor failed")


def _peer(server: bool, curve: str | None = None, cipher: str | None = None) -> ssl.SSLContext:
    """Python's stock context, narrowed to one curve or one TLS 1.2 suite."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    if not server:
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    if curve:
        ctx.set_ecdh_curve(curve)
    if cipher:
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_ciphers(cipher)
    return ctx


GROUPS = [("X25519", True), ("prime256v1", True), ("secp384r1", True), ("X448", False), ("secp521r1", False)]


@pytest.mark.parametrize(("curve", "agreed"), GROUPS)
def test_both_ends_agree_on_the_profiles_groups_only(
    cert: tuple[Path, Path, str], curve: str, agreed: bool
) -> None:
    c, k, _ = cert
    peer_server = _peer(True, curve=curve)
    peer_server.load_cert_chain(c, k)
    assert (handshake(_peer(False, curve=curve), server_context(c, k)) is not None) is agreed
    assert (handshake(client_context(), peer_server) is not None) is agreed


@pytest.mark.parametrize(
    ("suite", "agreed"),
    [
        ("ECDHE-ECDSA-AES128-SHA256", False),  # CBC: what the stock list still offers
        ("ECDHE-ECDSA-AES256-SHA384", False),
        ("ECDHE-ECDSA-AES128-GCM-SHA256", True),
        ("ECDHE-ECDSA-CHACHA20-POLY1305", True),
    ],
)
def test_tls_1_2_takes_aead_suites_only(cert: tuple[Path, Path, str], suite: str, agreed: bool) -> None:
    c, k, _ = cert
    peer_server = _peer(True, cipher=suite)
    peer_server.load_cert_chain(c, k)
    assert handshake(_peer(False, cipher=suite), server_context(c, k)) == (suite if agreed else None)
    assert handshake(client_context(), peer_server) == (suite if agreed else None)


def test_the_groups_go_through_openssl_here() -> None:
    assert tls_profile.apply(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)) in {"set_groups", "libssl"}


@pytest.mark.skipif(hasattr(ssl.SSLContext, "set_groups"), reason="this Python sets the group list itself")
def test_without_a_route_to_the_group_list_the_profile_narrows_to_p256(
    cert: tuple[Path, Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    c, k, _ = cert
    monkeypatch.setattr(tls_profile, "_set_groups_through_libssl", lambda _ctx, _groups: False)
    for curve, agreed in (("X25519", False), ("prime256v1", True)):
        peer_server = _peer(True, curve=curve)
        peer_server.load_cert_chain(c, k)
        assert (handshake(client_context(), peer_server) is not None) is agreed

"""Optional TLS on the controller port, with the certificate pinned by fingerprint.

Frames are authenticated by the run key whatever the transport; TLS adds
confidentiality for fleets that cross networks nobody controls. There is no CA:
the controller presents a self-signed certificate (the controller role generates
one, ``fdl tls generate`` does by hand) and every client pins its SHA-256
fingerprint, checked right after the handshake, before a byte of ours is sent.
Without TLS the controller says once per peer when a connection comes from
outside the private ranges.
"""

from __future__ import annotations

import ipaddress
import ssl
from datetime import UTC, datetime, timedelta
from pathlib import Path

from ..pin import fingerprint

PEM_MAX = 1024 * 1024  # bytes: a certificate is a few KiB


def cert_fingerprint(cert: Path) -> str:
    """The pin of a PEM certificate; ``ValueError`` for anything else (never read past PEM_MAX)."""
    with cert.open("rb") as handle:
        raw = handle.read(PEM_MAX + 1)
    if len(raw) > PEM_MAX:
        raise ValueError(f"larger than {PEM_MAX // 1024} KiB")
    return fingerprint(ssl.PEM_cert_to_DER_cert(raw.decode()))


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    return ctx


def client_context() -> ssl.SSLContext:
    """No CA and no host name: the pin is the whole check (``check_pin`` after the handshake)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def turned_away(exc: BaseException) -> bool:
    """The controller's dial guard turned this TLS dial away: its access_denied alert, sent
    before any handshake for the cost of one send (a cleartext dial reads ``preamble.RATE_LIMITED``)."""
    return isinstance(exc, ssl.SSLError) and exc.reason == "TLSV1_ALERT_ACCESS_DENIED"


def generate(cert: Path, key: Path, names: list[str], days: int = 3650) -> str:
    """A self-signed certificate and its key (mode 0600) for the controller; its fingerprint."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    private = ec.generate_private_key(ec.SECP256R1())
    # X.509 caps a common name at 64 characters; the names that matter are the SANs below.
    common = names[0] if names and len(names[0]) <= 64 else "flodl-controller"
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])
    alt: list[x509.GeneralName] = []
    for name in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt.append(x509.DNSName(name))
    now = datetime.now(UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=days))
    )
    if alt:
        builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    certificate = builder.sign(private, hashes.SHA256())
    key.parent.mkdir(parents=True, exist_ok=True)
    key.touch(mode=0o600)
    key.chmod(0o600)
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return fingerprint(certificate.public_bytes(serialization.Encoding.DER))

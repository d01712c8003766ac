"""Optional TLS on the controller port, with the certificate pinned by fingerprint.

Frames are authenticated by the run key whatever the transport; TLS adds
confidentiality for fleets that cross networks nobody controls. There is no CA:
the controller presents a self-signed certificate (the controller role generates
one, ``fdl tls generate`` does by hand) and every client pins its SHA-256
fingerprint, checked right after the handshake, before a byte of ours is sent.
Both ends hold to Mozilla's "intermediate" profile (``tls_profile``), and certificates
live at most a year (``MAX_DAYS``): renewing is ``--force`` and a re-pin. Without TLS
the controller says once per peer when a connection comes from outside the private
ranges.
"""

from __future__ import annotations

import ipaddress
import ssl
from datetime import UTC, datetime, timedelta
from pathlib import Path

from ..pin import fingerprint
from . import tls_profile

PEM_MAX = 1024 * 1024  # bytes: a certificate is a few KiB
DAYS = 365  # a certificate's default lifetime
MAX_DAYS = 366  # Mozilla's intermediate profile: no certificate lives longer


def cert_fingerprint(cert: Path) -> str:
    """The pin of a PEM certificate; ``ValueError`` for anything else (never read past PEM_MAX)."""
    with cert.open("rb") as handle:
        raw = handle.read(PEM_MAX + 1)
    if len(raw) > PEM_MAX:
        raise ValueError(f"larger than {PEM_MAX // 1024} KiB")
    return fingerprint(ssl.PEM_cert_to_DER_cert(raw.decode()))


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls_profile.apply(ctx)
    # Every suite left is strong: the client picks (ChaCha20 where it has no AES hardware).
    ctx.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    # No resumption: a ticket key that lives as long as the controller opens every session
    # it sealed (forward secrecy lost), and a worker dials only a handful of times a run.
    ctx.options |= ssl.OP_NO_TICKET
    ctx.num_tickets = 0
    ctx.load_cert_chain(cert, key)
    return ctx


def client_context() -> ssl.SSLContext:
    """No CA and no host name: the pin is the whole check (``check_pin`` after the handshake)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    tls_profile.apply(ctx)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def turned_away(exc: BaseException) -> bool:
    """The controller's dial guard turned this TLS dial away: its access_denied alert, sent
    before any handshake for the cost of one send (a cleartext dial reads ``preamble.RATE_LIMITED``)."""
    return isinstance(exc, ssl.SSLError) and exc.reason == "TLSV1_ALERT_ACCESS_DENIED"


def check_days(days: int) -> int:
    """A certificate's lifetime in days; ``ValueError`` outside 1..MAX_DAYS."""
    if not 1 <= days <= MAX_DAYS:
        raise ValueError(
            f"{days} days: a certificate lives 1 to {MAX_DAYS} days (Mozilla's intermediate"
            " TLS profile); renew it before it ends (--force) and re-pin the workers"
        )
    return days


def generate(cert: Path, key: Path, names: list[str], days: int = DAYS) -> str:
    """A self-signed certificate and its key (mode 0600) for the controller; its fingerprint.

    An end-entity certificate for a TLS server, with the extensions auditors look for: key
    identifiers (subject and authority, the same key here), not a CA, signing only, server
    authentication only, and ``days`` of life from its first to its last valid second."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    check_days(days)
    private = ec.generate_private_key(ec.SECP256R1())
    public = private.public_key()
    # X.509 caps a common name at 64 characters; the names that matter are the SANs below.
    common = names[0] if names and len(names[0]) <= 64 else "flodl-controller"
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])
    alt: list[x509.GeneralName] = []
    for name in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt.append(x509.DNSName(name))
    start = datetime.now(UTC) - timedelta(minutes=5)  # a worker's clock a little behind
    usage = x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=False,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + timedelta(days=days))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
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

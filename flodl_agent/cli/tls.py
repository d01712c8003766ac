"""`fdl tls`: a self-signed certificate for the controller port, and its pin."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import click

from ..address import AddressError, check_host
from ..config.source import NotRegular, read_bounded
from ..pin import fingerprint
from ..protocol.tls import DAYS, MAX_DAYS, PEM_MAX, check_days, generate
from .common import FilePath, fail


@click.group()
def tls() -> None:
    """TLS on the controller port: a self-signed certificate that clients pin."""


def _names(values: tuple[str, ...]) -> tuple[str, ...]:
    """Each --name goes into the certificate as a DNS name or an IP address: it must be one."""
    for value in values:
        try:
            check_host(value, "write a DNS name (ctrl.example.com) or an IP address (10.0.0.1)")
        except AddressError as exc:
            raise click.BadParameter(exc.render(), param_hint="--name") from None
    return values


def _days(value: int) -> int:
    try:
        return check_days(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--days") from None


@tls.command("generate")
@click.option("--cert", type=FilePath(path_type=Path, dir_okay=False), required=True, help="PEM out.")
@click.option("--key", type=FilePath(path_type=Path, dir_okay=False), required=True, help="PEM key out.")
@click.option(
    "--name",
    "names",
    multiple=True,
    callback=lambda _ctx, _param, values: _names(values),
    help="A DNS name or address of the controller (repeat).",
)
@click.option(
    "--days",
    type=int,
    default=DAYS,
    show_default=True,
    callback=lambda _ctx, _param, value: _days(value),
    help=f"Lifetime, at most {MAX_DAYS} (Mozilla's intermediate profile); renew with --force.",
)
@click.option("--force", is_flag=True, help="Replace an existing certificate (every pin must change).")
def tls_generate(cert: Path, key: Path, names: tuple[str, ...], days: int, force: bool) -> None:
    """Write a self-signed certificate and key (0600) for cluster.controller.tls; print the fingerprint
    workers pin (join.tls_fingerprint). Renewing is the same command with --force, then every
    worker's pin changes (site.yml re-pins them)."""
    if (cert.exists() or key.exists()) and not force:
        fail(
            "tls generate",
            f"{cert if cert.exists() else key} exists",
            "keep it (fdl tls fingerprint prints its pin), or --force to replace it and re-pin",
        )
    try:
        click.echo(generate(cert, key, list(names) or [socket.getfqdn()], days))
    except OSError as exc:
        fail(
            "tls generate",
            f"cannot write {exc.filename or cert}: {exc.strerror}",
            "name files in a writable directory",
        )


@tls.command("fingerprint")
@click.argument("cert", type=FilePath(path_type=Path, dir_okay=False, exists=True))
def tls_fingerprint(cert: Path) -> None:
    """Print a PEM certificate's pin (sha256:<hex>), as join.tls_fingerprint takes it."""
    try:
        click.echo(cert_pin(cert))
    except NotRegular as exc:  # swapped for a FIFO since the flag was checked
        raise click.BadParameter(str(exc), param_hint="CERT") from None
    except ValueError as exc:
        raise click.BadParameter(f"not a PEM certificate ({exc})", param_hint="CERT") from None
    except OSError as exc:
        raise click.BadParameter(f"cannot read it: {exc.strerror}", param_hint="CERT") from None


def cert_pin(cert: Path) -> str:
    """``cert_fingerprint``, read without waiting: a FIFO or a /proc file is ``NotRegular``."""
    raw = read_bounded(cert, PEM_MAX)
    if len(raw) > PEM_MAX:
        raise ValueError(f"larger than {PEM_MAX // 1024} KiB")
    return fingerprint(ssl.PEM_cert_to_DER_cert(raw.decode()))

"""Test PKI made on the fly (the `cryptography` package): a CA, a server certificate for 127.0.0.1 and
localhost, a client certificate, all written as PEM files the way a cert-manager Secret mounts them."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    """Paths of one CA's files: `ca.crt`, the server's `tls.crt`/`tls.key`, a client's pair."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )


def _issue(
    subject: str,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    server: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
    elif not ca:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(directory: Path, name: str = "test") -> Pki:
    """A fresh CA named `name` with one server and one client certificate under `directory/name`."""
    out = directory / name
    out.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _issue(f"{name} CA", _name(f"{name} CA"), ca_key, ca_key, ca=True)
    pki = Pki(out / "ca.crt", out / "tls.crt", out / "tls.key", out / "client.crt", out / "client.key")
    pki.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    for cert_path, key_path, server in (
        (pki.server_cert, pki.server_key, True),
        (pki.client_cert, pki.client_key, False),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _issue("server" if server else "client", ca_cert.subject, ca_key, key, server=server)
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, key_path)
    return pki

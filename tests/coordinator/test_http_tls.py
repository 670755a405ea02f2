"""The HTTP listener's TLS seam: given an `ssl.SSLContext` it serves HTTPS only (self-signed cert)."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path

import httpx2
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from coordinator.http.server import HttpServer


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


async def pong(request: Request) -> PlainTextResponse:
    return PlainTextResponse("pong")


async def test_the_listener_serves_https_with_the_context_it_is_given(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    server = HttpServer(Starlette(routes=[Route("/ping", pong)]), "127.0.0.1", 0, ssl_context=context)
    address = await server.start()
    try:
        trust = ssl.create_default_context(cafile=str(cert))
        async with httpx2.AsyncClient(verify=trust, timeout=10) as client:
            assert (await client.get(f"https://{address}/ping")).text == "pong"
        async with httpx2.AsyncClient(timeout=10) as client:
            with pytest.raises(httpx2.HTTPError):  # no plaintext on a TLS listener
                await client.get(f"http://{address}/ping")
    finally:
        await server.stop()

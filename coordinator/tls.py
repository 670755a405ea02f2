"""TLS for the API listeners and their clients: PEM files -> gRPC credentials or an `ssl.SSLContext`.

Server side (`ServerTls`): a certificate chain and key, plus optionally a client CA, which turns on
mutual TLS (every client must present a certificate that CA signed). The files are re-read when they
change on disk (checked at each new TLS handshake), so a cert-manager rotation of the mounted Secret
(`tls.crt`, `tls.key`, `ca.crt`) takes effect without a restart; connections already open keep theirs.
Client side (`ClientTls`): the CA to trust and optionally a client certificate.

Plaintext is only a default on loopback: `check_plaintext_bind` refuses any other host unless the
operator passed the explicit insecure flag. Used by the coordinator app, `splitserve.client` and the
HTTP front door.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

log = structlog.get_logger(__name__)

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain"})


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost; False for wildcards (0.0.0.0, ::, "") and the rest."""
    host = host.strip("[]")
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of(target: str) -> str:
    """The host part of `host:port` (brackets of an IPv6 literal removed)."""
    host, _, _ = target.rpartition(":")
    return (host or target).strip("[]")


def check_plaintext_bind(host: str, tls: ServerTls | None, insecure: bool, flag: str) -> None:
    """ValueError when `host` is not loopback, TLS is off and `flag` (e.g. --insecure-grpc) was not
    given; a warning log when the flag allows it."""
    if tls is not None or is_loopback(host):
        return
    if not insecure:
        raise ValueError(
            f"refusing to serve plaintext gRPC on {host!r} (not a loopback address): pass --tls-cert and "
            f"--tls-key, bind 127.0.0.1, or pass {flag} to accept an unencrypted, spoofable listener"
        )
    log.warning("plaintext gRPC on a non-loopback address", host=host, flag=flag)


def _read(path: str | Path | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


@dataclass(frozen=True, slots=True)
class ServerTls:
    """The listener's certificate (PEM chain), its key, and the client CA that enables mTLS."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def _files(self) -> tuple[Path, ...]:
        return (self.cert, self.key) if self.client_ca is None else (self.cert, self.key, self.client_ca)

    def _stamp(self) -> tuple[float, ...]:
        return tuple(os.stat(p).st_mtime for p in self._files())

    def _config(self) -> grpc.ServerCertificateConfiguration:
        pair = [(Path(self.key).read_bytes(), Path(self.cert).read_bytes())]
        return grpc.ssl_server_certificate_configuration(pair, root_certificates=_read(self.client_ca))

    def credentials(self) -> grpc.ServerCredentials:
        """gRPC server credentials that pick up rotated files at the next handshake. Raises OSError
        (missing file) or grpc's error (bad PEM) at once, so a misconfiguration fails the start."""
        stamp = [self._stamp()]

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            try:
                now = self._stamp()
                if now == stamp[0]:
                    return None
                config = self._config()
            except OSError as exc:  # mid-rotation: keep serving with the certificate we have
                log.warning("TLS files unreadable; keeping the current certificate", error=str(exc))
                return None
            stamp[0] = now
            log.info("TLS certificate reloaded", cert=str(self.cert))
            return config

        return grpc.dynamic_ssl_server_credentials(
            self._config(), fetch, require_client_authentication=self.mutual
        )

    def ssl_context(self) -> ssl.SSLContext:
        """A server-side `ssl.SSLContext` with the same files and client rule (for an HTTP listener)."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        if self.client_ca is not None:
            context.load_verify_locations(cafile=str(self.client_ca))
            context.verify_mode = ssl.CERT_REQUIRED
        return context


def server_tls(cert: str | None, key: str | None, client_ca: str | None) -> ServerTls | None:
    """From the --tls-cert/--tls-key/--tls-client-ca flags: None when TLS is off; ValueError when the
    flags are inconsistent (one of cert/key alone, a client CA without a certificate)."""
    if cert is None and key is None:
        if client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mTLS is TLS plus client certs)")
        return None
    if cert is None or key is None:
        raise ValueError("pass both --tls-cert and --tls-key")
    return ServerTls(Path(cert), Path(key), Path(client_ca) if client_ca else None)


@dataclass(frozen=True, slots=True)
class ClientTls:
    """What a client trusts (`ca`; None = the system roots) and the certificate it presents, if any."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs both --tls-cert and --tls-key")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca), private_key=_read(self.key), certificate_chain=_read(self.cert)
        )

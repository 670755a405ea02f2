"""Who is calling: API keys -> principals, and the admin key. Shared by the gRPC and HTTP front doors.

    keys = KeyRing.parse(["sk-plain", "sha256:<64 hex>"])     # entries: a key, or its sha256
    auth = Authenticator(api_keys=keys, admin_keys=KeyRing.parse([...]))
    principal = auth.authenticate(bearer)       # inference calls: Principal, or RpcError
    auth.authorize_admin(bearer)                # AdminService: Principal(admin=True), or RpcError

`bearer` is the raw `authorization` header/metadata value (`Bearer <key>`), or None when absent.
Keys are never stored in the clear: a plain entry is hashed at load, a presented key is hashed and
compared against every entry with `hmac.compare_digest` (no early exit, so the time does not say which
entry matched or how far). A principal's id is derived from its key's digest (`key:<12 hex>`): stable
across restarts, safe to log, and the owner of every request created with that key. With no API keys
configured every caller is the one `ANONYMOUS` principal (local development only; main logs a warning).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from coordinator.errors import RpcError

_SHA256_ENTRY = re.compile(r"sha256:([0-9a-fA-F]{64})")
Metadata = Iterable[tuple[str, str | bytes]]


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller. `id` scopes request ids and ownership; never a secret."""

    id: str
    admin: bool = False


ANONYMOUS = Principal("anonymous")


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def hash_entry(key: str) -> str:
    """The `sha256:<hex>` entry to configure instead of the key (shell: `printf %s KEY | sha256sum`)."""
    return "sha256:" + key_digest(key).hex()


@dataclass(frozen=True, slots=True)
class KeyRing:
    """A set of accepted keys, held as sha256 digests only."""

    digests: tuple[bytes, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> KeyRing:
        """Entries are plain keys or `sha256:<64 hex>`; blanks and `#` comments are skipped.

        ValueError names a malformed `sha256:` entry (by position, never by content)."""
        digests = []
        for i, raw in enumerate(entries):
            entry = raw.strip()
            if not entry or entry.startswith("#"):
                continue
            if entry.startswith("sha256:"):
                match = _SHA256_ENTRY.fullmatch(entry)
                if match is None:
                    raise ValueError(f"key entry {i + 1} starts with 'sha256:' but is not 64 hex digits")
                digests.append(bytes.fromhex(match.group(1)))
            else:
                digests.append(key_digest(entry))
        return cls(tuple(dict.fromkeys(digests)))

    def __bool__(self) -> bool:
        return bool(self.digests)

    def match(self, key: str) -> bytes | None:
        """The matching digest, or None; compares against every entry (constant time per entry)."""
        given = key_digest(key)
        found = None
        for digest in self.digests:
            if hmac.compare_digest(given, digest):
                found = digest
        return found


def read_key_entries(
    inline: str = "", env_var: str = "", files: Sequence[str | Path] = ()
) -> tuple[str, ...]:
    """Key entries from a comma-separated flag value, an environment variable and key files (one entry
    per line, `#` comments), in that order, blanks dropped. Parse them with `KeyRing.parse`."""
    entries = [*inline.split(","), *(os.environ.get(env_var, "").split(",") if env_var else [])]
    for path in files:
        entries.extend(Path(path).read_text().splitlines())
    return tuple(e.strip() for e in entries if e.strip() and not e.strip().startswith("#"))


def bearer_from_metadata(metadata: Metadata | None) -> str | None:
    """The first `authorization` value of gRPC invocation metadata, as text."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None


def _presented_key(bearer: str | None) -> str:
    if bearer is None:
        raise RpcError(
            grpc.StatusCode.UNAUTHENTICATED,
            "API_KEY_MISSING",
            "this server requires an API key: send metadata 'authorization: Bearer <key>'",
        )
    scheme, _, key = bearer.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise RpcError(
            grpc.StatusCode.UNAUTHENTICATED,
            "API_KEY_INVALID",
            "the authorization value is not 'Bearer <key>'",
        )
    return key.strip()


class Authenticator:
    """Stateless; built once by the coordinator app from its configured key rings."""

    def __init__(self, api_keys: KeyRing = KeyRing(), admin_keys: KeyRing = KeyRing()) -> None:
        self.api_keys = api_keys
        self.admin_keys = admin_keys

    def authenticate(self, bearer: str | None) -> Principal:
        """The inference principal of `bearer`. Admin keys are not inference keys."""
        if not self.api_keys:
            return ANONYMOUS
        digest = self.api_keys.match(_presented_key(bearer))
        if digest is None:
            raise RpcError(
                grpc.StatusCode.UNAUTHENTICATED,
                "API_KEY_INVALID",
                "the API key is not accepted: send 'authorization: Bearer <key>' with a valid key",
            )
        return Principal("key:" + digest.hex()[:12])

    def authorize_admin(self, bearer: str | None) -> Principal:
        """The admin principal: PERMISSION_DENIED while no admin key is configured or for an inference
        key, UNAUTHENTICATED for a missing or unknown key."""
        if not self.admin_keys:
            raise RpcError(
                grpc.StatusCode.PERMISSION_DENIED,
                "ADMIN_DISABLED",
                "AdminService is disabled: start the coordinator with --admin-key (or "
                "SPLITSERVE_ADMIN_KEY / --admin-key-file) and call it with that key",
            )
        key = _presented_key(bearer)
        digest = self.admin_keys.match(key)
        if digest is not None:
            return Principal("admin:" + digest.hex()[:12], admin=True)
        if self.api_keys.match(key) is not None:
            raise RpcError(
                grpc.StatusCode.PERMISSION_DENIED,
                "PERMISSION_DENIED",
                "an inference API key cannot call AdminService: use the admin key",
            )
        raise RpcError(grpc.StatusCode.UNAUTHENTICATED, "API_KEY_INVALID", "the admin key is not accepted")

"""API keys and principals (coordinator.auth): hashed entries, per-key principals, the admin key apart."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from coordinator.auth import ANONYMOUS, Authenticator, KeyRing, hash_entry, read_key_entries
from coordinator.errors import RpcError


def refused(call: Callable[..., object], *args: object) -> RpcError:
    with pytest.raises(RpcError) as caught:
        call(*args)
    return caught.value


def test_plain_and_hashed_entries_name_one_stable_principal_per_key() -> None:
    auth = Authenticator(KeyRing.parse(["alpha", hash_entry("beta"), "# a comment", ""]))
    a, b = auth.authenticate("Bearer alpha"), auth.authenticate("bearer  beta ")
    assert a != b and a.id.startswith("key:") and not a.admin
    assert Authenticator(KeyRing.parse([hash_entry("alpha")])).authenticate("Bearer alpha") == a
    assert "alpha" not in a.id and hash_entry("alpha")[7:] not in a.id  # the id is not the secret
    assert refused(auth.authenticate, None).reason == "API_KEY_MISSING"
    for bad in ("Bearer gamma", "Basic alpha", "Bearer", "alpha"):
        assert refused(auth.authenticate, bad).code == grpc.StatusCode.UNAUTHENTICATED


def test_without_keys_every_caller_is_the_anonymous_principal() -> None:
    assert Authenticator().authenticate(None) is ANONYMOUS
    assert Authenticator().authenticate("Bearer anything") is ANONYMOUS


def test_a_malformed_hash_entry_is_refused_without_echoing_it() -> None:
    with pytest.raises(ValueError, match="entry 2") as caught:
        KeyRing.parse(["ok", "sha256:abc123"])
    assert "abc123" not in str(caught.value)


def test_admin_key_is_its_own_and_admin_service_is_off_without_one() -> None:
    off = Authenticator(KeyRing.parse(["user"]))
    err = refused(off.authorize_admin, "Bearer user")
    assert (err.code, err.reason) == (grpc.StatusCode.PERMISSION_DENIED, "ADMIN_DISABLED")
    assert "--admin-key" in err.message
    auth = Authenticator(KeyRing.parse(["user"]), KeyRing.parse([hash_entry("root")]))
    assert auth.authorize_admin("Bearer root").admin
    err = refused(auth.authorize_admin, "Bearer user")
    assert (err.code, err.reason) == (grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED")
    assert refused(auth.authorize_admin, "Bearer nope").code == grpc.StatusCode.UNAUTHENTICATED
    assert refused(auth.authorize_admin, None).code == grpc.StatusCode.UNAUTHENTICATED
    assert refused(auth.authenticate, "Bearer root").code == grpc.StatusCode.UNAUTHENTICATED


def test_key_entries_come_from_the_flag_the_environment_and_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "keys"
    path.write_text("# team keys\nfile-key\n\n" + hash_entry("file-hashed") + "\n")
    monkeypatch.setenv("TEST_KEYS", "env-a, env-b")
    entries = read_key_entries("flag-a,", "TEST_KEYS", [path])
    assert entries == ("flag-a", "env-a", "env-b", "file-key", hash_entry("file-hashed"))
    ring = KeyRing.parse(entries)
    assert all(ring.match(k) for k in ("flag-a", "env-b", "file-key", "file-hashed"))
    assert ring.match("other") is None

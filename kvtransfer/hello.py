"""The transfer hello: an authenticated pairing of two workers, identical for every backend.

Every worker's transport holds a random 256-bit *transfer key* (`Transport.key`). The worker
advertises it only over the authenticated control plane (Register -> coordinator -> Peers /
Prefill / Decode), so a process that can merely reach the transfer port does not know it. The side
that connects proves it holds the accepting side's key, and the accepting side proves it back
(HMAC-SHA256 over both sides' fresh nonces, so a recorded hello cannot be replayed):

    connecting C                                    accepting A (key K)
    {version, address, layout, nonce_c}   ------->  version checked
                                          <-------  {nonce_a, proof_a = MAC(K, "accept", nonce_c, nonce_a)}
    proof_a checked; {proof_c = MAC(K, "connect", nonce_c, nonce_a, address)} ------->
                                          <-------  {ok} once proof_c and the layout check out, else a refusal

A is the only side that ever registers a peer under a claimed address, and only after proof_c
verified, so an outsider can neither be cached as a peer (and read sends meant for a real worker) nor
have its bytes read as KV. Every message is one JSON object of at most HELLO_MAX_BYTES; anything else
is refused as "malformed" before it is parsed further. Refusal reasons (the `reason` label of the
metric): malformed, version, auth, layout, timeout, closed, busy (too many hellos in progress).
"""

from __future__ import annotations

import hmac
import json
import secrets
from abc import ABC, abstractmethod
from typing import Any

import structlog

from kvtransfer.errors import LayoutMismatch, TransportError
from kvtransfer.layout import KVLayout

log = structlog.get_logger(__name__)

PROTOCOL_VERSION = 2
KEY_BYTES = 32
NONCE_BYTES = 16
HELLO_MAX_BYTES = 4096
REFUSAL_REASONS = ("malformed", "version", "auth", "layout", "timeout", "closed", "busy")


class HelloRefused(TransportError):
    """The accepting side refused a connection during the hello; `reason` is one of REFUSAL_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class HelloChannel(ABC):
    """One connection's hello messages; each backend implements it over its own connection."""

    @abstractmethod
    async def send(self, data: bytes) -> None:
        """Send one message (at most HELLO_MAX_BYTES). Raises ConnectionError/OSError if it broke."""

    @abstractmethod
    async def recv(self) -> bytes:
        """Receive one message. Raises HelloRefused("malformed") for one over HELLO_MAX_BYTES and
        ConnectionError/OSError if the connection broke."""


def new_key() -> bytes:
    """A fresh random transfer key."""
    return secrets.token_bytes(KEY_BYTES)


def _mac(key: bytes, label: str, *parts: bytes) -> bytes:
    h = hmac.new(key, label.encode(), "sha256")
    for part in parts:
        h.update(len(part).to_bytes(4, "big") + part)
    return h.digest()


def _decode(data: bytes, fields: dict[str, type]) -> dict[str, Any]:
    """Parse one hello message: a JSON object with at least `fields` of the given types."""
    try:
        msg = json.loads(data)
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError both are
        raise HelloRefused("malformed", f"not JSON: {e}") from None
    if not isinstance(msg, dict):
        raise HelloRefused("malformed", "not a JSON object")
    _require(msg, fields)
    return msg


def _require(msg: dict[str, Any], fields: dict[str, type]) -> None:
    for name, kind in fields.items():
        if not isinstance(msg.get(name), kind):
            raise HelloRefused("malformed", f"field {name!r} missing or not {kind.__name__}")


def _hex(msg: dict[str, Any], name: str, size: int) -> bytes:
    try:
        value = bytes.fromhex(msg[name])
    except (TypeError, ValueError):
        value = b""
    if len(value) != size:
        raise HelloRefused("malformed", f"field {name!r} is not {size} hex-encoded bytes")
    return value


def _encode(msg: dict[str, Any]) -> bytes:
    return json.dumps(msg).encode()


async def accept(channel: HelloChannel, layout: KVLayout, key: bytes) -> str:
    """Accepting side: the authenticated peer's advertised address; raises HelloRefused (after
    telling the peer why, where the peer could act on it)."""
    hello = _decode(await channel.recv(), {"address": str, "nonce": str})
    if hello.get("version") != PROTOCOL_VERSION:
        error = LayoutMismatch("protocol version", PROTOCOL_VERSION, repr(hello.get("version"))[:64])
        await channel.send(
            _encode({"ok": False, "field": error.field, "ours": error.ours, "theirs": error.theirs})
        )
        raise HelloRefused("version", str(error))
    address, nonce_c = hello["address"], _hex(hello, "nonce", NONCE_BYTES)
    nonce_a = secrets.token_bytes(NONCE_BYTES)
    proof_a = _mac(key, "accept", nonce_c, nonce_a)
    await channel.send(_encode({"ok": True, "nonce": nonce_a.hex(), "proof": proof_a.hex()}))
    answer = _decode(await channel.recv(), {"proof": str})
    proof_c = _hex(answer, "proof", len(proof_a))
    if not hmac.compare_digest(proof_c, _mac(key, "connect", nonce_c, nonce_a, address.encode())):
        await channel.send(_encode({"ok": False, "error": "transfer key proof rejected"}))
        raise HelloRefused("auth", f"peer claiming {address!r} does not hold our transfer key")
    try:
        theirs = KVLayout.from_dict(hello["layout"])
    except (KeyError, TypeError) as e:
        raise HelloRefused("malformed", f"bad layout: {e!r}") from None
    try:
        layout.check_compatible(theirs)
    except LayoutMismatch as e:
        await channel.send(_encode({"ok": False, "field": e.field, "ours": e.ours, "theirs": e.theirs}))
        raise HelloRefused("layout", str(e)) from None
    await channel.send(_encode({"ok": True}))
    return address


async def connect(channel: HelloChannel, layout: KVLayout, address: str, key: bytes) -> None:
    """Connecting side, to a peer whose transfer key is `key`; raises LayoutMismatch (from our point
    of view) or TransportError when the peer refused or could not prove it holds `key`."""
    if len(key) != KEY_BYTES:
        raise TransportError(f"the peer's transfer key must be {KEY_BYTES} bytes, got {len(key)}")
    nonce_c = secrets.token_bytes(NONCE_BYTES)
    hello = {
        "version": PROTOCOL_VERSION,
        "address": address,
        "layout": layout.to_dict(),
        "nonce": nonce_c.hex(),
    }
    await channel.send(_encode(hello))
    challenge = _check_reply(await channel.recv())
    nonce_a = _hex(challenge, "nonce", NONCE_BYTES)
    if not hmac.compare_digest(_hex(challenge, "proof", 32), _mac(key, "accept", nonce_c, nonce_a)):
        raise TransportError("the peer does not hold the transfer key it was advertised with")
    await channel.send(_encode({"proof": _mac(key, "connect", nonce_c, nonce_a, address.encode()).hex()}))
    _check_reply(await channel.recv())


def _check_reply(data: bytes) -> dict[str, Any]:
    reply = _decode(data, {"ok": bool})
    if not reply["ok"]:
        if "field" not in reply:
            raise TransportError(f"peer refused the connection: {reply.get('error', reply)}")
        raise LayoutMismatch(reply["field"], reply.get("theirs"), reply.get("ours"))
    return reply

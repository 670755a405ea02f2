"""An outsider who reaches the transfer ports can neither write KV into a receiver's blocks nor read
any, and its attempts harm no real session (both backends, real processes; attacker.py is the
outsider). Plus the hello's refusals of malformed and unauthenticated connections (TCP, in-process)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvtransfer import TcpTransport, TransportError
from kvtransfer.hello import HELLO_MAX_BYTES, NONCE_BYTES, PROTOCOL_VERSION
from kvtransfer.plan import message_tag, plan_messages
from kvtransfer.tcp import _LEN
from tests.kvtransfer.conftest import LAYOUT, Pair, assert_session_bit_exact, connect_pair, send_into

SMALL = {"max_message_bytes": 4 << 10, "min_direct_bytes": 2 << 10}
BLOCK_BYTES = math.prod(LAYOUT.block_shape) * 2  # float16
ATTACK_BYTE = 0x5A
WAIT_S = 30.0


def old_scheme_tags(rid: str, generation: int, n: int) -> list[int]:
    """The tags the previous scheme derived from (request id, generation) alone: guessable."""
    digest = hashlib.blake2b(f"{rid}\x00{generation}".encode(), digest_size=6).digest()
    return [(int.from_bytes(digest, "big") << 16) | i for i in range(n)]


async def run_attacker(backend: str, target: str, claim: str, messages: list[list[int]]) -> dict[str, Any]:
    spec = {
        "backend": backend,
        "layout": LAYOUT.to_dict(),
        "target": target,
        "claim": claim,
        "messages": messages,
        "byte": ATTACK_BYTE,
        "version": PROTOCOL_VERSION,
        "nonce_bytes": NONCE_BYTES,
        "hello_max_bytes": HELLO_MAX_BYTES,
    }
    argv = [sys.executable, "-m", "tests.kvtransfer.attacker", json.dumps(spec)]
    done = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


async def refused(pair_side: Any, at_least: dict[str, int]) -> dict[str, int]:
    """The agent's refusal counts once they reach `at_least` (counted just after the reply went out)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        counts: dict[str, int] = (await pair_side.call("info"))["refused"]
        if all(counts.get(reason, 0) >= n for reason, n in at_least.items()):
            return counts
        assert time.monotonic() < deadline, counts
        await asyncio.sleep(0.01)  # poll interval of a bounded wait


async def test_outsider_can_neither_write_nor_read_kv(own_agents: Any, backend: str) -> None:
    receiver, sender = own_agents
    # Read attempt: pose as the receiver at the sender's listener before the real pair connects. Had
    # the sender accepted it, its peer cache would hand the impostor every later send to the receiver.
    posing = await run_attacker(backend, sender.address, receiver.address, [])
    assert posing["challenge"]["ok"] and not posing["verdict"]["ok"], posing
    pair: Pair = await connect_pair(receiver, sender)
    try:
        stale = bytes.fromhex(await assert_session_bit_exact(pair, "finished", SMALL))
        # The victim's receives are posted (Reserved would be on its way to the sender) ...
        reserved = await pair.recv.call(
            "reserve", rid="victim", gen=0, n_blocks=24, peer=sender.address, config=SMALL
        )
        plan = plan_messages(reserved["block_ids"], BLOCK_BYTES, **SMALL)
        sizes = [m.num_blocks * BLOCK_BYTES for m in plan]
        tags = [
            *old_scheme_tags("victim", 0, len(plan)),
            *(message_tag(stale, m.index) for m in plan),
            *(secrets.randbits(64) for _ in plan),
        ]
        # ... when the outsider sends messages of the victim's exact sizes under the old scheme's
        # tags, a finished session's (stale secret) and random ones, around a forged hello.
        attack = await run_attacker(
            backend,
            receiver.address,
            sender.address,
            [[t, sizes[i % len(sizes)]] for i, t in enumerate(tags)],
        )
        assert attack["challenge"]["ok"] and not attack["verdict"]["ok"], attack
        sent = await send_into(pair, "victim", reserved, seed=9, config=SMALL)
        assert sent["sent"], sent
        await pair.recv.call("mark_done", rid="victim", gen=0, first_token=5, checksums=sent["checksums"])
        result = await pair.recv.call("wait_recv", rid="victim", gen=0, seed=9)
        assert result["done"] and result["exact"], result
        await pair.send.call("ack", rid="victim", gen=0)
        assert (await pair.recv.call("filled_with", value=ATTACK_BYTE))["blocks"] == []
        await pair.pools_free()
        counts = await refused(
            pair.recv, {"auth": 1, "malformed": 1} if backend in ("tcp", "nixl") else {"auth": 1}
        )
        assert set(counts) <= {"auth", "malformed", "closed"}, counts
        assert (await refused(pair.send, {"auth": 1}))["auth"] == 1
        # The pair still works after all that.
        await assert_session_bit_exact(pair, "after", SMALL)
    finally:
        pair.recv.close()
        pair.send.close()


# -- the hello's refusals, in-process over real loopback sockets ----------------------------------


@pytest.fixture
async def listener() -> AsyncIterator[TcpTransport]:
    transport = TcpTransport(LAYOUT, connect_timeout_s=5.0)
    await transport.start()
    yield transport
    await transport.close()


async def _raw_exchange(address: str, *messages: bytes, raw: bytes = b"") -> list[bytes]:
    """Send `raw`, then each message framed as the hello frames it; the replies until the close."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(raw + b"".join(_LEN.pack(len(m)) + m for m in messages))
    await writer.drain()
    replies = []
    try:
        while header := await reader.readexactly(_LEN.size):
            replies.append(await reader.readexactly(_LEN.unpack(header)[0]))
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    writer.close()
    return replies


def _hello(**overrides: Any) -> bytes:
    msg = {
        "version": PROTOCOL_VERSION,
        "address": "127.0.0.1:1",
        "layout": LAYOUT.to_dict(),
        "nonce": secrets.token_hex(NONCE_BYTES),
    }
    return json.dumps({**msg, **overrides}).encode()


@pytest.mark.parametrize(
    ("messages", "raw"),
    [
        ((), _LEN.pack(1 << 30)),  # a length the hello would have to allocate
        ((b"\xff\xfe not json",), b""),
        ((b"[1, 2]",), b""),
        ((_hello(nonce="zz"),), b""),
        ((_hello(address=7),), b""),
        ((_hello(), b'{"proof": "short"}'), b""),
    ],
    ids=["oversized", "not-json", "not-object", "bad-nonce", "bad-address", "bad-proof-field"],
)
async def test_malformed_hello_is_refused(
    listener: TcpTransport, messages: tuple[bytes, ...], raw: bytes
) -> None:
    await _raw_exchange(listener.address, *messages, raw=raw)
    while listener.refused["malformed"] < 1:
        await asyncio.sleep(0.005)  # poll interval; bounded by the test timeout
    assert listener.peer("127.0.0.1:1") is None


async def test_forged_proof_and_wrong_key_are_refused(listener: TcpTransport) -> None:
    forged = await _raw_exchange(listener.address, _hello(), json.dumps({"proof": "00" * 32}).encode())
    assert json.loads(forged[0])["ok"] and json.loads(forged[1]) == {
        "ok": False,
        "error": "transfer key proof rejected",
    }
    other = TcpTransport(LAYOUT)
    await other.start()
    try:
        with pytest.raises(TransportError, match="does not hold the transfer key"):
            await other.connect(listener.address, secrets.token_bytes(32))
        assert (await other.connect(listener.address, listener.key)).address == listener.address
        while listener.peer(other.address) is None:
            await asyncio.sleep(0.005)  # the accept handler's last step; bounded by the test timeout
    finally:
        await other.close()
    assert listener.refused["auth"] == 1 and set(listener.refused) <= {"auth", "closed"}


async def test_silent_connection_is_dropped_at_the_hello_timeout() -> None:
    transport = TcpTransport(LAYOUT, connect_timeout_s=0.2)
    await transport.start()
    try:
        host, port = transport.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            sock.settimeout(WAIT_S)
            assert await asyncio.to_thread(sock.recv, 1) == b""  # closed by the listener
        assert transport.refused == {"timeout": 1}
    finally:
        await transport.close()


async def test_hellos_in_progress_are_bounded(listener: TcpTransport) -> None:
    listener.max_pending_hellos = 2
    host, port = listener.address.rsplit(":", 1)
    silent = [await asyncio.open_connection(host, int(port)) for _ in range(3)]  # send no hello
    try:
        while listener.refused["busy"] < 1:
            await asyncio.sleep(0.005)  # poll interval; bounded by the test timeout
        other = TcpTransport(LAYOUT)
        await other.start()
        try:  # a real peer is refused too while they hold the slots, and pairs once they are gone
            with pytest.raises(TransportError, match="closed"):
                await other.connect(listener.address, listener.key)
            for _, writer in silent:
                writer.close()
            while listener._pending_hellos:
                await asyncio.sleep(0.005)  # poll interval; bounded by the test timeout
            assert (await other.connect(listener.address, listener.key)).address == listener.address
        finally:
            await other.close()
    finally:
        for _, writer in silent:
            writer.close()
    assert listener.refused["busy"] == 2

"""The ZeroMQ control channel: real sockets on loopback, port 0; malformed frames; CurveZMQ."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest
import structlog
import zmq.asyncio

from splitserve.control import ControlQueueFull, ControlSocket, envelope
from splitserve.control_auth import KeySet, ZapHandler, load_keys, load_public_key
from splitserve.logs import RateLimitedLog
from splitserve.v1 import control_pb2
from tests.control_attacks import Attacker, Case, named_cases


async def test_dealer_router_round_trip_names_the_sender() -> None:
    ctx = zmq.asyncio.Context()
    router = ControlSocket.router(ctx, "tcp://127.0.0.1:0")
    dealer = ControlSocket.dealer(ctx, router.address, identity="prefill-0")
    try:
        await dealer.send(envelope(abort=control_pb2.Abort(rid=7, generation=2)))
        got = await asyncio.wait_for(router.recv(), 5)
        assert got.sender == "prefill-0" and got.kind == "abort"
        assert got.envelope.abort.rid == 7 and got.envelope.abort.generation == 2
        await router.send(envelope(kv_ack=control_pb2.KVAck(rid=7, ok=True)), to="prefill-0")
        back = await asyncio.wait_for(dealer.recv(), 5)
        assert back.kind == "kv_ack" and back.envelope.kv_ack.ok
    finally:
        dealer.close()
        router.close()
        ctx.term()


async def test_router_send_to_unknown_peer_is_an_error_not_a_drop() -> None:
    ctx = zmq.asyncio.Context()
    router = ControlSocket.router(ctx, "tcp://127.0.0.1:0")
    try:
        with pytest.raises(ControlQueueFull, match="not connected"):
            await router.send(envelope(abort=control_pb2.Abort(rid=1)), to="nobody")
    finally:
        router.close()
        ctx.term()


async def test_full_queue_raises_instead_of_blocking() -> None:
    ctx = zmq.asyncio.Context()
    # a DEALER connected to nothing has no peer pipe, so its queue is full at once
    dealer = ControlSocket.dealer(ctx, "tcp://127.0.0.1:1", identity="d", hwm=1)
    try:
        with pytest.raises(ControlQueueFull):
            for _ in range(4):
                await dealer.send(envelope(abort=control_pb2.Abort(rid=1)))
    finally:
        dealer.close()
        ctx.term()


def test_envelope_takes_exactly_one_message() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        envelope()


# -- untrusted frames --------------------------------------------------------------------------------

GOOD = envelope(abort=control_pb2.Abort(rid=9, generation=1))
# what each named case is dropped as (random bytes may happen to parse as an Envelope with no kind)
EXPECTED_REASON = {
    "random_bytes": {"decode", "kind"},
    "truncated_envelope": {"decode"},
    "three_frames": {"frame_count"},
    "no_kind": {"kind"},
    "unknown_kind": {"kind"},
    "non_utf8_routing_id": {"routing_id"},
    "no_identity": {"routing_id"},
}


async def drain_drops(sock: ControlSocket, drops: list[str], n: int) -> None:
    """Let `sock.recv` work through queued frames until `n` drops were counted (bounded)."""
    reader = asyncio.create_task(sock.recv())
    try:
        async with asyncio.timeout(10):
            while len(drops) < n and not reader.done():
                await asyncio.sleep(0.01)  # poll interval of a bounded wait
    finally:
        reader.cancel()
    assert len(drops) >= n, drops


async def test_every_malformed_frame_is_dropped_and_counted_and_the_router_keeps_serving() -> None:
    ctx = zmq.asyncio.Context()
    drops: list[str] = []
    router = ControlSocket.router(ctx, "tcp://127.0.0.1:0", on_drop=drops.append)
    good = ControlSocket.dealer(ctx, router.address, identity="prefill-0")
    attacker = Attacker(router.address)
    try:
        for case in named_cases():
            await attacker.send(case)
            await good.send(GOOD)
            got = await asyncio.wait_for(router.recv(), 10)  # the router still serves
            assert got.sender == "prefill-0" and got.envelope == GOOD, case.name
        await drain_drops(router, drops, len(EXPECTED_REASON))
        # frames from different connections are fair-queued: compare counts, not order
        counts = Counter(drops)
        assert counts["frame_count"] == 1 and counts["routing_id"] == 2, counts
        assert counts["decode"] >= 1 and counts["kind"] >= 2, counts
        assert len(drops) == len(EXPECTED_REASON)  # the 32 MiB frame never reached Python
    finally:
        attacker.close()
        good.close()
        router.close()
        ctx.term()


async def test_a_dealer_drops_what_its_router_peer_sends_wrong() -> None:
    ctx = zmq.asyncio.Context()
    drops: list[str] = []
    raw = ctx.socket(zmq.ROUTER)
    raw.setsockopt(zmq.LINGER, 0)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    dealer = ControlSocket.dealer(ctx, f"tcp://127.0.0.1:{port}", identity="d", on_drop=drops.append)
    try:
        await dealer.send(GOOD)  # so the ROUTER learns the route
        assert (await asyncio.wait_for(raw.recv_multipart(), 10))[0] == b"d"
        for frames in ([b"x", b"y"], [b"\xff\xff\xff"], [b""], [GOOD.SerializeToString()]):
            await raw.send_multipart([b"d", *frames])
        got = await asyncio.wait_for(dealer.recv(), 10)
        assert got.envelope == GOOD and drops == ["frame_count", "decode", "kind"]
    finally:
        dealer.close()
        raw.close()
        ctx.term()


def test_drop_log_is_rate_limited() -> None:
    drop_log = RateLimitedLog("control input dropped", period_s=60.0, at="test")
    with structlog.testing.capture_logs() as lines:
        for _ in range(1000):
            drop_log("decode")
    assert len(lines) == 1


# -- CurveZMQ ---------------------------------------------------------------------------------------


async def test_only_allow_listed_keys_deliver_and_the_user_id_names_the_key(tmp_path: Path) -> None:
    keys = KeySet.create(tmp_path / "keys", ["prefill-0", "decode-0"])
    allowed = load_keys(keys.workers["prefill-0"]).public.decode()
    ctx = zmq.asyncio.Context()
    zap = ZapHandler(ctx, lambda key: key == allowed).start()
    router = ControlSocket.router(ctx, "tcp://127.0.0.1:0", keys=load_keys(keys.coordinator_secret))
    server_key = load_public_key(keys.coordinator_public)
    strangers = [
        Attacker(router.address),  # no CURVE at all
        Attacker(router.address, keys=keys.worker_keys("decode-0"), server_key=server_key),  # not listed
    ]
    good = ControlSocket.dealer(
        ctx, router.address, "prefill-0", keys=keys.worker_keys("prefill-0"), server_key=server_key
    )
    try:
        for attacker in strangers:
            await attacker.send(Case("valid", [GOOD.SerializeToString()], identity=b"decode-0"))
        await good.send(GOOD)
        got = await asyncio.wait_for(router.recv(), 10)
        assert (got.sender, got.user_id) == ("prefill-0", allowed)
    finally:
        for attacker in strangers:
            attacker.close()
        good.close()
        router.close()
        zap.stop()
        ctx.term()


async def test_a_dealer_talks_only_to_the_server_key_it_was_given(tmp_path: Path) -> None:
    """An impostor coordinator (its own keypair, admitting everyone) never hears from a worker."""
    real = KeySet.create(tmp_path / "real", ["prefill-0"])
    fake = KeySet.create(tmp_path / "fake")
    ctx = zmq.asyncio.Context()
    zap = ZapHandler(ctx, lambda key: True).start()
    impostor = ControlSocket.router(ctx, "tcp://127.0.0.1:0", keys=load_keys(fake.coordinator_secret))
    control = ControlSocket.router(ctx, "tcp://127.0.0.1:0", keys=load_keys(fake.coordinator_secret))
    worker = ControlSocket.dealer(
        ctx,
        impostor.address,
        "prefill-0",
        keys=real.worker_keys("prefill-0"),
        server_key=load_public_key(real.coordinator_public),
    )
    probe = ControlSocket.dealer(  # the same impostor, given its true key: delivered
        ctx,
        impostor.address,
        "probe",
        keys=real.worker_keys("prefill-0"),
        server_key=load_public_key(fake.coordinator_public),
    )
    try:
        await worker.send(GOOD)
        await probe.send(GOOD)
        got = await asyncio.wait_for(impostor.recv(), 10)
        assert got.sender == "probe"
    finally:
        for s in (worker, probe, impostor, control):
            s.close()
        zap.stop()
        ctx.term()

"""The ZeroMQ control channel: real sockets on loopback, port 0."""

from __future__ import annotations

import asyncio

import pytest
import zmq.asyncio

from splitserve.control import ControlQueueFull, ControlSocket, envelope
from splitserve.v1 import control_pb2


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

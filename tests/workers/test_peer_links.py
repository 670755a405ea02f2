"""PeerLinks connects to its partner peers when they join, so the CURVE handshake (and the peer's ZAP
decision) is done before the first request needs the link. Real sockets on loopback, port 0."""

from __future__ import annotations

import asyncio
from pathlib import Path

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from engine.worker.peers import PeerLinks
from splitserve.control import ControlSocket
from splitserve.control_auth import KeySet, ZapHandler, load_keys
from splitserve.v1 import control_pb2, serving_pb2


def peer(worker_id: str, role: serving_pb2.WorkerRole.ValueType, address: str, key: str) -> control_pb2.Peer:
    endpoint = control_pb2.WorkerEndpoint(
        worker_id=worker_id, control_address=address, control_public_key=key
    )
    return control_pb2.Peer(role=role, endpoint=endpoint, incarnation=1)


async def handshakes(monitor: zmq.asyncio.Socket, want: int, timeout_s: float) -> int:
    """CURVE handshakes the monitored ROUTER completed: returns at `want`, or at the bounded wait's end."""
    done = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while done < want and (left := deadline - loop.time()) > 0:
        try:
            event = await asyncio.wait_for(recv_monitor_message(monitor), left)
        except TimeoutError:
            break
        done += event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    return done


async def test_a_partner_is_connected_and_authenticated_when_it_joins_not_at_its_first_message(
    tmp_path: Path,
) -> None:
    keys = KeySet.create(tmp_path / "keys", ["prefill-0", "decode-0", "prefill-1"])
    decode_keys = load_keys(keys.workers["decode-0"])
    other_prefill_keys = load_keys(keys.workers["prefill-1"])
    ctx = zmq.asyncio.Context()
    zap = ZapHandler(ctx, lambda key: True).start()
    decode = ControlSocket.router(ctx, "tcp://127.0.0.1:0", keys=decode_keys)
    other_prefill = ControlSocket.router(ctx, "tcp://127.0.0.1:0", keys=other_prefill_keys)
    decode_events = decode.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    prefill_events = other_prefill.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    links = PeerLinks(
        ctx,
        "prefill-0",
        "layout",
        load_keys(keys.workers["prefill-0"]),
        partners=frozenset({serving_pb2.WORKER_ROLE_DECODE}),
    )
    try:
        links.update(
            [
                peer("decode-0", serving_pb2.WORKER_ROLE_DECODE, decode.address, decode_keys.public.decode()),
                peer(
                    "prefill-1",
                    serving_pb2.WORKER_ROLE_PREFILL,
                    other_prefill.address,
                    other_prefill_keys.public.decode(),
                ),
            ]
        )
        assert await handshakes(decode_events, 1, 10) == 1, "the decode partner was not connected at once"
        # not a partner: no link until a message needs one (bounded: the partner's took well under this)
        assert await handshakes(prefill_events, 1, 1) == 0
    finally:
        links.close()
        for sock in (decode_events, prefill_events):
            sock.close(linger=0)
        decode.close()
        other_prefill.close()
        zap.stop()
        ctx.term()

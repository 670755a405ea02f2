"""KVDone can overtake the bytes it announces (TCP's sender finishes once the kernel holds them):
the receive session must still complete when the last message lands after `mark_done`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import torch

from kvtransfer import KVLayout, Peer, RecvSession, SendSession, SessionConfig, SessionKey, TcpTransport

SECRET = bytes(range(16))


@contextlib.asynccontextmanager
async def tcp_pair(layout: KVLayout) -> AsyncIterator[tuple[Peer, Peer]]:
    """(decode's peer to prefill, prefill's peer to decode) over one real loopback connection."""
    prefill, decode = TcpTransport(layout), TcpTransport(layout)
    await prefill.start()
    await decode.start()
    try:
        to_prefill = await decode.connect(prefill.address, prefill.key)
        while (to_decode := prefill.peer(decode.address)) is None:
            await asyncio.sleep(0.01)  # bounded by the test timeout: the accept handler's last step
        yield to_prefill, to_decode
    finally:
        await prefill.close()
        await decode.close()


@pytest.mark.parametrize("done_first", [True, False])
async def test_session_completes_whether_done_or_data_comes_first(done_first: bool) -> None:
    layout = KVLayout("float32", 2, 4, 2, 8, "model")
    async with tcp_pair(layout) as (to_prefill, to_decode):
        src = torch.randn(16, 2, 2, 4, 2, 8)
        dst = torch.zeros_like(src)
        src_ids, dst_ids = [3, 7, 8], [10, 2, 5]  # non-contiguous on both sides: packed messages
        released: list[list[int]] = []
        config = SessionConfig(lease_s=20.0)
        recv = RecvSession(to_prefill, SessionKey("r1", 0), SECRET, dst, dst_ids, released.append, config)
        recv.start()
        send = SendSession(
            to_decode, SessionKey("r1", 0), SECRET, src, src_ids, dst_ids, released.append, config
        )
        if done_first:
            recv.mark_done(first_token=42)
        await asyncio.wait_for(send.send(), 10)
        if not done_first:
            await asyncio.sleep(0)  # let the landing tasks run first (ordering, not a timing wait)
            recv.mark_done(first_token=42)
        assert await asyncio.wait_for(recv.wait(), 10) == 42
        assert torch.equal(dst[dst_ids], src[src_ids])


async def test_sources_can_arrive_chunk_by_chunk() -> None:
    """The sender learns its source blocks as prefill finishes them; each send covers what is known."""
    layout = KVLayout("float32", 1, 2, 1, 4, "model")
    async with tcp_pair(layout) as (to_prefill, to_decode):
        src = torch.randn(12, 1, 2, 2, 1, 4)
        dst = torch.zeros_like(src)
        src_ids, dst_ids = [0, 1, 5, 6, 9], [2, 3, 4, 8, 11]
        config = SessionConfig(lease_s=20.0, max_message_bytes=src[0].numel() * 4, min_direct_bytes=1)
        recv = RecvSession(to_prefill, SessionKey("r2", 0), SECRET, dst, dst_ids, lambda _: None, config)
        recv.start()
        send = SendSession(to_decode, SessionKey("r2", 0), SECRET, src, [], dst_ids, lambda _: None, config)
        with pytest.raises(ValueError, match="source blocks are known"):
            await send.send(1)
        for first, last in ((0, 2), (2, 3), (3, 5)):
            send.extend_sources(src_ids[first:last])
            await asyncio.wait_for(send.send(last), 10)
        with pytest.raises(ValueError, match="more than 5 source blocks"):
            send.extend_sources([7])
        recv.mark_done(first_token=1)
        assert await asyncio.wait_for(recv.wait(), 10) == 1
        assert torch.equal(dst[dst_ids], src[src_ids])

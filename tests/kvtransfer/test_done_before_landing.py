"""KVDone can overtake the bytes it announces (TCP's sender finishes once the kernel holds them):
the receive session must still complete when the last message lands after `mark_done`."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvtransfer import KVLayout, RecvSession, SendSession, SessionConfig, SessionKey, TcpTransport


@pytest.mark.parametrize("done_first", [True, False])
async def test_session_completes_whether_done_or_data_comes_first(done_first: bool) -> None:
    layout = KVLayout("float32", 2, 4, 2, 8, "model")
    prefill, decode = TcpTransport(layout), TcpTransport(layout)
    await prefill.start()
    await decode.start()
    try:
        to_prefill = await decode.connect(prefill.address)
        while (to_decode := prefill.peer(decode.address)) is None:
            await asyncio.sleep(0.01)  # bounded below by wait_for: the accept handler's last step
        src = torch.randn(16, 2, 2, 4, 2, 8)
        dst = torch.zeros_like(src)
        src_ids, dst_ids = [3, 7, 8], [10, 2, 5]  # non-contiguous on both sides: packed messages
        released: list[list[int]] = []
        config = SessionConfig(lease_s=20.0)
        recv = RecvSession(to_prefill, SessionKey("r1", 0), dst, dst_ids, released.append, config)
        recv.start()
        send = SendSession(to_decode, SessionKey("r1", 0), src, src_ids, dst_ids, released.append, config)
        if done_first:
            recv.mark_done(first_token=42)
        await asyncio.wait_for(send.send(), 10)
        if not done_first:
            await asyncio.sleep(0)  # let the landing tasks run first (ordering, not a timing wait)
            recv.mark_done(first_token=42)
        assert await asyncio.wait_for(recv.wait(), 10) == 42
        assert torch.equal(dst[dst_ids], src[src_ids])
    finally:
        await prefill.close()
        await decode.close()

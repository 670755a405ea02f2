"""KV receiving for the decode worker (placeholder interface until kvtransfer's session API lands)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from decode.worker import DecodeRequest


class KVReceiver(Protocol):
    async def open(self, r: DecodeRequest) -> None: ...

    async def post(self, r: DecodeRequest, chunk_index: int, blocks: list[int]) -> None: ...

    async def wait(self, r: DecodeRequest, num_chunks: int) -> str | None: ...

    def close(self, r: DecodeRequest, *, ok: bool, reason: str = "") -> None: ...

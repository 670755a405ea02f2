"""KV shipping for the prefill worker (placeholder interface until kvtransfer's session API lands)."""

from __future__ import annotations

from typing import Protocol

from prefill.job import Chunk, PrefillJob


class KVShipper(Protocol):
    async def open(self, job: PrefillJob) -> None: ...

    async def post(self, job: PrefillJob, chunk: Chunk) -> None: ...

    async def flush(self, job: PrefillJob) -> str | None: ...

    def close(self, job: PrefillJob, *, ok: bool, reason: str = "") -> None: ...

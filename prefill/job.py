"""One request on a prefill worker, and the plan of which KV blocks go to the decode worker next.

Block index map (P's block table vs D's reservation; `start` = Reserved.kv_start_token // block_size):

    P seq.block_table:   [ 0 .. start-1 | start ........................ n_kv_blocks-1 ]
                           D has these    sent in chunks, in order, each a run of whole blocks
    Reserved.block_ids:                 [ 0 .................................... n-start-1 ]

A chunk covers the blocks that became full since the previous chunk; the last (possibly partial)
block goes only once the prefill finished, so no block is read while a later forward still writes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_manager import cdiv
from engine.worker.role import RequestRecord
from splitserve import wire
from splitserve.v1 import control_pb2, serving_pb2


@dataclass(slots=True)
class Chunk:
    """One KV chunk to ship: P's source blocks and D's destination blocks, in sequence order."""

    index: int
    src_blocks: list[int]
    dst_blocks: list[int]
    first_block: int  # index into Reserved.block_ids
    end_token: int


@dataclass(slots=True, eq=False)
class PrefillJob(RequestRecord):
    """Created by PrefillWorker.on_prefill, changed only by the worker, ended exactly once by the role's
    `_end` (which releases `seq`'s blocks: freed, or kept findable by the prefix cache). `peer` is the
    decode worker; `seq` is prompt + output (+ the first token once sampled), and its blocks stay held
    after the prefill (the scheduler keeps them) until D acknowledges the KV or the job ends."""

    token: int | None = None
    sampled_at: float | None = None
    finish: int = serving_pb2.FINISH_REASON_UNSPECIFIED
    reserved: control_pb2.Reserved | None = None
    next_block: int = 0
    chunks: int = 0
    done_sent: bool = False

    @property
    def decode(self) -> control_pb2.WorkerEndpoint:
        assert self.peer is not None
        return self.peer

    @property
    def prefilled(self) -> bool:
        return self.token is not None

    def reserved_blocks(self) -> list[int]:
        assert self.reserved is not None
        return wire.unpack_ids(self.reserved.block_ids)

    def check_reserved(self, reserved: control_pb2.Reserved, block_size: int) -> str | None:
        """Why `reserved` cannot hold this sequence's KV (None: it fits exactly)."""
        if reserved.kv_start_token % block_size or reserved.kv_start_token >= self.num_kv_tokens:
            return (
                f"kv_start_token {reserved.kv_start_token} is not a block boundary below {self.num_kv_tokens}"
            )
        want = cdiv(self.num_kv_tokens, block_size) - reserved.kv_start_token // block_size
        got = wire.ids_array(reserved.block_ids).size
        if got != want:
            return f"Reserved has {got} blocks, the KV needs {want}"
        return None

    def next_chunk(self, block_size: int) -> Chunk | None:
        """The next run of blocks ready to ship, or None. Does not advance; see `posted`."""
        if self.reserved is None or (self.prefilled and self.finish != serving_pb2.FINISH_REASON_UNSPECIFIED):
            return None  # no destination yet, or token 1 ended the request: D needs no more KV
        start = self.reserved.kv_start_token // block_size
        first = max(self.next_block, start)
        if self.prefilled:
            end = cdiv(self.num_kv_tokens, block_size)
        else:
            end = min(self.seq.num_computed_tokens, self.num_kv_tokens) // block_size
        if end <= first:
            return None
        dst = self.reserved_blocks()
        return Chunk(
            index=self.chunks,
            src_blocks=self.seq.block_table[first:end],
            dst_blocks=dst[first - start : end - start],
            first_block=first - start,
            end_token=min(end * block_size, self.num_kv_tokens),
        )

    def posted(self, chunk: Chunk, block_size: int) -> None:
        self.next_block = chunk.first_block + len(chunk.dst_blocks) + self.reserved_start(block_size)
        self.chunks += 1

    def reserved_start(self, block_size: int) -> int:
        return 0 if self.reserved is None else self.reserved.kv_start_token // block_size

    def all_posted(self, block_size: int) -> bool:
        """Every chunk D needs is posted (or none is needed because token 1 ended the request)."""
        if not self.prefilled or self.reserved is None:
            return False
        if self.finish != serving_pb2.FINISH_REASON_UNSPECIFIED:
            return True
        return max(self.next_block, self.reserved_start(block_size)) >= cdiv(self.num_kv_tokens, block_size)

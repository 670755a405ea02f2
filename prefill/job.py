"""One request on a prefill worker, and which part of its KV goes to the decode worker next.

Block index map (`start` = Reserved.kv_start_token // block_size; "logical" = the session's index):

    P seq.block_table:   [ 0 .. start-1 | start ........................ n_kv_blocks-1 ]
                           D has these    logical block 0 ................ n-start-1
    Reserved.block_ids:                 [ 0 .................................... n-start-1 ]

kvtransfer splits the logical blocks into messages from D's ids alone (kvtransfer.plan), so both
sides agree without talking. P sends a message once all of its blocks are computed and final (after
each prefill step, while the next chunk computes); each batch of messages sent together is one
KVChunkReady ("chunk"). A block is final once every token in it has been computed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv_manager import cdiv
from engine.worker.convert import Finish
from engine.worker.record import WorkerRequest
from kvtransfer.plan import Message
from kvtransfer.session import SourceSession
from splitserve import wire
from splitserve.v1 import control_pb2, serving_pb2


@dataclass(slots=True, eq=False)
class PrefillJob(WorkerRequest):
    """Created by PrefillWorker.on_prefill, changed only by the worker, ended exactly once by the role's
    `_end` (which ends its session and releases `seq`'s blocks: freed, or kept findable by the prefix
    cache). `peer` is the decode worker. `seq` is prompt + output (+ the first token once sampled); its
    blocks stay held after the prefill (the scheduler keeps them) until D acknowledges or the job ends.
    """

    token: int | None = None
    sampled_at: float | None = None
    finish: Finish = serving_pb2.FINISH_REASON_UNSPECIFIED
    reserved: control_pb2.Reserved | None = None
    session: SourceSession | None = None
    shipping: asyncio.Task[None] | None = None
    messages: list[Message] = field(default_factory=list)
    sent_messages: int = 0
    chunks: int = 0
    holds: list[Callable[[list[int]], None]] = field(default_factory=list)
    progress_at: float | None = None  # last PrefillProgress to D (monotonic)

    def progress_due(self, now: float) -> bool:
        """Whether D should hear of this step: the first one, then every Reserved.lease_ms / 4."""
        assert self.reserved is not None
        return self.progress_at is None or now - self.progress_at >= self.reserved.lease_ms / 4e3

    @property
    def decode(self) -> control_pb2.WorkerEndpoint:
        assert self.peer is not None
        return self.peer

    @property
    def prefilled(self) -> bool:
        return self.token is not None

    @property
    def ends_at_first_token(self) -> bool:
        return self.finish != serving_pb2.FINISH_REASON_UNSPECIFIED

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

    def start_block(self, block_size: int) -> int:
        assert self.reserved is not None
        return self.reserved.kv_start_token // block_size

    def src_blocks(self, block_size: int) -> list[int]:
        """P's blocks the session reads, in logical order (complete once the last chunk is scheduled)."""
        return self.seq.block_table[self.start_block(block_size) : cdiv(self.num_kv_tokens, block_size)]

    def dst_blocks(self) -> list[int]:
        assert self.reserved is not None
        return wire.unpack_ids(self.reserved.block_ids)

    def transfer_secret(self) -> bytes:
        """The session secret D drew for this reservation; the session's tags derive from it."""
        assert self.reserved is not None
        return self.reserved.transfer_secret

    def final_blocks(self, block_size: int) -> int:
        """Logical blocks whose KV is computed and will not be written again."""
        if self.prefilled:
            return cdiv(self.num_kv_tokens, block_size) - self.start_block(block_size)
        return max(
            0,
            min(self.seq.num_computed_tokens, self.num_kv_tokens) // block_size
            - self.start_block(block_size),
        )

    def next_chunk(self, block_size: int, upto: int) -> control_pb2.KVChunkReady | None:
        """The KVChunkReady for the messages that lie wholly below logical block `upto` and are not
        sent yet (None: there are none). Advances the job's counters: call it right before sending."""
        first = self.sent_messages
        n = 0
        while first + n < len(self.messages) and self.messages[first + n].stop <= upto:
            n += 1
        if n == 0:
            return None
        start, stop = self.messages[first].start, self.messages[first + n - 1].stop
        chunk = control_pb2.KVChunkReady(
            rid=self.rid,
            generation=self.generation,
            chunk_index=self.chunks,
            first_block=start,
            num_blocks=stop - start,
            end_token=min((self.start_block(block_size) + stop) * block_size, self.num_kv_tokens),
        )
        self.sent_messages += n
        self.chunks += 1
        return chunk

    def release_holds(self, _src_ids: list[int]) -> None:
        """The session's release: drop its reference on every source block it was given, once."""
        for release in self.holds:
            release(_src_ids)
        self.holds.clear()

    def reset_transfer(self) -> None:
        """Forget the destination (after a Reassign); the session was already ended by the caller."""
        self.reserved, self.session, self.shipping, self.progress_at = None, None, None, None
        self.messages, self.sent_messages, self.chunks = [], 0, 0

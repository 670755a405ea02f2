"""PrefillJob's transfer plan: which of P's blocks go where, which are final, what each chunk announces."""

from __future__ import annotations

import structlog

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from kvtransfer.plan import plan_messages
from prefill.job import PrefillJob
from splitserve import wire
from splitserve.v1 import control_pb2
from tests.workers.conftest import execution_request

BS = 4


def job_with(prompt_len: int, kv_start: int, dst: list[int], blocks_per_message: int) -> PrefillJob:
    prompt = list(range(10, 10 + prompt_len))
    seq = Sequence("1.1", prompt, SamplingParams(max_tokens=4))
    seq.block_table = [100 + i for i in range(-(-prompt_len // BS))]
    endpoint = control_pb2.WorkerEndpoint(worker_id="d")
    job = PrefillJob(execution_request(1, prompt, 4), seq, endpoint, structlog.get_logger())
    reserved = control_pb2.Reserved(
        rid=1, generation=1, block_ids=wire.pack_ids(dst), kv_start_token=kv_start
    )
    assert job.check_reserved(reserved, BS) is None
    job.reserved = reserved
    job.messages = plan_messages(dst, 1, blocks_per_message, blocks_per_message)
    return job


def test_only_final_blocks_ship_before_the_prefill_ends_then_the_rest() -> None:
    job = job_with(10, 0, [20, 21, 22], blocks_per_message=1)  # one message per block
    assert (job.src_blocks(BS), job.dst_blocks()) == ([100, 101, 102], [20, 21, 22])
    job.seq.num_computed_tokens = 7  # the last chunk's forward writes token 7 on: block 1 is not final
    assert job.final_blocks(BS) == 1
    first = job.next_chunk(BS, job.final_blocks(BS))
    assert first is not None
    assert (first.chunk_index, first.first_block, first.num_blocks, first.end_token) == (0, 0, 1, 4)
    assert job.next_chunk(BS, job.final_blocks(BS)) is None  # nothing new is final
    job.token = 7
    assert job.final_blocks(BS) == 3
    last = job.next_chunk(BS, job.final_blocks(BS))
    assert last is not None
    assert (last.chunk_index, last.first_block, last.num_blocks, last.end_token) == (1, 1, 2, 10)
    assert job.chunks == 2 and job.sent_messages == 3


def test_a_message_is_sent_only_when_all_its_blocks_are_final() -> None:
    job = job_with(16, 0, [20, 21, 22, 23], blocks_per_message=2)
    job.seq.num_computed_tokens = 12  # blocks 0..2 final; the second message needs block 3 too
    chunk = job.next_chunk(BS, job.final_blocks(BS))
    assert chunk is not None and (chunk.first_block, chunk.num_blocks) == (0, 2)
    assert job.next_chunk(BS, job.final_blocks(BS)) is None


def test_blocks_the_decode_worker_has_cached_are_skipped() -> None:
    job = job_with(10, 4, [31, 32], blocks_per_message=1)
    assert (job.src_blocks(BS), job.dst_blocks()) == ([101, 102], [31, 32])
    job.seq.num_computed_tokens = 8
    assert job.final_blocks(BS) == 1
    chunk = job.next_chunk(BS, job.final_blocks(BS))
    assert chunk is not None and (chunk.first_block, chunk.num_blocks, chunk.end_token) == (0, 1, 8)


def test_a_reservation_of_the_wrong_size_is_refused_with_the_numbers() -> None:
    job = job_with(10, 0, [20, 21, 22], blocks_per_message=1)
    short = control_pb2.Reserved(block_ids=wire.pack_ids([1, 2]))
    assert job.check_reserved(short, BS) == "Reserved has 2 blocks, the KV needs 3"
    unaligned = control_pb2.Reserved(block_ids=wire.pack_ids([1, 2]), kv_start_token=2)
    assert "not a block boundary" in (job.check_reserved(unaligned, BS) or "")

"""PrefillJob's chunk plan: which of P's blocks go to which of D's reserved blocks, and when."""

from __future__ import annotations

import structlog

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from prefill.job import PrefillJob
from splitserve import wire
from splitserve.v1 import control_pb2, serving_pb2
from tests.workers.conftest import execution_request

BS = 4


def job_with(prompt_len: int, kv_start: int, dst: list[int]) -> PrefillJob:
    prompt = list(range(10, 10 + prompt_len))
    seq = Sequence("1.1", prompt, SamplingParams(max_tokens=4))
    seq.block_table = [100 + i for i in range(-(-prompt_len // BS))]
    job = PrefillJob(
        execution_request(1, prompt, 4),
        seq,
        control_pb2.WorkerEndpoint(worker_id="d"),
        structlog.get_logger(),
    )
    reserved = control_pb2.Reserved(
        rid=1, generation=1, block_ids=wire.pack_ids(dst), kv_start_token=kv_start
    )
    assert job.check_reserved(reserved, BS) is None
    job.reserved = reserved
    return job


def test_full_blocks_ship_as_computed_and_the_partial_block_only_after_the_prefill() -> None:
    job = job_with(10, 0, [20, 21, 22])
    job.seq.num_computed_tokens = 3
    assert job.next_chunk(BS) is None  # no block is full yet
    job.seq.num_computed_tokens = 8
    chunk = job.next_chunk(BS)
    assert chunk is not None
    assert (chunk.index, chunk.src_blocks, chunk.dst_blocks, chunk.first_block, chunk.end_token) == (
        0,
        [100, 101],
        [20, 21],
        0,
        8,
    )
    job.posted(chunk, BS)
    job.seq.num_computed_tokens = 10
    assert job.next_chunk(BS) is None  # block 2 is partial while the prefill is still running
    assert not job.all_posted(BS)
    job.token = 7
    last = job.next_chunk(BS)
    assert last is not None and (last.index, last.src_blocks, last.dst_blocks, last.end_token) == (
        1,
        [102],
        [22],
        10,
    )
    job.posted(last, BS)
    assert job.next_chunk(BS) is None and job.all_posted(BS)


def test_blocks_the_decode_worker_has_cached_are_skipped() -> None:
    job = job_with(10, 4, [31, 32])
    job.seq.num_computed_tokens = 8
    chunk = job.next_chunk(BS)
    assert chunk is not None and (chunk.src_blocks, chunk.dst_blocks, chunk.first_block) == ([101], [31], 0)
    job.posted(chunk, BS)
    job.token = 7
    last = job.next_chunk(BS)
    assert last is not None and (last.src_blocks, last.dst_blocks, last.first_block) == ([102], [32], 1)


def test_a_first_token_that_ends_the_request_ships_nothing_more() -> None:
    job = job_with(10, 0, [20, 21, 22])
    job.seq.num_computed_tokens = 10
    job.token, job.finish = 1, serving_pb2.FINISH_REASON_EOS_TOKEN
    assert job.next_chunk(BS) is None and job.all_posted(BS)


def test_a_reservation_of_the_wrong_size_is_refused_with_the_numbers() -> None:
    job = job_with(10, 0, [20, 21, 22])
    short = control_pb2.Reserved(block_ids=wire.pack_ids([1, 2]))
    assert job.check_reserved(short, BS) == "Reserved has 2 blocks, the KV needs 3"
    unaligned = control_pb2.Reserved(block_ids=wire.pack_ids([1, 2]), kv_start_token=2)
    assert "not a block boundary" in (job.check_reserved(unaligned, BS) or "")

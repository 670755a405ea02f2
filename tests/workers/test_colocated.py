"""The colocated worker: one process prefills and decodes, speaking the same control protocol."""

from __future__ import annotations

import random

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from splitserve.v1 import serving_pb2
from tests.workers.conftest import Cluster, execution_request


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 1000) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


async def test_colocated_streams_greedy_output_and_ends_clean(cluster: Cluster) -> None:
    worker = await cluster.start("colocated", "colo-0", max_num_batched_tokens=24)
    coord = cluster.coordinator
    batch = prompts(4, seed=1)
    for rid, prompt in enumerate(batch, start=1):
        req = execution_request(rid, prompt, 10, identity=worker.engine.loaded.identity)
        await coord.send("colo-0", decode={"request": req})
    got = await coord.collect(set(range(1, len(batch) + 1)))
    llm = LLM(worker.engine.loaded.model_dir, block_size=4, num_blocks=64)
    want = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    for rid, expected in enumerate(want, start=1):
        assert got[rid] == (expected.token_ids, serving_pb2.FINISH_REASON_LENGTH)
    await coord.assert_pool_clean("colo-0")

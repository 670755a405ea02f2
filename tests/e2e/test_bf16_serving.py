"""bfloat16 served end to end (`ClusterSpec(dtype="bfloat16")`, every worker's `--dtype`): real
coordinator, prefill and decode processes on the tiny model. Both paths conditional disaggregation
chooses between give the offline engine's greedy output in bf16 (`engine.LLM(dtype="bfloat16")`)
token for token: the prefill worker's KV shipped to the decode worker (remote: `--disaggregation
always`, KV layout and bytes in bf16) and the decode worker prefilling the prompt itself (local:
`--disaggregation never`). transformers parity stays the float32 tests' job."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from splitserve.cluster import ClusterSpec, LocalCluster
from splitserve.v1 import serving_pb2
from tests.e2e.conftest import KEYS_ENV, assert_pools_clean, client_for, running_cluster, wait_quiescent

pytestmark = pytest.mark.xdist_group("e2e-bf16")
BUDGET = 64  # every prompt below fits one step everywhere: the same chunking served and offline
PATHS = {"always": serving_pb2.PREFILL_PATH_REMOTE, "never": serving_pb2.PREFILL_PATH_LOCAL}
MAX_TOKENS = 8


@pytest.fixture(scope="module", params=sorted(PATHS))
def bf16_cluster(
    request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    worker = ["--block-size", "4", "--max-num-batched-tokens", str(BUDGET)]
    spec = ClusterSpec(
        model=str(model_dir),
        dtype="bfloat16",
        transfer_backend="tcp",
        env=dict(KEYS_ENV),
        coordinator_args=["--disaggregation", request.param],
        prefill_args=worker,
        decode_args=worker,
    )
    yield from running_cluster(spec, tmp_path_factory.mktemp(f"bf16-{request.param}"))


async def test_bf16_served_greedy_equals_the_offline_engine(
    bf16_cluster: LocalCluster, model_dir: Path
) -> None:
    rng = random.Random(12)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 23, 48)]
    offline = LLM(model_dir, dtype="bfloat16", block_size=4, max_num_batched_tokens=BUDGET)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [offline.generate([p], params)[0].token_ids for p in prompts]  # one at a time, as served
    path = PATHS[bf16_cluster.spec.coordinator_args[-1]]
    async with client_for(bf16_cluster) as client:
        for prompt, expected in zip(prompts, want, strict=True):
            got = await client.complete(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            assert got.timings is not None and got.timings.routing.path == path
            assert got.token_ids == expected
        assert_pools_clean(await wait_quiescent(client))

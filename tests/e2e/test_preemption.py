"""A decode pool too small for its batch: requests are preempted, resumed through prefill, and the
client's streams simply continue, with output identical to an uninterrupted run."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from splitserve.cluster import ClusterSpec, LocalCluster
from tests.e2e.conftest import KEYS_ENV, assert_pools_clean, client_for, running_cluster, wait_quiescent

pytestmark = pytest.mark.xdist_group("e2e-small-pool")


@pytest.fixture(scope="module")
def small_pool_cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        model=str(model_dir),
        transfer_backend="tcp",
        env=dict(KEYS_ENV),
        prefill_args=["--block-size", "4"],
        decode_args=["--block-size", "4", "--num-gpu-blocks", "40"],
    )
    yield from running_cluster(spec, tmp_path_factory.mktemp("small-pool"))


async def test_preempted_requests_resume_with_identical_output(
    small_pool_cluster: LocalCluster, hf_greedy: Callable[[list[int], int], list[int]]
) -> None:
    rng = random.Random(5)
    # 4 requests x (20 prompt + 40 output) tokens need 60 blocks of 4 at the end; the pool has 40
    prompts = [[rng.randrange(3, 500) for _ in range(20)] for _ in range(4)]
    async with client_for(small_pool_cluster) as client:
        results = await asyncio.gather(
            *(client.complete(p, max_tokens=40, temperature=0.0, ignore_eos=True) for p in prompts)
        )
        assert sum(r.usage.preemptions for r in results if r.usage) > 0, "the pool never ran short"
        for prompt, got in zip(prompts, results, strict=True):
            assert got.token_ids == _greedy_ignoring_eos(hf_greedy, prompt, 40)
        assert_pools_clean(await wait_quiescent(client))


def _greedy_ignoring_eos(
    hf_greedy: Callable[[list[int], int], list[int]], prompt: list[int], n: int
) -> list[int]:
    """transformers stops at EOS; with ignore_eos the server continues, so extend past each EOS."""
    out: list[int] = []
    while len(out) < n:
        out += hf_greedy(prompt + out, n - len(out))
    return out[:n]

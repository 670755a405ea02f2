"""Push over UCX end to end. Over UCX a decode worker pulls by default (`--kv-transfer-mode auto`:
one-sided gets, kvtransfer.pull; the main e2e cluster runs that way); `--kv-transfer-mode push` keeps
P sending into D's posted receives, chunk by chunk under chunked prefill: greedy output equals
transformers' and every pool ends clean, and no pool is mapped for one-sided reads."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from splitserve.cluster import ClusterSpec, LocalCluster
from tests.e2e.conftest import KEYS_ENV, assert_pools_clean, client_for, running_cluster, wait_quiescent

pytestmark = pytest.mark.xdist_group("e2e-push-ucx")


@pytest.fixture(scope="module")
def push_cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """1 prefill worker computing 16 tokens a step (long prompts ship in several chunks) and 1 decode
    worker P pushes to, over UCX."""
    spec = ClusterSpec(
        model=str(model_dir),
        transfer_backend="ucx",
        env=dict(KEYS_ENV),
        prefill_args=["--block-size", "4", "--max-num-batched-tokens", "16"],
        decode_args=["--block-size", "4", "--kv-transfer-mode", "push"],
    )
    yield from running_cluster(spec, tmp_path_factory.mktemp("push-ucx"))


async def test_pushed_kv_over_ucx_gives_transformers_greedy_and_clean_pools(
    push_cluster: LocalCluster, hf_greedy: Callable[[list[int], int], list[int]]
) -> None:
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (1, 5, 17, 40, 90)]
    async with client_for(push_cluster) as client:
        results = await asyncio.gather(*(client.complete(p, max_tokens=8, temperature=0.0) for p in prompts))
        for prompt, got in zip(prompts, results, strict=True):
            assert got.token_ids == hf_greedy(prompt, 8)
        assert_pools_clean(await wait_quiescent(client))
    assert push_cluster.spec.log_dir is not None
    for role in ("prefill-0", "decode-0"):  # nobody mapped a pool: the KV went by tag-matched sends
        assert "kv pool mapped" not in (push_cluster.spec.log_dir / f"{role}.log").read_text()

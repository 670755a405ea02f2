"""The disaggregated path with `--transfer-backend nixl`, D pulling with NIXL READs (`pull`, what
`auto` does on NIXL) and P pushing (`push`): greedy output equal to the default backend's
(transformers' greedy, which test_serving holds the default UCX cluster to), every pool clean
afterwards."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtransfer.bench.nixl_sweep import nixl_missing
from splitserve.cluster import ClusterSpec, LocalCluster
from tests.e2e.conftest import KEYS_ENV, assert_pools_clean, client_for, running_cluster, wait_quiescent

NIXL_MISSING = nixl_missing()
pytestmark = [
    pytest.mark.xdist_group("e2e-nixl"),
    pytest.mark.skipif(NIXL_MISSING is not None, reason=f"nixl: {NIXL_MISSING}"),
]


@pytest.fixture(scope="module", params=["push", "pull"])
def nixl_cluster(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        model=str(model_dir),
        transfer_backend="nixl",
        env=dict(KEYS_ENV),
        # small chunks and blocks: a prompt's KV moves as several messages (push: direct and
        # packed) or chunks of reads (pull)
        prefill_args=["--max-num-batched-tokens", "32", "--block-size", "4"],
        decode_args=["--block-size", "4", "--kv-transfer-mode", request.param],
    )
    yield from running_cluster(spec, tmp_path_factory.mktemp(f"nixl-{request.param}"))


async def test_nixl_backend_serves_the_default_backends_greedy_output(
    nixl_cluster: LocalCluster, hf_greedy: Callable[[list[int], int], list[int]]
) -> None:
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 17, 64, 90)]
    async with client_for(nixl_cluster) as client:
        results = await asyncio.gather(*(client.complete(p, max_tokens=12, temperature=0.0) for p in prompts))
        for prompt, got in zip(prompts, results, strict=True):
            assert got.token_ids == hf_greedy(prompt, 12)
        assert_pools_clean(await wait_quiescent(client))
    logs = [p.read_text() for p in (nixl_cluster.spec.log_dir or Path()).glob("decode*")]
    assert any("nixl: UCX" in text for text in logs), "the decode worker never paired over NIXL"
    pulled = any("kv pool mapped for one-sided reads" in text for text in logs)
    assert pulled == ("pull" in nixl_cluster.spec.decode_args), "the decode worker pulled, or did not"

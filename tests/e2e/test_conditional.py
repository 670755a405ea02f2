"""Conditional disaggregation end to end (`ClusterSpec(mode="conditional")`): real coordinator, prefill
and decode processes. Long prompts go to the prefill worker; a short prompt arriving while the prefill
worker is queued is prefilled on the decode worker; every decision follows the estimates it records
in Timings.routing and is counted by `decision`; the output is transformers' greedy either way."""

from __future__ import annotations

import asyncio
import random
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from splitserve.client import Client, Completion
from splitserve.cluster import ClusterSpec, LocalCluster
from splitserve.v1 import serving_pb2
from tests.e2e.conftest import KEYS_ENV, assert_pools_clean, client_for, running_cluster, wait_quiescent

pytestmark = pytest.mark.xdist_group("e2e-conditional")
LOCAL_MAX = 48  # --local-prefill-max-tokens
DECODE_THRESHOLD = 64  # the decode worker's --long-prefill-token-threshold (P keeps the default, off)
REMOTE, LOCAL = serving_pb2.PREFILL_PATH_REMOTE, serving_pb2.PREFILL_PATH_LOCAL


@pytest.fixture(scope="module")
def conditional_cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """1 prefill worker computing 8 tokens a step (so three long prompts queue on it for a while) and
    1 decode worker with a 32-token step budget, over TCP. D's per-role threshold (64) is above every
    prompt it takes (LOCAL_MAX): each role gets its own, and D runs each of its prompts whole beside
    its decodes (`--short-prompts-whole`) where its cap would give them 4 tokens a step. A shipped
    request's first token streams as P samples it (`--first-token-from prefill`)."""
    spec = ClusterSpec(
        model=str(model_dir),
        mode="conditional",
        transfer_backend="tcp",
        long_prefill_token_threshold={"decode": DECODE_THRESHOLD},
        env=dict(KEYS_ENV),
        coordinator_args=[
            *("--local-prefill-max-tokens", str(LOCAL_MAX), "--heartbeat-interval-ms", "100"),
            *("--first-token-from", "prefill"),  # the e2e cluster of test_serving.py streams it from D
        ],
        prefill_args=["--block-size", "4", "--max-num-batched-tokens", "8"],
        decode_args=[
            *("--block-size", "4", "--max-num-batched-tokens", "32"),
            *("--prefill-tokens-while-decoding", "4", "--short-prompts-whole"),
        ],
    )
    yield from running_cluster(spec, tmp_path_factory.mktemp("conditional"))


async def _until(client: Client, cond: Callable[[serving_pb2.GetPoolStateResponse], bool]) -> None:
    deadline = time.monotonic() + 30
    while not cond(await client.pool_state(fresh=False)):
        assert time.monotonic() < deadline, "the cluster never reached the state"
        await asyncio.sleep(0.02)  # poll interval of a bounded wait


def _placements(cluster: LocalCluster) -> dict[str, float]:
    address = cluster.coordinator.ready["metrics_address"]
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    counts = {}
    for line in text.splitlines():
        if line.startswith("splitserve_coordinator_placements_total{"):
            label, value = line.rsplit(" ", 1)
            counts[label.split('decision="')[1].split('"')[0]] = float(value)
    return counts


def _routing(done: Completion) -> serving_pb2.RoutingDecision:
    assert done.timings is not None and done.timings.HasField("routing")
    return done.timings.routing


async def test_the_decision_follows_the_estimates_and_the_output_is_greedy(
    conditional_cluster: LocalCluster, hf_greedy: Callable[[list[int], int], list[int]]
) -> None:
    rng = random.Random(21)
    longs = [[rng.randrange(3, 500) for _ in range(300)] for _ in range(3)]
    shorts = [[rng.randrange(3, 500) for _ in range(12)] for _ in range(3)]
    async with client_for(conditional_cluster) as client:
        warm = await client.complete(shorts[0][:6], max_tokens=4, temperature=0.0)  # costs measured
        await _until(client, lambda s: all(w.load.step_token_budget for w in s.workers))
        assert warm.token_ids == hf_greedy(shorts[0][:6], 4)
        workers = (await client.pool_state()).workers
        thresholds = {w.role: w.load.long_prefill_token_threshold for w in workers}
        whole = {w.role: w.load.short_prompts_whole for w in workers}
        assert whole == {serving_pb2.WORKER_ROLE_PREFILL: False, serving_pb2.WORKER_ROLE_DECODE: True}
        assert thresholds == {
            serving_pb2.WORKER_ROLE_PREFILL: 0,
            serving_pb2.WORKER_ROLE_DECODE: DECODE_THRESHOLD,
        }
        long_tasks = [asyncio.create_task(client.complete(p, max_tokens=4, temperature=0.0)) for p in longs]
        await _until(client, lambda s: s.active_requests >= len(longs))  # placed: P has 900 tokens
        short_done = await asyncio.gather(
            *(client.complete(p, max_tokens=6, temperature=0.0) for p in shorts)
        )
        long_done = await asyncio.gather(*long_tasks)
        for prompt, got in zip(longs, long_done, strict=True):
            assert got.token_ids == hf_greedy(prompt, 4)
        for prompt, got in zip(shorts, short_done, strict=True):
            assert got.token_ids == hf_greedy(prompt, 6)
        for got in long_done:  # over the local limit: always the prefill worker
            routing = _routing(got)
            assert routing.path == REMOTE and routing.uncached_tokens > LOCAL_MAX
            assert got.timings is not None and not got.timings.kv_transfer_in_ttft  # streamed from P
            assert routing.estimated_ttft_ms == routing.remote_ttft_ms > 0
        for got in short_done:  # the cheaper estimate wins
            routing = _routing(got)
            want = LOCAL if 0 < routing.local_ttft_ms < routing.remote_ttft_ms else REMOTE
            assert routing.path == want and routing.decode_spare_tokens > 0
        paths = [_routing(got).path for got in short_done]
        assert LOCAL in paths, f"no short prompt skipped the queued prefill worker: {short_done}"
        paths += [_routing(got).path for got in [warm, *long_done]]
        state = await wait_quiescent(client)
        assert_pools_clean(state)
    counts = _placements(conditional_cluster)
    assert counts.get("local", 0) == paths.count(LOCAL)
    assert counts.get("remote", 0) == paths.count(REMOTE) and "colocated" not in counts

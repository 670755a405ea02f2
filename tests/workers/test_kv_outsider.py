"""A real prefill and decode worker while an outsider process attacks both transfer listeners: the
request's output still equals greedy, both pools end clean, and each worker counts the refusals."""

from __future__ import annotations

import random
import secrets
from pathlib import Path

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.worker.process import Worker
from tests.kvtransfer.test_outsider import old_scheme_tags, run_attacker
from tests.workers.conftest import Cluster, endpoint, execution_request
from tests.workers.test_disaggregated import (
    LENGTH,
    assert_quiescent,
    random_prompt,
    send_decode,
    send_prefill,
    wait_until,
)


def refusals(worker: Worker, reason: str) -> float:
    value = worker.metrics.registry.get_sample_value(
        "splitserve_worker_kv_connections_refused_total", {"reason": reason}
    )
    return value or 0.0


async def test_outsider_attacks_both_workers_and_the_request_is_unharmed(
    cluster: Cluster, model_dir: Path
) -> None:
    # leases long enough to outlast two attacker processes' start on a loaded machine
    p = await cluster.start("prefill", "p0", lease_ms=120_000)
    d = await cluster.start("decode", "d0", lease_ms=120_000)
    coord = cluster.coordinator
    assert len(coord.workers["p0"].endpoint.transfer_key) == 32  # advertised in Register only
    prompt = random_prompt(random.Random(11), 23)
    req = execution_request(21, prompt, 6, identity=p.engine.loaded.identity)
    await send_decode(coord, p, d, req)  # D reserves, posts its receives, sends Reserved to P
    assert p.role is not None
    await wait_until(lambda: 21 in p.role._early, "P to hold D's Reserved")  # type: ignore[union-attr]
    # While D's receives are posted: messages under the old scheme's tags for (rid, generation) and
    # random tags at D's listener, and a hello posing as D at P's.
    tags = [*old_scheme_tags("21", 1, 8), *(secrets.randbits(64) for _ in range(8))]
    messages = [[tag, 4096] for tag in tags]
    assert p.transfer is not None and d.transfer is not None
    await run_attacker("tcp", d.transfer.address, endpoint(p).transfer_address, messages)
    await run_attacker("tcp", p.transfer.address, endpoint(d).transfer_address, [])
    await send_prefill(coord, p, d, req)
    got = await coord.collect({21})
    llm = LLM(model_dir, block_size=4, num_blocks=64)
    expected = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert got[21] == (expected.token_ids, LENGTH)
    await assert_quiescent(cluster, p, d)
    await wait_until(lambda: refusals(d, "auth") >= 1 and refusals(d, "malformed") >= 1, "D's refusals")
    await wait_until(lambda: refusals(p, "auth") >= 1, "P's refusal")

"""The `splitserve chat` CLI, as a process, against the real cluster over mutual TLS."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from transformers import AutoTokenizer

from splitserve.cluster import LocalCluster
from tests.coordinator.test_tls import run_cli
from tests.e2e.conftest import API_KEY, client_tls

pytestmark = pytest.mark.xdist_group("e2e-cluster")


async def test_cli_chat_over_mtls_matches_transformers_greedy(
    cluster: LocalCluster, hf_greedy: Callable[[list[int], int], list[int]], model_dir: object
) -> None:
    tls = client_tls(cluster)
    assert tls is not None and tls.ca and tls.cert and tls.key
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    question = "Why is my device blinking amber?"
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)  # the template writes <|bos|> itself
    want = tokenizer.decode(hf_greedy(ids, 12), skip_special_tokens=True)
    common = [
        "--target",
        cluster.grpc_address,
        "--max-tokens",
        "12",
        "--temperature",
        "0",
        "--tls-ca",
        str(tls.ca),
    ]
    key = {"SPLITSERVE_API_KEY": API_KEY}
    cert = ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key)]
    code, out, err = await run_cli("chat", question, *common, *cert, env=key)
    assert code == 0, err
    assert out == want
    code, _, err = await run_cli("chat", question, *common, env=key)  # mTLS: no client certificate, no call
    assert code == 1 and "UNAVAILABLE" in err

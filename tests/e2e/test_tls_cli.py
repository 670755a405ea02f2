"""The `splitserve chat` CLI, as a process, against the real cluster over mutual TLS."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable

import pytest
from transformers import AutoTokenizer

from splitserve.cluster import LocalCluster
from tests.e2e.conftest import API_KEY, client_tls

pytestmark = pytest.mark.xdist_group("e2e-cluster")


async def run_cli(*args: str) -> tuple[int, str, str]:
    env = {**os.environ, "SPLITSERVE_API_KEY": API_KEY}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "splitserve.cli", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


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
    code, out, err = await run_cli(
        "chat", question, *common, "--tls-cert", str(tls.cert), "--tls-key", str(tls.key)
    )
    assert code == 0, err
    assert out == want
    code, _, err = await run_cli("chat", question, *common)  # mTLS: no client certificate, no call
    assert code == 1 and "UNAVAILABLE" in err

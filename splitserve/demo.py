"""`splitserve demo` (what `make run` runs): a local cluster on a real model serving one chat request.

Fetches the model on first use (default `smollm2-135m-instruct`), starts a coordinator, a prefill
worker and a decode worker (one progress line each; their logs go to files, see `splitserve.launch`),
sends the chat request "Why is my device blinking amber?" with a system prompt under an ephemeral
API key (so no other process on the host can use the cluster), streams the greedy answer, prints the
start-up time, the per-stage timings and usage, then drains and stops every process.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets

from splitserve.launch import started
from splitserve.serve import add_cluster_arguments, cluster_spec

SYSTEM = "You answer questions about Acme products."
QUESTION = "Why is my device blinking amber?"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_cluster_arguments(parser)
    parser.add_argument("--max-tokens", type=int, default=48)


async def _ask(address: str, api_key: str, max_tokens: int) -> None:
    from splitserve.client import Client, Completion

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    print(f"system: {SYSTEM}\nuser:   {QUESTION}\nassistant: ", end="", flush=True)
    completion = Completion()
    async with Client(address, api_key=api_key) as client:
        async for event in client.chat(messages, max_tokens=max_tokens, temperature=0.0, timeout=120):
            completion.add(event)
            if event.WhichOneof("event") == "delta":
                print(event.delta.text, end="", flush=True)
    t, u = completion.timings, completion.usage
    assert t is not None and u is not None
    print(
        f"\n\nfinish: {completion.finish_reason}   tokens: prompt {u.prompt_tokens}, "
        f"completion {u.completion_tokens}, cached {u.cached_prompt_tokens}"
    )
    print(
        "timings (ms): "
        + "  ".join(
            f"{name} {getattr(t, name + '_ms'):.1f}"
            for name in ("queue", "prefill", "kv_transfer", "first_token", "decode", "total")
        )
    )


def run(args: argparse.Namespace) -> int:
    spec = cluster_spec(args, log_files_by_default=True)
    api_key = secrets.token_urlsafe(24)  # ephemeral: the demo's own client is the only tenant
    spec.env["SPLITSERVE_API_KEY"] = api_key
    with started(spec) as cluster:
        asyncio.run(_ask(cluster.grpc_address, api_key, args.max_tokens))
        codes = cluster.stop()
    if args.model.startswith("tiny"):
        print("note: the built-in tiny model has random weights, so the answer is gibberish by design.")
    print(f"cluster stopped cleanly: {all(c == 0 for c in codes.values())} ({codes})")
    return 0 if all(c == 0 for c in codes.values()) else 1

"""`splitserve demo` (what `make run` runs): a local cluster on the tiny model serving one real chat request.

Starts a coordinator, a prefill worker and a decode worker, sends the chat request "Why is my device
blinking amber?" with a system prompt, streams the answer, prints the per-stage timings and usage,
then drains and stops every process.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from splitserve.cluster import LocalCluster
from splitserve.serve import add_cluster_arguments, cluster_spec

SYSTEM = "You answer questions about Acme products."
QUESTION = "Why is my device blinking amber?"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_cluster_arguments(parser)
    parser.add_argument("--max-tokens", type=int, default=48)


async def _ask(address: str, max_tokens: int) -> None:
    from splitserve.client import Client, Completion

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    print(f"system: {SYSTEM}\nuser:   {QUESTION}\nassistant: ", end="", flush=True)
    completion = Completion()
    async with Client(address) as client:
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
    print("note: the built-in tiny model has random weights, so the answer is gibberish by design.")


def run(args: argparse.Namespace) -> int:
    spec = cluster_spec(args)
    with LocalCluster(spec) as cluster:
        print(
            f"cluster up: coordinator {cluster.grpc_address}, "
            f"workers {', '.join(p.name for p in cluster.processes[1:])}",
            file=sys.stderr,
        )
        asyncio.run(_ask(cluster.grpc_address, args.max_tokens))
        codes = cluster.stop()
    print(f"cluster stopped cleanly: {all(c == 0 for c in codes.values())} ({codes})")
    return 0 if all(c == 0 for c in codes.values()) else 1

"""`splitserve generate "text"` and `splitserve chat "question"`: stream from a running server."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="prompt text (generate) or the user message (chat)")
    parser.add_argument("--target", default="127.0.0.1:50051", help="coordinator gRPC address")
    parser.add_argument("--model", default="", help="served model name (default: the only one)")
    parser.add_argument("--system", default=None, help="chat: a system message first")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument("--tls-ca", default=None, help="PEM CA bundle to verify the server: use TLS")
    parser.add_argument("--tls-cert", default=None, help="PEM client certificate (mTLS), with --tls-key")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument(
        "--insecure", action="store_true", help="plaintext to a non-loopback target (unencrypted)"
    )


async def _stream(args: argparse.Namespace) -> int:
    import grpc

    from coordinator.tls import ClientTls
    from splitserve.client import Client, Completion

    params = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
        "stop": args.stop,
    }
    completion = Completion()
    try:
        tls = None
        if args.tls_ca or args.tls_cert:
            tls = ClientTls(*(Path(p) if p else None for p in (args.tls_ca, args.tls_cert, args.tls_key)))
        client = Client(
            args.target,
            api_key=os.environ.get("SPLITSERVE_API_KEY"),
            model=args.model,
            tls=tls,
            insecure=args.insecure,
        )
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    async with client:
        stream: AsyncIterator[Any]
        if args.command == "chat":
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": args.prompt}
            ]
            stream = client.chat(messages, timeout=args.timeout, **params)
        else:
            stream = client.generate(args.prompt, timeout=args.timeout, **params)
        try:
            async for event in stream:
                completion.add(event)
                if event.WhichOneof("event") == "delta":
                    print(event.delta.text, end="", flush=True)
        except grpc.aio.AioRpcError as err:
            print(f"\nerror: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    u, t = completion.usage, completion.timings
    if u is not None and t is not None:
        print(
            f"\n[{completion.finish_reason}; {u.prompt_tokens} prompt + {u.completion_tokens} completion tokens; "
            f"ttft {t.first_token_ms:.1f} ms, total {t.total_ms:.1f} ms]",
            file=sys.stderr,
        )
    return 0


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_stream(args))

"""`splitserve bench`: a serving benchmark against a running server or a cluster it launches itself.

Requests arrive as a Poisson process at each `--rate` (requests/s); prompt and output lengths are
drawn from a seeded generator (or prompts come from a JSONL file with a "prompt" or "token_ids"
field). Every request streams; we record the arrival of each token to derive:

- TTFT: first token time minus send time;
- TPOT: per request, (last token - first token) / (tokens - 1), then the distribution over requests;
- ITL: every gap between consecutive tokens of a request, pooled over all requests;
- goodput: the share of requests that finished and met both the TTFT and the TPOT SLO (a request
  that failed or timed out is a miss).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from splitserve.cluster import LocalCluster
from splitserve.serve import add_cluster_arguments, cluster_spec


@dataclass(slots=True)
class RequestTrace:
    prompt_len: int
    max_tokens: int
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and len(self.token_times) > 0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


@dataclass(slots=True)
class BenchResult:
    mode: str
    rate: float
    num_requests: int
    completed: int
    duration_s: float
    output_tok_s: float
    request_s: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    slo_ttft_ms: float
    slo_tpot_ms: float
    slo_attainment: float
    errors: dict[str, int]
    inputs: dict[str, Any]


def summarize(
    traces: list[RequestTrace], duration: float, args: argparse.Namespace, rate: float, mode: str
) -> BenchResult:
    ok = [t for t in traces if t.ok]
    ttfts = [t.ttft * 1e3 for t in ok]
    tpots = [t.tpot * 1e3 for t in ok if t.tpot is not None]
    itls = [(b - a) * 1e3 for t in ok for a, b in zip(t.token_times, t.token_times[1:], strict=False)]

    def dist(values: list[float]) -> dict[str, float]:
        return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}

    met = sum(
        1
        for t in ok
        if t.ttft * 1e3 <= args.slo_ttft_ms and (t.tpot is None or t.tpot * 1e3 <= args.slo_tpot_ms)
    )
    return BenchResult(
        mode=mode,
        rate=rate,
        num_requests=len(traces),
        completed=len(ok),
        duration_s=duration,
        output_tok_s=sum(len(t.token_times) for t in ok) / duration,
        request_s=len(ok) / duration,
        ttft_ms=dist(ttfts),
        tpot_ms=dist(tpots),
        itl_ms=dist(itls),
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        slo_attainment=met / len(traces),
        errors=dict(Counter(t.error for t in traces if t.error)),
        inputs={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "_module"},
    )


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int] | str, int]]:
    rng = random.Random(args.seed)
    if args.dataset:
        rows = [json.loads(line) for line in Path(args.dataset).read_text().splitlines() if line.strip()]
        return [
            (r.get("token_ids") or r["prompt"], int(r.get("max_tokens", args.output_len)))
            for r in rows[: args.num_requests]
        ]
    items: list[tuple[list[int] | str, int]] = []
    for _ in range(args.num_requests):
        n = max(1, int(rng.uniform(1 - args.len_jitter, 1 + args.len_jitter) * args.input_len))
        m = max(1, int(rng.uniform(1 - args.len_jitter, 1 + args.len_jitter) * args.output_len))
        items.append(([rng.randrange(3, vocab) for _ in range(n)], m))
    return items


async def run_rate(
    address: str, items: list[tuple[list[int] | str, int]], rate: float, args: argparse.Namespace
) -> tuple[list[RequestTrace], float]:
    import grpc

    from splitserve.client import Client

    rng = random.Random(args.seed + 1)
    traces = [RequestTrace(len(p), m) for p, m in items]

    async with Client(address) as client:

        async def one(i: int, prompt: list[int] | str, max_tokens: int) -> None:
            trace = traces[i]
            trace.sent = time.perf_counter()
            try:
                async for event in client.generate(
                    prompt,
                    max_tokens=max_tokens,
                    ignore_eos=True,
                    temperature=0.0,
                    timeout=args.request_timeout,
                ):
                    if event.WhichOneof("event") == "delta":
                        now = time.perf_counter()
                        trace.token_times.extend([now] * len(event.delta.token_ids))
            except grpc.aio.AioRpcError as exc:  # a failed request is a recorded miss, not a crash
                trace.error = f"{exc.code().name}: {exc.details()}"

        start = time.perf_counter()
        tasks = []
        for i, (prompt, max_tokens) in enumerate(items):
            tasks.append(asyncio.create_task(one(i, prompt, max_tokens)))
            if rate > 0:
                await asyncio.sleep(rng.expovariate(rate))  # the arrival process itself, not a sync wait
        await asyncio.gather(*tasks)
        return traces, time.perf_counter() - start


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", default=None, help="a running coordinator; default: launch a local cluster"
    )
    add_cluster_arguments(parser)
    parser.add_argument(
        "--rates", default="1,2,4", help="comma-separated request rates (req/s); 0 = all at once"
    )
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--len-jitter", type=float, default=0.5, help="lengths uniform in len*(1±jitter)")
    parser.add_argument("--dataset", type=Path, default=None, help="JSONL with prompt/token_ids[/max_tokens]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=200.0)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--json", type=Path, default=None, help="append one JSON line per rate")


def print_table(results: list[BenchResult]) -> None:
    head = (
        f"{'mode':<14}{'rate':>6}{'done':>6}{'tok/s':>8}{'ttft p50':>10}{'p90':>8}{'p99':>8}"
        f"{'tpot p50':>10}{'p90':>8}{'p99':>8}{'itl p50':>9}{'p99':>8}{'slo':>6}"
    )
    print(head)
    for r in results:
        print(
            f"{r.mode:<14}{r.rate:>6g}{r.completed:>3}/{r.num_requests:<2}{r.output_tok_s:>8.1f}"
            f"{r.ttft_ms['p50']:>10.1f}{r.ttft_ms['p90']:>8.1f}{r.ttft_ms['p99']:>8.1f}"
            f"{r.tpot_ms['p50']:>10.1f}{r.tpot_ms['p90']:>8.1f}{r.tpot_ms['p99']:>8.1f}"
            f"{r.itl_ms['p50']:>9.1f}{r.itl_ms['p99']:>8.1f}{r.slo_attainment:>6.0%}"
        )
    print("(milliseconds; slo = share of requests meeting both the TTFT and the TPOT SLO)")
    for r in results:
        for error, count in r.errors.items():
            print(f"{r.mode} rate {r.rate:g}: {count} failed with {error}")


def run(args: argparse.Namespace) -> int:
    from engine.loader import load_tokenizer
    from engine.model_dir import resolve_model_dir

    vocab = len(load_tokenizer(resolve_model_dir(args.model)))
    items = workload(args, vocab)
    rates = [float(r) for r in args.rates.split(",")]
    results = []

    def bench_all(address: str, mode: str) -> None:
        for rate in rates:
            traces, duration = asyncio.run(run_rate(address, items, rate, args))
            results.append(summarize(traces, duration, args, rate, mode))

    if args.target:
        bench_all(args.target, "remote")
    else:
        with LocalCluster(cluster_spec(args)) as cluster:
            bench_all(cluster.grpc_address, args.mode)
    print_table(results)
    if args.json:
        with args.json.open("a") as f:
            for r in results:
                f.write(json.dumps(asdict(r)) + "\n")
    return 0

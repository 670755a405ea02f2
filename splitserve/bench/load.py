"""Sending a workload to a coordinator over gRPC and recording, per request, when each token came and
the server's `Timings` for it (the latency breakdown)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.bench.workload import Item
from splitserve.v1 import serving_pb2

# The server's per-request Timings fields (serving.proto) that the breakdown reports.
TIMING_FIELDS = ("queue_ms", "prefill_ms", "kv_transfer_ms", "first_token_ms", "decode_ms", "total_ms")
# the router's estimates behind its path (Timings.routing), per request in the study's JSON: the TTFT
# estimates, and the decode worker's projected TPOT with the local prefill against the target it is
# held to (what keeps a prompt off the decode worker when its TTFT estimate there is the lower), and
# the factors a long prompt's estimates include (coordinator/ttft_calibration.py), and the gap a local
# prefill would make in the decode worker's running requests (what `--itl-stretch` holds it to)
ROUTING_FIELDS = (
    "estimated_ttft_ms", "remote_ttft_ms", "local_ttft_ms", "transfer_ms", "prefill_queue_ms",
    "local_tpot_ms", "tpot_target_ms", "local_added_ms", "remote_ttft_factor", "local_ttft_factor",
    "local_on_borrowed_cores", "local_gap_ms",
)  # fmt: skip


def path_name(path: serving_pb2.PrefillPath.ValueType) -> str:
    """`PREFILL_PATH_REMOTE` -> "remote"; "" for unspecified."""
    if path == serving_pb2.PREFILL_PATH_UNSPECIFIED:
        return ""
    return serving_pb2.PrefillPath.Name(path).removeprefix("PREFILL_PATH_").lower()


@dataclass(slots=True)
class RequestTrace:
    """One request as the client saw it (`sent`, `token_times`, perf_counter seconds) and as the
    server timed it (`timings`, milliseconds, empty when the stream never finished)."""

    kind: str
    prompt_len: int
    max_tokens: int
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    path: str = ""  # where the router had it prefilled: remote, local or colocated ("" unknown)
    routing: dict[str, float] = field(default_factory=dict)  # ROUTING_FIELDS of Timings.routing
    resumes: int = 0  # Usage.preemptions: runs after the first (their queue and prefill are summed in)
    kv_transfer_in_ttft: bool = False  # Timings.kv_transfer_in_ttft: the first token waited for D
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and len(self.token_times) > 0

    @property
    def ttft_ms(self) -> float:
        return (self.token_times[0] - self.sent) * 1e3

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first; None for a single-token output."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) * 1e3 if n > 1 else None

    @property
    def first_gap_ms(self) -> float | None:
        """Token 1 -> 2 (a remote request's hop unless its first token waited for the decode worker);
        None with fewer than two tokens, 0 when both came in one Delta (the coordinator sends what it
        has queued as one)."""
        return (self.token_times[1] - self.token_times[0]) * 1e3 if len(self.token_times) > 1 else None

    @property
    def itls_ms(self) -> list[float]:
        return [(b - a) * 1e3 for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


async def run_load(
    address: str,
    items: list[Item],
    offsets: list[float],
    *,
    timeout: float,
    on_done: Callable[[], None] | None = None,
) -> tuple[list[RequestTrace], float]:
    """Send `items[i]` at `offsets[i]` seconds after the start, all streaming, greedy, EOS ignored.
    Returns the traces (a failed request is a recorded miss, never an exception) and the wall time
    from the first send to the last finish. `on_done` is called as each request ends."""
    import grpc

    from splitserve.client import Client

    traces = [RequestTrace(it.kind, it.prompt_len, it.max_tokens) for it in items]

    async def one(trace: RequestTrace, item: Item) -> None:
        trace.sent = time.perf_counter()
        try:
            async for event in client.generate(
                item.prompt, max_tokens=item.max_tokens, ignore_eos=True, temperature=0.0, timeout=timeout
            ):
                kind = event.WhichOneof("event")
                if kind == "delta":
                    now = time.perf_counter()
                    trace.token_times.extend([now] * len(event.delta.token_ids))
                elif kind == "finished":
                    t = event.finished.timings
                    trace.timings = {name: float(getattr(t, name)) for name in TIMING_FIELDS}
                    trace.path = path_name(t.routing.path)
                    trace.routing = {name: float(getattr(t.routing, name)) for name in ROUTING_FIELDS}
                    trace.resumes = event.finished.usage.preemptions
                    trace.kv_transfer_in_ttft = t.kv_transfer_in_ttft
        except grpc.aio.AioRpcError as exc:
            trace.error = f"{exc.code().name}: {exc.details()}"
        if on_done is not None:
            on_done()

    async with Client(address) as client:
        start = time.perf_counter()
        tasks = []
        for trace, item, offset in zip(traces, items, offsets, strict=True):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival process itself, not a synchronisation wait
            tasks.append(asyncio.create_task(one(trace, item)))
        await asyncio.gather(*tasks)
        return traces, time.perf_counter() - start


async def run_sequential(address: str, items: list[Item], *, timeout: float) -> list[RequestTrace]:
    """Each item alone, one after the other (the unloaded latencies)."""
    traces: list[RequestTrace] = []
    for item in items:
        traces += (await run_load(address, [item], [0.0], timeout=timeout))[0]
    return traces

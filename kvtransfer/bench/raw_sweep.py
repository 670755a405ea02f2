"""kvbench's raw rows: every backend of a round measured side by side (`runner.raw_points`).

Each backend opens its lanes (its agents started once for the round): our push backends one
`runner.TwoSidedLane`, `ucx-get` one `get_loops.GetLane`, `nixl-raw` one `nixl_sweep.NixlLane`
per variant; `nixl-get` has no raw rows. The lanes' agents are closed when the sweep ends, failed
or not.
"""

from __future__ import annotations

import sys

from kvtransfer.bench import get_loops, nixl_sweep, runner
from kvtransfer.bench.report import PEER, Progress, Row

NO_RAW_ROWS = ("nixl-get",)  # model-shaped pulls only (nixl-raw is NIXL's raw READ)


async def _open(cfg: runner.BenchConfig, backend: str) -> list[runner.RawLane]:
    if backend == PEER:
        return await nixl_sweep.open_lanes(cfg)
    if backend == get_loops.BACKEND:
        return [await get_loops.GetLane.open(cfg, backend)]
    return [await runner.TwoSidedLane.open(cfg, backend)]


async def raw_sweep(
    cfg: runner.BenchConfig, backends: list[str], memcpy: dict[int, float], progress: Progress
) -> list[Row]:
    """The raw rows of `backends` at `cfg.sizes` x `cfg.depths`, in `backends`' order per point."""
    for backend in backends:
        if backend in NO_RAW_ROWS:
            print(
                f"{backend}: no raw rows (model-shaped pulls only; {PEER} is NIXL's raw READ)",
                file=sys.stderr,
            )
    measured = [b for b in backends if b not in NO_RAW_ROWS]
    lanes: list[runner.RawLane] = []
    try:
        for backend in measured:
            lanes += await _open(cfg, backend)
        return nixl_sweep.best_variants(await runner.raw_points(cfg, lanes, memcpy, progress))
    finally:
        await runner.close_lanes(lanes)

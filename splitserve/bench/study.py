"""The study: each deployment variant on its own fresh local cluster (or one running target), the same
workload and arrivals, unloaded baselines first, then the rate sweep; the result is one JSON-able dict.

A variant is a mode (splitserve.cluster.MODES) plus, for colocated, a chunked-prefill token budget
(the worker's `--max-num-batched-tokens`): the baseline is tuned by sweeping it, and the best budget
(highest goodput, then highest mean attainment) is marked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from splitserve.bench.load import RequestTrace, run_load, run_sequential
from splitserve.bench.metrics import (
    GOODPUT_TARGET,
    Latency,
    attainment,
    breakdown,
    goodput,
    scaled,
    summarize,
    unloaded,
)
from splitserve.bench.progress import ProgressBar
from splitserve.bench.workload import Item, arrivals
from splitserve.cluster import ClusterSpec, LocalCluster

BUDGET_FLAG = "--max-num-batched-tokens"  # the engine's per-step (chunked-prefill) token budget


@dataclass(frozen=True, slots=True)
class Variant:
    mode: str
    chunk_budget: int | None = None

    @property
    def name(self) -> str:
        return self.mode if self.chunk_budget is None else f"{self.mode}@{self.chunk_budget}"


def variants(modes: list[str], budgets: list[int]) -> list[Variant]:
    """One variant per mode; colocated once per chunk budget when budgets are given."""
    out = []
    for mode in modes:
        tuned: list[int | None] = list(budgets) if mode == "colocated" and budgets else [None]
        out += [Variant(mode, b) for b in tuned]
    return out


def variant_spec(base: ClusterSpec, v: Variant) -> ClusterSpec:
    """`base` in `v`'s mode, its worker args carrying `v`'s chunk budget; logs in a subdirectory."""
    extra = [] if v.chunk_budget is None else [BUDGET_FLAG, str(v.chunk_budget)]
    log_dir = None if base.log_dir is None else base.log_dir / v.name
    return dataclasses.replace(base, mode=v.mode, decode_args=[*base.decode_args, *extra], log_dir=log_dir)


@dataclass(slots=True)
class StudyPlan:
    """What to run: the workload, the rates, the SLO (absolute per kind, or `slo_scale` x the first
    variant's unloaded latencies) and the scales of the attainment-vs-scale curve."""

    items: list[Item]
    rates: list[float]
    seed: int
    slo: Latency
    slo_scale: float | None
    slo_scales: list[float]
    unloaded_probes: int
    request_timeout: float
    scale_rate: float


def probes(items: list[Item], per_kind: int) -> list[Item]:
    """The first `per_kind` items of each kind, in order of first appearance."""
    out: list[Item] = []
    for kind in dict.fromkeys(it.kind for it in items):
        out += [it for it in items if it.kind == kind][:per_kind]
    return out


def _request_rows(traces: list[RequestTrace]) -> list[dict[str, Any]]:
    return [
        {
            "kind": t.kind,
            "prompt_len": t.prompt_len,
            "path": t.path,
            "tokens": len(t.token_times),
            "ttft_ms": t.ttft_ms if t.ok else None,
            "tpot_ms": t.tpot_ms if t.ok else None,
            "breakdown_ms": breakdown(t),
            "error": t.error,
        }
        for t in traces
    ]


@dataclass(frozen=True, slots=True)
class Reference:
    """The first variant's unloaded latencies per kind (`base`, the SLO scale's unit) and the SLO
    every variant is held to (`slos`)."""

    base: dict[str, Latency]
    slos: dict[str, Latency]


def _unloaded(address: str, plan: StudyPlan) -> dict[str, Latency]:
    """One untimed warm-up request per kind (first-call costs), then the timed probes, one at a time."""
    warm = [Item(it.prompt, 2, it.kind) for it in probes(plan.items, 1)]
    asyncio.run(run_sequential(address, warm, timeout=plan.request_timeout))
    timed = probes(plan.items, plan.unloaded_probes)
    return unloaded(asyncio.run(run_sequential(address, timed, timeout=plan.request_timeout)))


def _row(
    v: Variant, rate: float, traces: list[RequestTrace], duration: float, ref: Reference, plan: StudyPlan
) -> dict[str, Any]:
    row: dict[str, Any] = {"variant": v.name, "mode": v.mode, "chunk_budget": v.chunk_budget, "rate": rate}
    row |= summarize(traces, duration, ref.slos)
    row["attainment_by_scale"] = {f"{s:g}": attainment(traces, scaled(ref.base, s)) for s in plan.slo_scales}
    row["requests"] = _request_rows(traces)
    return row


def _sweep(
    address: str, v: Variant, plan: StudyPlan, study: dict[str, Any], ref: Reference | None
) -> Reference:
    """Unloaded probes, then every rate, against one server; appends to `study`. The first variant
    (`ref` None) sets the reference that it returns."""
    base = _unloaded(address, plan)
    study["unloaded"][v.name] = {k: dataclasses.asdict(x) for k, x in base.items()}
    if ref is None:
        ref = Reference(base, scaled(base, plan.slo_scale) if plan.slo_scale else {k: plan.slo for k in base})
        study["slo"].update(reference=v.name, by_kind={k: dataclasses.asdict(x) for k, x in ref.slos.items()})
    for rate in plan.rates:
        bar = ProgressBar(f"{v.name} @ {rate:g} req/s", len(plan.items))
        offsets = arrivals(len(plan.items), rate, plan.seed + 1)
        traces, duration = asyncio.run(
            run_load(address, plan.items, offsets, timeout=plan.request_timeout, on_done=bar.advance)
        )
        bar.close()
        study["rows"].append(_row(v, rate, traces, duration, ref, plan))
    return ref


def _mark_best(study: dict[str, Any]) -> None:
    for v in study["variants"]:
        points = [(r["rate"], r["attainment"]) for r in study["rows"] if r["variant"] == v["name"]]
        v["goodput"] = goodput(points, GOODPUT_TARGET)
        v["mean_attainment"] = statistics.fmean(a for _, a in points) if points else 0.0
    tuned = [v for v in study["variants"] if v["mode"] == "colocated" and v["chunk_budget"] is not None]
    for v in study["variants"]:
        v["best"] = False
    if tuned:
        max(tuned, key=lambda v: (v["goodput"], v["mean_attainment"]))["best"] = True


@contextmanager
def _served(spec: ClusterSpec | None, target: str | None) -> Iterator[str]:
    """The address to load: `target`, or a fresh local cluster of `spec` for the duration."""
    if spec is None:
        assert target is not None
        yield target
        return
    with LocalCluster(spec, ready_timeout=300) as cluster:
        yield cluster.grpc_address


def run_study(
    plan: StudyPlan,
    vs: list[Variant],
    base_spec: ClusterSpec | None,
    target: str | None = None,
    say: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Run every variant (each on a fresh cluster from `base_spec`, or all against `target`) and
    return the study: slo, unloaded baselines, variants (goodput, best), one row per variant and rate."""
    study: dict[str, Any] = {
        "slo": {"scale": plan.slo_scale},
        "scale_rate": plan.scale_rate,
        "goodput_target": GOODPUT_TARGET,
        "unloaded": {},
        "variants": [{"name": v.name, "mode": v.mode, "chunk_budget": v.chunk_budget} for v in vs],
        "rows": [],
    }
    ref: Reference | None = None
    for v in vs:
        say(f"{v.name}: starting" if base_spec else f"{v.name}: against {target}")
        with _served(None if base_spec is None else variant_spec(base_spec, v), target) as address:
            ref = _sweep(address, v, plan, study, ref)
    _mark_best(study)
    return study

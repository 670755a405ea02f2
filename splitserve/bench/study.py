"""The study: each deployment variant on its own fresh local cluster (or one running target), the same
workload and arrivals, unloaded baselines first, then the rate sweep; the result is one JSON-able dict.

A variant is a mode (splitserve.cluster.MODES) plus, for colocated, a chunked-prefill token budget
(the worker's `--max-num-batched-tokens`): the baseline is tuned by sweeping it, and the best budget
(highest goodput, then highest mean attainment) is marked. A variant also names its control plane
(CurveZMQ, or plaintext under --insecure-control-plane) and, with repeats, its round: rounds
alternate the variants' order (A B, B A, ...) so that drift on a shared machine hits both alike.

Each row also carries the CPU seconds the local cluster's processes (coordinator and workers) spent
per request at that rate, read from /proc: on a busy machine a steadier cost measure than wall time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import statistics
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitserve.bench.jitter import jitter_summary, time_fixed_work
from splitserve.bench.load import RequestTrace, run_load, run_sequential
from splitserve.bench.metrics import (
    GOODPUT_TARGET,
    Latency,
    attainment,
    breakdown,
    goodput,
    scaled,
    share_within,
    summarize,
    unloaded,
)
from splitserve.bench.progress import ProgressBar
from splitserve.bench.workload import Item, arrivals
from splitserve.cluster import ClusterSpec, LocalCluster
from splitserve.heap import freeze_heap

BUDGET_FLAG = "--max-num-batched-tokens"  # the engine's per-step (chunked-prefill) token budget
CAP_FLAG = "--prefill-tokens-while-decoding"  # a decode worker's prompt tokens per step beside decodes
CAP_MS_FLAG = "--prefill-ms-while-decoding"  # the same cap in milliseconds of step time
SHORT_WHOLE_FLAG = "--short-prompts-whole"  # the caps bound long prompts' chunks only


CONTROL_PLANES = ("curve", "plain")  # plain: --insecure-control-plane
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Variant:
    mode: str
    chunk_budget: int | None = None
    control_plane: str = "curve"
    round: int = 0  # 0-based; named only when the study has several rounds
    rounds: int = 1
    compares_planes: bool = False  # the study runs both control planes: "+plain" names the plaintext one
    itl_stretch: float | None = None  # conditional's coordinator --itl-stretch (None: as the flags say)
    short_lane: int | None = None  # ClusterSpec.short_prompt_lane (None: as the flags say)
    replicas: int = 1  # colocated workers, each on its own share of the colocated CPUs when > 1

    @property
    def name(self) -> str:
        name = self.mode if self.chunk_budget is None else f"{self.mode}@{self.chunk_budget}"
        name += f"x{self.replicas}" if self.replicas > 1 else ""
        name += f"~itl{self.itl_stretch:g}" if self.itl_stretch else ""
        name += f"+lane{self.short_lane}" if self.short_lane else ""
        name += "+plain" if self.compares_planes and self.control_plane == "plain" else ""
        return name if self.rounds == 1 else f"{name}#{self.round + 1}"


def variants(
    modes: list[str],
    budgets: list[int],
    control_planes: list[str] | None = None,
    rounds: int = 1,
    itl_stretches: Sequence[float] = (),
    short_lanes: Sequence[int] = (),
    colocated_replicas: Sequence[int] = (),
) -> list[Variant]:
    """One variant per mode (colocated once per chunk budget and replica count when those are given,
    conditional once per ITL stretch when those are, the modes with prefill workers once per short
    prompt lane when those are) and control plane, `rounds` times, every other round in reverse
    order."""
    planes = control_planes or ["curve"]
    out = []
    for r in range(rounds):
        one = []
        for mode in modes:
            tuned: list[int | None] = list(budgets) if mode == "colocated" and budgets else [None]
            bounds: list[float | None] = (
                list(itl_stretches) if mode == "conditional" and itl_stretches else [None]
            )
            lanes: list[int | None] = list(short_lanes) if mode != "colocated" and short_lanes else [None]
            copies = list(colocated_replicas) if mode == "colocated" and colocated_replicas else [1]
            for plane in planes:
                one += [
                    Variant(mode, b, plane, r, rounds, len(set(planes)) > 1, x, lane, n)
                    for b in tuned
                    for n in copies
                    for x in bounds
                    for lane in lanes
                ]
        out += one if r % 2 == 0 else one[::-1]
    return out


def variant_spec(base: ClusterSpec, v: Variant, decode_caps: Sequence[str] = ()) -> ClusterSpec:
    """`base` in `v`'s mode and control plane, its worker args carrying `v`'s chunk budget (colocated)
    or `decode_caps` (the decode workers' flags in the other modes), its coordinator args `v`'s ITL
    stretch (after the base's: the last flag wins), its prefill pool `v`'s short prompt lane (none
    in colocated mode); `v`'s colocated replicas each on its own equal share of the colocated CPUs
    with a torch thread per CPU of it (ValueError when they do not divide); logs in a
    subdirectory."""
    extra = [] if v.chunk_budget is None else [BUDGET_FLAG, str(v.chunk_budget)]
    if v.mode != "colocated":
        extra += decode_caps
    stretch = [] if v.itl_stretch is None else ["--itl-stretch", f"{v.itl_stretch:g}"]
    log_dir = None if base.log_dir is None else base.log_dir / v.name
    lane = base.short_prompt_lane if v.short_lane is None else v.short_lane
    spec = dataclasses.replace(
        base,
        mode=v.mode,
        coordinator_args=[*base.coordinator_args, *stretch],
        decode_args=[*base.decode_args, *extra],
        log_dir=log_dir,
        insecure_control_plane=v.control_plane == "plain",
        short_prompt_lane=0 if v.mode == "colocated" else lane,
    )
    if v.replicas == 1:
        return spec
    threads = {**base.threads, "colocated": replica_share(base.cpus, v.replicas)}
    return dataclasses.replace(spec, decode_workers=v.replicas, split_pins=True, threads=threads)


def replica_share(cpus: dict[str, tuple[int, ...]], replicas: int) -> int:
    """The CPUs each of `replicas` colocated workers gets of the colocated set `cpus` pins; ValueError
    (saying what to fix) when it is not pinned or does not divide."""
    pinned = cpus.get("colocated", ())
    if not pinned or len(pinned) % replicas:
        raise ValueError(
            f"{replicas} colocated replicas need --pin colocated=CPUS with a multiple of {replicas} CPUs "
            f"(each replica gets its own share), got {list(pinned) or 'none'}"
        )
    return len(pinned) // replicas


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes `pids` have used so far (Linux /proc)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / TICKS_PER_S


@dataclass(slots=True)
class StudyPlan:
    """What to run: the workload, the rates, the SLO (absolute per kind, or `slo_scale` x the first
    variant's unloaded latencies) and the scales of the attainment-vs-scale curve.

    `items` feeds the warm-up and the unloaded probes; `rate_items[i]` is what rate `i` sends, the
    same for every variant. Synthetic workloads draw each from its own seed, so no rate finds its
    prompts in the prefix cache that an earlier rate or the probes filled (a 1,024-token document
    sent twice costs its prefill once)."""

    items: list[Item]
    rate_items: list[list[Item]]
    rates: list[float]
    seed: int
    slo: Latency
    slo_scale: float | None
    slo_scales: list[float]
    unloaded_probes: int
    request_timeout: float
    scale_rate: float
    decode_caps: list[str] = field(default_factory=list)  # the decode workers' caps (not colocated's)
    tpot_slo_multiples: list[float] = field(default_factory=list)  # mark_strict_tpot's
    host_jitter_samples: int = 0  # fixed-work runs on each local cluster's decode CPUs (0: none)


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
            "first_gap_ms": t.first_gap_ms if t.ok else None,
            "kv_transfer_in_ttft": t.kv_transfer_in_ttft,
            "breakdown_ms": breakdown(t),
            "routing_ms": t.routing,
            "error": t.error,
            "sent_s": t.sent,  # perf_counter seconds: the requests of one row share the clock
            "token_ms": [round((x - t.sent) * 1e3, 2) for x in t.token_times],  # each token's arrival
        }
        for t in traces
    ]


@dataclass(frozen=True, slots=True)
class Reference:
    """The first variant's unloaded latencies per kind (`base`, the SLO scale's unit) and the SLO
    every variant is held to (`slos`)."""

    base: dict[str, Latency]
    slos: dict[str, Latency]


def warm_up_items(items: list[Item]) -> list[Item]:
    """One untimed request per kind, of its first probe's shape but with its prompt reversed, so
    that no probe finds its prefix cached by the warm-up (the same prompt made the first probe of
    each kind a prefix-cache hit, and the unloaded document TTFT came out about half the real one)."""
    return [Item(it.prompt[::-1], 2, it.kind) for it in probes(items, 1)]


def _unloaded(address: str, plan: StudyPlan) -> dict[str, Latency]:
    """The warm-up (first-call costs), then the timed probes, one at a time."""
    warm = warm_up_items(plan.items)
    asyncio.run(run_sequential(address, warm, timeout=plan.request_timeout))
    timed = probes(plan.items, plan.unloaded_probes)
    return unloaded(asyncio.run(run_sequential(address, timed, timeout=plan.request_timeout)))


def _row(
    v: Variant, rate: float, traces: list[RequestTrace], duration: float, ref: Reference, plan: StudyPlan
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "variant": v.name,
        "mode": v.mode,
        "chunk_budget": v.chunk_budget,
        "control_plane": v.control_plane,
        "itl_stretch": v.itl_stretch,
        "short_lane": v.short_lane,
        "round": v.round,
        "rate": rate,
    }
    row |= summarize(traces, duration, ref.slos)
    row["attainment_by_scale"] = {f"{s:g}": attainment(traces, scaled(ref.base, s)) for s in plan.slo_scales}
    row["requests"] = _request_rows(traces)
    return row


def _sweep(
    served: Served, v: Variant, plan: StudyPlan, study: dict[str, Any], ref: Reference | None
) -> Reference:
    """Unloaded probes, then every rate, against one server; appends to `study`. The first variant
    (`ref` None) sets the reference that it returns."""
    address = served.address
    base = _unloaded(address, plan)
    study["unloaded"][v.name] = {k: dataclasses.asdict(x) for k, x in base.items()}
    if ref is None:
        ref = Reference(base, scaled(base, plan.slo_scale) if plan.slo_scale else {k: plan.slo for k in base})
        study["slo"].update(reference=v.name, by_kind={k: dataclasses.asdict(x) for k, x in ref.slos.items()})
    for rate, items in zip(plan.rates, plan.rate_items, strict=True):
        bar = ProgressBar(f"{v.name} @ {rate:g} req/s", len(items))
        offsets = arrivals(len(items), rate, plan.seed + 1)
        cpu0 = cpu_seconds(served.pids)
        freeze_heap()  # no full collection walks the earlier rates' traces while this one is timed
        traces, duration = asyncio.run(
            run_load(address, items, offsets, timeout=plan.request_timeout, on_done=bar.advance)
        )
        cpu = cpu_seconds(served.pids) - cpu0
        bar.close()
        row = _row(v, rate, traces, duration, ref, plan)
        row["cluster_cpu_ms_per_request"] = cpu / len(traces) * 1e3 if served.pids else None
        study["rows"].append(row)
    return ref


def mark_itl_stretch(study: dict[str, Any]) -> None:
    """Issue 12's decode target as the study reads it: each row's ITL p99 over `unloaded_decode_ms`,
    the fastest unloaded TPOT of the sitting (any variant, any kind). One reference for every
    variant: each variant's own two probes ranged 9.2-13.6 ms in one sitting (session 36), and a
    slow probe flattered its variant's ratio."""
    tpots = [
        kind["tpot_ms"]
        for base in study["unloaded"].values()
        for kind in base.values()
        if kind["tpot_ms"] > 0
    ]
    if not tpots:
        return
    reference = study["unloaded_decode_ms"] = min(tpots)
    for row in study["rows"]:
        row["itl_p99_x_unloaded"] = row["itl_ms"]["p99"] / reference


def mark_strict_tpot(study: dict[str, Any], multiples: Sequence[float]) -> None:
    """Goodput under TPOT SLOs of `multiples` x `unloaded_decode_ms`, each kind's TTFT SLO as the
    study's: issue 12's "strict TPOT SLO" on any host. A fixed 80 ms was about 2x unloaded decode
    where the issue was filed and 8.8x on a host that decodes in 9 ms (session 37). Read from the
    rows' requests after the sweep, as the reference is the whole sitting's; the router and the
    workers ran under the study's own SLO. Per multiple (keyed "2", "3", ...): each row's
    `attainment_by_tpot_x`, each variant's `goodput_by_tpot_x`, and in `best_by_tpot_x` the
    colocated budget with the highest goodput under it (the baseline is tuned per SLO)."""
    reference = study.get("unloaded_decode_ms")
    if not multiples or reference is None:
        return
    targets = {f"{k:g}": k * reference for k in multiples}
    study["tpot_slo_multiples"] = targets
    by_kind = study["slo"]["by_kind"]
    for row in study["rows"]:
        row["attainment_by_tpot_x"] = {
            key: share_within(
                [(q["kind"], q["ttft_ms"], q["tpot_ms"]) for q in row["requests"]],
                {kind: Latency(slo["ttft_ms"], tpot) for kind, slo in by_kind.items()},
            )
            for key, tpot in targets.items()
        }
    study["best_by_tpot_x"] = {}
    for key in targets:
        for v in study["variants"]:
            points = [
                (r["rate"], r["attainment_by_tpot_x"][key])
                for r in study["rows"]
                if r["variant"] == v["name"]
            ]
            v.setdefault("goodput_by_tpot_x", {})[key] = goodput(points, GOODPUT_TARGET)
            v.setdefault("mean_attainment_by_tpot_x", {})[key] = _mean(a for _, a in points)
        best = _best_tuned(study["variants"], _ranked_under(key))
        if best is not None:
            study["best_by_tpot_x"][key] = best["name"]


def _mark_best(study: dict[str, Any]) -> None:
    for v in study["variants"]:
        points = [(r["rate"], r["attainment"]) for r in study["rows"] if r["variant"] == v["name"]]
        v["goodput"] = goodput(points, GOODPUT_TARGET)
        v["mean_attainment"] = _mean(a for _, a in points)
    for v in study["variants"]:
        v["best"] = False
    best = _best_tuned(study["variants"], lambda v: (v["goodput"], v["mean_attainment"]))
    if best is not None:
        best["best"] = True


def _best_tuned(
    vs: list[dict[str, Any]], rank: Callable[[dict[str, Any]], tuple[float, float]]
) -> dict[str, Any] | None:
    """The colocated variant with a chunk budget (of any replica count) that ranks highest, or None
    without one."""
    tuned = [v for v in vs if v["mode"] == "colocated" and v["chunk_budget"] is not None]
    return max(tuned, key=rank) if tuned else None


def _ranked_under(key: str) -> Callable[[dict[str, Any]], tuple[float, float]]:
    """A variant's rank under the TPOT SLO `key` of mark_strict_tpot: goodput, then mean attainment."""
    return lambda v: (v["goodput_by_tpot_x"][key], v["mean_attainment_by_tpot_x"][key])


def _mean(shares: Iterable[float]) -> float:
    values = list(shares)
    return statistics.fmean(values) if values else 0.0


@dataclass(frozen=True, slots=True)
class Served:
    """The server a variant loads: its gRPC address and, for a local cluster, its processes' pids and
    the CPUs its decode role is pinned to (None: not pinned)."""

    address: str
    pids: list[int]
    decode_cpus: tuple[int, ...] | None = None


@contextmanager
def _served(spec: ClusterSpec | None, target: str | None) -> Iterator[Served]:
    """`target`, or a fresh local cluster of `spec` for the duration."""
    if spec is None:
        assert target is not None
        yield Served(target, [])
        return
    with LocalCluster(spec, ready_timeout=300) as cluster:
        decode_cpus = spec.cpus.get("colocated" if spec.mode == "colocated" else "decode")
        yield Served(cluster.grpc_address, [p.proc.pid for p in cluster.processes], decode_cpus)


def _host_jitter(served: Served, v: Variant, plan: StudyPlan, study: dict[str, Any]) -> list[float]:
    """Identical work timed on `served`'s decode CPUs while its cluster idles (splitserve.bench.jitter):
    recorded per variant in `study["host_jitter"]["by_variant"]`; returns the times for the pool."""
    run = time_fixed_work(plan.host_jitter_samples, served.decode_cpus)
    by_variant = study.setdefault("host_jitter", {"by_variant": {}})["by_variant"]
    by_variant[v.name] = {**jitter_summary(run.times_ms), "cpus": run.cpus}
    return run.times_ms


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
        "variants": [
            {
                "name": v.name,
                "mode": v.mode,
                "chunk_budget": v.chunk_budget,
                "control_plane": v.control_plane,
                "itl_stretch": v.itl_stretch,
                "short_lane": v.short_lane,
                "replicas": v.replicas,
            }
            for v in vs
        ],
        "rows": [],
    }
    ref: Reference | None = None
    jitter: list[float] = []
    for v in vs:
        say(f"{v.name}: starting" if base_spec else f"{v.name}: against {target}")
        with _served(
            None if base_spec is None else variant_spec(base_spec, v, plan.decode_caps), target
        ) as served:
            if plan.host_jitter_samples and served.pids:
                jitter += _host_jitter(served, v, plan, study)
            ref = _sweep(served, v, plan, study, ref)
    if jitter:
        study["host_jitter"] |= jitter_summary(jitter)
    _mark_best(study)
    mark_itl_stretch(study)
    mark_strict_tpot(study, plan.tpot_slo_multiples)
    return study


def decode_caps(tokens: int, ms: float, short_prompts_whole: bool = False) -> list[str]:
    """The decode workers' flags for the local-prefill caps (0: that cap off), and whether they bound
    long prompts' chunks only."""
    caps = [*([CAP_FLAG, str(tokens)] if tokens else []), *([CAP_MS_FLAG, f"{ms:g}"] if ms else [])]
    return [*caps, *([SHORT_WHOLE_FLAG] if short_prompts_whole else [])]

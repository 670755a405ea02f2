"""`splitserve bench`: the serving study, against a running server or local clusters it launches.

Each deployment variant (`--modes`, colocated once per `--prefill-chunk-budgets` entry) gets a fresh
local cluster and the same seeded workload (`--mix`, `--dataset`, or one jittered shape) with the same
Poisson arrivals at each `--rates` entry. Before its sweep every variant is probed unloaded (a few
requests of each kind, one at a time), after its decode CPUs time identical work
(`--host-jitter-samples`: the host's own p99/p50, splitserve.bench.jitter). Per request we record
each token's arrival and the server's Timings; per (variant, rate) row:

- TTFT (first token - send), TPOT ((last - first) / (tokens - 1)), ITL (every gap, pooled);
- the mean latency breakdown: queue, prefill, KV transfer, other, first token, decode;
- SLO attainment: the share of requests that finished within the TTFT and TPOT SLO of their kind
  (`--slo-ttft-ms/--slo-tpot-ms`, or `--slo-scale` x the first variant's unloaded latencies), and the
  same at every `--slo-scales` entry;
- per variant, goodput: the highest swept rate with >= 90% attainment (all lower rates too), and
  with `--tpot-slo-multiples` the same under each TPOT SLO of that many times the sitting's unloaded
  decode (TTFT SLO unchanged), against the colocated budget tuned best for it.

`--json` writes the whole study, `--plots DIR` attainment vs rate and vs SLO scale (PNG). `--busy N`
runs N busy loops beside the whole study (probes included; on the `--busy-pin` CPUs, else on the
bench's own), as a serving host runs other work; the JSON records both (`workload.busy`,
`workload.busy_pin`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from coordinator.routing_policy import (
    FIRST_TOKEN_FROM,
    ITL_STRETCH_RULE,
    TPOT_GUARDS,
    valid_itl_stretch,
)
from kvtransfer.bench.busy import BusyLoops
from splitserve.argtypes import checked, csv_of, non_negative, non_negative_float, positive
from splitserve.bench.host import host_info
from splitserve.bench.metrics import GOODPUT_TARGET, Latency
from splitserve.bench.study import (
    CONTROL_PLANES,
    StudyPlan,
    decode_caps,
    replica_share,
    run_study,
    variants,
)
from splitserve.bench.workload import MIXES, Item, from_jsonl, jittered, mixed, parse_mix
from splitserve.cluster import MODES
from splitserve.placement import parse_cpu_set
from splitserve.serve import add_cluster_arguments, cluster_spec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--target", default=None, help="a running coordinator; default: launch a local cluster per variant")
    add_cluster_arguments(parser)
    a(
        "--modes",
        type=csv_of(str, f"a mode ({', '.join(MODES)})", lambda m: m in MODES),
        default=None,
        help=f"comma-separated modes, each on its own fresh cluster (default: --mode); of {', '.join(MODES)}",
    )
    a(
        "--prefill-chunk-budgets",
        type=csv_of(int, "a positive token count", lambda n: n > 0),
        default=[],
        help="colocated only: one variant per per-step token budget (e.g. 128,256,512); the best is marked",
    )
    a(
        "--colocated-replicas",
        type=csv_of(int, "a replica count >= 1", lambda n: n >= 1),
        default=[],
        help="colocated only: one variant per count of colocated workers (e.g. 1,2), each on its own "
        "equal share of --pin colocated=CPUS with a torch thread per CPU of it (2 on 0-1: a one-thread "
        "replica per core, as P and D are placed)",
    )
    a(
        "--itl-stretches",
        type=csv_of(float, ITL_STRETCH_RULE, valid_itl_stretch),
        default=[],
        help="conditional only: one variant per coordinator --itl-stretch (e.g. 0,1.5: its two "
        "operating points side by side; default: one variant, --router-itl-stretch or the coordinator's)",
    )
    a(
        "--short-prompt-lanes",
        type=csv_of(int, "a token count >= 0 (0: no lane)", lambda n: n >= 0),
        default=[],
        help="disaggregated and conditional: one variant per --short-prompt-lane (e.g. 0,256: the "
        "prefill pool without and with a short prompt lane, side by side)",
    )
    a(
        "--control-planes",
        type=csv_of(str, f"a control plane ({', '.join(CONTROL_PLANES)})", lambda c: c in CONTROL_PLANES),
        default=None,
        help="curve,plain: each variant with CurveZMQ and with --insecure-control-plane (its cost, side "
        "by side; default: as --insecure-control-plane says)",
    )
    a(
        "--rounds",
        type=positive,
        default=1,
        help="run the variants this many times, every other round in reverse order (A B B A ...)",
    )
    a(
        "--rates",
        type=csv_of(float, "a rate (req/s, >= 0)", lambda r: r >= 0),
        default=[1.0, 2.0, 4.0],
        help="comma-separated Poisson request rates (req/s); 0 = all at once",
    )
    a("--num-requests", type=positive, default=32)
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--mix",
        type=checked(parse_mix),
        default=None,
        help=f"a named mix ({', '.join(MIXES)}) or SHARE:INxOUT,... (0.25:1024x16,0.75:64x64)",
    )
    source.add_argument(
        "--dataset", type=Path, default=None, help="JSONL with prompt|token_ids [, max_tokens, kind]"
    )
    a("--input-len", type=int, default=128, help="without --mix/--dataset: prompt tokens")
    a("--output-len", type=int, default=32, help="without --mix/--dataset: output tokens")
    a(
        "--len-jitter",
        type=float,
        default=0.5,
        help="without --mix/--dataset: lengths uniform in len*(1±jitter)",
    )
    a("--seed", type=int, default=0)
    a("--slo-ttft-ms", type=float, default=2000.0, help="absolute TTFT SLO (without --slo-scale)")
    a("--slo-tpot-ms", type=float, default=200.0, help="absolute TPOT SLO (without --slo-scale)")
    a(
        "--slo-scale",
        type=float,
        default=None,
        help="SLO = this x the unloaded TTFT/TPOT of each request kind (measured on the first variant)",
    )
    a(
        "--slo-scales",
        type=csv_of(float, "a positive scale", lambda s: s > 0),
        default=[0.5, 1.0, 2.0, 4.0, 8.0],
        help="scales of the attainment-vs-SLO-scale curve",
    )
    a(
        "--tpot-slo-multiples",
        type=csv_of(float, "a positive multiple", lambda s: s > 0),
        default=[],
        help="goodput also under a TPOT SLO of each multiple x the sitting's unloaded decode (the "
        "fastest unloaded TPOT of any variant), each kind's TTFT SLO unchanged: a strict TPOT SLO that "
        "scales with the host (e.g. 2,3)",
    )
    a(
        "--scale-rate",
        type=float,
        default=None,
        help="rate of the attainment-vs-scale plot (default: the highest)",
    )
    a(
        "--router-tpot-slo-ms",
        type=non_negative_float,
        default=None,
        help="the coordinator's --tpot-slo-ms (conditional: local prefill only within it; default: the "
        "absolute --slo-tpot-ms, 0 under --slo-scale; 0 = off)",
    )
    a(
        "--router-ttft-slo-ms",
        type=non_negative_float,
        default=None,
        help="the coordinator's --ttft-slo-ms (conditional: a long prompt prefills on a decode worker "
        "only when a prefill worker would miss it; default: the absolute --slo-ttft-ms, 0 under "
        "--slo-scale; 0 = off)",
    )
    a(
        "--router-local-first-ttft-ms",
        type=non_negative_float,
        default=None,
        help="the coordinator's --local-first-ttft-ms (conditional: prefill on the decode worker "
        "whenever its estimate is within it; default: the coordinator's, 0 = off)",
    )
    a(
        "--router-itl-stretch",
        type=checked(itl_stretch),
        default=None,
        help="the coordinator's --itl-stretch (conditional: prefill on a decode worker that is decoding "
        "only while the step carrying the prompt stays within this multiple of its decode step; "
        "default: the coordinator's, 0 = off)",
    )
    a(
        "--router-local-prefill-max-tokens",
        type=non_negative,
        default=None,
        help="the coordinator's --local-prefill-max-tokens (conditional: the longest uncached prompt "
        "a decode worker may prefill itself; default: the coordinator's)",
    )
    a(
        "--router-tpot-guard",
        choices=TPOT_GUARDS,
        default=None,
        help="the coordinator's --tpot-guard (default: the coordinator's)",
    )
    a(
        "--first-token-from",
        choices=FIRST_TOKEN_FROM,
        default=None,
        help="the coordinator's --first-token-from: a shipped request's first token streams when D "
        "starts on it (decode) or when P samples it (prefill) (default: the coordinator's)",
    )
    a(
        "--prefill-tokens-while-decoding",
        type=non_negative,
        default=0,
        help="the decode workers' (disaggregated, conditional) cap on prompt tokens per step beside "
        "running decodes: bounds their ITL while they prefill locally (0: none)",
    )
    a(
        "--prefill-ms-while-decoding",
        type=non_negative_float,
        default=0.0,
        help="the same cap in step time: the prompt tokens that many ms buy at each decode worker's "
        "measured cost of a prompt token beside decodes (0: none; with both, the lower cap)",
    )
    a(
        "--short-prompts-whole",
        action="store_true",
        help="the decode workers' --short-prompts-whole: their caps beside decodes bound long prompts' "
        "chunks only, a short prompt (by their --long-prefill-token-threshold) runs whole",
    )
    a("--unloaded-probes", type=positive, default=2, help="unloaded requests per kind before each sweep")
    a(
        "--host-jitter-samples",
        type=non_negative,
        default=500,
        help="before each local cluster's probes, time the same few-ms loop this many times on its "
        "decode CPUs: the ITL p99/p50 identical work shows on this host (0: skip)",
    )
    a(
        "--busy",
        type=non_negative,
        default=0,
        help="busy-loop processes running beside the whole study, probes included (0: none)",
    )
    a(
        "--busy-pin",
        type=checked(parse_cpu_set),
        default=None,
        help="the CPU set the busy loops run on (default: the CPUs the bench itself may use)",
    )
    a("--request-timeout", type=float, default=300.0)
    a("--json", type=Path, default=None, help="write the whole study (JSON) here")
    a(
        "--plots",
        type=Path,
        default=None,
        help="write attainment-vs-rate.png and attainment-vs-slo-scale.png here",
    )


def itl_stretch(text: str) -> float:
    """`--router-itl-stretch`: a number the coordinator's --itl-stretch takes (ITL_STRETCH_RULE)."""
    try:
        stretch = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not valid_itl_stretch(stretch):
        raise ValueError(f"{text} is not {ITL_STRETCH_RULE}")
    return stretch


def router_targets(args: argparse.Namespace) -> Latency:
    """The router's TTFT and TPOT targets: `--router-ttft/tpot-slo-ms`, else the absolute SLO (0, off,
    under `--slo-scale`, whose SLO differs per request kind)."""

    def target(given: float | None, slo_ms: float) -> float:
        if given is not None:
            return given
        return 0.0 if args.slo_scale else slo_ms

    return Latency(
        target(args.router_ttft_slo_ms, args.slo_ttft_ms), target(args.router_tpot_slo_ms, args.slo_tpot_ms)
    )


def router_args(args: argparse.Namespace, targets: Latency) -> list[str]:
    """The coordinator flags that the `--router-*` and `--first-token-from` flags set (those unset
    keep the coordinator's defaults; the TTFT and TPOT targets are always given)."""
    out = ["--ttft-slo-ms", f"{targets.ttft_ms:g}", "--tpot-slo-ms", f"{targets.tpot_ms:g}"]
    if args.router_tpot_guard:
        out += ["--tpot-guard", args.router_tpot_guard]
    if args.router_local_first_ttft_ms is not None:
        out += ["--local-first-ttft-ms", f"{args.router_local_first_ttft_ms:g}"]
    if args.router_local_prefill_max_tokens is not None:
        out += ["--local-prefill-max-tokens", str(args.router_local_prefill_max_tokens)]
    if args.router_itl_stretch is not None:
        out += ["--itl-stretch", f"{args.router_itl_stretch:g}"]
    if args.first_token_from:
        out += ["--first-token-from", args.first_token_from]
    return out


def _workloads(args: argparse.Namespace) -> list[list[Item]]:
    """The probes' workload, then one per rate. A `--dataset` is the same rows every time (its
    repeats may hit the prefix cache); a synthetic workload is drawn afresh for each, from
    `--seed` + its index, so every variant still gets the same requests at each rate."""
    count = 1 + len(args.rates)
    if args.dataset:
        return [from_jsonl(args.dataset, args.num_requests, args.output_len)] * count
    from engine.loader import load_tokenizer
    from engine.model_dir import resolve_model_dir

    vocab = len(load_tokenizer(resolve_model_dir(args.model)))
    if args.mix:
        return [mixed(args.mix, args.num_requests, vocab, args.seed + i) for i in range(count)]
    return [
        jittered(args.num_requests, args.input_len, args.output_len, args.len_jitter, vocab, args.seed + i)
        for i in range(count)
    ]


def _usage_error(args: argparse.Namespace) -> str:
    """A cross-flag mistake argparse cannot see, or ''."""
    modes = args.modes or [args.mode]
    if args.prefill_chunk_budgets and "colocated" not in modes:
        return "--prefill-chunk-budgets tunes the colocated baseline: add colocated to --modes"
    if args.colocated_replicas and "colocated" not in modes:
        return "--colocated-replicas sets the colocated baseline: add colocated to --modes"
    if args.colocated_replicas and args.target:
        return "--colocated-replicas starts local clusters: drop --target"
    for n in (n for n in args.colocated_replicas if n > 1):
        try:
            replica_share(args.pin, n)
        except ValueError as exc:
            return str(exc)
    if args.itl_stretches and "conditional" not in modes:
        return "--itl-stretches sets conditional's router: add conditional to --modes"
    if args.itl_stretches and args.router_itl_stretch is not None:
        return "--itl-stretches and --router-itl-stretch both set the bound: give one"
    if args.short_prompt_lanes and not {"disaggregated", "conditional"} & set(modes):
        return "--short-prompt-lanes sets a prefill pool: add disaggregated or conditional to --modes"
    if args.short_prompt_lanes and args.short_prompt_lane:
        return "--short-prompt-lanes and --short-prompt-lane both set the lane: give one"
    if args.target and (args.control_planes or args.short_prompt_lanes or args.rounds > 1):
        return "--control-planes, --short-prompt-lanes and --rounds start local clusters: drop --target"
    if args.scale_rate is not None and args.scale_rate not in args.rates:
        return f"--scale-rate {args.scale_rate:g} is not one of --rates"
    if args.target and args.modes and len(args.modes) > 1:
        return "--target is one running server: several --modes need local clusters (drop --target)"
    if args.short_prompts_whole and not args.long_prefill_token_threshold.get("decode"):
        return "--short-prompts-whole needs the decode workers' threshold: add --long-prefill-token-threshold"
    return ""


def run(args: argparse.Namespace) -> int:
    error = _usage_error(args)
    if error:
        print(f"splitserve bench: error: {error}", file=sys.stderr)
        return 2
    from splitserve.bench.plots import plot_study
    from splitserve.bench.report import render
    from splitserve.launch import say

    probe_items, *rate_items = _workloads(args)
    plan = StudyPlan(
        items=probe_items,
        rate_items=rate_items,
        rates=args.rates,
        seed=args.seed,
        slo=Latency(args.slo_ttft_ms, args.slo_tpot_ms),
        slo_scale=args.slo_scale,
        slo_scales=args.slo_scales,
        tpot_slo_multiples=args.tpot_slo_multiples,
        unloaded_probes=args.unloaded_probes,
        host_jitter_samples=args.host_jitter_samples,
        request_timeout=args.request_timeout,
        scale_rate=args.scale_rate if args.scale_rate is not None else max(args.rates),
        decode_caps=decode_caps(
            args.prefill_tokens_while_decoding, args.prefill_ms_while_decoding, args.short_prompts_whole
        ),
    )
    planes = args.control_planes or ["plain" if args.insecure_control_plane else "curve"]
    modes = ["remote"] if args.target else (args.modes or [args.mode])
    vs = variants(
        modes,
        args.prefill_chunk_budgets,
        planes,
        args.rounds,
        args.itl_stretches,
        args.short_prompt_lanes,
        args.colocated_replicas,
    )
    targets = router_targets(args)
    spec = None
    if not args.target:
        spec = cluster_spec(args)
        spec.coordinator_args = [*spec.coordinator_args, *router_args(args, targets)]
    with BusyLoops(args.busy, args.busy_pin) as busy:
        if busy.pids:
            where = "on the bench's CPUs" if args.busy_pin is None else f"on CPUs {list(args.busy_pin)}"
            say(f"{args.busy} busy loop(s) beside the study, {where}: pids {busy.pids}")
        study = run_study(plan, vs, spec, args.target, say=say)
    study["workload"] = {
        "num_requests": len(plan.items),
        "kinds": {
            k: sum(1 for it in plan.items if it.kind == k)
            for k in dict.fromkeys(it.kind for it in plan.items)
        },
        "seed": args.seed,
        "rates": args.rates,
        "pin": {k: list(v) for k, v in args.pin.items()},
        "threads": args.threads,
        "share_idle_cores": args.share_idle_cores,
        "short_prompt_lane": args.short_prompt_lane,
        "colocated_replicas": args.colocated_replicas,
        "router_ttft_slo_ms": None if args.target else targets.ttft_ms,
        "router_tpot_slo_ms": None if args.target else targets.tpot_ms,
        "router_tpot_guard": args.router_tpot_guard,
        "router_local_first_ttft_ms": args.router_local_first_ttft_ms,
        "router_local_prefill_max_tokens": args.router_local_prefill_max_tokens,
        "router_itl_stretch": args.router_itl_stretch,
        "first_token_from": args.first_token_from,
        "prefill_tokens_while_decoding": args.prefill_tokens_while_decoding,
        "prefill_ms_while_decoding": args.prefill_ms_while_decoding,
        "short_prompts_whole": args.short_prompts_whole,
        "busy": args.busy,
        "busy_pin": None if args.busy_pin is None else list(args.busy_pin),
        "long_prefill_token_threshold": args.long_prefill_token_threshold,
        "dtype": None if args.target else args.dtype,
        "transfer_backend": None if args.target else args.transfer_backend,
        "host": host_info(),
    }
    print(render(study))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(study, indent=1) + "\n")
    if args.plots:
        for path in plot_study(study, args.plots, GOODPUT_TARGET):
            say(f"plot: {path}")
    return 0

"""`splitserve bench` without servers: workload mixes and arrivals, SLO scale, goodput, flags."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from splitserve import bench
from splitserve.bench.host import host_info
from splitserve.bench.jitter import jitter_summary, time_fixed_work
from splitserve.bench.load import RequestTrace
from splitserve.bench.metrics import Latency, attainment, breakdown, goodput, scaled, summarize, unloaded
from splitserve.bench.report import render
from splitserve.bench.study import (
    BUDGET_FLAG,
    CAP_FLAG,
    CAP_MS_FLAG,
    Variant,
    decode_caps,
    mark_itl_stretch,
    mark_strict_tpot,
    probes,
    variant_spec,
    variants,
    warm_up_items,
)
from splitserve.bench.workload import MIXES, arrivals, mixed, parse_mix
from splitserve.cli import build_parser
from splitserve.cluster import ClusterSpec
from splitserve.placement import parse_long_prefill_thresholds, parse_pins, parse_threads


def trace(kind: str, ttft_ms: float, tpot_ms: float, tokens: int = 3) -> RequestTrace:
    t = RequestTrace(kind, 8, tokens, sent=0.0)
    first = ttft_ms / 1e3
    t.token_times = [first + i * tpot_ms / 1e3 for i in range(tokens)]
    return t


def pairs(latencies: dict[str, Latency]) -> dict[str, float]:
    """Flat {"kind.ttft": ms, "kind.tpot": ms} for pytest.approx."""
    return {f"{k}.{f}": getattr(v, f"{f}_ms") for k, v in latencies.items() for f in ("ttft", "tpot")}


def test_other_is_left_out_for_a_resumed_request() -> None:
    """A resumed request's queue and prefill sum every run, the later ones after its first token:
    `other` (first token - queue - prefill) would go negative, so it is not computed for it."""
    timed = {"queue_ms": 40.0, "prefill_ms": 30.0, "kv_transfer_ms": 1.0, "first_token_ms": 100.0}
    timed |= {"decode_ms": 50.0, "total_ms": 150.0}
    plain, resumed = trace("chat", 100.0, 25.0), trace("chat", 100.0, 25.0)
    plain.timings = dict(timed)
    resumed.timings = timed | {"queue_ms": 90.0, "prefill_ms": 60.0}  # a second run after token 1
    resumed.resumes = 1
    assert breakdown(plain)["other_ms"] == pytest.approx(30.0)
    assert "other_ms" not in breakdown(resumed) and breakdown(resumed)["queue_ms"] == 90.0
    row = summarize([plain, resumed], 1.0, {"chat": Latency(1e3, 1e3)})
    assert row["breakdown_ms"]["other_ms"] == pytest.approx(30.0)  # the never-resumed request only
    assert row["breakdown_ms"]["queue_ms"] == pytest.approx(65.0) and row["resumed"] == 1


def test_first_gaps_are_reported_apart_from_the_rest() -> None:
    # a remote request's first gap holds the hop: the row splits it from the later gaps
    hop, steady = trace("chat", 50.0, 20.0, tokens=4), trace("chat", 50.0, 20.0, tokens=4)
    hop.token_times[1:] = [x + 0.1 for x in hop.token_times[1:]]  # token 2 came 100 ms late
    row = summarize([hop, steady], 1.0, {"chat": Latency(1e3, 1e3)})
    assert row["first_itl_ms"]["p99"] == pytest.approx(120.0, abs=1.0)
    assert row["first_itl_ms"]["p50"] == pytest.approx(20.0)
    assert row["later_itl_ms"]["p99"] == pytest.approx(20.0)
    assert row["itl_ms"]["p99"] == pytest.approx(row["first_itl_ms"]["p99"])


def test_docs_chats_mix_has_exact_shares_and_is_seeded() -> None:
    items = mixed(MIXES["docs-chats"], 40, vocab=100, seed=3)
    assert sum(1 for it in items if it.kind == "doc") == 10
    assert {(it.prompt_len, it.max_tokens) for it in items} == {(1024, 16), (64, 64)}
    assert items == mixed(MIXES["docs-chats"], 40, vocab=100, seed=3)
    small = mixed(parse_mix("0.25:16x2,0.75:4x4"), 4, vocab=100, seed=0)
    assert sorted(it.kind for it in small) == ["16x2", "4x4", "4x4", "4x4"]  # a 4-request run keeps a doc


def test_the_warm_up_shares_no_prefix_block_with_the_probes() -> None:
    """The warm-up once sent each kind's first probe itself, which the probe then found cached."""
    items = mixed(MIXES["docs-chats"], 48, vocab=49_000, seed=0)
    warm = warm_up_items(items)
    assert [(w.kind, w.prompt_len, w.max_tokens) for w in warm] == [
        (it.kind, it.prompt_len, 2) for it in probes(items, 1)
    ]
    for w in warm:
        for probe in probes(items, 2):
            assert w.prompt[:16] != probe.prompt[:16]  # not even the first 16-token KV block


def test_poisson_arrivals_are_seeded_and_increasing() -> None:
    a = arrivals(50, 4.0, seed=1)
    assert a == arrivals(50, 4.0, seed=1) and a != arrivals(50, 4.0, seed=2)
    assert a[0] == 0.0 and all(x < y for x, y in itertools.pairwise(a))
    assert 5 < a[-1] < 25  # 49 gaps of mean 0.25 s
    assert arrivals(3, 0.0, seed=1) == [0.0, 0.0, 0.0]


def test_slo_scale_resolves_against_each_kinds_unloaded_latency() -> None:
    base = unloaded(
        [trace("doc", 100, 10), trace("doc", 120, 12), trace("doc", 500, 50), trace("chat", 20, 5)]
    )
    assert pairs(base) == pytest.approx(
        {"doc.ttft": 120, "doc.tpot": 12, "chat.ttft": 20, "chat.tpot": 5}
    )  # medians per kind
    slos = scaled(base, 2.5)
    assert pairs(slos) == pytest.approx({"doc.ttft": 300, "doc.tpot": 30, "chat.ttft": 50, "chat.tpot": 12.5})
    loaded = [trace("doc", 290, 29), trace("doc", 310, 5), trace("chat", 40, 13), trace("chat", 40, 12.4)]
    assert attainment(loaded, slos) == 0.5
    failed = RequestTrace("chat", 8, 3, error="UNAVAILABLE: gone")
    assert attainment([*loaded, failed], slos) == 0.4  # a failed request is a miss
    with pytest.raises(ValueError, match="unloaded probe failed: UNAVAILABLE"):
        unloaded([failed])


def test_goodput_is_the_highest_rate_before_attainment_drops() -> None:
    assert goodput([(1, 1.0), (2, 0.95), (4, 0.5), (8, 0.92)]) == 2  # 8 after a collapse does not count
    assert goodput([(0, 1.0), (1, 0.8)]) == 0.0  # a burst (rate 0) is no rate
    assert goodput([(4, 0.9), (2, 1.0)]) == 4


def test_itl_p99_is_read_against_the_sittings_fastest_unloaded_decode() -> None:
    """One reference for every variant: the slowest variant's own probe would have called its ITL
    p99 1.5x; against the sitting's fastest unloaded TPOT it is 2x. The goodput line names the ratio
    to the best colocated budget."""
    rows = []
    for name, ttft, tpot in (("colocated@128", 50.0, 9.0), ("conditional", 40.0, 12.0)):
        row = summarize([trace("chat", ttft, tpot, tokens=4), trace("chat", ttft, 18.0, tokens=4)], 1.0, {})
        rows.append({"variant": name, "rate": 1.0, **row})
    study = {
        "slo": {"scale": 0.0, "by_kind": {}},
        "goodput_target": 0.9,
        "unloaded": {
            "colocated@128": {
                "chat": {"ttft_ms": 40.0, "tpot_ms": 9.0},
                "doc": {"ttft_ms": 400.0, "tpot_ms": 11.0},
            },
            "conditional": {"chat": {"ttft_ms": 40.0, "tpot_ms": 12.0}},
        },
        "variants": [
            {"name": "colocated@128", "mode": "colocated", "goodput": 4.0, "best": True},
            {"name": "conditional", "mode": "conditional", "goodput": 6.0, "best": False},
        ],
        "rows": rows,
    }
    mark_itl_stretch(study)
    assert study["unloaded_decode_ms"] == 9.0
    assert [r["itl_p99_x_unloaded"] for r in rows] == pytest.approx([2.0, 2.0], abs=0.01)
    text = render(study)
    assert "unloaded decode: 9.0 ms" in text
    assert "goodput conditional: 6 req/s (>= 90%)  (1.50x colocated@128)" in text


def test_identical_work_is_timed_on_the_cpus_asked_for_and_read_as_p99_over_p50() -> None:
    cpu = max(os.sched_getaffinity(0))
    run = time_fixed_work(40, {cpu})
    assert run.cpus == [cpu]  # the child's own affinity, as it read it
    assert len(run.times_ms) == 40 and all(t > 0 for t in run.times_ms)
    assert time_fixed_work(3, None).cpus == sorted(os.sched_getaffinity(0))  # unpinned: inherited
    with pytest.raises(ValueError, match="samples must be >= 1"):
        time_fixed_work(0, None)
    summary = jitter_summary([4.0] * 98 + [6.0, 9.0])  # nearest rank: p99 is the 99th of 100
    assert summary == {"p50": 4.0, "p90": 4.0, "p99": 6.0, "samples": 100, "p99_x_p50": 1.5}
    study = {
        "slo": {"scale": 0.0, "by_kind": {}},
        "goodput_target": 0.9,
        "variants": [],
        "rows": [],
        "host_jitter": {**summary, "by_variant": {"a": summary, "b": summary}},
    }
    assert (
        "host jitter: the same loop on the decode CPUs took p99 1.50x its median (100 runs over 2"
        in render(study)
    )


def test_goodput_under_a_strict_tpot_slo_is_read_against_the_sittings_unloaded_decode() -> None:
    """TPOT SLOs of 2x and 8x the sitting's unloaded decode (10 ms), each kind's TTFT SLO kept: per
    multiple each variant's goodput, and the colocated budget tuned best for that SLO (the small
    budget under the strict one, the large one under the loose one) as the ratio's base."""
    tpots = {  # variant -> (rate -> every request's TPOT); every TTFT 100 ms, within the 3 s SLO
        "colocated@64": {1.0: 19.0, 2.0: 25.0, 3.0: 85.0},
        "colocated@256": {1.0: 25.0, 2.0: 30.0, 3.0: 40.0},
        "conditional": {1.0: 12.0, 2.0: 15.0, 3.0: 90.0},
    }
    rows = [
        {
            "variant": name,
            "rate": rate,
            "requests": [
                {"kind": "chat", "ttft_ms": 100.0, "tpot_ms": tpot},
                {"kind": "chat", "ttft_ms": None, "tpot_ms": None},  # failed: a miss at every SLO
            ]
            + [{"kind": "chat", "ttft_ms": 100.0, "tpot_ms": tpot}] * 8,
        }
        for name, by_rate in tpots.items()
        for rate, tpot in by_rate.items()
    ]
    study = {
        "slo": {"scale": 0.0, "by_kind": {"chat": {"ttft_ms": 3000.0, "tpot_ms": 80.0}}},
        "goodput_target": 0.9,
        "unloaded_decode_ms": 10.0,
        "variants": [
            {"name": n, "mode": n.split("@")[0], "chunk_budget": int(n.split("@")[1]) if "@" in n else None}
            for n in tpots
        ],
        "rows": rows,
    }
    mark_strict_tpot(study, [2, 8])
    assert study["tpot_slo_multiples"] == {"2": 20.0, "8": 80.0}
    assert [r["attainment_by_tpot_x"]["2"] for r in rows[:3]] == [0.9, 0.0, 0.0]
    goodputs = {v["name"]: v["goodput_by_tpot_x"] for v in study["variants"]}
    assert goodputs == {
        "colocated@64": {"2": 1.0, "8": 2.0},
        "colocated@256": {"2": 0.0, "8": 3.0},
        "conditional": {"2": 2.0, "8": 2.0},
    }
    assert study["best_by_tpot_x"] == {"2": "colocated@64", "8": "colocated@256"}
    for v in study["variants"]:
        v["best"], v["goodput"] = v["name"] == "colocated@256", v["goodput_by_tpot_x"]["8"]
    text = render(study | {"rows": []})
    assert "goodput with TPOT SLO 2x unloaded decode (20.0 ms), TTFT SLO as above:" in text
    assert "  colocated@64: 1 req/s  <- best tuned colocated\n  colocated@256: 0 req/s\n" in text
    assert "  conditional: 2 req/s  (2.00x colocated@64)" in text
    assert "  conditional: 2 req/s  (0.67x colocated@256)" in text


def test_chunk_budgets_make_colocated_variants_with_the_worker_flag() -> None:
    vs = variants(["colocated", "disaggregated"], [128, 512])
    assert [v.name for v in vs] == ["colocated@128", "colocated@512", "disaggregated"]
    spec = variant_spec(ClusterSpec(mode="disaggregated", decode_args=["--block-size", "4"]), vs[1])
    assert spec.mode == "colocated" and spec.decode_args == ["--block-size", "4", BUDGET_FLAG, "512"]
    assert variant_spec(ClusterSpec(), Variant("disaggregated")).decode_args == []


def test_itl_stretches_make_conditional_variants_with_the_coordinator_flag() -> None:
    vs = variants(["colocated", "conditional"], [128], itl_stretches=[0, 1.5])
    assert [v.name for v in vs] == ["colocated@128", "conditional", "conditional~itl1.5"]
    base = ClusterSpec(coordinator_args=["--itl-stretch", "2"])  # a --router-itl-stretch: the variant's wins
    assert variant_spec(base, vs[2]).coordinator_args == ["--itl-stretch", "2", "--itl-stretch", "1.5"]
    assert variant_spec(base, vs[1]).coordinator_args[-2:] == ["--itl-stretch", "0"]
    assert variant_spec(base, vs[0]).coordinator_args == ["--itl-stretch", "2"]


def test_short_prompt_lanes_make_variants_of_the_modes_with_prefill_workers() -> None:
    vs = variants(["colocated", "conditional"], [128], itl_stretches=[1.5], short_lanes=[0, 256])
    assert [v.name for v in vs] == ["colocated@128", "conditional~itl1.5", "conditional~itl1.5+lane256"]
    base = ClusterSpec(short_prompt_lane=64)  # a --short-prompt-lane: the variant's wins
    assert [variant_spec(base, v).short_prompt_lane for v in vs] == [0, 0, 256]
    assert variant_spec(base, Variant("disaggregated")).short_prompt_lane == 64


def test_colocated_replicas_make_variants_each_replica_on_its_own_share_of_the_cpus() -> None:
    vs = variants(["colocated", "conditional"], [128, 256], colocated_replicas=[1, 2])
    assert [v.name for v in vs] == [
        "colocated@128",
        "colocated@128x2",
        "colocated@256",
        "colocated@256x2",
        "conditional",
    ]
    base = ClusterSpec(cpus={"coordinator": (0,), "colocated": (0, 1)}, threads={"colocated": 2})
    one, two = variant_spec(base, vs[0]), variant_spec(base, vs[1])
    assert (one.decode_workers, one.split_pins, one.threads) == (1, False, {"colocated": 2})
    assert (two.decode_workers, two.split_pins, two.threads) == (2, True, {"colocated": 1})
    assert [two.worker_cpus(role, wid) for role, wid in two.worker_ids()] == [(0,), (1,)]
    assert two.worker_cpus("coordinator", "coordinator") == (0,)
    with pytest.raises(
        ValueError, match="3 colocated replicas need --pin colocated=CPUS with a multiple of 3"
    ):
        variant_spec(base, Variant("colocated", 128, replicas=3))


def test_split_pins_give_each_worker_of_a_role_its_own_share_and_refuse_what_does_not_divide() -> None:
    spec = ClusterSpec(prefill_workers=2, decode_workers=1, cpus={"prefill": (0, 1, 2, 3), "decode": (4,)})
    assert spec.worker_cpus("prefill", "prefill-1") == (0, 1, 2, 3)  # not split: the whole set
    split = ClusterSpec(
        prefill_workers=2, decode_workers=1, cpus={"prefill": (0, 1, 2, 3), "decode": (4,)}, split_pins=True
    )
    assert [split.worker_cpus(r, w) for r, w in split.worker_ids()] == [(0, 1), (2, 3), (4,)]
    assert split.worker_cpus("prefill", "prefill-0") == (0, 1)
    with pytest.raises(ValueError, match="not one of the prefill workers"):
        split.worker_cpus("prefill", "prefill-2")  # a worker added later has no share
    with pytest.raises(ValueError, match="2 decode workers cannot share 3 CPUs"):
        ClusterSpec(decode_workers=2, cpus={"decode": (0, 1, 2)}, split_pins=True)
    with pytest.raises(ValueError, match="--threads decode=2 would oversubscribe"):
        ClusterSpec(decode_workers=2, cpus={"decode": (0, 1)}, threads={"decode": 2}, split_pins=True)
    with pytest.raises(ValueError, match="a short prompt lane shares P's"):
        ClusterSpec(short_prompt_lane=256, split_pins=True)


def test_a_short_prompt_lane_is_one_more_prefill_worker_and_idles_the_others() -> None:
    spec = ClusterSpec(prefill_workers=1, short_prompt_lane=256)
    assert spec.worker_ids() == [
        ("prefill", "prefill-0"),
        ("prefill", "prefill-short"),
        ("decode", "decode-0"),
    ]
    assert spec.lane_args("prefill", "prefill-short") == ["--max-prompt-tokens", "256"]
    assert spec.lane_args("prefill", "prefill-0") == ["--cpu-priority", "idle"]
    assert spec.lane_args("decode", "decode-0") == [] == ClusterSpec().lane_args("prefill", "prefill-0")
    with pytest.raises(ValueError, match="colocated clusters have none"):
        ClusterSpec(mode="colocated", short_prompt_lane=256)


def test_the_decode_cap_goes_to_decode_workers_not_to_the_tuned_colocated_baseline() -> None:
    base = ClusterSpec(dtype="bfloat16")
    caps = decode_caps(16, 7.5)
    assert caps == [CAP_FLAG, "16", CAP_MS_FLAG, "7.5"] and decode_caps(0, 0) == []
    assert decode_caps(0, 30, short_prompts_whole=True) == [CAP_MS_FLAG, "30", "--short-prompts-whole"]
    capped = variant_spec(base, Variant("conditional"), caps)
    assert capped.decode_args == caps and capped.dtype == "bfloat16"
    assert variant_spec(base, Variant("colocated", 256), caps).decode_args == [BUDGET_FLAG, "256"]


def test_pin_and_thread_flags_parse() -> None:
    assert parse_pins("prefill=0,decode=1+3,colocated=0-2") == {
        "prefill": (0,),
        "decode": (1, 3),
        "colocated": (0, 1, 2),
    }
    assert parse_threads("2")["prefill"] == 2 and "coordinator" not in parse_threads("2")
    assert parse_threads("decode=1") == {"decode": 1}
    assert parse_long_prefill_thresholds("prefill=256,decode=0") == {"prefill": 256, "decode": 0}
    assert set(parse_long_prefill_thresholds("128").values()) == {128}


def test_router_flags_reach_the_coordinator_as_its_own() -> None:
    """What `--router-*` and `--first-token-from` set is what the study's coordinator parses."""
    flags = ["--router-local-prefill-max-tokens", "2048", "--router-local-first-ttft-ms", "1500"]
    flags += ["--router-tpot-guard", "increment", "--first-token-from", "prefill"]
    flags += ["--router-itl-stretch", "1.5"]
    args = build_parser("bench").parse_args(["bench", *flags])
    forwarded = bench.router_args(args, bench.router_targets(args))
    coordinator = build_parser("coordinator").parse_args(["coordinator", "--model", "tiny", *forwarded])
    assert (coordinator.local_prefill_max_tokens, coordinator.local_first_ttft_ms) == (2048, 1500.0)
    assert (coordinator.tpot_guard, coordinator.first_token_from) == ("increment", "prefill")
    assert coordinator.itl_stretch == 1.5
    # the router's targets are the study's absolute SLO unless given; none under --slo-scale
    assert (coordinator.ttft_slo_ms, coordinator.tpot_slo_ms) == (args.slo_ttft_ms, args.slo_tpot_ms)
    given = build_parser("bench").parse_args(
        ["bench", "--router-ttft-slo-ms", "0", "--router-tpot-slo-ms", "50"]
    )
    assert bench.router_targets(given) == Latency(0.0, 50.0)
    scaled = build_parser("bench").parse_args(["bench", "--slo-scale", "4"])
    defaults = bench.router_args(scaled, bench.router_targets(scaled))
    assert defaults == ["--ttft-slo-ms", "0", "--tpot-slo-ms", "0"]  # the rest stays the coordinator's


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--modes", "colocated,split"], "'split' is not a mode (disaggregated, colocated, conditional)"),
        (["--rates", "1,fast"], "'fast' is not a rate"),
        (["--prefill-chunk-budgets", "128,-1"], "'-1' is not a positive token count"),
        (["--mix", "half:1024x16"], "SHARE:INxOUT items"),
        (["--pin", "gpu=0"], "ROLE in coordinator, prefill, decode, colocated"),
        (["--pin", "decode=1-0"], "bad CPU range"),
        (["--threads", "decode=0"], "--threads 'decode=0': values must be >= 1"),
        (["--long-prefill-token-threshold", "prefill=-1"], "values must be >= 0"),
        (["--long-prefill-token-threshold", "p=256"], "ROLE in coordinator, prefill, decode, colocated"),
        (["--mix", "docs-chats", "--dataset", "x.jsonl"], "not allowed with argument"),
        (["--control-planes", "curve,tls"], "'tls' is not a control plane (curve, plain)"),
        (["--router-tpot-slo-ms", "-1"], "argument --router-tpot-slo-ms: -1 is not >= 0 (0: off)"),
        (["--router-local-prefill-max-tokens", "-1"], "-1 is negative"),
        (["--prefill-tokens-while-decoding", "-16"], "-16 is negative (0: off)"),
        (["--num-requests", "0"], "argument --num-requests: 0 is not >= 1"),
        (["--rounds", "two"], "'two' is not an integer"),
        (["--itl-stretches", "0.5"], "'0.5' is not 0 (off) or >= 1 (a multiple of the decode step)"),
        (["--router-itl-stretch", "0.5"], "0.5 is not 0 (off) or >= 1 (a multiple of the decode step)"),
        (["--short-prompt-lane", "-1"], "-1 is negative"),
        (["--short-prompt-lanes", "0,-64"], "'-64'"),
        (["--colocated-replicas", "0,2"], "'0' is not a replica count >= 1"),
    ],
)
def test_bad_flags_are_usage_errors(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser("bench").parse_args(["bench", *flags])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--modes", "disaggregated", "--prefill-chunk-budgets", "128"], "add colocated to --modes"),
        (["--modes", "disaggregated", "--itl-stretches", "0,1.5"], "add conditional to --modes"),
        (
            ["--modes", "conditional", "--itl-stretches", "1.5", "--router-itl-stretch", "2"],
            "give one",
        ),
        (["--modes", "colocated", "--short-prompt-lanes", "0,256"], "add disaggregated or conditional"),
        (["--short-prompt-lanes", "256", "--short-prompt-lane", "128"], "give one"),
        (["--modes", "disaggregated", "--colocated-replicas", "2"], "add colocated to --modes"),
        (
            ["--modes", "colocated", "--colocated-replicas", "1,2", "--pin", "colocated=0-2"],
            "2 colocated replicas need --pin colocated=CPUS with a multiple of 2 CPUs",
        ),
        (["--modes", "colocated", "--colocated-replicas", "2"], "got none"),
        (["--rates", "1,2", "--scale-rate", "4"], "--scale-rate 4 is not one of --rates"),
        (
            ["--target", "127.0.0.1:1", "--control-planes", "curve,plain"],
            "start local clusters: drop --target",
        ),
        (["--target", "127.0.0.1:1", "--modes", "colocated,disaggregated"], "several --modes need local"),
        (["--short-prompts-whole"], "--short-prompts-whole needs the decode workers' threshold"),
        (
            ["--short-prompts-whole", "--long-prefill-token-threshold", "prefill=256"],
            "add --long-prefill-token-threshold",
        ),
    ],
)
def test_contradicting_flags_stop_before_any_cluster(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from splitserve import bench

    assert bench.run(build_parser("bench").parse_args(["bench", *flags])) == 2
    assert message in capsys.readouterr().err


def test_control_planes_and_rounds_alternate_the_order_and_set_the_flag() -> None:
    vs = variants(["disaggregated"], [], ["curve", "plain"], rounds=3)
    assert [v.name for v in vs] == [
        "disaggregated#1",
        "disaggregated+plain#1",
        "disaggregated+plain#2",
        "disaggregated#2",
        "disaggregated#3",
        "disaggregated+plain#3",
    ]
    base = ClusterSpec(insecure_control_plane=True)
    assert [variant_spec(base, v).insecure_control_plane for v in vs[:2]] == [False, True]
    assert [v.name for v in variants(["colocated"], [], None)] == ["colocated"]


def test_cluster_cpu_seconds_are_read_from_proc() -> None:
    import os

    from splitserve.bench.study import cpu_seconds

    before = cpu_seconds([os.getpid()])
    sum(i * i for i in range(2_000_000))  # burn some CPU in this process
    assert cpu_seconds([os.getpid()]) > before


def test_each_rate_draws_its_own_prompts_the_same_for_every_variant(
    tiny_model_dir: Callable[[], Path],
) -> None:
    # The same prompts at every rate would meet the prefix cache from the second rate on (a
    # 1,024-token document's prefill paid once): each rate, and the probes, get a fresh draw.
    args = build_parser("bench").parse_args(
        [
            "bench",
            "--model",
            str(tiny_model_dir()),
            "--mix",
            "docs-chats",
            "--num-requests",
            "8",
            "--rates",
            "0.5,1",
        ]
    )
    draws = bench._workloads(args)
    assert len(draws) == 3  # the probes', then one per rate
    assert [sorted(it.kind for it in d) for d in draws] == [sorted(it.kind for it in draws[0])] * 3
    first_tokens = {tuple(it.prompt[:16]) for d in draws for it in d}
    assert len(first_tokens) == 3 * 8  # no prompt prefix repeats across draws
    assert [it.prompt for it in bench._workloads(args)[2]] == [it.prompt for it in draws[2]]


def test_the_host_record_names_the_cpu_and_its_matrix_extensions(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: Example CPU 9000\nflags\t\t: fpu avx2 avx512f amx_tile amx_bf16\n\n"
        "processor\t: 1\nmodel name\t: Example CPU 9000\nflags\t\t: fpu avx2 avx512f amx_tile amx_bf16\n"
    )
    host = host_info(cpuinfo)
    assert host["cpu"] == "Example CPU 9000" and host["cpus"] == os.cpu_count()
    assert host["isa"] == ["avx2", "avx512f", "amx_tile", "amx_bf16"]  # ISA_FLAGS order, no avx512_bf16
    assert host_info(tmp_path / "missing")["isa"] == []  # not Linux: no flags, still a record

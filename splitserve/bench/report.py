"""The study for people: a table per rate row, the latency breakdown, goodput and the best budget."""

from __future__ import annotations

from typing import Any

# TTFT = queue + prefill + other; the KV transfer overlaps decode (it delays the second token)
BREAKDOWN = ("queue_ms", "prefill_ms", "other_ms", "first_token_ms", "kv_transfer_ms", "decode_ms")


def render(study: dict[str, Any]) -> str:
    """The study as plain text (milliseconds)."""
    width = max([len(r["variant"]) for r in study["rows"]] + [8]) + 2
    lines = [
        f"{'variant':<{width}}{'rate':>6}{'done':>7}{'tok/s':>8}{'ttft p50':>10}{'p99':>8}"
        f"{'tpot p50':>10}{'p99':>8}{'itl p99':>9}{'x':>6}{'1st':>6}{'later':>7}{'slo':>6}{'cpu/req':>9}"
    ]
    for r in study["rows"]:
        lines.append(
            f"{r['variant']:<{width}}{r['rate']:>6g}{r['completed']:>4}/{r['num_requests']:<2}"
            f"{r['output_tok_s']:>8.1f}{r['ttft_ms']['p50']:>10.0f}{r['ttft_ms']['p99']:>8.0f}"
            f"{r['tpot_ms']['p50']:>10.1f}{r['tpot_ms']['p99']:>8.1f}{r['itl_ms']['p99']:>9.1f}"
            f"{_times(r.get('itl_p99_x_unloaded')):>6}{r['first_itl_ms']['p99']:>6.0f}{r['later_itl_ms']['p99']:>7.0f}{r['attainment']:>6.0%}{_cpu(r.get('cluster_cpu_ms_per_request')):>9}"
        )
    lines.append(
        "(milliseconds; x: itl p99 over the unloaded decode below; itl 1st / later: p99 of each"
        " request's first gap, token 1 -> 2, and of the gaps after it; cpu/req: CPU ms of the"
        " cluster's processes per request)"
    )
    lines.append("")
    lines.append(
        f"{'breakdown (mean)':<{width + 6}}" + "".join(f"{k.removesuffix('_ms'):>12}" for k in BREAKDOWN)
    )
    for r in study["rows"]:
        b = r["breakdown_ms"]
        cells = "".join(f"{b[k]:>12.1f}" if k in b else f"{'-':>12}" for k in BREAKDOWN)
        lines.append(f"{r['variant']:<{width}}{r['rate']:>6g}{cells}")
    lines.append("")
    slo = study["slo"]
    how = f"{slo['scale']:g} x unloaded of {slo['reference']}" if slo["scale"] else "absolute"
    kinds = ", ".join(
        f"{k} TTFT {v['ttft_ms']:.0f} / TPOT {v['tpot_ms']:.1f}" for k, v in slo["by_kind"].items()
    )
    lines.append(f"SLO ({how}): {kinds}")
    served = study.get("workload", {})
    if served.get("dtype"):
        lines.append(f"served: {served['dtype']}, KV transfer over {served['transfer_backend']}")
    if host := served.get("host"):
        lines.append(f"host: {host['cpu']}, {host['cpus']} CPUs, {' '.join(host['isa']) or 'no AVX2'}")
    if "unloaded_decode_ms" in study:
        lines.append(
            f"unloaded decode: {study['unloaded_decode_ms']:.1f} ms (the fastest unloaded TPOT of any variant)"
        )
    if jitter := study.get("host_jitter"):
        lines.append(
            f"host jitter: the same loop on the decode CPUs took p99 {jitter['p99_x_p50']:.2f}x its median "
            f"({jitter['samples']} runs over {len(jitter['by_variant'])} clusters; no ITL p99 ratio reads lower)"
        )
    best = next((v for v in study["variants"] if v["best"]), None)
    for v in study["variants"]:
        mark = "  <- best tuned colocated" if v["best"] else ""
        if best and v["mode"] != "colocated" and best["goodput"] > 0:
            mark = f"  ({v['goodput'] / best['goodput']:.2f}x {best['name']})"
        lines.append(f"goodput {v['name']}: {v['goodput']:g} req/s (>= {study['goodput_target']:.0%}){mark}")
    for key, tpot_ms in study.get("tpot_slo_multiples", {}).items():
        lines.append(f"goodput with TPOT SLO {key}x unloaded decode ({tpot_ms:.1f} ms), TTFT SLO as above:")
        lines += _goodput_under(study, key)
    for r in study["rows"]:
        for error, count in r["errors"].items():
            lines.append(f"{r['variant']} rate {r['rate']:g}: {count} failed with {error}")
    return "\n".join(lines)


def _goodput_under(study: dict[str, Any], key: str) -> list[str]:
    """One line per variant: its goodput under the TPOT SLO `key` and its ratio to the colocated
    budget tuned best for that SLO (study.mark_strict_tpot)."""
    best_name = study["best_by_tpot_x"].get(key)
    best = next((v["goodput_by_tpot_x"][key] for v in study["variants"] if v["name"] == best_name), 0.0)
    lines = []
    for v in study["variants"]:
        rate = v["goodput_by_tpot_x"][key]
        mark = "  <- best tuned colocated" if v["name"] == best_name else ""
        if v["mode"] != "colocated" and best_name is not None:
            mark = f"  ({rate / best:.2f}x {best_name})" if best > 0 else f"  ({best_name}: 0)"
        lines.append(f"  {v['name']}: {rate:g} req/s{mark}")
    return lines


def _cpu(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.1f}"


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"

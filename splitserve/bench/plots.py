"""The study's PNG plots (matplotlib, headless): SLO attainment against request rate and against SLO
scale, one line per deployment variant."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def _figure(title: str, xlabel: str) -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig: Any, ax: Any, path: Path, target: float) -> Path:
    import matplotlib.pyplot as plt

    ax.axhline(target, color="grey", linestyle=":", linewidth=1, label=f"{target:.0%} (goodput)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _by_rate(
    rows: list[dict[str, Any]],
    names: list[str],
    share: Callable[[dict[str, Any]], float],
    title: str,
    path: Path,
    target: float,
) -> Path:
    """One line per variant of `share` (a row's attainment) against the rows' rates."""
    fig, ax = _figure(title, "rate (requests/s)")
    for name in names:
        mine = sorted((r["rate"], share(r)) for r in rows if r["variant"] == name)
        ax.plot([x for x, _ in mine], [y for _, y in mine], marker="o", label=name)
    return _save(fig, ax, path, target)


def _under(key: str) -> Callable[[dict[str, Any]], float]:
    """A row's attainment under the TPOT SLO `key` (study.mark_strict_tpot)."""
    return lambda r: r["attainment_by_tpot_x"][key]


def plot_study(study: dict[str, Any], out_dir: Path, target: float) -> list[Path]:
    """Write attainment-vs-rate.png (and attainment-vs-rate-tpot<k>x.png per `--tpot-slo-multiples`
    entry) and attainment-vs-slo-scale.png under `out_dir`; the scale plot uses the rows at
    `study["scale_rate"]` and is skipped when no scales were measured."""
    rows = [r for r in study["rows"] if r["rate"] > 0]
    names = list(dict.fromkeys(r["variant"] for r in rows))
    written = [
        _by_rate(
            rows,
            names,
            lambda r: r["attainment"],
            "SLO attainment vs request rate",
            out_dir / "attainment-vs-rate.png",
            target,
        )
    ]
    for key, tpot_ms in study.get("tpot_slo_multiples", {}).items():
        title = f"attainment vs rate, TPOT SLO {key}x unloaded decode ({tpot_ms:.1f} ms)"
        path = out_dir / f"attainment-vs-rate-tpot{key}x.png"
        written.append(_by_rate(rows, names, _under(key), title, path, target))
    at_rate = [r for r in study["rows"] if r["rate"] == study["scale_rate"] and r["attainment_by_scale"]]
    if at_rate:
        fig, ax = _figure(f"SLO attainment vs SLO scale at {study['scale_rate']:g} req/s", "SLO scale")
        for r in at_rate:
            points = sorted((float(s), a) for s, a in r["attainment_by_scale"].items())
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=r["variant"])
        written.append(_save(fig, ax, out_dir / "attainment-vs-slo-scale.png", target))
    return written

"""kvbench output: the readable table, a progress bar, JSON lines, CSV and the bandwidth plot.

A row is a flat dict. Every row carries `backend`, `size_bytes`, `gbps`, `memcpy_gbps`, `ratio`,
`p50_us`, `p99_us`, `verified` and the inputs needed to reproduce it (`command`, `settings`).
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

Row = dict[str, Any]

UNITS = {
    "B": 1,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "K": 1000,
    "KB": 1000,
    "MB": 10**6,
    "GB": 10**9,
}

COLUMNS = [
    ("busy", "busy", "{}"),
    ("link", "link", "{}"),
    ("backend", "backend", "{}"),
    ("size", "size", "{}"),
    ("depth", "depth", "{}"),
    ("gbps", "GB/s", "{:.2f}"),
    ("gbits", "Gb/s", "{:.1f}"),
    ("memcpy_gbps", "memcpy", "{:.2f}"),
    ("ratio", "ratio", "{:.2f}"),
    ("peer_ratio", "vs peer", "{:.2f}"),
    ("round", "round", "{}"),
    ("p50_us", "p50 us", "{:.0f}"),
    ("p99_us", "p99 us", "{:.0f}"),
    ("p999_us", "p99.9 us", "{:.0f}"),
    ("cpu_s_per_gib", "CPU s/GiB", "{:.2f}"),
    ("connect_ms", "connect ms", "{:.1f}"),
    ("reg_ms", "reg ms", "{:.2f}"),
    ("verified", "verified", "{}"),
    ("transport", "transport", "{}"),
]

MODEL_COLUMNS = [
    ("busy", "busy", "{}"),
    ("backend", "backend", "{}"),
    ("model_shape", "shape", "{}"),
    ("tokens", "tokens", "{}"),
    ("blocks", "blocks", "{}"),
    ("messages", "msgs/gets", "{}"),
    ("size", "bytes", "{}"),
    ("transfer_ms", "transfer ms", "{:.2f}"),
    ("in_agent_ms", "in agent ms", "{:.2f}"),
    ("gbps", "GB/s", "{:.2f}"),
    ("memcpy_gbps", "memcpy", "{:.2f}"),
    ("ratio", "ratio", "{:.2f}"),
    ("raw_ratio", "vs raw", "{:.2f}"),
    ("peer_ratio", "vs peer", "{:.2f}"),
    ("round", "round", "{}"),
    ("verified", "verified", "{}"),
    ("transport", "transport", "{}"),
]


def parse_size(text: str) -> int:
    """'64KiB' -> 65536, '4MiB' -> 4194304, '1000' -> 1000."""
    t = text.strip().upper()
    for unit in sorted(UNITS, key=len, reverse=True):
        if t.endswith(unit) and t[: -len(unit)].replace(".", "", 1).isdigit():
            return int(float(t[: -len(unit)]) * UNITS[unit])
    return int(t)


def parse_tokens(text: str) -> int:
    """'128' -> 128, '4k' -> 4096, '32k' -> 32768 (token counts use binary k)."""
    t = text.strip().lower()
    return int(float(t[:-1]) * 1024) if t.endswith("k") else int(t)


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


class Progress:
    """A one-line progress bar on stderr (only when it is a terminal, or when forced)."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, enabled: bool | None = None) -> None:
        self.total, self.done, self.stream = total, 0, stream
        self.enabled = stream.isatty() if enabled is None else enabled

    def step(self, label: str) -> None:
        self.done += 1
        if self.enabled:
            filled = int(30 * self.done / max(self.total, 1))
            self.stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} {label:<40}")
            self.stream.flush()
            if self.done == self.total:
                self.stream.write("\n")


def table(rows: Sequence[Row], columns: Sequence[tuple[str, str, str]] = COLUMNS) -> str:
    """Rows as an aligned text table; only the columns some row has."""
    present = [c for c in columns if any(c[0] in r for r in rows)]
    cells = [[h for _, h, _ in present]]
    for r in rows:
        cells.append([fmt.format(r[k]) if r.get(k) is not None else "-" for k, _, fmt in present])
    widths = [max(len(row[i]) for row in cells) for i in range(len(present))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


PEER = "nixl-raw"  # the best peer kvbench runs beside ours (kvtransfer/bench/nixl_sweep.py)


def _point(r: Row) -> tuple[Any, ...]:
    """What makes two rows the same measurement point: mode, busy, size (raw) or prompt (model), depth."""
    return (r["mode"], r["busy"], r["size_bytes"] if r["mode"] == "raw" else r["tokens"], r.get("depth"))


def add_peer_ratios(rows: list[Row]) -> None:
    """Give every row of ours `peer_ratio`: its GB/s over the peer row's at the same point in the
    same round, where the run measured one."""
    peer = {(*_point(r), r.get("round", 0)): r for r in rows if r["backend"] == PEER}
    for r in rows:
        base = peer.get((*_point(r), r.get("round", 0)))
        if r["backend"] != PEER and base is not None:
            r["peer_ratio"] = r["gbps"] / base["gbps"] if base["gbps"] else 0.0


def peer_summary(rows: Sequence[Row]) -> str:
    """Each (backend, point)'s `peer_ratio` round by round and their median, as a table ("" if none)."""
    by_point: dict[tuple[Any, ...], list[Row]] = {}
    for r in rows:
        if "peer_ratio" in r:
            by_point.setdefault((r["backend"], *_point(r)), []).append(r)
    summary = []
    for (backend, mode, busy, _, depth), mine in by_point.items():
        ratios = [r["peer_ratio"] for r in sorted(mine, key=lambda r: r["round"])]
        point = mine[0]["size"] if mode == "raw" else f"{mine[0]['tokens']} tokens"
        summary.append(
            {
                "busy": busy,
                "backend": backend,
                "point": point if depth in (None, 1) else f"{point} depth {depth}",
                "rounds": " ".join(f"{x:.2f}" for x in ratios),
                "median": statistics.median(ratios),
                "min": min(ratios),
            }
        )
    return table(summary, SUMMARY_COLUMNS) if summary else ""


SUMMARY_COLUMNS = [
    ("busy", "busy", "{}"),
    ("backend", "backend", "{}"),
    ("point", "point", "{}"),
    ("rounds", "vs peer, round by round", "{}"),
    ("median", "median", "{:.2f}"),
    ("min", "min", "{:.2f}"),
]


def write_json_lines(rows: Sequence[Row], path: Path) -> None:
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=True) + "\n")


def write_csv(rows: Sequence[Row], path: Path) -> None:
    keys = sorted({k for r in rows for k in r})
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in r.items()})


def plot(rows: Sequence[Row], memcpy: dict[int, float], path: Path) -> None:
    """Bandwidth vs message size, one line per backend (first depth), memcpy as the ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = sorted(memcpy)
    ax.plot(sizes, [memcpy[s] for s in sizes], "k--", label="memcpy (1 thread)")
    for backend in dict.fromkeys(r["backend"] for r in rows):
        mine = [r for r in rows if r["backend"] == backend]
        depth = mine[0].get("depth")
        mine = sorted((r for r in mine if r.get("depth") == depth), key=lambda r: r["size_bytes"])
        ax.plot(
            [r["size_bytes"] for r in mine],
            [r["gbps"] for r in mine],
            "o-",
            label=f"{backend} (depth {depth})",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("GB/s (10^9 bytes/s)")
    ax.set_title("kvbench: bandwidth between two processes")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""What the benchmark sends: the requests (a named or inline mix, a JSONL file, or one jittered shape)
and when (Poisson arrivals). Everything is drawn from `seed`, so every mode of a study gets the same
requests at the same offsets."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Shape:
    """One class of a mix: `share` of the requests have `prompt_len` tokens in and `output_len` out."""

    kind: str
    share: float
    prompt_len: int
    output_len: int


# Named mixes. docs-chats is issue 12's study workload: a quarter long documents, the rest short chats.
MIXES: dict[str, tuple[Shape, ...]] = {
    "docs-chats": (Shape("doc", 0.25, 1024, 16), Shape("chat", 0.75, 64, 64)),
}


@dataclass(frozen=True, slots=True)
class Item:
    """One request: its prompt (token ids or text), how many tokens it asks for, and its class."""

    prompt: list[int] | str
    max_tokens: int
    kind: str

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


def parse_mix(text: str) -> tuple[Shape, ...]:
    """A name from MIXES, or `SHARE:INxOUT[,...]` (e.g. `0.25:1024x16,0.75:64x64`); ValueError says
    what to fix. Shares are normalised to sum to 1."""
    if text in MIXES:
        return MIXES[text]
    shapes = []
    try:
        for part in text.split(","):
            share, _, lengths = part.partition(":")
            prompt_len, _, output_len = lengths.partition("x")
            shapes.append(Shape(f"{prompt_len}x{output_len}", float(share), int(prompt_len), int(output_len)))
    except ValueError:
        raise ValueError(
            f"mix {text!r}: want a name ({', '.join(MIXES)}) or SHARE:INxOUT items like 0.25:1024x16,0.75:64x64"
        ) from None
    if any(s.share <= 0 or s.prompt_len < 1 or s.output_len < 1 for s in shapes):
        raise ValueError(f"mix {text!r}: shares and lengths must be positive")
    total = sum(s.share for s in shapes)
    return tuple(Shape(s.kind, s.share / total, s.prompt_len, s.output_len) for s in shapes)


def _counts(shapes: tuple[Shape, ...], n: int) -> list[int]:
    """Requests per shape: exact shares of `n` by largest remainder (a 4-request test still gets a doc)."""
    raw = [s.share * n for s in shapes]
    counts = [int(r) for r in raw]
    by_remainder = sorted(range(len(shapes)), key=lambda i: raw[i] - counts[i], reverse=True)
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    return counts


def mixed(shapes: tuple[Shape, ...], n: int, vocab: int, seed: int) -> list[Item]:
    """`n` requests in the mix's proportions, shuffled; prompts are random token ids below `vocab`."""
    rng = random.Random(seed)
    items = [
        Item([rng.randrange(3, vocab) for _ in range(s.prompt_len)], s.output_len, s.kind)
        for s, count in zip(shapes, _counts(shapes, n), strict=True)
        for _ in range(count)
    ]
    rng.shuffle(items)
    return items


def jittered(n: int, input_len: int, output_len: int, jitter: float, vocab: int, seed: int) -> list[Item]:
    """`n` requests with lengths uniform in len * (1 ± jitter)."""
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        p = max(1, int(rng.uniform(1 - jitter, 1 + jitter) * input_len))
        m = max(1, int(rng.uniform(1 - jitter, 1 + jitter) * output_len))
        items.append(Item([rng.randrange(3, vocab) for _ in range(p)], m, "synthetic"))
    return items


def from_jsonl(path: Path, n: int, default_output_len: int) -> list[Item]:
    """The first `n` rows of a JSONL file with `prompt` (text) or `token_ids`, optional `max_tokens`
    and `kind`."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [
        Item(
            r.get("token_ids") or r["prompt"],
            int(r.get("max_tokens", default_output_len)),
            r.get("kind", "dataset"),
        )
        for r in rows[:n]
    ]


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets in seconds from the start: a Poisson process at `rate` req/s (0: all at once)."""
    if rate <= 0:
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out

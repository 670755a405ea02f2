"""Which bytes travel in which message: the plan both sides of a session compute identically.

A session moves the sequence's logical blocks `0..n-1` from the sender's block ids `src[i]` into
the receiver's reserved ids `dst[i]`. The plan depends only on the receiver's ids (which the sender
learns from the receiver's reservation), so both sides derive the same messages without talking:

    logical blocks  0   1   2   3   4   5   6   7
    dst ids        [40  41  42  43][7][19][3][60  61  62]
    messages       |---- m0: direct --|-- m1: packed --|- m2: direct -|

- a *direct* message covers a run of consecutive dst ids, so it is received straight into the cache
  (no copy) and, when the src ids of the same run are consecutive too, sent straight from the cache;
- a *packed* message covers short runs that are coalesced: the receiver receives into a staging
  buffer and scatters (`kernels.scatter_blocks`), the sender gathers (`kernels.gather_blocks`).

Each message has a 64-bit tag, a keyed hash (BLAKE2b) of its index under the session's *secret*:
128 random bits the receiver draws when it reserves the blocks (`new_session_secret`) and sends only
over the authenticated control plane (Reserved). Only the two ends of the session can name one of its
tags, so a process that reaches the transfer port cannot hit a posted receive (UCX matches tags
across every endpoint of a worker); a retry draws a new secret, so no tag is ever reused and a
finished session's secret names no posted receive.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

MAX_MESSAGES = 1 << 16
SECRET_BYTES = 16


def new_session_secret() -> bytes:
    """A fresh session secret (the receiver draws one per reservation)."""
    return secrets.token_bytes(SECRET_BYTES)


def check_session_secret(secret: bytes) -> None:
    """Raise ValueError unless `secret` is long enough to make the session's tags unguessable."""
    if len(secret) < SECRET_BYTES:
        raise ValueError(f"a session secret has at least {SECRET_BYTES} bytes, got {len(secret)}")


def message_tag(secret: bytes, index: int) -> int:
    """The 64-bit tag of message `index` of the session whose secret is `secret`; equal in every process."""
    return int.from_bytes(
        hashlib.blake2b(index.to_bytes(4, "big"), digest_size=8, key=secret).digest(), "big"
    )


@dataclass(frozen=True, slots=True)
class Message:
    """Logical blocks `[start, stop)` of a session, sent as one tagged message."""

    index: int
    start: int
    stop: int
    direct: bool

    @property
    def num_blocks(self) -> int:
        return self.stop - self.start


def consecutive_start(ids: Sequence[int]) -> int | None:
    """`ids[0]` when ids are consecutive ascending (one contiguous byte range), else None."""
    if not ids:
        return None
    first = ids[0]
    return first if all(b == first + i for i, b in enumerate(ids)) else None


@dataclass(frozen=True, slots=True)
class Run:
    """Logical blocks `[start, start + n)` whose src ids and dst ids are both consecutive."""

    start: int
    src: int
    dst: int
    n: int


def coalesce_runs(src_ids: Sequence[int], dst_ids: Sequence[int], start: int = 0) -> list[Run]:
    """Cut the pairs `(src_ids[i], dst_ids[i])` (logical block `start + i`) into the fewest runs in
    which both ids step by one: each run is one contiguous read into one contiguous destination
    (one one-sided get, kvtransfer.pull)."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source ids for {len(dst_ids)} destination ids")
    runs: list[Run] = []
    for i, (s, d) in enumerate(zip(src_ids, dst_ids, strict=True)):
        last = runs[-1] if runs else None
        if last is not None and s == last.src + last.n and d == last.dst + last.n:
            runs[-1] = Run(last.start, last.src, last.dst, last.n + 1)
        else:
            runs.append(Run(start + i, s, d, 1))
    return runs


def plan_messages(
    dst_ids: Sequence[int], block_bytes: int, max_message_bytes: int, min_direct_bytes: int
) -> list[Message]:
    """Split the receiver's reserved ids into messages (see module docstring).

    Runs of consecutive dst ids of at least `min_direct_bytes` become direct messages; shorter runs
    are packed together. No message exceeds `max_message_bytes` (but each holds at least a block).
    """
    max_blocks = max(1, max_message_bytes // block_bytes)
    min_direct_blocks = max(1, -(-min_direct_bytes // block_bytes))
    messages: list[Message] = []
    packed_start: int | None = None

    def add(start: int, stop: int, direct: bool) -> None:
        for s in range(start, stop, max_blocks):
            messages.append(Message(len(messages), s, min(s + max_blocks, stop), direct))

    def flush_packed(upto: int) -> None:
        nonlocal packed_start
        if packed_start is not None:
            add(packed_start, upto, False)
            packed_start = None

    i = 0
    while i < len(dst_ids):
        j = i + 1
        while j < len(dst_ids) and dst_ids[j] == dst_ids[j - 1] + 1:
            j += 1
        if j - i >= min_direct_blocks:
            flush_packed(i)
            add(i, j, True)
        elif packed_start is None:
            packed_start = i
        i = j
    flush_packed(len(dst_ids))
    if len(messages) > MAX_MESSAGES:
        raise ValueError(f"{len(messages)} messages exceed the tag space of {MAX_MESSAGES}")
    return messages

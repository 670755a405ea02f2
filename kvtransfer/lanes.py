"""A short, bounded name for what carries a peer's bytes, from `Peer.transports` (a metric label).

    ucx: sysv/memory(am keepalive), posix/memory(-), cma/memory(rma_bw#0)   -> ucx:cma
    ucx: tcp/veth0(rma_bw#0 am wireup)                                      -> ucx:tcp
    ucx: tcp/lo(am), tcp/lo(rma_bw#0)   (same host, shared memory left out) -> ucx:tcp-lo
    ucx: sysv/memory(am keepalive)                                          -> ucx:sysv
    tcp                                                                     -> tcp

For UCX, the bulk lanes are those UCX picked for rendezvous (`rma_bw`), else those for active
messages (`am`): what a large KV message travels on. TCP on the loopback device gets its own name,
so a silent fallback from shared memory to TCP loopback shows on a dashboard. Names are UCX
transport names (a fixed set compiled into UCX), sanitized and at most three per label; anything
unparseable becomes `unknown`, so a label's values stay few whatever a peer's string says.
"""

from __future__ import annotations

import functools
import re

_LANE = re.compile(r"([A-Za-z0-9_]+)/([^(\s]+)\(([^)]*)\)")
_NAME = re.compile(r"[a-z0-9_]{1,16}")
MAX_NAMES = 3


@functools.lru_cache(maxsize=256)  # called per chunk and per session; a peer's string never changes
def transport_label(transports: str) -> str:
    """The label of a `Peer.transports` string (see the module docstring)."""
    backend, _, lanes = transports.partition(":")
    backend = backend.strip()
    if not _NAME.fullmatch(backend):
        return "unknown"
    if backend != "ucx":
        return backend
    parsed = [(tl, dev, roles.split()) for tl, dev, roles in _LANE.findall(lanes)]
    bulk = [lane for lane in parsed if any(r.startswith("rma_bw") for r in lane[2])]
    bulk = bulk or [lane for lane in parsed if "am" in lane[2]]
    names = sorted({f"{tl}-lo" if tl == "tcp" and dev == "lo" else tl for tl, dev, _ in bulk})
    names = [n for n in names if _NAME.fullmatch(n.replace("-", "_"))][:MAX_NAMES]
    return f"ucx:{'+'.join(names)}" if names else "ucx:unknown"


def gets_over_tcp(transports: str) -> bool:
    """Whether a UCX peer's bulk lanes are all TCP (no RDMA, shared memory or CMA): UCX then
    carries a one-sided get as a request and a reply over its sockets, slower than its two-sided
    rendezvous there (docs/kvtransfer.md, "Across hosts"), so a decode worker in
    `--kv-transfer-mode auto` has such a peer push."""
    label = transport_label(transports)
    names = label.removeprefix("ucx:").split("+")
    return label.startswith("ucx:") and all(name in ("tcp", "tcp-lo") for name in names)

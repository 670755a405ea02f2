"""The worker's links to its peers: one cached DEALER per peer for P<->D control messages.

A peer is known from the coordinator's `Peers` list, or first from the `WorkerEndpoint` inside a
Prefill/Decode/Reassign (the lists may lag a request). A peer that leaves the list, or comes back
under a new incarnation, is "lost": its DEALER is closed and the role aborts every transfer with it.
"""

from __future__ import annotations

from collections.abc import Iterable

import structlog
import zmq.asyncio

from splitserve.control import ControlSocket
from splitserve.v1 import control_pb2

log = structlog.get_logger(__name__)


class PeerLinks:
    """Owned by the worker's event loop. `dealer()` connects lazily; `update()` applies a Peers list."""

    def __init__(self, ctx: zmq.asyncio.Context, worker_id: str, kv_layout_hash: str) -> None:
        self.ctx = ctx
        self.worker_id = worker_id
        self.kv_layout_hash = kv_layout_hash
        self.peers: dict[str, control_pb2.Peer] = {}
        self._dealers: dict[str, tuple[str, ControlSocket]] = {}

    def dealer(self, endpoint: control_pb2.WorkerEndpoint) -> ControlSocket:
        """The cached DEALER to `endpoint`'s ROUTER (identity = this worker's id), connected on first use."""
        cached = self._dealers.get(endpoint.worker_id)
        if cached is not None and cached[0] == endpoint.control_address:
            return cached[1]
        if cached is not None:  # same id, new address: a restarted peer
            cached[1].close()
        sock = ControlSocket.dealer(self.ctx, endpoint.control_address, identity=self.worker_id)
        self._dealers[endpoint.worker_id] = (endpoint.control_address, sock)
        return sock

    def compatible(self, worker_id: str) -> str | None:
        """None when the peer may pair with us, else why not (layout hash differs)."""
        peer = self.peers.get(worker_id)
        if peer is not None and peer.kv_layout_hash and peer.kv_layout_hash != self.kv_layout_hash:
            return f"peer {worker_id} has kv_layout hash {peer.kv_layout_hash[:12]}, ours is {self.kv_layout_hash[:12]}"
        return None

    def update(self, peers: Iterable[control_pb2.Peer]) -> set[str]:
        """Replace the peer list; returns the ids of peers lost (gone, or back with a new incarnation)."""
        new = {p.endpoint.worker_id: p for p in peers if p.endpoint.worker_id != self.worker_id}
        lost = {
            wid
            for wid, old in self.peers.items()
            if wid not in new or new[wid].incarnation != old.incarnation
        }
        for wid in lost:
            self.drop(wid)
        for wid, peer in new.items():
            if wid not in self.peers or wid in lost:
                log.info("peer joined", peer=wid, control=peer.endpoint.control_address)
        self.peers = new
        return lost

    def drop(self, worker_id: str) -> None:
        cached = self._dealers.pop(worker_id, None)
        if cached is not None:
            cached[1].close()
        log.info("peer lost", peer=worker_id)

    def close(self) -> None:
        for _, sock in self._dealers.values():
            sock.close()
        self._dealers.clear()

"""The worker's links to its peers: one cached DEALER per peer for P<->D control messages, and the
peer keys this worker's ROUTER admits.

A peer is known from the coordinator's `Peers` list, or first from the `WorkerEndpoint` inside a
Prefill/Decode/Reassign (the lists may lag a request). A peer that leaves the list, or comes back
under a new incarnation, is "lost": its DEALER is closed and the role aborts every transfer with it.

Trust: only the coordinator (an authenticated, server-verified link) introduces peers, with each
peer's CurveZMQ public key (`WorkerEndpoint.control_public_key`). `allows(key)` is the ZAP decision of
this worker's ROUTER; `authentic(worker_id, key)` checks that a message under a peer's routing id came
from that peer's key. Under --insecure-control-plane every key is "".
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import structlog
import zmq.asyncio

from splitserve.control import ControlSocket, CurveKeys
from splitserve.v1 import control_pb2, serving_pb2

log = structlog.get_logger(__name__)


class PeerLinks:
    """Owned by the worker's event loop. `update()` applies a Peers list and connects at once to every
    listed peer whose role is in `partners` (P to D, D to P); `dealer()` connects any other on first use.

    Why at once: with CURVE a new connection's handshake needs the ZAP decision of the peer's event
    loop, which under load waits behind that peer's steps; connected when the peer joins, the
    handshake is done before the first request needs the link, and no request of a burst waits for it."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        worker_id: str,
        kv_layout_hash: str,
        keys: CurveKeys | None = None,
        partners: frozenset[serving_pb2.WorkerRole.ValueType] = frozenset(),
    ) -> None:
        self.ctx = ctx
        self.worker_id = worker_id
        self.kv_layout_hash = kv_layout_hash
        self.keys = keys
        self.partners = partners
        self.peers: dict[str, control_pb2.Peer] = {}
        self._learned: dict[str, str] = {}  # worker id -> key, from endpoints in work messages
        self._dealers: dict[str, tuple[str, str, ControlSocket]] = {}
        self._changed = asyncio.Event()  # set (and cleared) whenever the known peers change

    def dealer(self, endpoint: control_pb2.WorkerEndpoint) -> ControlSocket:
        """The cached DEALER to `endpoint`'s ROUTER (identity = this worker's id), connected on first
        use; with CURVE it only talks to the holder of `endpoint.control_public_key`."""
        key = endpoint.control_public_key
        cached = self._dealers.get(endpoint.worker_id)
        if cached is not None and cached[:2] == (endpoint.control_address, key):
            return cached[2]
        if cached is not None:  # same id, new address or key: a restarted peer
            cached[2].close()
        server_key = key.encode("ascii", "replace") if self.keys is not None else None
        sock = ControlSocket.dealer(
            self.ctx, endpoint.control_address, identity=self.worker_id, keys=self.keys, server_key=server_key
        )
        self._dealers[endpoint.worker_id] = (endpoint.control_address, key, sock)
        return sock

    def learn(self, endpoint: control_pb2.WorkerEndpoint) -> None:
        """A peer named by the coordinator in a work message (it may precede the Peers list)."""
        if endpoint.worker_id and endpoint.worker_id != self.worker_id:
            self._learned[endpoint.worker_id] = endpoint.control_public_key
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_allowed(self, key: str) -> bool:
        """Wait until `allows(key)` (the caller bounds the wait): a peer's first connection may beat
        the Peers list that introduces it."""
        while not self.allows(key):
            await self._changed.wait()
        return True

    def key_of(self, worker_id: str) -> str | None:
        peer = self.peers.get(worker_id)
        return peer.endpoint.control_public_key if peer is not None else self._learned.get(worker_id)

    def authentic(self, worker_id: str, key: str) -> bool:
        """True when `worker_id` is a peer the coordinator introduced and `key` is its key."""
        return self.key_of(worker_id) == key

    def allows(self, key: str) -> bool:
        """ZAP decision for a connection to this worker's ROUTER: the key of a known peer."""
        return bool(key) and (
            key in self._learned.values()
            or any(p.endpoint.control_public_key == key for p in self.peers.values())
        )

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
            self._learned.pop(wid, None)  # the list is the authority from now on
        self.peers = new
        for peer in new.values():
            if peer.role in self.partners:
                self.dealer(peer.endpoint)
        self._notify()
        return lost

    def drop(self, worker_id: str) -> None:
        cached = self._dealers.pop(worker_id, None)
        if cached is not None:
            cached[2].close()
        self._learned.pop(worker_id, None)
        log.info("peer lost", peer=worker_id)

    def close(self) -> None:
        for *_, sock in self._dealers.values():
            sock.close()
        self._dealers.clear()

"""Content routing: who holds a CID.

The blob service needs two things from the network: announce "I hold this"
and ask "who holds this". :class:`ContentRouting` is that much and no more, so
the service runs over the real Kademlia DHT (:class:`DhtRouting`, provider
records) in a node and over :class:`MemoryRouting` (a shared dict) in unit
tests, with no other difference.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Protocol

from libp2p.kad_dht.kad_dht import KadDHT
from libp2p.peer.peerinfo import PeerInfo

from pcp_p2p.core.errors import PeerError


class ContentRouting(Protocol):
    async def provide(self, cid: str) -> None:
        """Announce that this node can serve ``cid``."""
        ...

    async def find_providers(self, cid: str) -> list[PeerInfo]:
        """Peers that announced ``cid`` (may include stale ones)."""
        ...


class DhtRouting:
    """Provider records in py-libp2p's Kademlia DHT.

    ``KadDHT.provide`` takes the CID string as the record key (it is hashed
    into the keyspace by py-libp2p). The DHT must already have peers in its
    routing table: connecting alone does not add them (see the py-libp2p notes).
    """

    def __init__(self, dht: KadDHT, *, count: int = 20) -> None:
        self.dht = dht
        self.count = count

    async def provide(self, cid: str) -> None:
        try:
            ok = await self.dht.provide(cid)
        except Exception as exc:  # py-libp2p raises assorted types from the network
            raise PeerError(f"DHT provide of {cid} failed: {exc}") from exc
        if not ok:
            raise PeerError(f"DHT provide of {cid} reached no peer")

    async def find_providers(self, cid: str) -> list[PeerInfo]:
        try:
            return list(await self.dht.find_providers(cid, self.count))
        except Exception as exc:
            raise PeerError(f"DHT find_providers for {cid} failed: {exc}") from exc


class MemoryRouting:
    """An in-memory provider table; one instance shared by the nodes of a test.

    Each node gets a view with :meth:`for_peer` so ``provide`` records *who*.
    """

    def __init__(self) -> None:
        self.table: dict[str, dict[str, PeerInfo]] = defaultdict(dict)

    def for_peer(self, info: PeerInfo) -> _MemoryView:
        return _MemoryView(self, info)


class _MemoryView:
    def __init__(self, shared: MemoryRouting, me: PeerInfo) -> None:
        self.shared = shared
        self.me = me

    async def provide(self, cid: str) -> None:
        self.shared.table[cid][self.me.peer_id.to_base58()] = self.me

    async def find_providers(self, cid: str) -> list[PeerInfo]:
        return list(self.shared.table.get(cid, {}).values())

"""Who may sit in a PCP node's Kademlia routing table: DHT servers that can be dialled.

A routing table is what other nodes' lookups walk, so every entry in it
costs: a lookup that reaches a peer which has gone, or which cannot be dialled,
waits out a timeout before it moves on. Under load ``pcp generate`` failed 4 of
4 times with a 10 s DHT timeout because servers kept short-lived clients
(``pcp run create``, ``pcp generate``), which advertise ``/ip4/0.0.0.0``, in
their tables. py-libp2p 0.8.1 lets them in two ways:

- a peer that opens a KAD stream is added with the server-mode check skipped
  (``KadDHT._do_handle_stream``: "Peer initiated a KAD stream, so they MUST
  support KAD server mode"), yet client-mode nodes send requests too;
- a peer whose only advertised addresses are unspecified (``0.0.0.0``,
  ``::``) is added like any other, and handed to others in ``closerPeers``.

:class:`ServersOnlyRoutingTable` refuses both, in PCP code rather than in the
installed library: an entry needs a dialable address and, once identify has
told us the peer's protocols, the KAD protocol among them. A peer that opened a
KAD stream before identify finished is looked at again once it has (a short,
bounded wait in the table's own nursery), so a server that dialled us still
gets in. :class:`PcpKadDHT` is a ``KadDHT`` with that table.
"""

from __future__ import annotations

import ipaddress
import logging
from collections import Counter
from collections.abc import Iterable

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.kad_dht.common import PROTOCOL_ID
from libp2p.kad_dht.kad_dht import KadDHT
from libp2p.kad_dht.routing_table import RoutingTable
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

log = logging.getLogger("pcp.dht")

# How long a peer that opened a KAD stream before identify finished may take to
# show its protocols before it is left out (identify is one round trip).
IDENTIFY_WAIT_S = 10.0
IDENTIFY_POLL_S = 0.1  # py-libp2p sets no event when identify completes: the peerstore is read again
MAX_PENDING = 256  # peers awaiting that check at once; more are simply not added


def is_unspecified(addr: multiaddr.Multiaddr) -> bool:
    """True for ``/ip4/0.0.0.0/...`` and ``/ip6/::/...``: a listen address, not one anyone can dial."""
    for proto in ("ip4", "ip6"):
        try:
            value = addr.value_for_protocol(proto)
        except Exception:
            continue
        try:
            return ipaddress.ip_address(value).is_unspecified
        except ValueError:
            return False
    return False


def dialable(addrs: Iterable[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
    """The addresses of ``addrs`` another node could dial (unspecified ones dropped)."""
    return [a for a in addrs if not is_unspecified(a)]


def expand_unspecified(addrs: list[multiaddr.Multiaddr], local_ips: Iterable[str]) -> list[multiaddr.Multiaddr]:
    """``/ip4/0.0.0.0/tcp/P`` as ``/ip4/<ip>/tcp/P`` for each local IPv4 address, others kept.

    Used as the host's ``addrs_factory``: what identify advertises to peers is
    then something they can dial (and keep in their routing tables), not the
    wildcard a node listens on.
    """
    ips = list(local_ips)
    out: list[multiaddr.Multiaddr] = []
    for a in addrs:
        s = str(a)
        if s.startswith("/ip4/0.0.0.0/"):
            out.extend(multiaddr.Multiaddr(s.replace("/ip4/0.0.0.0/", f"/ip4/{ip}/", 1)) for ip in ips)
        else:
            out.append(a)
    return list({str(a): a for a in out}.values())


class ServersOnlyRoutingTable(RoutingTable):
    """A routing table that holds only DHT servers with a dialable address (see the module docstring)."""

    def __init__(self, local_id: ID, host: IHost, **kw: int | None) -> None:
        super().__init__(local_id, host, **kw)  # type: ignore[arg-type]
        self.refused: Counter[str] = Counter()  # why peers were kept out: for tests and debugging
        self._pending: set[ID] = set()
        self._nursery: trio.Nursery | None = None

    def start_periodic_refresh(self, nursery: trio.Nursery) -> None:
        """KadDHT.run hands its nursery here: the deferred checks run in it too."""
        self._nursery = nursery
        super().start_periodic_refresh(nursery)

    def _protocols(self, peer_id: ID) -> list[str] | None:
        """The peer's protocols as identify reported them; None while not known."""
        try:
            protocols = self.host.get_peerstore().get_protocols(peer_id)
        except Exception:
            return None
        return [str(p) for p in protocols] if protocols else None

    def _addrs(self, peer_obj: PeerInfo | ID) -> tuple[ID, list[multiaddr.Multiaddr]]:
        if isinstance(peer_obj, PeerInfo):
            return peer_obj.peer_id, list(peer_obj.addrs)
        try:
            return peer_obj, list(self.host.get_peerstore().addrs(peer_obj))
        except Exception:
            return peer_obj, []

    async def add_peer(self, peer_obj: PeerInfo | ID, *, skip_server_mode_check: bool = False) -> bool:
        """Add a DHT server with a dialable address; refuse clients and wildcard-only peers.

        ``skip_server_mode_check`` (py-libp2p sets it for a peer that opened a
        KAD stream) is not trusted: a client opens KAD streams too. Such a peer
        whose protocols are not known yet is checked again once identify has
        run, in the background; the stream it opened is served meanwhile.
        """
        peer_id, addrs = self._addrs(peer_obj)
        if peer_id == self.local_id:
            return False
        good = dialable(addrs)
        protocols = self._protocols(peer_id)
        if protocols is not None and str(PROTOCOL_ID) not in protocols:
            return self._refuse(peer_id, "not a DHT server")
        if protocols is None and skip_server_mode_check:
            self._check_later(peer_id)
            return False
        if not good:
            return self._refuse(peer_id, "no dialable address")
        return await super().add_peer(PeerInfo(peer_id, good))

    def _refuse(self, peer_id: ID, why: str) -> bool:
        self.refused[why] += 1
        if self.peer_in_table(peer_id):
            self.remove_peer(peer_id)  # it was let in before its protocols were known
        log.debug("routing table: %s left out (%s)", peer_id, why)
        return False

    def _check_later(self, peer_id: ID) -> None:
        if self._nursery is None or peer_id in self._pending or len(self._pending) >= MAX_PENDING:
            return
        self._pending.add(peer_id)
        self._nursery.start_soon(self._add_once_identified, peer_id)

    async def _add_once_identified(self, peer_id: ID) -> None:
        try:
            with trio.move_on_after(IDENTIFY_WAIT_S):
                while self._protocols(peer_id) is None:
                    await trio.sleep(IDENTIFY_POLL_S)
            if self._protocols(peer_id) is None:
                self._refuse(peer_id, "identify did not answer")
                return
            await self.add_peer(peer_id)
        except Exception as exc:  # a background check must never take the DHT down
            log.debug("routing table: deferred check of %s failed: %s", peer_id, exc)
        finally:
            self._pending.discard(peer_id)


class PcpKadDHT(KadDHT):
    """``KadDHT`` whose routing table is a :class:`ServersOnlyRoutingTable`."""

    routing_table: ServersOnlyRoutingTable

    def __init__(self, host: IHost, *args: object, **kwargs: object) -> None:
        super().__init__(host, *args, **kwargs)  # type: ignore[arg-type]
        old = self.routing_table
        self.routing_table = ServersOnlyRoutingTable(
            self.local_peer_id, host,
            max_peers_per_subnet=old.max_peers_per_subnet,
            max_peers_per_subnet_table=old.max_peers_per_subnet_table,
        )
        self.peer_routing.routing_table = self.routing_table
        if self.rt_refresh_manager is not None:  # random walk: not used by PCP, kept consistent anyway
            self.rt_refresh_manager.routing_table = self.routing_table

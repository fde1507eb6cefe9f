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
installed library: an entry needs a dialable address that is not a relay
circuit (a NAT'd home asks the DHT, it is never asked through a relay) and,
once identify has told us the peer's protocols, the KAD protocol among them. A peer that opened a
KAD stream before identify finished is looked at again once it has (a short,
bounded wait in the table's own nursery), so a server that dialled us still
gets in. :class:`PcpKadDHT` is a ``KadDHT`` with that table, and with
``get_value``/``put_value`` driven by the machines of :mod:`pcp_p2p.dht.lookup`
(start from the routing table, ask in parallel, stop early, finish stores and
corrections off the caller's path) on the same KAD wire protocol.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.kad_dht.common import PROTOCOL_ID
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT, _encode_key
from libp2p.kad_dht.pb.kademlia_pb2 import Message, Record
from libp2p.kad_dht.routing_table import RoutingTable, peer_id_to_key
from libp2p.kad_dht.utils import xor_distance
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.records.validator import NamespacedValidator

from pcp_p2p.core import addrs as addr_rules
from pcp_p2p.core.errors import PcpError
from pcp_p2p.core.faults import Boundary
from pcp_p2p.core.logs import LogOnce
from pcp_p2p.dht import rpc
from pcp_p2p.dht.lookup import (
    GET_QUORUM,
    HEDGE_S,
    PUT_QUORUM,
    REFRESHED_REPLICAS,
    ClosestWalk,
    K,
    StoreFanout,
    ValueLookup,
)

log = logging.getLogger("pcp.dht")

# How long a peer that opened a KAD stream before identify finished may take to
# show its protocols before it is left out (identify is one round trip).
IDENTIFY_WAIT_S = 10.0
IDENTIFY_POLL_S = 0.1  # py-libp2p sets no event when identify completes: the peerstore is read again
MAX_PENDING = 256  # peers awaiting that check at once; more are simply not added
RPC_TIMEOUT_S = 5.0  # one GET_VALUE / PUT_VALUE / FIND_NODE; a lookup asks another peer meanwhile
MAX_BACKGROUND = 32  # puts' remainders and entry corrections running at once; beyond, the caller waits
MIN_START_PEERS = 5  # fewer in the routing table: connected peers are asked too (as py-libp2p does)


def is_unspecified(addr: multiaddr.Multiaddr) -> bool:
    """True for ``/ip4/0.0.0.0/...`` and ``/ip6/::/...``: a listen address, not one anyone can dial."""
    return addr_rules.is_unspecified(addr)


def dialable(peer_addrs: Iterable[multiaddr.Multiaddr],
             networks: Sequence[addr_rules.IPNetwork] = ()) -> list[multiaddr.Multiaddr]:
    """The addresses of ``peer_addrs`` this node could dial: unspecified ones dropped, and private
    ones outside our ``networks`` (another home's ``10.x``), :func:`pcp_p2p.core.addrs.dialable_here`."""
    return [multiaddr.Multiaddr(a) for a in addr_rules.dialable_here(peer_addrs, networks)]


def direct_addrs(addrs: Iterable[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
    """Those of ``addrs`` that are not relay circuits."""
    return [a for a in addrs if addr_rules.CIRCUIT not in str(a)]


class ServersOnlyRoutingTable(RoutingTable):
    """A routing table that holds only DHT servers with a dialable address (see the module docstring)."""

    def __init__(
        self, local_id: ID, host: IHost, *,
        max_peers_per_subnet: int | None = None, max_peers_per_subnet_table: int = 0,
        networks: Sequence[addr_rules.IPNetwork] = (),
    ) -> None:
        super().__init__(local_id, host, max_peers_per_subnet=max_peers_per_subnet,
                         max_peers_per_subnet_table=max_peers_per_subnet_table)
        self.networks = tuple(networks)  # ours: whose private addresses we could dial
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
        peer_id, peer_addrs = self._addrs(peer_obj)
        if peer_id == self.local_id:
            return False
        good = dialable(peer_addrs, self.networks)
        protocols = self._protocols(peer_id)
        if protocols is not None and str(PROTOCOL_ID) not in protocols:
            return self._refuse(peer_id, "not a DHT server")
        if protocols is None and skip_server_mode_check:
            self._check_later(peer_id)
            return False
        if not good:
            return self._refuse(peer_id, "no dialable address")
        direct = direct_addrs(good)
        if not direct:
            # A home behind a NAT advertises only circuits through its relay: every lookup
            # that walked through it would cost the relay, which lends its bandwidth for
            # control traffic only. Such a node asks the DHT (a client, in effect) and is
            # never asked: on the network lab its KAD streams were most of the relay's bytes
            # (docs/connectivity.md, run 12).
            return self._refuse(peer_id, "reachable only through a relay")
        return await super().add_peer(PeerInfo(peer_id, direct))

    def could_hold(self, peer_id: ID) -> bool:
        """Whether this table would take ``peer_id`` as it stands (a DHT server, as far as identify
        told, with a dialable address that is not a relay circuit): who else a lookup may ask."""
        protocols = self._protocols(peer_id)
        if protocols is not None and str(PROTOCOL_ID) not in protocols:
            return False
        return bool(direct_addrs(dialable(self._addrs(peer_id)[1], self.networks)))

    def _refuse(self, peer_id: ID, why: str) -> bool:
        self.refused[why] += 1
        if self.peer_in_table(peer_id):
            self.remove_peer(peer_id)  # it was let in before its protocols were known
        log.debug("routing table: %s left out (%s)", peer_id, why)
        return False

    def _check_later(self, peer_id: ID) -> None:
        if self._nursery is None or peer_id in self._pending or len(self._pending) >= MAX_PENDING:
            return
        if _start_in(self._nursery, self._add_once_identified, peer_id):
            self._pending.add(peer_id)

    async def _add_once_identified(self, peer_id: ID) -> None:
        try:
            with trio.move_on_after(IDENTIFY_WAIT_S):
                while self._protocols(peer_id) is None:  # noqa: ASYNC110 (no event to wait on: see IDENTIFY_POLL_S)
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

    def __init__(
        self,
        host: IHost,
        mode: DHTMode,
        *,
        validator: NamespacedValidator | None = None,
        validator_changed: bool = False,
        strict_validation: bool = False,
        networks: Sequence[addr_rules.IPNetwork] = (),
    ) -> None:
        super().__init__(host, mode, validator=validator, validator_changed=validator_changed,
                         strict_validation=strict_validation)
        old = self.routing_table
        self.networks = tuple(networks)  # this node's networks (pcp_p2p.core.addrs.local_networks)
        self.routing_table = ServersOnlyRoutingTable(
            self.local_peer_id, host,
            max_peers_per_subnet=old.max_peers_per_subnet,
            max_peers_per_subnet_table=old.max_peers_per_subnet_table,
            networks=self.networks,
        )
        self.peer_routing.routing_table = self.routing_table
        if self.rt_refresh_manager is not None:  # random walk: not used by PCP, kept consistent anyway
            self.rt_refresh_manager.routing_table = self.routing_table
        self.boundary = Boundary(LogOnce(log))  # judges background work's errors (open_node passes the node's)

    def _add_closer_peers_to_response(
        self, response: Message, closest_peers: Sequence[ID], exclude_peer_id: ID | None = None,
    ) -> None:
        """py-libp2p 0.8.1's closerPeers (FIND_NODE, GET_VALUE, GET_PROVIDERS answers), with only
        the addresses the asker could dial (:func:`pcp_p2p.core.addrs.dialable_by`): another home's
        private address, or an unspecified one, is never handed to a stranger. A peer's signed peer
        record goes along only when it names no address held back (it cannot be trimmed).

        A GET_PROVIDERS answer's provider entries get the same rule here: py-libp2p builds them
        inline, from the provider store, just before it calls this, and this is the one hook
        between them and the wire. The store keeps what each provider said of itself when it
        announced, which is a private address for one recorded before its reachability verdict."""
        super()._add_closer_peers_to_response(response, closest_peers, exclude_peer_id)
        asker = _remote_ip(self.host, exclude_peer_id)
        for peer in [*response.closerPeers, *response.providerPeers]:
            raw = list(peer.addrs)
            kept = []
            for b in raw:
                try:
                    a = multiaddr.Multiaddr(b)
                except Exception:
                    continue
                if addr_rules.dialable_by([a], asker, self.networks):
                    kept.append(b)
            if len(kept) != len(raw):
                del peer.addrs[:]
                peer.addrs.extend(kept)
                peer.ClearField("signedRecord")


    # -- lookups (pcp_p2p.dht.lookup) ---------------------------------------------------

    _background: int = 0
    _idle: trio.Event | None = None

    async def wait_idle(self) -> None:
        """Until no background work (a put's replication, an entry correction) is running:
        for benchmarks and tests that must not time one operation's leftovers into the next."""
        while self._background:
            if self._idle is None or self._idle.is_set():
                self._idle = trio.Event()
            await self._idle.wait()

    def _distance_to(self, key_bytes: bytes) -> Callable[[ID], int]:
        target = hashlib.sha256(key_bytes).digest()
        cache: dict[ID, int] = {}

        def distance(peer: ID) -> int:
            if peer not in cache:
                cache[peer] = xor_distance(peer_id_to_key(peer), target)
            return cache[peer]

        return distance

    def _start_peers(self, key_bytes: bytes) -> tuple[list[ID], bool]:
        """The routing table's closest peers to the key, and whether the table is thin.

        A thin table (fewer than ``MIN_START_PEERS``: the node is bootstrapping)
        is topped up with connected peers, as py-libp2p does, and the operation
        asks them all at once and learns from every answer, instead of trusting
        the table's few entries to be the closest.
        """
        peers = self.routing_table.find_local_closest_peers(key_bytes, K)
        thin = len(peers) < MIN_START_PEERS
        if thin:  # (clients, and homes reachable only through a relay, left out: as the table does)
            known = [p for p in self.host.get_connected_peers() if self.routing_table.could_hold(p)]
            peers = list(dict.fromkeys([*peers, *known]))
        return [p for p in peers if p != self.local_peer_id], thin

    def _newer(self, key: str) -> Callable[[bytes, bytes], bool]:
        def newer(a: bytes, b: bytes) -> bool:
            assert self.validator is not None
            return self.validator.select(key, [b, a]) == 1

        return newer

    def _valid(self, key: str, value: bytes) -> bool:
        assert self.validator is not None
        try:
            self.validator.validate(key, value)
            return True
        except Exception as exc:
            log.debug("dropping an invalid value for %s: %s", key, exc)
            return False

    async def get_value(self, key: str, quorum: int = 0) -> bytes | None:
        """The newest valid value of ``key``: the local replica, else a :class:`ValueLookup`.

        Peers are asked ``ALPHA`` at a time from the routing table's closest;
        the lookup stops at ``quorum`` (default ``GET_QUORUM``) valid answers.
        The winner is kept locally; replicas found stale are corrected in the
        background.
        """
        if self.validator is None:
            raise ValueError("Validator required for DHT operations")
        key_bytes = key.encode("utf-8")
        local = self.value_store.get(key_bytes)
        if local is not None:
            return local.value
        start, thin = self._start_peers(key_bytes)
        lookup: ValueLookup[ID] = ValueLookup(self._distance_to(key_bytes), self._newer(key),
                                             started_at=trio.current_time(),
                                             quorum=quorum or (len(start) if thin else GET_QUORUM),
                                             hedge_s=0.0 if thin else HEDGE_S)
        lookup.add_candidates(start)
        records: dict[bytes, Record] = {}

        async def query(peer: ID) -> tuple[bytes | None, list[ID]]:
            rec, closer = await rpc.get_value(self.host, peer, key_bytes, closer_if_found=thin or lookup.quorum > 1,
                                              networks=self.networks, boundary=self.boundary)
            if rec is None or not self._valid(key, rec.value):
                return None, closer
            records.setdefault(rec.value, rec)
            return rec.value, closer

        await self._drive(lookup, query, thin, "GET_VALUE")
        if lookup.best is None:
            return None
        best = records[lookup.best]
        self.value_store.put_record(key_bytes, best)
        stale = lookup.stale_peers()
        if stale:
            await self._off_path(self._store_at_all, stale, key_bytes, lookup.best)
        return lookup.best

    async def find_providers(self, key: str, count: int = 20) -> list[PeerInfo]:
        """Providers of ``key`` (a CID): the local provider store's, else a :class:`ValueLookup`
        with GET_PROVIDERS that stops at the first answer naming any.

        Why not py-libp2p 0.8.1's own: without a local record it first walks the network
        (FIND_NODE, each answer ~5 KB of signed peer records) and then asks every peer the
        walk found. Provider records are announced at ``REFRESHED_REPLICAS`` peers (every
        holder announces its own copy, every round), so most nodes hold none for a given
        CID, and a fetch without a hint paid that walk (issue #15).
        """
        key_bytes = _encode_key(key)
        local = self.provider_store.get_providers(key_bytes)
        if local:
            return local[:count]
        start, thin = self._start_peers(key_bytes)
        # (a lookup with no "newer": any answer naming providers ends it)
        lookup: ValueLookup[ID] = ValueLookup(self._distance_to(key_bytes), lambda a, b: False,
                                             started_at=trio.current_time(), hedge_s=0.0 if thin else HEDGE_S)
        lookup.add_candidates(start)
        found: dict[ID, PeerInfo] = {}

        async def query(peer: ID) -> tuple[bytes | None, list[ID]]:
            providers, closer = await rpc.get_providers(self.host, peer, key_bytes, networks=self.networks,
                                                        boundary=self.boundary)
            for info in providers:
                found.setdefault(info.peer_id, info)
            return (b"providers" if providers else None), closer

        await self._drive(lookup, query, thin, "GET_PROVIDERS")
        return list(found.values())[:count]

    async def _drive(
        self, lookup: ValueLookup[ID], query: Callable[[ID], Awaitable[tuple[bytes | None, list[ID]]]],
        thin: bool, what: str,
    ) -> None:
        """Run ``lookup`` to its end: ``query(peer)`` is one request (its valid value, or None,
        and the closer peers it named), at most ``RPC_TIMEOUT_S`` each; one more in flight each
        ``HEDGE_S`` without an answer. Peers that answer are learned (and those they name, while
        the table is ``thin``)."""
        changed = trio.Event()
        async with trio.open_nursery() as nursery:

            def launch() -> None:
                for peer in lookup.next_queries(trio.current_time()):
                    nursery.start_soon(ask, peer)
                if lookup.done:
                    nursery.cancel_scope.cancel()

            async def ask(peer: ID) -> None:
                nonlocal changed
                result = None
                with trio.move_on_after(RPC_TIMEOUT_S):
                    try:
                        result = await query(peer)
                    except PcpError as exc:
                        log.debug("%s at %s: %s", what, peer, exc)
                if result is None:
                    lookup.on_failure(peer)
                else:
                    value, closer = result
                    lookup.on_answer(peer, value, closer)
                    await self._learn([peer, *closer] if thin else [peer])
                launch()
                changed.set()

            launch()
            while not lookup.done:  # hedging: one more query in flight each HEDGE_S without an answer
                with trio.move_on_at(lookup.next_wakeup(trio.current_time())):
                    await changed.wait()
                changed = trio.Event()
                launch()

    async def put_value(self, key: str, value: bytes, *, replicas: int = K, checkup: bool = True) -> None:
        """Store locally, then at the routing table's ``replicas`` closest peers at once.

        Returns once ``PUT_QUORUM`` stores were acknowledged (or all answered);
        the remaining stores, and (with ``checkup``) a :class:`ClosestWalk` that
        stores at any closer peer it finds, finish in the background.

        Fewer replicas and no walk are for a record its author replaces every few
        seconds (a shepherd's lease): it needs no k copies to survive churn, since the
        next put makes them again, and k copies plus a walk per put cost its author
        O(N) of uplink a put up to k = 20 (issue #15).
        """
        if self.validator is None:
            raise ValueError("Validator required for DHT operations")
        self.validator.validate(key, value)
        key_bytes = key.encode("utf-8")
        old = self.value_store.get(key_bytes)
        if old is not None and old.value != value and self.validator.select(key, [value, old.value]) != 0:
            raise ValueError("Refusing to replace newer value with the older one")
        self.value_store.put(key_bytes, value)

        async def store(peer: ID) -> bool:
            return await self._store_at(peer, key_bytes, value)

        start, thin = self._start_peers(key_bytes)
        fanout = await self._spread(key_bytes, start[:replicas], thin, store, checkup=checkup)
        if fanout.acked == 0 and fanout.failed:
            log.debug("put of %s: no peer acknowledged the store", key)

    async def provide(self, key: str, *, replicas: int = REFRESHED_REPLICAS) -> bool:
        """Announce that this node provides ``key`` (a CID): ADD_PROVIDER at the routing table's
        ``replicas`` closest peers, without :meth:`put_value`'s check-up walk, and True once a
        peer acknowledged it.

        Why so few: every holder of a blob announces its own copy (each worker, of each
        round's checkpoint, update and Δ), and peers mostly fetch by the hint the message
        naming a blob carries. At k peers and with a walk, each announcement reached every
        node of a small swarm: O(N) announcements a round at the shepherd, and a walk answer
        (~5 KB of signed peer records) per announcement (issue #15). A fetch without a hint
        finds the records with :meth:`find_providers` (one GET_PROVIDERS at the key's closest
        peers, not py-libp2p's walk, which this would have made the common case).

        Why not py-libp2p 0.8.1's own: it first walks the network for the closest peers
        (FIND_NODE, three at a time, until no answer brings a closer one), and every answer
        names up to 20 peers with their signed records, about 10 KB. In a swarm the routing
        table already holds the closest peers (a 16-node swarm's table holds them all), so that
        walk asked every node for nothing new: a shepherd paid it for each round's checkpoint,
        and every worker that announced the checkpoint it fetched asked the shepherd too
        (issue #15: most of the shepherd's DHT bytes that were not lease puts). A thin table is
        topped up with the connected peers it could hold (:meth:`_start_peers`), not walked
        py-libp2p's way: that walk asks every peer in the peerstore, homes behind NATs through
        their relays included, and a swarm whose only public nodes are a few (three on the
        network lab) keeps a thin table for good (docs/connectivity.md, run 12).
        """
        key_bytes = _encode_key(key)
        start, thin = self._start_peers(key_bytes)
        self.provider_store.providing_keys.add(key_bytes)  # (py-libp2p's republishing reads this)
        self.provider_store.add_provider(key_bytes, PeerInfo(self.local_peer_id, list(self.host.get_addrs())))

        async def announce(peer: ID) -> bool:
            with trio.move_on_after(RPC_TIMEOUT_S):
                try:
                    return await rpc.add_provider(self.host, peer, key_bytes, boundary=self.boundary)
                except PcpError as exc:
                    log.debug("ADD_PROVIDER at %s: %s", peer, exc)
            return False

        return (await self._spread(key_bytes, start[:replicas], thin, announce, checkup=False)).acked > 0

    async def _spread(
        self, key_bytes: bytes, start: list[ID], thin: bool, store: Callable[[ID], Awaitable[bool]],
        *, checkup: bool = True,
    ) -> StoreFanout[ID]:
        """``store`` at the ``start`` peers (closest first) until ``PUT_QUORUM`` acknowledged (all
        of them when the table is ``thin``); the rest, and (with ``checkup``) any closer peer a
        walk finds, in the background (:meth:`_replicate`)."""
        fanout: StoreFanout[ID] = StoreFanout(quorum=len(start) if thin else PUT_QUORUM)
        fanout.add_targets(start)
        async with trio.open_nursery() as nursery:

            def launch() -> None:
                for peer in fanout.next_urgent():
                    nursery.start_soon(store_one, peer)

            async def store_one(peer: ID) -> None:
                ok = await store(peer)
                fanout.on_result(peer, ok)
                if ok:
                    await self._learn([peer])
                launch()

            launch()
        await self._off_path(self._replicate, key_bytes, fanout, store, checkup)
        return fanout

    async def _replicate(
        self, key_bytes: bytes, fanout: StoreFanout[ID], store: Callable[[ID], Awaitable[bool]], checkup: bool,
    ) -> None:
        """The rest of a put, one RPC at a time (gentle on a shared CPU): the remaining closest
        peers of the routing table, then (``checkup``) a :class:`ClosestWalk` storing at any closer
        peer it finds."""
        for peer in fanout.rest():
            fanout.on_result(peer, await store(peer))
        if not checkup:
            return
        walk: ClosestWalk[ID] = ClosestWalk(self._distance_to(key_bytes), alpha=1)
        walk.add(self._start_peers(key_bytes)[0])
        while not walk.done:
            for peer in walk.next_queries():
                closer: list[ID] | None = None
                with trio.move_on_after(RPC_TIMEOUT_S):
                    try:  # GET_VALUE, not FIND_NODE: see pcp_p2p.dht.rpc
                        closer = (await rpc.get_value(self.host, peer, key_bytes, networks=self.networks,
                                                      boundary=self.boundary))[1]
                    except PcpError as exc:
                        log.debug("GET_VALUE (closer peers) at %s: %s", peer, exc)
                if closer is None:
                    walk.on_failure(peer)
                    continue
                await self._learn([peer, *closer])
                fanout.add_targets(walk.on_answer(peer, closer))
                for new in fanout.rest():
                    fanout.on_result(new, await store(new))

    async def _learn(self, peers: list[ID]) -> None:
        """Peers that answered a KAD request, or that one named, go into the routing table (as
        py-libp2p's own lookups add them; the table's rules still apply)."""
        for peer in peers:
            if peer != self.local_peer_id and not self.routing_table.peer_in_table(peer):
                await self.routing_table.add_peer(peer)

    async def _store_at(self, peer: ID, key_bytes: bytes, value: bytes) -> bool:
        """PUT_VALUE at one peer; False when it refused (it may hold a newer value) or did not answer."""
        with trio.move_on_after(RPC_TIMEOUT_S):
            try:
                return await rpc.put_value(self.host, peer, key_bytes, value, boundary=self.boundary)
            except PcpError as exc:
                log.debug("PUT_VALUE at %s: %s", peer, exc)
        return False

    async def _store_at_all(self, peers: list[ID], key_bytes: bytes, value: bytes) -> None:
        async with trio.open_nursery() as nursery:
            for peer in peers:
                nursery.start_soon(self._store_at, peer, key_bytes, value)

    def _spawn(self, fn: Callable[..., Awaitable[object]], *args: object) -> bool:
        """Start ``fn(*args)`` in the DHT's own nursery, off the caller's path; False when there
        is none (not running), it is closed (stopping) or ``MAX_BACKGROUND`` jobs already run:
        the caller then awaits it."""
        nursery = self.routing_table._nursery
        if nursery is None or self._background >= MAX_BACKGROUND:
            return False

        async def job() -> None:
            try:
                await _quietly(self.boundary, fn, *args)
            finally:
                self._background -= 1
                if not self._background and self._idle is not None:
                    self._idle.set()

        if not _start_in(nursery, job):
            return False
        self._background += 1  # (counted once started: start_soon never runs the job before returning)
        return True

    async def _off_path(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        """Run ``fn(*args)`` in the background if the budget allows, else here."""
        if not self._spawn(fn, *args):
            await _quietly(self.boundary, fn, *args)


def _remote_ip(host: IHost, peer: ID | None) -> str | None:
    """The IP a direct connection to ``peer`` comes from; None when unknown (no peer, relayed)."""
    if peer is None:
        return None
    try:
        for conn in host.get_network().get_connections(peer):
            if any("/p2p-circuit" in str(a) for a in conn.get_transport_addresses()):
                continue
            ip: str = conn.muxed_conn.get_remote_address()[0]  # type: ignore[attr-defined]  # not in IMuxedConn
            return ip
    except Exception:
        return None
    return None


def _start_in(nursery: trio.Nursery, fn: Callable[..., Awaitable[object]], *args: object) -> bool:
    """``nursery.start_soon(fn, *args)``; False when that nursery is closed. The DHT's nursery is
    not the caller's: a node task, or a KAD stream handler, may ask for background work while
    the DHT service is stopping, and trio refuses a closed nursery with a RuntimeError that
    would take the caller's nursery, and the node with it, down on the way out."""
    try:
        nursery.start_soon(fn, *args)
    except RuntimeError:  # "Nursery is closed to new arrivals"
        return False
    return True


async def _quietly(boundary: Boundary, fn: Callable[..., Awaitable[object]], *args: object) -> None:
    """Background DHT work must never take the DHT down: its errors are judged by the boundary's rule
    (:mod:`pcp_p2p.core.faults`: a bug logged with its traceback and counted; a peer's bad answer or
    absence counted, and logged only at debug) and dropped."""
    try:
        await fn(*args)
    except Exception as exc:
        boundary.judge("self", exc, "dht", level=logging.DEBUG)

"""The node: one py-libp2p host, its Kademlia DHT and gossipsub, in one trio nursery.

:func:`open_node` is the only way to get a running :class:`Node`; leaving its
``async with`` block stops everything it started, in order (our own tasks
first, then gossipsub, pubsub, the DHT, and the host last: stopping pubsub
while messages are still being handled has crashed py-libp2p hosts).

Tasks a node runs, each a thin pump around sans-IO logic:

- *bootstrap*: dial the bootstrap servers (any one answering is enough; none
  answering is retried with back-off, not fatal), add them to the DHT routing
  table and refresh it — connecting alone does not fill a py-libp2p routing
  table (see shared/notes/py-libp2p.md);
- *discovery*: keep connections to the peers the DHT and membership know, so
  gossipsub has a mesh and not just a star around the bootstrap server;
- *record*: keep this node's signed member record current (re-signed when it
  changes or about half its lifetime has passed, jittered per node) and published in the DHT;
- *swim*: carry :class:`~pcp_p2p.net.membership.Membership`'s SWIM packets
  over ``/pcp/swim/1.0.0`` streams and feed it clock ticks and replies; answer
  other nodes' probes (budgeted per peer and in total);
- *status*: answer ``/pcp/status/1.0.0``;
- *reachability*: judge from what peers observe whether this node is public,
  hole-punchable or relay-only, and behind a NAT keep a reservation on the
  bootstrap relays and advertise the relayed address
  (:mod:`pcp_p2p.net.connectivity`; relays and DCUtR run on every node).

Every network operation has a deadline (``op_timeout``).
"""

from __future__ import annotations

import errno
import logging
import random
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.kad_dht import DHTMode
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID, PROTOCOL_ID_V11, GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.records.validator import NamespacedValidator
from libp2p.tools.anyio_service import background_trio_service

from pcp_p2p import __version__
from pcp_p2p.blob.routing import DhtRouting
from pcp_p2p.blob.service import BlobService
from pcp_p2p.blob.store import BlobStore
from pcp_p2p.core.addrs import local_networks
from pcp_p2p.core.errors import ConfigError, PcpError, PeerTimeout
from pcp_p2p.core.faults import WORLD_BROKE, Blame, Boundary, LocalFaults
from pcp_p2p.core.identity import Identity, load_or_create_identity
from pcp_p2p.core.logs import LogOnce
from pcp_p2p.dht.lookup import K
from pcp_p2p.dht.records import KindRule, SignedRecord, record_key, sign_record, verify_record
from pcp_p2p.dht.table import PcpKadDHT
from pcp_p2p.dht.validator import PcpRecordValidator
from pcp_p2p.net import yamux_credit
from pcp_p2p.net.advertise import Advertiser, expand_listen, install
from pcp_p2p.net.budget import Budget, Limits, Rate, RateLimits
from pcp_p2p.net.capabilities import Capabilities, probe
from pcp_p2p.net.connectivity import (
    Connectivity,
    RelayBudget,
    connect,
    is_circuit,
    is_public_ip,
)
from pcp_p2p.net.membership import (
    DEFAULT_PERIOD_S,
    MAX_PACKET,
    SWIM_PROTOCOL,
    MemberJoined,
    MemberLeft,
    MemberRecord,
    Membership,
    MembershipEvent,
    Refute,
    Send,
    SwimConfig,
    SwimPacket,
)
from pcp_p2p.net.reachability import HOLE_PUNCHABLE, RELAY_ONLY, known, takes_dials
from pcp_p2p.net.swarm_key import read_swarm_key
from pcp_p2p.net.traffic import Traffic, count_host_traffic
from pcp_p2p.node.doctor import SPEED_PROTOCOL, SpeedServer, measure
from pcp_p2p.node.messaging import LINE_PROTOCOL, MSG_PROTOCOL, Messenger
from pcp_p2p.node.record_kinds import RECORD_KINDS
from pcp_p2p.node.status import (
    MAX_REQUEST,
    STATUS_PROTOCOL,
    MemberStatus,
    StatusReply,
    StatusRequest,
    split_rejected,
)
from pcp_p2p.wire import decode, encode
from pcp_p2p.wire.framing import read_frame, reset_quietly, write_frame

log = logging.getLogger("pcp.node")

# worker: a member that trains; bootstrap: a DHT server that only introduces
# peers; client: a short-lived node run by a command (pcp run create), not a member.
ROLES = ("worker", "bootstrap", "client")
KAD_K = 20  # Kademlia's bucket size in py-libp2p: a refresh queries about this many peers


@dataclass
class NodeConfig:
    data_dir: Path
    listen: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    bootstrap: tuple[str, ...] = ()
    role: str = "worker"
    client_mode: bool = False
    swarm_key: Path | None = None
    backend: str = "auto"
    swim: SwimConfig = field(default_factory=SwimConfig)
    # Inbound /pcp/swim streams: a probe is one small packet each way.
    swim_streams_per_peer: int = 4
    swim_streams_total: int = 64
    # ... and how often: an honest peer sends a node about one probe a second plus
    # gossip pushes (fan-out 2 every 0.5 s) while there is news, so 10/s is ample.
    swim_rate: RateLimits = field(default_factory=lambda: RateLimits(
        per_peer_s=10.0, per_peer_burst=20.0, total_s=200.0, total_burst=400.0))
    min_peers: int = 8  # connections the discovery loop keeps open (probes dial the rest on demand)
    op_timeout: float = 10.0
    record_ttl: float = 600.0
    benchmark_s: float = 0.25
    max_connections: int = 64
    max_storage_bytes: int = 10 * 1024**3  # blob store (artifacts, θ, checkpoints); pinned content is never evicted
    # Inbound /pcp/msg budgets (pcp_p2p.net.budget, docs/security.md): concurrent
    # streams and buffered bytes, one peer's share and the total for all peers. A
    # frame must arrive within op_timeout + size / msg_min_rate of its stream opening.
    msg_streams_per_peer: int = 8
    msg_streams_total: int = 64
    msg_bytes_per_peer: int = 24 * 1024**2  # three frames of HARD_MAX_SIZE at once
    msg_bytes_total: int = 128 * 1024**2
    msg_small_reserve: int = 8 * 1024**2  # of the total, kept for frames of 64 KiB or less (control messages)
    msg_min_rate: float = 1024**2  # bytes/s; a sender's own deadline (op_timeout per send) asks more
    # Inbound /pcp/line streams (Messenger.post: heartbeats): one kept stream per peer, this
    # many in all; closed after line_idle_s without a frame; frames paced like SWIM's probes
    # (a holder beats 4 times a second).
    lines_total: int = 128
    line_idle_s: float = 30.0
    line_rate: RateLimits = field(default_factory=lambda: RateLimits(
        per_peer_s=20.0, per_peer_burst=40.0, total_s=400.0, total_burst=800.0))
    # Pre-measured capabilities (tests, or a restart within one process).
    capabilities: Capabilities | None = None
    # Offer circuit relay v2 reservations (HOP) to nodes behind NAT, within relay_budget
    # (control traffic only). None: on for bootstrap servers, off for workers (--relay).
    relay: bool | None = None
    relay_budget: RelayBudget = field(default_factory=RelayBudget)
    extra_status: dict[str, Callable[[], Any]] = field(default_factory=dict)
    # The record kinds its DHT stores and serves: every kind of the protocol (a benchmark adds its own).
    record_kinds: Mapping[str, KindRule] = field(default_factory=lambda: RECORD_KINDS)
    # This node is rank 0 of an MPI worker group (pcp_p2p.cluster.group.WorkerGroup): its
    # runs' inner loops spread over the group's ranks. None: a node on its own.
    worker_group: Any = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"unknown role {self.role!r}")
        if self.role == "client":
            # A short-lived client asks the DHT but serves nothing: in client mode
            # it never lands in the servers' routing tables (pcp_p2p/dht/table.py).
            self.client_mode = True
        if not self.listen:
            raise ConfigError("a node needs at least one --listen address")
        if self.relay is None:
            self.relay = self.role == "bootstrap"


def parse_peer_addr(addr: str) -> PeerInfo:
    """A full multiaddr ``/ip4/.../tcp/.../p2p/<id>`` as a PeerInfo, or ConfigError."""
    try:
        return info_from_p2p_addr(multiaddr.Multiaddr(addr))
    except Exception as exc:
        raise ConfigError(f"not a full multiaddr with /p2p/<peer id>: {addr!r}") from exc


def transport_addrs(addrs: tuple[str, ...] | list[str]) -> list[multiaddr.Multiaddr]:
    """The dialable part (``/p2p/<id>`` stripped) of each well-formed direct address (relayed ones
    need the relay client: :meth:`Node.connect`)."""
    out = []
    for a in addrs:
        if is_circuit(a):
            continue
        try:
            out.append(multiaddr.Multiaddr(a.split("/p2p/")[0]))
        except Exception:
            continue
    return out


def _parse_listen(addr: str) -> multiaddr.Multiaddr:
    try:
        return multiaddr.Multiaddr(addr)
    except Exception as exc:
        raise ConfigError(f"not a multiaddr: {addr!r}") from exc


def check_can_bind(host: str, port: int, what: str) -> None:
    """Refuse (ConfigError "cannot <what>: <why>") a TCP address this process could not own alone.

    py-libp2p 0.8.1's TCP listener sets SO_REUSEPORT (for hole punching), and
    two sockets that both set it share a port: a second ``pcp bootstrap`` on a
    taken port started with another peer id and the kernel split incoming
    connections between the two processes. Binding once, the way a sole owner
    does (SO_REUSEADDR for TIME_WAIT leftovers, never SO_REUSEPORT), fails with
    EADDRINUSE while anyone listens there, so it is checked before the host
    starts. Two nodes started within the same few milliseconds can still both
    pass; that window is the price of keeping py-libp2p's transport unchanged.
    Port 0 (any free port) always passes.
    """
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as exc:
        why = (exc.strerror or str(exc)).lower()
        if exc.errno == errno.EADDRINUSE:
            why += " (another process is listening there: stop it or choose another port)"
        raise ConfigError(f"cannot {what}: {why}") from exc
    except OverflowError as exc:  # a port above 65535
        raise ConfigError(f"cannot {what}: port out of range") from exc


def check_listen_addrs(listen: list[multiaddr.Multiaddr]) -> None:
    """:func:`check_can_bind` for every ``/ip4|ip6/.../tcp/PORT`` listen address."""
    for ma in listen:
        try:
            port = int(ma.value_for_protocol("tcp"))
        except Exception:
            continue  # not TCP: the transport reports its own errors
        host = None
        for proto in ("ip4", "ip6"):
            try:
                host = ma.value_for_protocol(proto)
                break
            except Exception:
                continue
        if host is not None:
            check_can_bind(host, port, f"listen on {ma}")


class Node:
    """A running PCP node. Get one from :func:`open_node`."""

    def __init__(
        self,
        config: NodeConfig,
        identity: Identity,
        capabilities: Capabilities,
        host: IHost,
        dht: PcpKadDHT,
        pubsub: Pubsub,
        blobs: BlobService,
        nursery: trio.Nursery,
        connectivity: Connectivity,
    ) -> None:
        self.config = config
        self.identity = identity
        self.capabilities = capabilities
        self.host = host
        self.dht = dht
        self.pubsub = pubsub
        self.blobs = blobs
        self.nursery = nursery
        self.connectivity = connectivity
        self.peer_id = identity.peer_id
        self.started_at = time.time()
        self._boot = int(self.started_at * 1000)
        self._started_mono = trio.current_time()
        self._record_seq = 0
        self.membership = Membership(self.peer_id, config=config.swim, announce=config.role == "worker")
        self.swim_budget = Budget(
            Limits(streams_per_peer=config.swim_streams_per_peer, streams_total=config.swim_streams_total,
                   bytes_per_peer=config.swim_streams_per_peer * MAX_PACKET,
                   bytes_total=config.swim_streams_total * MAX_PACKET),
            name="swim",
        )
        self.swim_rate = Rate(config.swim_rate, name="swim")
        self.runs: set[str] = set()  # runs this node takes part in (advertised in its member record)
        self.leads: set[str] = set()  # runs this node is the shepherd of (advertised likewise)
        self.state = "idle"
        self.messenger = Messenger(self)
        self.record_validator = PcpRecordValidator(config.record_kinds)  # replaced by open_node with the DHT's own
        self.bootstrapped = trio.Event()
        # The error boundary (pcp_p2p.core.faults): rejected inputs by reason ("swim:BadSignature", ...),
        # and this node's own bugs met while handling them (local_faults), for status and metrics. One
        # per node: open_node hands the same one to the blob server, the DHT and the speed server.
        self.boundary = blobs.boundary
        self.log_once = self.boundary.log_once
        self.rejected: Counter[str] = self.boundary.rejected
        self._changed = trio.Event()
        self._signed_record: SignedRecord | None = None
        self._record: MemberRecord | None = None  # what _signed_record says, to see when it changes
        self._record_bytes = b""
        self._record_signed_at = 0.0
        self._refresh_after = self._refresh_interval()
        self._aged_signings = 0  # re-signings for age: each is published to the DHT

    # -- change notification -------------------------------------------------------

    def _notify(self) -> None:
        """Wake everyone waiting in :meth:`wait_until` (membership changed, input rejected)."""
        self._changed.set()
        self._changed = trio.Event()

    def _reject(self, peer: str, exc: BaseException, what: str) -> Blame:
        """Whatever a handler of ``peer``'s input raised: the peer's, the world's or our fault
        (:mod:`pcp_p2p.core.faults`), counted and logged as such."""
        blame = self.boundary.judge(peer, exc, what)
        self._notify()
        return blame

    async def wait_until(self, predicate: Callable[[], bool], timeout: float) -> None:
        """Wait, on events rather than polling, until ``predicate()`` holds."""
        with trio.fail_after(timeout):
            while not predicate():
                await self._changed.wait()

    # -- addresses --------------------------------------------------------------

    def addrs(self) -> list[str]:
        """This node's own listen addresses, dialable from this machine (``/p2p/<id>`` included):
        what ``pcp node join`` prints and writes to ``node.addr`` for local tools. What others
        are told to dial is :meth:`advertised_addrs`."""
        listen = [str(a).split("/p2p/")[0] for a in self.host.get_transport_addrs()]
        ips = _local_ipv4s() if any(a.startswith("/ip4/0.0.0.0/") for a in listen) else []
        return [f"{a}/p2p/{self.peer_id}" for a in expand_listen(listen, ips)]

    def advertised_addrs(self) -> list[str]:
        """What this node tells others to dial (member record, status, and through the host
        identify and the DHT): one rule from the reachability verdict (:mod:`pcp_p2p.net.advertise`)."""
        return [str(a) for a in self.host.get_addrs()]

    def side_reachable(self, peer_id: str) -> bool:
        """Whether a blob side channel (a TCP port the serving peer opens, dialled at the address
        its libp2p connection comes from) can reach ``peer_id``: only a public peer's, or one whose
        verdict is not known. Behind a NAT that address is the router's, which drops the SYN: each
        fetch from a home then lost a connect timeout before the stream path took over, and a
        checkpoint fetched from a home missed the commit's replication wait (network lab,
        2026-11-24: a public node missed rounds 1 and 2). Homes on one LAN use the stream path."""
        member = self.membership.get(peer_id)
        return member is None or takes_dials(member.record.reachability)

    async def connect(self, peer: ID, addrs: tuple[str, ...] | list[str]) -> None:
        """Open a connection to ``peer`` at ``addrs``: direct ones first, then through its relays."""
        await connect(self.host, peer, addrs, self.connectivity.transport)

    # -- member record -------------------------------------------

    def member_record(self) -> MemberRecord:
        return MemberRecord(
            peer_id=self.peer_id,
            addrs=tuple(self.advertised_addrs()),
            role=self.config.role,
            started_at=self.started_at,
            capabilities=self.capabilities,
            runs=tuple(sorted(self.runs)),
            leads=tuple(sorted(self.leads)),
            state=self.state,
            reachability=self.connectivity.reachability,
        )

    def _signed_member_record(self, *, refute: bool = False) -> SignedRecord:
        """The current signed record, re-signed when it changes, when about half its
        lifetime has passed (:meth:`_refresh_interval`), or (``refute``) to answer a suspicion with a higher seq."""
        now = time.time()
        record = self.member_record()
        signed = self._signed_record
        aged = signed is not None and now - self._record_signed_at > self._refresh_after
        changed = signed is None or self._record != record
        if signed is None or refute or aged or changed:
            self._aged_signings += aged
            self._record_seq += 1
            signed = self._signed_record = sign_record(
                self.identity, "member", self.peer_id, record,
                ttl_s=self.config.record_ttl, seq=self._record_seq, now=now,
            )
            self._record_bytes = encode(signed)
            self._record = record
            self._record_signed_at = now
            self._refresh_after = self._refresh_interval()
            self.membership.set_self(self._record_bytes, now=trio.current_time(), wall_now=now,
                                     news=refute or changed)
            self.membership.set_interest(self.runs | self.leads)
        return signed

    def _refresh_interval(self) -> float:
        """When to re-sign (and re-publish) the record for age: about half its lifetime,
        jittered per node (0.4-0.6). Without the jitter, nodes started together re-signed
        and re-put their records in the same second five minutes later: 32 DHT puts and
        32 new incarnations at once starved a 2-core machine for seconds, and probes went
        unanswered long enough for live nodes to be declared dead."""
        return self.config.record_ttl * random.uniform(0.4, 0.6)

    async def _record_loop(self) -> None:
        """Keep the member record current (runs, state and addresses change) and in the DHT.

        The DHT copy is put when the record's content changes and when it is re-signed
        for age (:meth:`_refresh_interval`), not on every re-signing: a refutation re-signs to raise the
        incarnation, and a DHT put (a lookup, then a store at ~20 peers) per
        refutation turned a CPU-starved moment into a storm.
        """
        published: tuple[MemberRecord | None, int] = (None, 0)
        while True:
            signed = self._signed_member_record()
            if (self.config.role == "worker" and self.bootstrapped.is_set()
                    and published != (self._record, self._aged_signings)):
                published = (self._record, self._aged_signings)
                self.nursery.start_soon(self._put_member_record, signed)
            await trio.sleep(DEFAULT_PERIOD_S)

    async def _put_member_record(self, signed: SignedRecord) -> None:
        try:
            await self.put_record(signed)
        except PcpError as exc:
            self.log_once("self", exc, "member record put failed")

    async def put_record(self, signed: SignedRecord, *, timeout: float | None = None, replicas: int = K,
                         checkup: bool = True) -> None:
        """Store a signed record in the DHT (with a deadline; ``replicas`` and ``checkup``: see
        :meth:`PcpKadDHT.put_value`)."""
        with trio.move_on_after(timeout or self.config.op_timeout) as scope:
            try:
                await self.dht.put_value(signed.key, encode(signed), replicas=replicas, checkup=checkup)
            except trio.Cancelled:
                raise
            except Exception as exc:
                raise self.boundary.failure(exc, "dht", f"DHT put of {signed.key}") from exc  # (our bug: InternalFault)
        if scope.cancelled_caught:
            raise PeerTimeout(f"DHT put of {signed.key} timed out")

    async def get_record(self, kind: str, name: str) -> Any:
        """Fetch and verify a record from the DHT; returns its payload or None."""
        key = record_key(kind, name)
        with trio.move_on_after(self.config.op_timeout) as scope:
            try:
                value = await self.dht.get_value(key)
            except trio.Cancelled:
                raise
            except Exception as exc:
                raise self.boundary.failure(exc, "dht", f"DHT get of {key}") from exc
        if scope.cancelled_caught:
            raise PeerTimeout(f"DHT get of {key} timed out")
        if value is None:
            return None
        return verify_record(value, kinds=self.config.record_kinds, key=key).payload

    # -- SWIM ------------------------------------------------------------------------

    def _on_membership(self, events: list[MembershipEvent], sender: str = "?") -> None:
        for exc in self.membership.take_errors():
            self._reject(sender, exc, "swim")
        if not events:
            return
        self._notify()
        for ev in events:
            if isinstance(ev, MemberJoined):
                log.info("member joined: %s", ev.peer_id)
            elif isinstance(ev, MemberLeft):
                # an eviction from a full view is routine in a large swarm (it stays a member)
                (log.debug if ev.reason == "evicted" else log.info)(
                    "member left: %s (%s, silent %.1f s)", ev.peer_id, ev.reason, ev.silent_s)

    async def _swim_loop(self) -> None:
        """Tick the SWIM machine and carry out what it asks (probes, indirect probes, syncs)."""
        while True:
            effects, events = self.membership.tick(trio.current_time())
            self._on_membership(events)
            for effect in effects:
                if isinstance(effect, Refute):
                    self._signed_member_record(refute=True)
                elif isinstance(effect, Send):
                    self.nursery.start_soon(self._swim_exchange, effect)
            await trio.sleep(0.1)

    async def _swim_exchange(self, send: Send) -> bool:
        """One request and its reply; the reply goes to the machine. Failures are silence (SWIM's timeouts)."""
        pid = ID.from_base58(send.peer)
        with trio.move_on_after(send.timeout_s):
            try:
                if pid not in self.host.get_network().connections:
                    await self.connect(pid, send.addrs)
                stream = await self.host.new_stream(pid, [TProtocol(SWIM_PROTOCOL)])
            except trio.Cancelled:
                raise
            except Exception as exc:
                log.debug("swim: cannot reach %s: %s", send.peer, exc)
                return False
            try:
                await write_frame(stream, encode(send.packet), timeout=send.timeout_s)
                reply = decode(await read_frame(stream, max_size=MAX_PACKET, timeout=send.timeout_s), SwimPacket)
                self._on_membership(self.membership.receive(send.peer, reply, trio.current_time()), send.peer)
                return reply.kind != "nack"
            except WORLD_BROKE as exc:  # silence: SWIM's timeouts deal with it
                log.debug("swim: exchange with %s failed: %s", send.peer, exc)
            except Exception as exc:  # the boundary: a bad reply is the peer's, a bug ours
                self._reject(send.peer, exc, "swim")
            finally:
                await reset_quietly(stream)
        return False

    async def _handle_swim(self, stream: INetStream) -> None:
        try:
            peer = stream.muxed_conn.peer_id.to_base58()
        except Exception:
            await reset_quietly(stream)
            return
        try:
            self.swim_rate.take(peer, trio.current_time())
            with self.swim_budget.open(peer) as reservation:
                reservation.reserve(MAX_PACKET)
                timeout = self.config.swim.probe_timeout_s
                packet = decode(await read_frame(stream, max_size=MAX_PACKET, timeout=timeout), SwimPacket)
                reply, relay, events = self.membership.respond(peer, packet, trio.current_time())
                self._on_membership(events, peer)
                if relay is not None:
                    acked = await self._swim_exchange(relay)
                    reply = self.membership.relay_result(peer, packet, acked)
                if reply is not None:
                    await write_frame(stream, encode(reply), timeout=timeout)
                await stream.close()
        except WORLD_BROKE as exc:  # the prober gave up or went away: not bad input
            log.debug("swim: %s went away mid-exchange: %s", peer, exc)
            await reset_quietly(stream)
        except Exception as exc:  # the boundary: bad input is the peer's, a broken stream nobody's, a bug ours
            self._reject(peer, exc, "swim")
            await reset_quietly(stream)

    async def _join(self, info: PeerInfo) -> None:
        """Sync with one bootstrap server: its sample of signed records is how a joiner learns the swarm."""
        addrs = tuple(f"{a}/p2p/{info.peer_id.to_base58()}" for a in info.addrs)
        self.membership.add_seed(info.peer_id.to_base58(), addrs)
        packet = self.membership.join(trio.current_time())
        await self._swim_exchange(Send(info.peer_id.to_base58(), addrs, packet, self.config.op_timeout))

    # -- bootstrap and discovery --------------------------------------------------

    async def _dial(self, info: PeerInfo) -> bool:
        with trio.move_on_after(self.config.op_timeout):
            try:
                await self.host.connect(info)
                await self.dht.add_peer(info.peer_id)
                return True
            except trio.Cancelled:
                raise
            except Exception as exc:
                log.debug("dial %s failed: %s", info.peer_id, exc)
        return False

    async def _bootstrap_loop(self) -> None:
        infos = [parse_peer_addr(a) for a in self.config.bootstrap]
        delay = 1.0

        async def one(info: PeerInfo, answered: list[bool]) -> None:
            answered.append(await self._dial(info))

        while infos:
            answered: list[bool] = []
            async with trio.open_nursery() as n:
                for info in infos:
                    n.start_soon(one, info, answered)
            if any(answered):
                for info in infos:
                    self.nursery.start_soon(self._join, info)
                break
            log.warning("no bootstrap server answered (%d tried); retrying in %.0f s", len(infos), delay)
            await trio.sleep(delay)
            delay = min(delay * 2, 30.0)
        await self._refresh()
        self.bootstrapped.set()
        log.info("bootstrapped: %d peers in the routing table", self.dht.get_routing_table_size())

    async def _refresh(self) -> None:
        with trio.move_on_after(self.config.op_timeout):
            try:
                await self.dht.refresh_routing_table()
            except trio.Cancelled:
                raise
            except Exception as exc:
                log.debug("routing table refresh failed: %s", exc)

    async def _discovery_loop(self) -> None:
        """Fill the routing table, then leave it to py-libp2p's own 10-minute refresh.

        A refresh queries up to k = 20 peers: refreshing every few seconds, as the
        first design did, made an idle node's cost grow with the swarm up to k. So
        this loop refreshes (at 2, 6, 14, 30 ... s, at most every 5 minutes) only
        while the table holds fewer peers than the membership view suggests it
        could, and tops connections up to ``min_peers`` (probes dial the rest).
        """
        await self.bootstrapped.wait()
        period = 2.0
        while True:
            await trio.sleep(period)
            if self.dht.get_routing_table_size() < min(KAD_K, len(self.membership)):
                await self._refresh()
            for pid in self.dht.routing_table.get_peer_ids():
                if len(self.host.get_network().connections) >= self.config.min_peers:
                    break
                if pid not in self.host.get_network().connections:
                    addrs = self.host.get_peerstore().addrs(pid)
                    if addrs:
                        await self._dial(PeerInfo(pid, addrs))
            period = min(period * 2, 300.0)

    async def _reachability_loop(self) -> None:
        """Judge reachability from peers' observations; behind a NAT, hold a relay reservation.

        Observations arrive with identify, just after the bootstrap connection:
        the verdict is checked every second for the first 30 s, then every 15 s.
        Behind a NAT, each bootstrap server is asked for a reservation until one
        grants it (servers with ``relay`` off refuse); a lost reservation (the
        relay restarted) is asked for again. The verdict is logged once, and
        again when it changes (the ``pcp node join`` start-up line). Peers that
        DCUtR gave up on get new attempts after a back-off.
        """
        conn = self.connectivity
        await self.bootstrapped.wait()
        started = trio.current_time()
        bandwidth: list[str] = []  # the start-up line's figures, once measured
        measured = trio.Event()
        measuring = False

        async def measure_links() -> None:
            """Bandwidth to up to 3 bootstrap servers at public addresses (pcp doctor's test), for the
            start-up line; none on a local swarm (127.0.0.1, a LAN), where it would only load the CPU."""
            speeds = []
            for addr in self.config.bootstrap[:3]:
                try:
                    ma = multiaddr.Multiaddr(addr)
                    peer = info_from_p2p_addr(ma).peer_id
                    if not is_public_ip(ma.value_for_protocol("ip4")):
                        continue
                except Exception:
                    continue
                speeds.append(await measure(self.host, peer, 1 << 20, 2 << 20, timeout=20.0))
            ok = [s for s in speeds if s.error is None]
            if ok:
                up = sorted(s.up_mbit or 0.0 for s in ok)[len(ok) // 2]
                down = sorted(s.down_mbit or 0.0 for s in ok)[len(ok) // 2]
                bandwidth.append(f"bandwidth to {len(ok)} peer{'s' * (len(ok) > 1)}: up {up:.1f} Mbit/s, "
                                 f"down {down:.1f} Mbit/s")
            measured.set()

        while True:
            before = (conn.reachability, tuple(conn.relayed_addrs(self.peer_id)))
            conn.update()
            if conn.reachability in (HOLE_PUNCHABLE, RELAY_ONLY) and not conn.relayed_addrs(self.peer_id):
                for addr in self.config.bootstrap:
                    if await conn.reserve(addr, self.nursery, self.config.op_timeout):
                        log.info("relay reservation on %s", addr)
                        break
            for peer in conn.rearm_hole_punching(trio.current_time()):
                log.debug("hole punching to %s: trying again", peer)
            if (conn.reachability, tuple(conn.relayed_addrs(self.peer_id))) != before:
                self._notify()
            if conn.addrs_changed():  # peers learned our addresses at connection time: correct them
                self.nursery.start_soon(conn.push_addrs, self.config.op_timeout)
            # The first verdict on a real network (never on 127.0.0.1: nobody public observes
            # us there) comes with the bandwidth to a few peers, measured once.
            late = trio.current_time() - started > 30
            if conn.reachability != "unknown" and conn.reported is None and not measuring:
                measuring = True
                self.nursery.start_soon(measure_links)
            if (conn.reachability != "unknown" and (measured.is_set() or conn.reported is not None)) or late:
                line = conn.report(self.peer_id, bandwidth[0] if bandwidth else "")
                if line is not None:
                    log.info("%s", line)
            await trio.sleep(1.0 if trio.current_time() - started < 30 else 15.0)

    # -- status -------------------------------------------------------------------

    def _traffic(self) -> dict[str, Any]:
        """Every byte this node moved (``bytes_in``/``bytes_out``) and the blob side channels'
        part of it (``blob_bytes_in``/``blob_bytes_out``; the rest is control traffic)."""
        blob = self.blobs.traffic
        if blob is None:
            return {}
        whole = blob.parent or blob
        split = {"protocol_bytes": whole.protocols.snapshot()} if whole.protocols is not None else {}
        return {**whole.snapshot(), **{f"blob_{k}": v for k, v in blob.snapshot().items()}, **split}

    def status(self, members: bool = True) -> StatusReply:
        now = trio.current_time()
        member_list = tuple(
            MemberStatus(
                peer_id=m.record.peer_id,
                addrs=m.record.addrs,
                role=m.record.role,
                capabilities=m.record.capabilities,
                state=m.record.state,
                last_seen_s=round(max(0.0, now - m.last_seen), 3),
                suspect=m.suspect_since is not None,
                reachability=known(m.record.reachability),
            )
            for m in self.membership.live()
        ) if members else ()
        network = {
            "connected_peers": len(self.host.get_network().connections),
            "routing_table_size": self.dht.get_routing_table_size(),
            "dht_mode": self.dht.mode.name.lower(),
            "reachability": self.connectivity.reachability,
            "listen_addrs": self.addrs(),  # this node's own (advertised: the reply's addrs)
            "relayed_addrs": self.connectivity.relayed_addrs(self.peer_id),
            "relay_hop": self.connectivity.hop,
            "relayed_bytes": self.connectivity.protocol.relayed_bytes,
            "relayed_from": dict(self.connectivity.protocol.relayed_from),
            "connections": self.connectivity.connection_kinds(),
            "rejected": dict(self.rejected),
            # this node's own bugs met while handling peers' input (never counted as their rejection)
            "dropped": dict(self.boundary.dropped),  # exchanges a stalled or vanished peer broke off
            "local_faults": self.boundary.faults.total,
            "local_fault_kinds": dict(self.boundary.faults.counts),
            "membership_msgs": self.membership.stats.sent + self.membership.stats.received,
            "membership": {**self.membership.stats.as_dict(), "view": len(self.membership),
                           "suspected": len(self.membership.suspected()), "health": self.membership.health,
                           "rate_refused": dict(self.swim_rate.refusals)},
            # the same counts split for people: "rejected 321" alarmed in a healthy swarm
            **dict(zip(("refused_bad_input", "stale_or_duplicate"), split_rejected(dict(self.rejected)))),
            **self._traffic(),
            **self.blobs.swarm.as_status(),
        }
        extra = {"storage": self.blobs.store.usage(),
                 **{name: fn() for name, fn in self.config.extra_status.items()}}
        return StatusReply(
            peer_id=self.peer_id,
            addrs=tuple(self.advertised_addrs()),
            version=__version__,
            role=self.config.role,
            uptime_s=round(now - self._started_mono, 3),
            capabilities=self.capabilities,
            members=member_list,
            network=network,
            extra=extra,
        )

    async def _handle_status(self, stream: INetStream) -> None:
        try:
            peer = stream.muxed_conn.peer_id.to_base58()
        except Exception:
            peer = "?"
        try:
            req = decode(
                await read_frame(stream, max_size=MAX_REQUEST, timeout=self.config.op_timeout),
                StatusRequest,
            )
            await write_frame(stream, encode(self.status(req.members)), timeout=self.config.op_timeout)
            await stream.close()
        except Exception as exc:  # the boundary: a bad request is the peer's, a bug in status() ours
            self._reject(peer, exc, "status")
            await reset_quietly(stream)



def _local_ipv4s() -> list[str]:
    import ifaddr

    ips = ["127.0.0.1"]
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str) and not ip.ip.startswith("127."):
                ips.append(ip.ip)
    return ips


@asynccontextmanager
async def open_node(config: NodeConfig, *, identity: Identity | None = None) -> AsyncIterator[Node]:
    """Start a node; it runs until the ``async with`` block ends."""
    yamux_credit.install()  # go-yamux's window-update rule: a third of the frames per small RPC
    identity = identity or load_or_create_identity(config.data_dir)
    listen = [_parse_listen(a) for a in config.listen]
    for a in config.bootstrap:
        parse_peer_addr(a)  # fail fast on a typo, before anything starts
    check_listen_addrs(listen)  # a taken port is refused, not shared (SO_REUSEPORT)
    psk = read_swarm_key(config.swarm_key) if config.swarm_key else None
    caps = config.capabilities
    if caps is None:
        caps = await trio.to_thread.run_sync(lambda: probe(config.backend, benchmark_s=config.benchmark_s))
    local_ips = _local_ipv4s()
    # py-libp2p's auto-connector dials every peer it has heard of every 30 s until
    # it holds 100 connections: in a swarm that makes connections, and their
    # upkeep, grow with N. Probes dial on demand; keep only min_peers warm.
    connections = ConnectionConfig(min_connections=config.min_peers, low_watermark=config.min_peers)
    host = new_host(key_pair=identity.key_pair, psk=psk, listen_addrs=listen, connection_config=connections)
    # What identify, the DHT and the member record advertise: one rule, from the verdict
    # (pcp_p2p/net/advertise.py); never 0.0.0.0, never a private address from behind a NAT.
    advertiser = Advertiser(identity.peer_id, local_ips)
    install(host, advertiser)
    faults = LocalFaults()  # the node's own bugs, whichever boundary met them (Node.boundary, blobs, DHT)
    boundary = Boundary(LogOnce(log), faults)  # the one rule, shared by every boundary of the node
    record_validator = PcpRecordValidator(config.record_kinds, faults=faults)
    validator = NamespacedValidator({"pcp": record_validator}, strict_validation=True)
    dht = PcpKadDHT(
        host,
        DHTMode.CLIENT if config.client_mode else DHTMode.SERVER,
        validator=validator,
        validator_changed=True,
        strict_validation=True,
        networks=local_networks(),  # whose private addresses its table keeps and passes on
    )
    dht.boundary = boundary
    gossipsub = GossipSub(
        protocols=[PROTOCOL_ID_V11, PROTOCOL_ID],
        degree=6,
        degree_low=4,
        degree_high=12,
        heartbeat_interval=1,
    )
    pubsub = Pubsub(host, gossipsub, strict_signing=True)
    store = BlobStore(config.data_dir / "blobs", config.max_storage_bytes)
    traffic = Traffic()
    count_host_traffic(host, traffic)
    blobs = BlobService(host, store, DhtRouting(dht), identity, traffic=Traffic(parent=traffic), boundary=boundary)
    connectivity = Connectivity(host, hop=bool(config.relay), budget=config.relay_budget, local_ips=local_ips,
                                advertiser=advertiser)
    async with host.run(listen_addrs=listen), connectivity.running():
        async with background_trio_service(dht), background_trio_service(pubsub), background_trio_service(gossipsub):
            await pubsub.wait_until_ready()
            async with trio.open_nursery() as nursery:
                node = Node(config, identity, caps, host, dht, pubsub, blobs, nursery, connectivity)
                node.record_validator = record_validator
                blobs.side_reachable = node.side_reachable
                blobs.register()
                host.set_stream_handler(TProtocol(STATUS_PROTOCOL), node._handle_status)
                host.set_stream_handler(MSG_PROTOCOL, node.messenger.handle)
                host.set_stream_handler(LINE_PROTOCOL, node.messenger.handle_line)
                host.set_stream_handler(TProtocol(SWIM_PROTOCOL), node._handle_swim)
                host.set_stream_handler(SPEED_PROTOCOL, SpeedServer(boundary=boundary).handle)  # pcp doctor's bandwidth
                node._signed_member_record()
                nursery.start_soon(node._record_loop)
                nursery.start_soon(node._swim_loop)
                nursery.start_soon(node._bootstrap_loop)
                nursery.start_soon(node._discovery_loop)
                if config.role != "client":
                    nursery.start_soon(node._reachability_loop)
                log.info("node %s (%s) listening on %s", node.peer_id, config.role, " ".join(node.addrs()))
                try:
                    yield node
                finally:
                    nursery.cancel_scope.cancel()

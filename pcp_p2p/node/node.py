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
- *heartbeat*: publish a signed member record to the DHT and a heartbeat over
  gossipsub every second;
- *membership*: feed received heartbeats and clock ticks to
  :class:`~pcp_p2p.node.membership.Membership`;
- *status*: answer ``/pcp/status/1.0.0``.

Every network operation has a deadline (``op_timeout``).
"""

from __future__ import annotations

import errno
import logging
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
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
from pcp_p2p.dht.kinds import register_all as register_all_kinds
from pcp_p2p.dht.records import SignedRecord, record_key, sign_record, verify_record
from pcp_p2p.dht.table import PcpKadDHT, expand_unspecified
from pcp_p2p.dht.validator import PcpRecordValidator
from pcp_p2p.errors import ConfigError, PcpError, PeerGone, PeerTimeout
from pcp_p2p.logs import LogOnce
from pcp_p2p.node.capabilities import Capabilities, probe
from pcp_p2p.node.identity import Identity, load_or_create_identity
from pcp_p2p.node.membership import (
    DEFAULT_INTERVAL_S,
    DEFAULT_TIMEOUT_S,
    HEARTBEAT_TOPIC,
    Heartbeat,
    MemberJoined,
    MemberLeft,
    MemberRecord,
    Membership,
)
from pcp_p2p.node.messaging import MSG_PROTOCOL, Messenger
from pcp_p2p.node.status import (
    MAX_REQUEST,
    STATUS_PROTOCOL,
    MemberStatus,
    StatusReply,
    StatusRequest,
    split_rejected,
)
from pcp_p2p.node.swarm_key import read_swarm_key
from pcp_p2p.node.traffic import Traffic, count_host_traffic
from pcp_p2p.wire import decode, encode
from pcp_p2p.wire.framing import read_frame, reset_quietly, write_frame

log = logging.getLogger("pcp.node")

# worker: a member that trains; bootstrap: a DHT server that only introduces
# peers; client: a short-lived node run by a command (pcp run create), not a member.
ROLES = ("worker", "bootstrap", "client")


@dataclass
class NodeConfig:
    data_dir: Path
    listen: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    bootstrap: tuple[str, ...] = ()
    role: str = "worker"
    client_mode: bool = False
    swarm_key: Path | None = None
    backend: str = "auto"
    heartbeat_interval: float = DEFAULT_INTERVAL_S
    member_timeout: float = DEFAULT_TIMEOUT_S
    op_timeout: float = 10.0
    record_ttl: float = 600.0
    benchmark_s: float = 0.25
    max_connections: int = 64
    max_storage_bytes: int = 10 * 1024**3  # blob store (artifacts, θ, checkpoints); pinned content is never evicted
    # Inbound /pcp/msg budgets (pcp_p2p.node.budget, docs/security.md): concurrent
    # streams and buffered bytes, one peer's share and the total for all peers. A
    # frame must arrive within op_timeout + size / msg_min_rate of its stream opening.
    msg_streams_per_peer: int = 8
    msg_streams_total: int = 64
    msg_bytes_per_peer: int = 24 * 1024**2  # three frames of HARD_MAX_SIZE at once
    msg_bytes_total: int = 128 * 1024**2
    msg_small_reserve: int = 8 * 1024**2  # of the total, kept for frames of 64 KiB or less (control messages)
    msg_min_rate: float = 1024**2  # bytes/s; a sender's own deadline (op_timeout per send) asks more
    # Pre-measured capabilities (tests, or a restart within one process).
    capabilities: Capabilities | None = None
    extra_status: dict[str, Callable[[], Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"unknown role {self.role!r}")
        if self.role == "client":
            # A short-lived client asks the DHT but serves nothing: in client mode
            # it never lands in the servers' routing tables (pcp_p2p/dht/table.py).
            self.client_mode = True
        if not self.listen:
            raise ConfigError("a node needs at least one --listen address")


def parse_peer_addr(addr: str) -> PeerInfo:
    """A full multiaddr ``/ip4/.../tcp/.../p2p/<id>`` as a PeerInfo, or ConfigError."""
    try:
        return info_from_p2p_addr(multiaddr.Multiaddr(addr))
    except Exception as exc:
        raise ConfigError(f"not a full multiaddr with /p2p/<peer id>: {addr!r}") from exc


def transport_addrs(addrs: tuple[str, ...] | list[str]) -> list[multiaddr.Multiaddr]:
    """The dialable part (``/p2p/<id>`` stripped) of each well-formed address."""
    out = []
    for a in addrs:
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
        dht: KadDHT,
        pubsub: Pubsub,
        blobs: BlobService,
        nursery: trio.Nursery,
    ) -> None:
        self.config = config
        self.identity = identity
        self.capabilities = capabilities
        self.host = host
        self.dht = dht
        self.pubsub = pubsub
        self.blobs = blobs
        self.nursery = nursery
        self.peer_id = identity.peer_id
        self.started_at = time.time()
        self._boot = int(self.started_at * 1000)
        self._started_mono = trio.current_time()
        self._seq = 0
        self._record_seq = 0
        self.membership = Membership(self.peer_id, timeout=config.member_timeout)
        self.runs: set[str] = set()  # runs this node takes part in (advertised in its member record)
        self.leads: set[str] = set()  # runs this node is the shepherd of (advertised likewise)
        self.state = "idle"
        self.messenger = Messenger(self)
        self.record_validator = PcpRecordValidator()  # replaced by open_node with the DHT's own
        self.bootstrapped = trio.Event()
        self.log_once = LogOnce(log)
        # Rejected inputs by reason ("heartbeat:StaleMessage", ...): for status and metrics.
        self.rejected: Counter[str] = Counter()
        self._changed = trio.Event()
        self._signed_record: SignedRecord | None = None
        self._record: MemberRecord | None = None  # what _signed_record says, to see when it changes
        self._record_bytes = b""
        self._record_signed_at = 0.0

    # -- change notification -------------------------------------------------------

    def _notify(self) -> None:
        """Wake everyone waiting in :meth:`wait_until` (membership changed, input rejected)."""
        self._changed.set()
        self._changed = trio.Event()

    def _reject(self, peer: str, exc: BaseException, what: str) -> None:
        self.rejected[f"{what}:{type(exc).__name__}"] += 1
        self.log_once(peer, exc, f"{what} rejected")
        self._notify()

    async def wait_until(self, predicate: Callable[[], bool], timeout: float) -> None:
        """Wait, on events rather than polling, until ``predicate()`` holds."""
        with trio.fail_after(timeout):
            while not predicate():
                await self._changed.wait()

    # -- addresses --------------------------------------------------------------

    def addrs(self) -> list[str]:
        """Dialable full multiaddrs of this node (``/p2p/<id>`` included)."""
        out: list[str] = []
        for ma in self.host.get_addrs():
            s = str(ma)
            if "/p2p/" not in s:
                s = f"{s}/p2p/{self.peer_id}"
            if s.startswith("/ip4/0.0.0.0/"):
                out.extend(s.replace("/ip4/0.0.0.0/", f"/ip4/{ip}/", 1) for ip in _local_ipv4s())
            else:
                out.append(s)
        return list(dict.fromkeys(out))

    # -- member record and heartbeats -------------------------------------------

    def member_record(self) -> MemberRecord:
        return MemberRecord(
            peer_id=self.peer_id,
            addrs=tuple(self.addrs()),
            role=self.config.role,
            started_at=self.started_at,
            capabilities=self.capabilities,
            runs=tuple(sorted(self.runs)),
            leads=tuple(sorted(self.leads)),
            state=self.state,
        )

    def _signed_member_record(self) -> SignedRecord:
        """The current signed record, re-signed when half its lifetime has passed."""
        now = time.time()
        record = self.member_record()
        if (
            self._signed_record is None
            or now - self._record_signed_at > self.config.record_ttl / 2
            or self._record != record
        ):
            self._record_seq += 1
            self._signed_record = sign_record(
                self.identity, "member", self.peer_id, record,
                ttl_s=self.config.record_ttl, seq=self._record_seq, now=now,
            )
            self._record_bytes = encode(self._signed_record)
            self._record = record
            self._record_signed_at = now
        return self._signed_record

    async def _heartbeat_loop(self) -> None:
        published_seq = -1
        while True:
            signed = self._signed_member_record()
            self._seq += 1
            hb = Heartbeat(peer_id=self.peer_id, boot=self._boot, seq=self._seq, record=self._record_bytes)
            self.membership.observe_self(self.member_record(), signed, self._boot, self._seq, trio.current_time())
            if self.config.role == "worker":
                with trio.move_on_after(self.config.op_timeout):
                    try:
                        await self.pubsub.publish(HEARTBEAT_TOPIC, encode(hb))
                    except trio.Cancelled:
                        raise
                    except Exception as exc:
                        self.log_once("self", exc, "heartbeat publish failed")
                if signed.seq != published_seq and self.bootstrapped.is_set():
                    published_seq = signed.seq
                    self.nursery.start_soon(self._put_member_record, signed)
            await trio.sleep(self.config.heartbeat_interval)

    async def _put_member_record(self, signed: SignedRecord) -> None:
        try:
            await self.put_record(signed)
        except PcpError as exc:
            self.log_once("self", exc, "member record put failed")

    async def put_record(self, signed: SignedRecord, *, timeout: float | None = None) -> None:
        """Store a signed record in the DHT (with a deadline)."""
        with trio.move_on_after(timeout or self.config.op_timeout) as scope:
            try:
                await self.dht.put_value(signed.key, encode(signed))
            except trio.Cancelled:
                raise
            except Exception as exc:
                raise PeerGone(f"DHT put of {signed.key} failed: {exc}") from exc
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
                raise PeerGone(f"DHT get of {key} failed: {exc}") from exc
        if scope.cancelled_caught:
            raise PeerTimeout(f"DHT get of {key} timed out")
        if value is None:
            return None
        return verify_record(value, key=key).payload

    async def _membership_loop(self) -> None:
        sub = await self.pubsub.subscribe(HEARTBEAT_TOPIC)
        while True:
            msg = await sub.get()
            try:
                sender = ID(msg.from_id).to_base58()
            except Exception:
                continue
            if sender == self.peer_id:
                continue
            try:
                events = self.membership.receive_heartbeat(msg.data, sender=sender, now=trio.current_time())
            except PcpError as exc:
                self._reject(sender, exc, "heartbeat")
                continue
            if events:
                self._notify()
            for ev in events:
                if isinstance(ev, MemberJoined):
                    member = self.membership.get(ev.peer_id)
                    log.info("member joined: %s", ev.peer_id)
                    if member is not None:
                        self.nursery.start_soon(self._ensure_connected, ev.peer_id, member.record.addrs)

    async def _tick_loop(self) -> None:
        while True:
            events = self.membership.tick(trio.current_time())
            if events:
                self._notify()
            for ev in events:
                if isinstance(ev, MemberLeft):
                    log.info("member left: %s (silent %.1f s)", ev.peer_id, ev.silent_s)
            await trio.sleep(min(0.25, self.config.member_timeout / 4))

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
        while infos:
            answered: list[bool] = []

            async def one(info: PeerInfo) -> None:
                answered.append(await self._dial(info))

            async with trio.open_nursery() as n:
                for info in infos:
                    n.start_soon(one, info)
            if any(answered):
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

    async def _ensure_connected(self, peer_id: str, addrs: tuple[str, ...]) -> None:
        pid = ID.from_base58(peer_id)
        if pid in self.host.get_network().connections or peer_id == self.peer_id:
            return
        if len(self.host.get_network().connections) >= self.config.max_connections:
            return
        maddrs = transport_addrs(addrs)
        if maddrs:
            await self._dial(PeerInfo(pid, maddrs))

    async def _discovery_loop(self) -> None:
        await self.bootstrapped.wait()
        period = 2.0
        while True:
            await trio.sleep(period)
            await self._refresh()
            for pid in self.dht.routing_table.get_peer_ids():
                if pid not in self.host.get_network().connections:
                    addrs = self.host.get_peerstore().addrs(pid)
                    if addrs:
                        await self._dial(PeerInfo(pid, addrs))
            period = min(period * 1.5, 30.0)

    # -- status -------------------------------------------------------------------

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
            )
            for m in self.membership.live()
        ) if members else ()
        network = {
            "connected_peers": len(self.host.get_network().connections),
            "routing_table_size": self.dht.get_routing_table_size(),
            "dht_mode": self.dht.mode.name.lower(),
            "rejected": dict(self.rejected),
            # the same counts split for people: "rejected 321" alarmed in a healthy swarm
            **dict(zip(("refused_bad_input", "stale_or_duplicate"), split_rejected(dict(self.rejected)))),
            **(self.blobs.traffic.snapshot() if self.blobs.traffic is not None else {}),
        }
        extra = {"storage": self.blobs.store.usage(),
                 **{name: fn() for name, fn in self.config.extra_status.items()}}
        return StatusReply(
            peer_id=self.peer_id,
            addrs=tuple(self.addrs()),
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
        except PcpError as exc:
            self._reject(peer, exc, "status")
            await reset_quietly(stream)
        except Exception as exc:  # a libp2p stream error mid-reply: the peer's problem
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
    register_all_kinds()
    identity = identity or load_or_create_identity(config.data_dir)
    listen = [_parse_listen(a) for a in config.listen]
    for a in config.bootstrap:
        parse_peer_addr(a)  # fail fast on a typo, before anything starts
    check_listen_addrs(listen)  # a taken port is refused, not shared (SO_REUSEPORT)
    psk = read_swarm_key(config.swarm_key) if config.swarm_key else None
    caps = config.capabilities or await trio.to_thread.run_sync(
        lambda: probe(config.backend, benchmark_s=config.benchmark_s)
    )
    local_ips = _local_ipv4s()
    # Identify advertises dialable addresses, not the 0.0.0.0 a node listens on:
    # peers keep only dialable ones in their routing tables (pcp_p2p/dht/table.py).
    host = new_host(key_pair=identity.key_pair, psk=psk, listen_addrs=listen,
                    addrs_factory=lambda addrs: expand_unspecified(addrs, local_ips))
    record_validator = PcpRecordValidator()
    validator = NamespacedValidator({"pcp": record_validator}, strict_validation=True)
    dht = PcpKadDHT(
        host,
        DHTMode.CLIENT if config.client_mode else DHTMode.SERVER,
        validator=validator,
        validator_changed=True,
        strict_validation=True,
    )
    gossipsub = GossipSub(
        protocols=[PROTOCOL_ID_V11, PROTOCOL_ID],
        degree=6,
        degree_low=4,
        degree_high=12,
        heartbeat_interval=1,
        # The default (10 msg/s per peer per topic, own publishes included)
        # silently drops heartbeats forwarded by a well-connected peer.
        spam_protection_enabled=False,
    )
    pubsub = Pubsub(host, gossipsub, strict_signing=True)
    store = BlobStore(config.data_dir / "blobs", config.max_storage_bytes)
    traffic = Traffic()
    count_host_traffic(host, traffic)
    blobs = BlobService(host, store, DhtRouting(dht), identity, traffic=traffic)
    async with host.run(listen_addrs=listen):
        async with background_trio_service(dht), background_trio_service(pubsub), background_trio_service(gossipsub):
            await pubsub.wait_until_ready()
            async with trio.open_nursery() as nursery:
                node = Node(config, identity, caps, host, dht, pubsub, blobs, nursery)
                node.record_validator = record_validator
                blobs.register()
                host.set_stream_handler(TProtocol(STATUS_PROTOCOL), node._handle_status)
                host.set_stream_handler(MSG_PROTOCOL, node.messenger.handle)
                nursery.start_soon(node._membership_loop)
                nursery.start_soon(node._heartbeat_loop)
                nursery.start_soon(node._tick_loop)
                nursery.start_soon(node._bootstrap_loop)
                nursery.start_soon(node._discovery_loop)
                log.info("node %s (%s) listening on %s", node.peer_id, config.role, " ".join(node.addrs()))
                try:
                    yield node
                finally:
                    nursery.cancel_scope.cancel()

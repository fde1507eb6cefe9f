"""Reaching nodes behind NAT: circuit relay v2, DCUtR hole punching, and a reachability verdict.

py-libp2p 0.8.1 has the parts but ``new_host()`` wires none of them
(shared/notes/testbed.md, "NAT traversal with py-libp2p 0.8.1"). This module
wires them into a node:

- every node runs the relay protocol as a *client* (it may reserve a slot on a
  relay and accept circuits through it, the STOP role) and DCUtR (a relayed
  connection between two nodes is upgraded to a direct one when both NATs keep
  ports, the "cone" kind);
- a node with ``relay`` on (bootstrap servers by default, ``--relay`` for public
  nodes) also offers reservations (HOP) under :class:`RelayBudget`: sized for
  control traffic (SWIM, status, messages), never for blobs;
- :func:`verdict` (pure, sans-IO) turns what peers observed of this node
  (identify's observed address) into ``public`` / ``hole-punchable`` /
  ``relay-only`` / ``unknown``;
- :class:`Connectivity` keeps a reservation on the bootstrap relays while the
  verdict says the node sits behind a NAT, and keeps the node's
  :class:`~pcp_p2p.net.advertise.Advertiser` current (verdict, relayed addresses
  ``<relay>/p2p-circuit/p2p/<me>``, observed public IP): what identify, the DHT
  and the member record advertise instead of private addresses.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, cast

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.identity.identify_push import push_identify_to_peers
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import MAX_HOLE_PUNCH_ATTEMPTS, DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service

from pcp_p2p.core.addrs import BENCHMARK_NET as BENCHMARK_NET  # re-exported
from pcp_p2p.core.addrs import is_public_ip as is_public_ip
from pcp_p2p.core.errors import PeerGone
from pcp_p2p.net.advertise import Advertiser, ListenView
from pcp_p2p.net.reachability import HOLE_PUNCHABLE, PUBLIC, RELAY_ONLY, UNKNOWN, VERDICTS  # noqa: F401 (re-exported)

log = logging.getLogger("pcp.connectivity")

CIRCUIT = "/p2p-circuit"

# What each verdict means to the person running the node (the start-up line).
ADVICE = {
    PUBLIC: "reachable: peers dial this node directly",
    HOLE_PUNCHABLE: "behind a NAT that keeps ports (cone): reachable through a relay, "
                    "and peers behind cone NATs upgrade to a direct (hole-punched) connection",
    RELAY_ONLY: "behind a NAT that changes ports per destination (symmetric): reachable only through a "
                "relay; forwarding a port to this node (and --listen on it) would make it public",
    UNKNOWN: "not known yet (no peer has reported how it sees this node)",
}


@dataclass(frozen=True)
class RelayBudget:
    """What a relay (HOP) lends: enough for control traffic, too little for blobs or Δs.

    A circuit carries at most ``circuit_bytes`` in both directions together and
    lives at most ``circuit_s`` (the client dials again when it needs to); a node
    may hold ``circuits_per_reservation`` circuits at once, and the relay holds at
    most ``max_reservations`` reservations (each a NATed node).
    """

    circuit_s: int = 300
    circuit_bytes: int = 1 << 20
    circuits_per_reservation: int = 16
    max_reservations: int = 128

    def limits(self) -> RelayLimits:
        return RelayLimits(duration=self.circuit_s, data=self.circuit_bytes,
                           max_circuit_conns=self.circuits_per_reservation, max_reservations=self.max_reservations)


@dataclass(frozen=True)
class Observation:
    """How one peer (at ``observer``) saw one of our connections: as (ip, port), our local port when known."""

    ip: str
    port: int
    local_port: int | None
    observer: str


def verdict(local_ips: Iterable[str], observations: Sequence[Observation]) -> str:
    """Whether others can dial this node, from what peers observed of it (pure: no I/O, no clock).

    Only observers at public IPs count: a peer in the same home sees our
    private address, which says nothing about the internet.

    - An observed IP that is one of ours: nothing translates our address → public.
    - No observation yet: public if we hold a public IP, else unknown.
    - Observed behind a NAT: py-libp2p 0.8.1's DCUtR predicts our address as
      observed IP + our own port, which holds exactly when the NAT keeps the
      port of a connection (endpoint-independent, "cone"). So a connection whose
      observed port equals its local port → hole-punchable; ports changed on
      every connection we could check → relay-only; ports unknown → unknown.
    """
    ours = set(local_ips)
    observations = [o for o in observations if is_public_ip(o.observer)]
    if any(o.ip in ours for o in observations):
        return PUBLIC
    if not observations:
        return PUBLIC if any(is_public_ip(ip) for ip in ours) else UNKNOWN
    checked = [o for o in observations if o.local_port is not None]
    if any(o.port == o.local_port for o in checked):
        return HOLE_PUNCHABLE
    return RELAY_ONLY if checked else UNKNOWN


def is_circuit(addr: str) -> bool:
    return CIRCUIT in addr


def is_relayed(conn: Any) -> bool:
    """Whether a swarm connection runs through a relay (its transport address has /p2p-circuit)."""
    try:
        return any(is_circuit(str(a)) for a in conn.get_transport_addresses())
    except Exception:
        return False


def stream_is_relayed(stream: Any) -> bool:
    """Whether a stream rides a relayed connection. Relays carry control traffic only: the blob
    service refuses such streams both ways, so blobs, Δs and θ never cross a relay."""
    conn = getattr(stream, "swarm_conn", None)
    return conn is not None and is_relayed(conn)


def has_direct(host: IHost, peer: ID) -> bool:
    """Whether some open connection to ``peer`` is direct (dialled, accepted or hole-punched)."""
    try:
        conns = host.get_network().get_connections(peer)
    except Exception:
        return False
    return any(not is_relayed(c) for c in conns)


def _local_port(conn: Any) -> int | None:
    """The local TCP port of a swarm connection, found by walking its wrappers down to the socket.

    py-libp2p exposes only the remote end; the wrappers (swarm conn → muxer →
    secure session → raw connection → trio stream → socket) differ by
    transport, so this follows the usual attribute names, bounded in depth.
    """
    seen: set[int] = set()
    frontier = [conn]
    for _ in range(8):
        nxt = []
        for obj in frontier:
            if obj is None or id(obj) in seen:
                continue
            seen.add(id(obj))
            getsockname = getattr(obj, "getsockname", None)
            if callable(getsockname):
                try:
                    name = getsockname()
                    return int(name[1])
                except Exception:
                    continue
            for attr in ("muxed_conn", "secured_conn", "conn", "raw_conn", "stream", "socket", "_stream",
                         "read_writer"):
                try:
                    nxt.append(getattr(obj, attr, None))
                except Exception:
                    continue
        frontier = nxt
    return None


def observations(host: IHost) -> list[Observation]:
    """Identify's observed addresses of our live direct connections (relayed ones report the relay)."""
    manager = getattr(host, "_observed_addr_manager", None)
    if manager is None:
        return []
    out = []
    for _local_tw, ext_tw, _group, ref in list(getattr(manager, "_conn_observations", {}).values()):
        conn = ref()
        if conn is None or getattr(conn, "is_closed", False):
            continue
        try:
            ma = multiaddr.Multiaddr(ext_tw)
            ip = ma.value_for_protocol("ip4")
            port = int(ma.value_for_protocol("tcp"))
        except Exception:
            continue
        try:
            observer = str(conn.muxed_conn.get_remote_address()[0])
        except Exception:
            continue  # no remote address: cannot tell whether the observer is on the internet
        out.append(Observation(ip, port, _local_port(conn), observer))
    return out


def split_addrs(addrs: Iterable[str]) -> tuple[list[multiaddr.Multiaddr], list[multiaddr.Multiaddr]]:
    """(direct transport addresses with ``/p2p/<id>`` stripped, full circuit addresses) of well-formed addrs."""
    direct, circuit = [], []
    for a in addrs:
        try:
            if is_circuit(a):
                circuit.append(multiaddr.Multiaddr(a))
            else:
                direct.append(multiaddr.Multiaddr(a.split("/p2p/")[0]))
        except Exception:
            continue
    return direct, circuit


async def connect(host: IHost, peer: ID, addrs: Iterable[str], circuits: CircuitV2Transport | None) -> None:
    """Open a connection to ``peer``: its direct addresses first, then through its relays.

    Raises PeerGone when none answers (callers put their own deadline around it). A direct
    connection already open (the peer behind NAT dialled us) is used as it is: no circuit is
    opened beside it.
    """
    if has_direct(host, peer):
        return
    direct, circuit = split_addrs(addrs)
    errors: list[str] = []
    if direct:
        try:
            await host.connect(PeerInfo(peer, direct))
            return
        except trio.Cancelled:
            raise
        except Exception as exc:
            errors.append(f"direct: {exc or type(exc).__name__}")
    if circuits is not None:
        for ma in circuit:
            try:
                await circuits.dial(ma)
                return
            except trio.Cancelled:
                raise
            except Exception as exc:
                errors.append(f"{ma}: {exc or type(exc).__name__}")
    raise PeerGone(f"cannot reach {peer}: {'; '.join(errors) or 'no usable address'}")


def _transport(host: IHost, proto: CircuitV2Protocol, budget: RelayBudget) -> CircuitV2Transport:
    return CircuitV2Transport(host, proto, RelayConfig(roles=RelayRole.STOP | RelayRole.CLIENT, limits=budget.limits()))


@asynccontextmanager
async def circuit_dialer(host: IHost) -> AsyncIterator[CircuitV2Transport]:
    """The relay client for a short-lived host (``pcp status --connect <circuit addr>``): dial only."""
    budget = RelayBudget()
    proto = CircuitV2Protocol(host, limits=budget.limits(), allow_hop=False)
    async with background_trio_service(proto):
        yield _transport(host, proto, budget)


class CountingRelay(CircuitV2Protocol):
    """The relay protocol, counting the bytes it splices between the two ends of its circuits.

    ``relayed_bytes`` is what this relay carried for others (both directions):
    the figure that shows relays carry control traffic only (``bench/wan.py``'s
    ``relay_byte_share``, ``pcp status``'s ``network.relayed_bytes``).
    """

    relayed_bytes: int = 0
    MAX_SOURCES = 64

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.relayed_from: dict[str, int] = {}  # bytes by the peer that sent them (who uses this relay)

    async def _read_stream_with_retry(self, stream: Any, *args: Any, **kwargs: Any) -> bytes | None:
        data = await super()._read_stream_with_retry(stream, *args, **kwargs)
        if data:
            self.relayed_bytes += len(data)
            try:
                src = stream.muxed_conn.peer_id.to_base58()
            except Exception:
                src = "?"
            if src in self.relayed_from or len(self.relayed_from) < self.MAX_SOURCES:
                self.relayed_from[src] = self.relayed_from.get(src, 0) + len(data)
        return data


class PunchBackoff:
    """When to let DCUtR try a peer again after it used up its attempts (pure: time is passed in).

    py-libp2p 0.8.1's DCUtR makes 3 attempts per relayed peer, then never again
    until the peer disconnects: one unlucky moment (a loaded machine missing the
    simultaneous open) would leave two cone homes relayed for good. A peer that
    is still relayed-only after its attempts gets another three after
    ``first_s``, doubling up to ``max_s``.
    """

    def __init__(self, first_s: float = 30.0, max_s: float = 600.0) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self._next: dict[str, tuple[float, float]] = {}  # peer -> (when to rearm, the wait after that)

    def due(self, peer: str, now: float) -> bool:
        """True when an exhausted ``peer`` may be rearmed now (and schedules the next rearm)."""
        when, wait = self._next.get(peer, (now + self.first_s, self.first_s))
        if peer not in self._next:
            self._next[peer] = (when, wait)
            return False
        if now < when:
            return False
        self._next[peer] = (now + min(wait * 2, self.max_s), min(wait * 2, self.max_s))
        return True

    def forget(self, keep: set[str]) -> None:
        """Drop peers no longer relayed-only (direct now, or gone)."""
        for peer in [p for p in self._next if p not in keep]:
            del self._next[peer]


class Connectivity:
    """One node's relay protocol, relay client, DCUtR, reservations and verdict."""

    def __init__(self, host: IHost, *, hop: bool, budget: RelayBudget, local_ips: Sequence[str],
                 advertiser: Advertiser) -> None:
        """``advertiser``: the one the host advertises from (:func:`pcp_p2p.net.advertise.install`)."""
        self.host = host
        self.hop = hop
        self.budget = budget
        self.local_ips = tuple(local_ips)
        self.protocol = CountingRelay(host, limits=budget.limits(), allow_hop=hop)
        self.transport = _transport(host, self.protocol, budget)
        self.dcutr = DCUtRProtocol(host)
        # DCUtR reads our local listen address from host.get_addrs(), which advertises (net.advertise).
        self.dcutr.host = cast(IHost, ListenView(host, local_ips))
        self.advertiser = advertiser
        self._pushed: tuple[str, ...] | None = None  # the advertised set peers were last told of
        self.pushes = 0  # identify pushes of a changed set (a handful in a node's life)
        self.reserved: dict[str, str] = {}  # relay peer id -> the relay's full multiaddr
        self.reachability = UNKNOWN
        self.reported: str | None = None  # the verdict last logged
        self.punch_backoff = PunchBackoff()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Connectivity]:
        """Run the relay protocol and DCUtR (start it once the host listens: what identify tells
        peers from then on is the advertised set as it stands, pushed again only when it changes)."""
        self._pushed = tuple(str(a) for a in self.host.get_addrs())
        async with background_trio_service(self.protocol), background_trio_service(self.dcutr):
            yield self

    def update(self) -> str:
        """Recompute the verdict from the host's current observations, and forget reservations on
        relays we lost the connection to (a restarted relay forgot them: they are asked for again)."""
        connected = {pid.to_base58() for pid in self.host.get_network().connections}
        for pid in [p for p in self.reserved if p not in connected]:
            del self.reserved[pid]
            getattr(self.transport, "_reservations", {}).pop(ID.from_base58(pid), None)
            log.info("relay %s gone: its reservation is dropped", pid)
        now = verdict(self.local_ips, observations(self.host))
        # What we learned stays true until contradicted: when the observers' connections close
        # (the relay was our only one and died), we are still behind the same NAT, and must
        # keep asking for a reservation.
        if now != UNKNOWN or self.reachability == PUBLIC:
            self.reachability = now
        self._advertise()
        return self.reachability

    def _advertise(self) -> None:
        """Hand the advertiser the verdict and the live relayed addresses."""
        self.advertiser.verdict = self.reachability
        self.advertiser.relayed = tuple(self.relayed_addrs(self.advertiser.me))

    def addrs_changed(self) -> bool:
        """Whether the advertised set changed since peers were last told (:meth:`push_addrs`)."""
        return tuple(str(a) for a in self.host.get_addrs()) != self._pushed

    async def push_addrs(self, timeout: float) -> None:
        """Tell every connected peer our advertised set (identify push): what they learned at
        connection time (before the verdict: our private addresses) is replaced in their peerstores,
        and so in their DHT answers about us."""
        self._pushed = tuple(str(a) for a in self.host.get_addrs())
        self.pushes += 1
        log.info("advertising %s", " ".join(self._pushed) or "nothing")
        with trio.move_on_after(timeout):
            await push_identify_to_peers(self.host)

    def connection_kinds(self) -> dict[str, str]:
        """``{peer id: "direct" | "relayed"}`` for every open connection (direct wins when both are open)."""
        out: dict[str, str] = {}
        for pid, conns in list(self.host.get_network().connections.items()):
            kinds = set()
            for c in conns if isinstance(conns, list) else [conns]:
                try:
                    addrs = [str(a) for a in c.get_transport_addresses()]
                except Exception:
                    continue
                kinds.add("relayed" if any(is_circuit(a) for a in addrs) else "direct")
            if kinds:
                out[pid.to_base58()] = "direct" if "direct" in kinds else "relayed"
        return out

    def rearm_hole_punching(self, now: float) -> list[str]:
        """Give DCUtR new attempts towards relayed-only peers whose back-off is over; returns them."""
        relayed = {p for p, kind in self.connection_kinds().items() if kind == "relayed"}
        self.punch_backoff.forget(relayed)
        attempts: dict[ID, int] = getattr(self.dcutr, "_hole_punch_attempts", {})
        rearmed = []
        for pid in list(attempts):
            peer = pid.to_base58()
            if peer in relayed and attempts[pid] >= MAX_HOLE_PUNCH_ATTEMPTS and self.punch_backoff.due(peer, now):
                del attempts[pid]  # the auto-drive loop (every 2 s) tries it again
                rearmed.append(peer)
        return rearmed

    def relayed_addrs(self, me: str) -> list[str]:
        """``<relay>/p2p-circuit/p2p/<me>`` for every relay that holds a live reservation for us."""
        live = {str(p) for p in getattr(self.transport, "_reservations", {})}
        return [f"{addr}{CIRCUIT}/p2p/{me}" for pid, addr in self.reserved.items() if pid in live]

    async def reserve(self, relay_addr: str, nursery: trio.Nursery, timeout: float) -> bool:
        """Reserve a slot on the relay at ``relay_addr`` (a full multiaddr); False if it refuses or is away."""
        info = info_from_p2p_addr(multiaddr.Multiaddr(relay_addr))
        ok = False
        with trio.move_on_after(timeout):
            try:
                # py-libp2p refuses, for 60 s, to dial a peer whose addresses all failed (its
                # "negative cache"): a relay back from a restart would wait out that minute.
                # Our own schedule (every 15 s at most) already paces these dials.
                unblock = getattr(self.host.get_network(), "unblock_peer", None)
                if callable(unblock):
                    unblock(info.peer_id)
                await self.host.connect(info)
                stream = await self.host.new_stream(info.peer_id, [HOP_PROTOCOL])
                ok = await self.transport.reserve(stream, info.peer_id, nursery)
            except trio.Cancelled:
                raise
            except Exception as exc:
                log.debug("reservation on %s failed: %s", relay_addr, exc)
        if ok:
            self.reserved[info.peer_id.to_base58()] = relay_addr
            self._advertise()
        return ok

    def report(self, me: str, bandwidth: str = "") -> str | None:
        """The start-up line when the verdict changes (None when it did not); ``bandwidth``: what
        was measured to a few peers, in words (``pcp doctor``'s figures)."""
        if self.reachability == self.reported:
            return None
        self.reported = self.reachability
        relayed = self.relayed_addrs(me)
        via = f"; relayed address {relayed[0]}" if relayed else ""
        bw = f"; {bandwidth}" if bandwidth else ""
        return f"reachability: {self.reachability} ({ADVICE[self.reachability]}){bw}{via}"

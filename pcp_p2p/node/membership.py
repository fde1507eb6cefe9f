"""Membership: who is in the swarm right now, as a sans-IO state machine.

Design
------
Each node publishes a signed *member record* (peer id, addresses, measured
capabilities) and, every second, a *heartbeat* over gossipsub. A heartbeat
carries the sender's incarnation (``boot``: when this run of the process
started, in ms) and a sequence number, plus the current signed member record,
so a heartbeat alone is enough to learn a new member: gossipsub drops messages
silently under load, and a design that needed a second message (a DHT lookup)
to make sense of the first would turn each drop into a delay.

Liveness is soft state: a member silent for longer than ``timeout`` (default
5 s, five heartbeats) leaves the view. Losing up to four heartbeats in a row is
therefore harmless, which is how we tolerate gossipsub's drops.

Ordering is by ``(boot, seq)``: a heartbeat at or below the newest one seen
from that peer is a replay (or a duplicate from gossip) and is refused with
:class:`~pcp_p2p.errors.StaleMessage`. A restarted node has a later ``boot``
and starts again at seq 0 without being mistaken for a replay.

This module does no I/O and reads no clock: the pump passes ``now`` (trio's
clock, so tests run on ``MockClock``) and acts on the returned events.

Transitions, per peer::

    (unknown) --heartbeat--> LIVE   emits MemberJoined
    LIVE      --heartbeat--> LIVE   emits MemberUpdated if the record changed
    LIVE      --tick, silent > timeout--> (unknown)  emits MemberLeft
"""

from __future__ import annotations

from dataclasses import dataclass

from pcp_p2p.dht.records import SignedRecord, register_kind, verify_record
from pcp_p2p.errors import BadSignature, StaleMessage
from pcp_p2p.node.capabilities import Capabilities
from pcp_p2p.wire import Message, decode, wire_message

HEARTBEAT_TOPIC = "/pcp/members/1.0.0"
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_INTERVAL_S = 1.0


@wire_message("member.record", max_size=8 * 1024)
class MemberRecord(Message):
    peer_id: str
    addrs: tuple[str, ...]
    role: str  # "worker" or "bootstrap"
    started_at: float  # unix seconds
    capabilities: Capabilities
    runs: tuple[str, ...] = ()  # ids of the runs this node takes part in (how late joiners find runs)
    leads: tuple[str, ...] = ()  # ids of the runs this node is the shepherd of (how late joiners find it)
    state: str = "idle"  # what it is doing: idle, training, shepherd, ...


register_kind("member", MemberRecord)


@wire_message("member.heartbeat", max_size=16 * 1024)
class Heartbeat(Message):
    peer_id: str
    boot: int  # incarnation: process start, unix ms
    seq: int
    record: bytes  # an encoded SignedRecord holding the sender's MemberRecord


@dataclass(frozen=True)
class MemberJoined:
    peer_id: str


@dataclass(frozen=True)
class MemberUpdated:
    peer_id: str


@dataclass(frozen=True)
class MemberLeft:
    peer_id: str
    silent_s: float


MembershipEvent = MemberJoined | MemberUpdated | MemberLeft


@dataclass
class Member:
    record: MemberRecord
    signed: SignedRecord
    boot: int
    seq: int
    last_seen: float  # on the pump's clock


class Membership:
    """The membership view of one node."""

    def __init__(self, self_peer_id: str, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.self_peer_id = self_peer_id
        self.timeout = timeout
        self._members: dict[str, Member] = {}

    # -- inputs ---------------------------------------------------------------

    def receive_heartbeat(
        self, data: bytes, *, sender: str, now: float, wall_now: float | None = None
    ) -> list[MembershipEvent]:
        """Handle one heartbeat's bytes as delivered by pubsub from ``sender``.

        ``sender`` is the pubsub-authenticated origin; a heartbeat whose body
        claims another peer is refused. Raises only PcpError subclasses.
        """
        hb = decode(data, Heartbeat)
        if hb.peer_id != sender:
            raise BadSignature(f"heartbeat from {sender} claims to be {hb.peer_id}")
        verified = verify_record(hb.record, now=wall_now)
        if verified.kind != "member" or verified.name != hb.peer_id:
            raise BadSignature(f"heartbeat from {sender} carries a record for {verified.name}")
        record = verified.payload
        assert isinstance(record, MemberRecord)
        return self._observe(hb, record, verified.record, now)

    def tick(self, now: float) -> list[MembershipEvent]:
        """Drop members silent past the timeout."""
        events: list[MembershipEvent] = []
        for peer_id, m in list(self._members.items()):
            silent = now - m.last_seen
            if silent > self.timeout:
                del self._members[peer_id]
                events.append(MemberLeft(peer_id, silent))
        return events

    def observe_self(self, record: MemberRecord, signed: SignedRecord, boot: int, seq: int, now: float) -> None:
        """Keep this node's own entry fresh (it does not hear its own gossip)."""
        self._members[self.self_peer_id] = Member(record, signed, boot, seq, now)

    # -- outputs --------------------------------------------------------------

    def live(self) -> list[Member]:
        return sorted(self._members.values(), key=lambda m: m.record.peer_id)

    def get(self, peer_id: str) -> Member | None:
        return self._members.get(peer_id)

    def __contains__(self, peer_id: str) -> bool:
        return peer_id in self._members

    def __len__(self) -> int:
        return len(self._members)

    # -- internals ------------------------------------------------------------

    def _observe(self, hb: Heartbeat, record: MemberRecord, signed: SignedRecord, now: float) -> list[MembershipEvent]:
        current = self._members.get(hb.peer_id)
        if current is None:
            self._members[hb.peer_id] = Member(record, signed, hb.boot, hb.seq, now)
            return [MemberJoined(hb.peer_id)]
        if (hb.boot, hb.seq) == (current.boot, current.seq):
            return []  # the same heartbeat again by another gossip path: not a replay
        if (hb.boot, hb.seq) < (current.boot, current.seq):
            raise StaleMessage(
                f"heartbeat ({hb.boot}, {hb.seq}) from {hb.peer_id} not newer than ({current.boot}, {current.seq})"
            )
        changed = record != current.record
        current.record, current.signed = record, signed
        current.boot, current.seq, current.last_seen = hb.boot, hb.seq, now
        return [MemberUpdated(hb.peer_id)] if changed else []

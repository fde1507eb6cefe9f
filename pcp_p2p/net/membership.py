"""Membership: who is in the swarm right now, as a sans-IO SWIM state machine.

Why SWIM and not heartbeats
---------------------------
The first design published a heartbeat per node per second on one gossipsub
topic. Every node then received and relayed every other node's heartbeat, so an
idle node's cost grew as N and the swarm's as N²: twelve idle nodes saturated a
2-core machine (issue #18). Here, as in SWIM (Das, Gupta, Motivala 2002) and its
descendants (memberlist, Lifeguard), each node does a constant amount of work per
protocol period whatever the size of the swarm:

- **Probing.** Every ``period_s`` a node pings one member, taken round-robin from
  a shuffled list of its view (so every member is probed within two passes). No
  ack within ``ping_timeout_s``: it asks ``indirect_k`` other members to ping the
  target for it (a ``ping_req``), which tells a dead node from a lossy path
  between two live ones. No ack, direct or relayed, by ``probe_timeout_s``: the
  target becomes *suspect*.
- **Suspicion.** A suspect that does not refute in time is declared dead and
  leaves the view: ``max_suspicion_s`` with one suspecter, down to
  ``suspicion_s`` with ``confirmations`` independent ones or a ``dead`` claim
  (Lifeguard); the suspect is told at once by a direct ping (Lifeguard's buddy
  system). A node whose own probes fail, without every helper it asked answering
  that the target is silent to it too (Lifeguard's nacks), raises a local health score that scales
  its period and timeouts (Lifeguard's local health): a starved node accuses no one. Nodes refute by re-signing
  their member record with a higher ``seq``: the incarnation is ``(boot, seq)``, boot being the
  record's ``started_at`` in ms (so a restarted node starts above its old self)
  and ``seq`` the signed record's sequence number. Only the subject can sign its
  record, so only it can refute, and a replayed older record changes nothing.
- **Dissemination.** Changes (alive with a new record, suspect, dead) ride on the
  pings and acks a node sends anyway, at most ``max_piggyback`` per packet, each
  retransmitted ``retransmit_mult * ceil(log10(N + 2))`` times, and are pushed to
  ``gossip_fanout`` members every ``gossip_interval_s`` while any wait: spread in
  O(log N) rounds, and nothing at all sent for it while nothing changes. Only
  news spreads (a sync's sample and copies seen before are not queued again).
- **Anti-entropy and joining.** A joiner ``sync``s with a bootstrap server (its
  own record out, a bounded sample of signed records back), and every node syncs
  with a random member every ``sync_every_s``, which repairs what piggybacking
  missed and keeps partial views mixed. A sync says what the sender holds by
  incarnation (``have``), and the reply carries only the records it lacks or holds
  older (:meth:`Membership._sync_packet`).

Every peer is a stranger
------------------------
- ``alive`` carries the subject's signed record: verified (signature, expiry,
  kind, key) before anything changes; older incarnations are dropped.
- ``suspect`` and ``dead`` are *claims* by the (stream-authenticated) sender and
  cannot remove anyone by themselves: a claim only starts this node's own
  suspicion timer, the subject hears of it and refutes, and this node itself
  decides when the timer runs out. A stranger spreading "everyone is dead" makes
  nodes re-sign their records; it does not empty views.
- Views are bounded (``max_view``); a full view takes a newcomer in place of a
  random member only when the newcomer contacted this node itself (a ping carries
  the prober's record until the target holds it), not for records it merely hears
  of: views stay nearly symmetric, so every node is held, and probed, by about as
  many nodes as it holds, whatever the swarm's size. Members that share a run with this node
  (:meth:`Membership.set_interest`) are never evicted: the run's roster is
  tracked exactly, the rest of the planet by sample.
- Tombstones (bounded) keep a dead incarnation from being resurrected by a late
  copy of its old record; only the member itself, talking to this node, is taken
  back (and told to refute): that is how a healed partition merges.

This module does no I/O and reads no clock: the pump
(:class:`pcp_p2p.node.node.Node`) passes ``now`` (trio's clock, so tests run on
``MockClock``), carries the :class:`SwimPacket` effects over ``/pcp/swim/1.0.0``
streams and feeds back what comes in.

Transitions, per member::

    (unknown) --alive, verified--------------------> ALIVE    MemberJoined
    ALIVE     --alive, higher incarnation----------> ALIVE    MemberUpdated if the record changed
    ALIVE     --probe unanswered / suspect claim---> SUSPECT
    SUSPECT   --alive, higher incarnation----------> ALIVE
    SUSPECT   --direct ack from it-----------------> ALIVE    (proof of life; nothing gossiped)
    SUSPECT   --suspicion timeout, no refutation---> (dead)   MemberLeft, dead gossiped, tombstone
    (dead)    --alive from the member itself-------> ALIVE    MemberJoined; dead claim queued so it refutes
    ALIVE     --evicted from a full view-----------> (unknown) MemberLeft(reason="evicted")
    self      --suspect/dead claim about us--------> Refute effect: the pump re-signs the record
"""

from __future__ import annotations

import itertools
import math
import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pcp_p2p.core.errors import BadSignature, MalformedMessage, PcpError, VerificationError
from pcp_p2p.dht.records import KindRule, SignedRecord, VerifiedRecord, verify_record
from pcp_p2p.net.capabilities import Capabilities
from pcp_p2p.wire import Message, wire_message
from pcp_p2p.wire.codec import wire_struct

SWIM_PROTOCOL = "/pcp/swim/1.0.0"
MAX_PACKET = 64 * 1024
MAX_HAVE = 400  # digest entries a sync request carries at most (~70 bytes each: within MAX_PACKET / 2)
DEFAULT_PERIOD_S = 1.0
# How long a SIGKILLed node stays in views on a quiet loopback swarm, about at most:
# probe_timeout (2.5 s) + the longest suspicion (12 s, one suspecter); with the usual
# three suspecters it is nearer 8 s. Tests and docs take it as the bound.
DEFAULT_TIMEOUT_S = 15.0


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
    reachability: str = "unknown"  # its own verdict (pcp_p2p.net.reachability): public, hole-punchable, relay-only


MEMBER_KIND = "member"
MEMBER_RULE = KindRule(MemberRecord)
"""A member record may be signed only by the peer it is stored under (and names)."""
MEMBER_KINDS = {MEMBER_KIND: MEMBER_RULE}
"""The one kind a SWIM packet may carry."""


def verify_member_record(data: bytes, now: float | None = None) -> VerifiedRecord:
    """:func:`~pcp_p2p.dht.records.verify_record` for member records (any other kind is refused)."""
    return verify_record(data, kinds=MEMBER_KINDS, now=now)



@wire_struct
class Gossip(Message):
    """One membership change riding on a packet."""

    kind: str  # alive | suspect | dead
    peer_id: str
    boot: int
    seq: int
    record: bytes = b""  # alive: the subject's encoded SignedRecord
    origin: str = ""  # suspect: the node whose probe failed (Lifeguard's independent confirmations)


@wire_struct
class Have(Message):
    """A member record the sender of a ``sync`` holds, by incarnation (no record bytes)."""

    peer_id: str
    boot: int
    seq: int


@wire_message("swim.packet", max_size=MAX_PACKET)
class SwimPacket(Message):
    """Everything on ``/pcp/swim/1.0.0``: a request and its reply are one packet each.

    ``ping``: is the receiver alive? ``target`` names the receiver and
    ``known_boot``/``known_seq`` say which of its records the sender holds, so the
    ack carries the receiver's record only when the sender is behind; an ``ack``'s
    say which of the prober's records the receiver holds, so the next ping carries
    the prober's record only while the receiver lacks it.
    ``ping_req``: ping ``target`` for me; answered by ``ack`` (target answered)
    or ``nack``. ``sync``: the sender's own record and ``have``, what it holds of the others by
    incarnation, answered by the records the sender lacks or holds older (a sample, by size).
    """

    kind: str
    probe: int = 0
    target: str = ""
    known_boot: int = 0
    known_seq: int = 0
    updates: tuple[Gossip, ...] = ()
    have: tuple[Have, ...] = ()


@dataclass(frozen=True)
class SwimConfig:
    period_s: float = DEFAULT_PERIOD_S
    ping_timeout_s: float = 1.0
    probe_timeout_s: float = 2.5  # direct + indirect, from the ping
    indirect_k: int = 3
    suspicion_s: float = 3.0  # with `confirmations` independent suspecters; one alone waits max_suspicion_s
    max_suspicion_s: float = 12.0
    max_health: int = 8  # timeouts and the probe period scale by (1 + local health score)
    confirmations: int = 3
    max_view: int = 256
    max_piggyback: int = 8
    max_queue: int = 512  # changes waiting to be piggybacked
    # While changes wait to be spread, also push them to a few random members this
    # often (memberlist's gossip): spread in O(log N) half-seconds, not probe periods.
    # Nothing is sent when there is nothing new, so an idle swarm pays nothing for it.
    gossip_interval_s: float = 0.5
    gossip_fanout: int = 2
    retransmit_mult: int = 4
    sync_every_s: float = 30.0
    sync_bytes: int = 40 * 1024  # records per sync packet, by size
    tombstone_s: float = 300.0
    max_tombstones: int = 4096


# -- events (for the node and the runtime) and effects (for the pump) ---------


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
    reason: str = "dead"  # dead (suspicion ran out) or evicted (view full)


MembershipEvent = MemberJoined | MemberUpdated | MemberLeft


@dataclass(frozen=True)
class Send:
    """Open a stream to ``peer`` (at ``addrs``), write ``packet``, feed the reply to :meth:`Membership.receive`."""

    peer: str
    addrs: tuple[str, ...]
    packet: SwimPacket
    timeout_s: float


@dataclass(frozen=True)
class Refute:
    """Someone suspects this node: re-sign its record with a higher seq and call :meth:`Membership.set_self`."""


Effect = Send | Refute


@dataclass
class Member:
    record: MemberRecord
    signed: SignedRecord
    signed_bytes: bytes
    last_seen: float  # last evidence of life, on the pump's clock
    suspect_since: float | None = None
    suspecters: set[str] = field(default_factory=set)
    # Our incarnation this member said it holds (its acks carry it): a ping carries our own
    # record until it does, so whom we probe comes to hold us too (see _make_room).
    knows_me: tuple[int, int] = (0, 0)

    @property
    def incarnation(self) -> tuple[int, int]:
        return boot_ms(self.record), self.signed.seq


@dataclass
class _Probe:
    id: int
    target: str
    started: float
    indirect_sent: bool = False
    helpers: set[str] = field(default_factory=set)  # asked to ping the target for us
    nacked: set[str] = field(default_factory=set)  # helpers that answered "no ack from it"


@dataclass
class _Outgoing:
    gossip: Gossip
    left: int
    known: bool = True  # about a member of this node's view


@dataclass
class Stats:
    sent: int = 0
    received: int = 0
    suspicions: int = 0  # members this node started to suspect
    refuted: int = 0  # suspicions cleared by a higher incarnation or a direct ack
    confirmed: int = 0  # suspects declared dead
    refutations: int = 0  # times this node re-signed to refute a claim about itself
    stale: int = 0  # gossip older than what is held (normal in epidemic spread)
    evicted: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def boot_ms(record: MemberRecord) -> int:
    return round(record.started_at * 1000)


class Membership:
    """The membership view of one node, and its part in the SWIM protocol.

    ``announce``: whether this node is a member others should see (workers are;
    bootstrap servers and short-lived clients take part without being listed).
    """

    def __init__(
        self,
        self_peer_id: str,
        *,
        config: SwimConfig | None = None,
        rng: random.Random | None = None,
        announce: bool = True,
        verify: Callable[[bytes], VerifiedRecord] = verify_member_record,
    ) -> None:
        self.self_peer_id = self_peer_id
        # verify_member_record by default; a simulator of 10,000 nodes passes a cached one
        # (the same checks, done once per distinct record rather than once per copy).
        self._verify = verify
        self.config = config or SwimConfig()
        self.rng = rng or random.Random()
        self.announce = announce
        self.stats = Stats()
        self._self: Member | None = None
        self._members: dict[str, Member] = {}
        self._order: list[str] = []  # probe round-robin
        self._suspects: set[str] = set()  # members with suspect_since set (so tick does not scan the view)
        self._probe: _Probe | None = None
        self._next_probe_at = 0.0
        self._next_sync_at: float | None = None
        self._sync_gap = self.config.sync_every_s
        self._next_gossip_at = 0.0
        self._probe_ids = 0
        self._queue: dict[tuple[str, str, str], _Outgoing] = {}
        self._queued_about: dict[str, set[tuple[str, str, str]]] = {}
        self._spreading = True  # False while absorbing a sync: samples are not news
        self._seen: OrderedDict[tuple[str, str, int, int, str], None] = OrderedDict()
        # suspicion origins passed on per incarnation of a peer outside the view (see _relay_unknown)
        self._suspicions_relayed: OrderedDict[tuple[str, int, int], int] = OrderedDict()
        # dead members: (incarnation, kept until, their last record: for reconnect attempts)
        self._tombstones: OrderedDict[str, tuple[tuple[int, int], float, Member]] = OrderedDict()
        self._interest: frozenset[str] = frozenset()
        self._seeds: dict[str, tuple[str, ...]] = {}
        self._refute_pending = False
        self.errors: list[PcpError] = []
        # Lifeguard's local health: failed probes and suspicions of ourselves mostly mean
        # *this* node is slow (a loaded 2-core laptop), so it probes less often and waits
        # longer, rather than accusing healthy peers; answered probes bring it back down.
        self._health = 0

    # -- inputs: this node ---------------------------------------------------------

    def set_self(self, signed_bytes: bytes, *, now: float, wall_now: float | None = None,
                 news: bool = True) -> None:
        """This node's own signed member record (call again whenever it is re-signed).

        ``news=False`` for a record re-signed only because it aged (same content): it
        reaches the members that hold us through our pings and their probes' acks,
        which carry it while they hold an older one, not by gossip to the whole swarm.
        Ten thousand nodes re-signing every five minutes would otherwise put 33 records
        a second into every node's piggyback queue, more than it can carry.
        """
        verified = verify_member_record(signed_bytes, now=wall_now)
        record = verified.payload
        if verified.kind != "member" or verified.name != self.self_peer_id or not isinstance(record, MemberRecord):
            raise VerificationError("set_self: not this node's member record")
        previous = self._self
        self._self = Member(record, verified.record, signed_bytes, now)
        self._refute_pending = False
        if news and self.announce and (previous is None or previous.signed_bytes != signed_bytes):
            self._enqueue(Gossip("alive", self.self_peer_id, boot_ms(record), verified.record.seq, signed_bytes))

    def set_interest(self, run_ids: set[str] | frozenset[str]) -> None:
        """The runs this node works in: members listing one are tracked exactly, never evicted."""
        self._interest = frozenset(run_ids)

    def add_seed(self, peer_id: str, addrs: tuple[str, ...]) -> None:
        """A peer to sync with while the view is empty (a bootstrap server): a lost join is retried."""
        self._seeds[peer_id] = addrs

    def join(self, now: float) -> SwimPacket:
        """A ``sync`` to send to a bootstrap server (or any known peer) to enter the swarm.

        Nodes that start together each find the bootstrap knowing only those that
        came before them, so the next syncs (with random members) come soon and
        then slow down: 2, 4, 8 ... s up to ``sync_every_s``.
        """
        self._sync_gap = min(2.0, self.config.sync_every_s)
        self._next_sync_at = now + self._sync_gap
        return self._sync_packet()

    # -- inputs: the network ------------------------------------------------------

    def respond(
        self, sender: str, packet: SwimPacket, now: float
    ) -> tuple[SwimPacket | None, Send | None, list[MembershipEvent]]:
        """Handle a request that arrived on an inbound stream from ``sender``.

        Returns the reply to write (None for a ``ping_req``: first carry out the
        returned :class:`Send` to its target, then write :meth:`relay_result`),
        and the membership events the packet's gossip caused. Raises only
        PcpError subclasses (bad input); nothing changes before checks pass.
        """
        if packet.kind not in ("ping", "ping_req", "sync", "gossip"):
            raise MalformedMessage(f"swim: {packet.kind!r:.20} is not a request")
        if packet.kind == "ping" and packet.target != self.self_peer_id:
            raise MalformedMessage(f"swim: ping for {packet.target[-8:]} sent to {self.self_peer_id[-8:]}")
        self.stats.received += 1
        # A ping carries the prober's own record (an introduction), a ping_req the target's
        # (so a helper that does not hold it can ping it): each is carried for a purpose, not news.
        carried = sender if packet.kind == "ping" else packet.target if packet.kind == "ping_req" else None
        events = self._absorb(sender, packet.updates, now, spread=packet.kind != "sync", carried=carried)
        self._heard_from(sender, now)
        if packet.kind == "ping":
            updates = self._piggyback()
            me = self._self
            if me is not None and self.announce and me.incarnation > (packet.known_boot, packet.known_seq):
                mine = Gossip("alive", self.self_peer_id, *me.incarnation, me.signed_bytes)
                updates = (mine, *[u for u in updates if u.peer_id != self.self_peer_id])
            held = self._members.get(sender)
            b, s = held.incarnation if held is not None else (0, 0)
            return self._count(SwimPacket("ack", packet.probe, self.self_peer_id, b, s, updates)), None, events
        if packet.kind == "sync":
            reply = self._sync_packet(packet.have)
            tomb = self._tombstones.get(sender)
            if tomb is not None:  # a member we declared dead syncs with us: it should know, and refute
                reply = SwimPacket("sync", updates=(Gossip("dead", sender, *tomb[0]), *reply.updates))
            return self._count(reply), None, events
        if packet.kind == "gossip":  # push-pull: what we have new goes back
            return self._count(SwimPacket("ack", updates=self._piggyback())), None, events
        # ping_req: ping the target on the requester's behalf. In a partial view the
        # helper may not hold the target: the request carries its record first.
        target = self._members.get(packet.target)
        if target is None:
            offered = [g for g in packet.updates if g.kind == "alive" and g.peer_id == packet.target]
            try:
                target = self._verify_alive(offered[0]) if offered else None
            except PcpError:
                target = None
        if target is None or packet.target in (self.self_peer_id, sender):
            return self._count(SwimPacket("nack", packet.probe, packet.target)), None, events
        return None, self._ping(target, packet.probe, self.config.ping_timeout_s), events

    def relay_result(self, requester: str, request: SwimPacket, acked: bool) -> SwimPacket:
        """The reply to a ``ping_req`` once its ping to the target has ended."""
        kind = "ack" if acked else "nack"
        return self._count(SwimPacket(kind, request.probe, request.target, updates=self._piggyback()))

    def receive(self, sender: str, packet: SwimPacket, now: float) -> list[MembershipEvent]:
        """Handle the reply to a :class:`Send` this node made to ``sender``."""
        if packet.kind not in ("ack", "nack", "sync"):
            raise MalformedMessage(f"swim: {packet.kind!r} is not a reply")
        self.stats.received += 1
        events = self._absorb(sender, packet.updates, now, spread=packet.kind != "sync")
        self._heard_from(sender, now)
        if packet.kind == "ack" and packet.target == sender:
            # The member itself answered over an authenticated stream (a probe, or the
            # buddy ping that told a suspect it is suspected): proof of life here, now.
            answered = self._members.get(sender)
            if answered is not None and answered.suspect_since is not None:
                self._clear_suspicion(answered)
        probe = self._probe
        if (packet.kind == "nack" and probe is not None and packet.probe == probe.id
                and packet.target == probe.target and sender in probe.helpers):
            probe.nacked.add(sender)
        if packet.kind == "ack" and probe is not None and packet.probe == probe.id and packet.target == probe.target:
            # Direct (sender is the target) or relayed by a helper we asked.
            target = self._members.get(probe.target)
            if target is not None:
                target.last_seen = now
                if sender == probe.target:
                    target.knows_me = (packet.known_boot, packet.known_seq)
            self._probe = None
            self._health = max(0, self._health - 1)
        return events

    # -- the clock -------------------------------------------------------------------

    def tick(self, now: float) -> tuple[list[Effect], list[MembershipEvent]]:
        """Advance timers: start probes, escalate them, expire suspicions, schedule syncs."""
        effects: list[Effect] = []
        events: list[MembershipEvent] = []
        cfg = self.config
        if self._refute_pending:
            self._refute_pending = False  # asked once; set_self answers it
            self.stats.refutations += 1
            self._health = min(cfg.max_health, self._health + 1)  # others could not reach us in time
            effects.append(Refute())
        probe = self._probe
        if probe is not None:
            age = now - probe.started
            if probe.target not in self._members:
                self._probe = None
            elif age >= self._scaled(cfg.probe_timeout_s):
                # Lifeguard's nack rule: helpers that answered "the target did not ack me
                # either" show that our own links work, so the failure is the target's and
                # our health score stays. Without it every holder of a dead node slowed
                # itself down, which delayed the detection of the next death.
                if not probe.helpers or probe.nacked != probe.helpers:
                    self._health = min(cfg.max_health, self._health + 1)
                self._suspect(probe.target, now, self.self_peer_id)
                self._probe = None
                # Tell the suspect at once (Lifeguard's buddy system): a live node
                # behind a lossy path answers, which clears it here, and refutes.
                self._probe_ids += 1
                effects.append(self._ping(self._members[probe.target], self._probe_ids,
                                          self._scaled(cfg.ping_timeout_s)))
            elif age >= self._scaled(cfg.ping_timeout_s) and not probe.indirect_sent:
                probe.indirect_sent = True
                helpers = [p for p in self._members if p != probe.target]
                t = self._members[probe.target]
                card = Gossip("alive", probe.target, *t.incarnation, t.signed_bytes)
                for helper in self.rng.sample(helpers, min(cfg.indirect_k, len(helpers))):
                    probe.helpers.add(helper)
                    updates = (card, *self._piggyback()[: cfg.max_piggyback - 1])
                    req = SwimPacket("ping_req", probe.id, probe.target, updates=updates)
                    effects.append(Send(helper, self._members[helper].record.addrs, self._count(req),
                                        self._scaled(cfg.probe_timeout_s) - age))
        if self._probe is None and now >= self._next_probe_at and self._members:
            target = self._next_target()
            if target is not None:
                self._probe_ids += 1
                self._probe = _Probe(self._probe_ids, target, now)
                effects.append(self._ping(self._members[target], self._probe_ids, self._scaled(cfg.ping_timeout_s)))
            self._next_probe_at = now + self._scaled(cfg.period_s)
        for peer_id in sorted(self._suspects):
            m = self._members[peer_id]
            if m.suspect_since is not None and now - m.suspect_since >= self._suspicion_timeout(m):
                self._remove(peer_id, now, "dead", events)
                self.stats.confirmed += 1
                self._enqueue(Gossip("dead", peer_id, *m.incarnation))
        if self._queue and self._members and now >= self._next_gossip_at:
            self._next_gossip_at = now + cfg.gossip_interval_s
            peers = sorted(self._members)
            for peer in self.rng.sample(peers, min(cfg.gossip_fanout, len(peers))):
                packet = SwimPacket("gossip", updates=self._piggyback())
                if packet.updates:
                    effects.append(Send(peer, self._members[peer].record.addrs, self._count(packet),
                                        cfg.ping_timeout_s))
        if (self._next_sync_at is not None and now >= self._next_sync_at
                and (self._members or self._tombstones or self._seeds)):
            self._sync_gap = min(self._sync_gap * 2, cfg.sync_every_s)
            self._next_sync_at = now + self._sync_gap
            effects.append(self._sync_effect())
        self._expire_tombstones(now)
        return effects, events

    # -- outputs ---------------------------------------------------------------------

    def live(self) -> list[Member]:
        """Members in view (this node included), suspects too: they are alive until confirmed dead."""
        members = list(self._members.values())
        if self._self is not None:
            members.append(self._self)
        return sorted(members, key=lambda m: m.record.peer_id)

    def get(self, peer_id: str) -> Member | None:
        if peer_id == self.self_peer_id:
            return self._self
        return self._members.get(peer_id)

    def settle(self) -> None:
        """Drop every change still waiting to be spread.

        For simulators that seed views directly: a swarm that has been running a
        while has nothing left to spread, and without this the seeding itself
        (every node's record, new to every other) is measured as a join storm.
        """
        self._queue.clear()
        self._queued_about.clear()

    def suspected(self) -> list[str]:
        return sorted(self._suspects)

    def __contains__(self, peer_id: str) -> bool:
        return self.get(peer_id) is not None

    def __len__(self) -> int:
        return len(self._members) + (self._self is not None)

    # -- internals: gossip -------------------------------------------------------------

    def _absorb(self, sender: str, updates: tuple[Gossip, ...], now: float, *, spread: bool = True,
                carried: str | None = None) -> list[MembershipEvent]:
        """Apply piggybacked changes, each on its own.

        A bad update (forged, expired, malformed) is refused alone and kept in
        :attr:`errors` for the pump to count: the packet's other updates and its
        ack still count, so one relayed bad record cannot make a live peer suspect.
        """
        events: list[MembershipEvent] = []
        for g in updates:
            # Only news spreads: a sync's sample is learned, not passed on, and a copy
            # seen before (an evicted member coming back into view, say) is not queued
            # again; without this, old records circulate for ever in large swarms.
            key = (g.peer_id, g.kind, g.boot, g.seq, g.origin)
            # In a sync, the sender introducing itself is news (a joiner's record
            # reaches the swarm through its bootstrap server); the rest is a sample.
            # A record carried for a purpose (``carried``: the prober's own in its ping,
            # the target's in a ping_req) is not news to spread either: a new incarnation
            # is spread by its subject. When ping_req cards spread, every node's record
            # became news in turn; a 10,000-node swarm outgrew the ``_seen`` window, the
            # records circulated for ever and crowded out suspicions and refutations.
            if g.kind == "alive" and g.peer_id == carried:
                news = False
            else:
                news = spread or g.peer_id == sender
            self._spreading = news and key not in self._seen
            if self._spreading:
                self._seen[key] = None
                if len(self._seen) > 8 * self.config.max_queue:
                    self._seen.popitem(last=False)
            try:
                if g.kind == "alive":
                    self._apply_alive(g, self._verify_alive(g), now, events, sender)
                elif g.kind in ("suspect", "dead"):
                    self._apply_claim(g, now)
                else:
                    raise MalformedMessage(f"swim: gossip kind {g.kind!r:.20}")
            except PcpError as exc:
                self.errors.append(exc)
        self._spreading = True
        return events

    def take_errors(self) -> list[PcpError]:
        """Bad updates refused since the last call (the pump counts them as rejected input)."""
        out, self.errors = self.errors, []
        return out

    def _verify_alive(self, g: Gossip) -> Member:
        verified = self._verify(g.record)
        record = verified.payload
        if verified.kind != "member" or verified.name != g.peer_id or not isinstance(record, MemberRecord):
            raise BadSignature(f"swim: alive for {g.peer_id[-8:]} carries another record")
        if (boot_ms(record), verified.record.seq) != (g.boot, g.seq):
            raise BadSignature(f"swim: alive for {g.peer_id[-8:]} claims another incarnation than its record")
        if record.role == "client":
            raise VerificationError(f"swim: {g.peer_id[-8:]} is a short-lived client, not a member")
        return Member(record, verified.record, g.record, 0.0)

    def _apply_alive(self, g: Gossip, fresh: Member, now: float, events: list[MembershipEvent], sender: str) -> None:
        if g.peer_id == self.self_peer_id:
            return
        inc = (g.boot, g.seq)
        tomb = self._tombstones.get(g.peer_id)
        if tomb is not None and inc <= tomb[0]:
            if sender != g.peer_id:
                self.stats.stale += 1
                return
            # Proof of life: the "dead" member itself just talked to us over an
            # authenticated stream (a healed partition). Take it back, and tell it
            # it was declared dead so it refutes: its higher incarnation then
            # passes everyone else's tombstone too.
            del self._tombstones[g.peer_id]
            self._enqueue(Gossip("dead", g.peer_id, *inc), force=True)
        current = self._members.get(g.peer_id)
        if current is None:
            if not self._make_room(g.peer_id, fresh.record, now, events, direct=sender == g.peer_id):
                self._relay_unknown(g)  # not in our view, but others may hold it: pass it on once
                return
            fresh.last_seen = now
            self._members[g.peer_id] = fresh
            self._order.insert(self.rng.randrange(len(self._order) + 1), g.peer_id)
            self._tombstones.pop(g.peer_id, None)
            events.append(MemberJoined(g.peer_id))
            self._enqueue(g)
            return
        if inc <= current.incarnation:
            self.stats.stale += 1
            return
        changed = fresh.record != current.record
        if current.suspect_since is not None:
            self._clear_suspicion(current)
        current.record, current.signed, current.signed_bytes = fresh.record, fresh.signed, fresh.signed_bytes
        current.last_seen = now
        self._enqueue(g)
        if changed:
            events.append(MemberUpdated(g.peer_id))

    def _apply_claim(self, g: Gossip, now: float) -> None:
        inc = (g.boot, g.seq)
        if g.peer_id == self.self_peer_id:
            me = self._self
            if me is not None and self.announce:
                if inc >= me.incarnation:
                    self._refute_pending = True
                else:
                    # A claim about an older record of ours (one re-signed quietly for age,
                    # set_self(news=False), that the claimant's side never heard of): our
                    # current record already refutes it; it only has to travel.
                    self._enqueue(Gossip("alive", self.self_peer_id, *me.incarnation, me.signed_bytes), force=True)
            return
        current = self._members.get(g.peer_id)
        if current is None:
            self._relay_unknown(g)
            return
        if inc < current.incarnation:
            self.stats.stale += 1
            return
        if g.kind == "dead":
            # Someone's suspicion ran out: as strong as `confirmations` suspecters (the
            # shortest wait), still only a claim: this node decides, the subject may refute.
            for i in range(self.config.confirmations):
                self._suspect(g.peer_id, now, f"dead#{i}", relay=False)
            return
        self._suspect(g.peer_id, now, g.origin or "?")

    def _suspect(self, peer_id: str, now: float, origin: str, *, relay: bool = True) -> None:
        """Start suspecting, or count one more independent suspecter (which shortens the wait)."""
        m = self._members.get(peer_id)
        if m is None or origin in m.suspecters:
            return
        if m.suspect_since is None:
            m.suspect_since = now
            self._suspects.add(peer_id)
            self.stats.suspicions += 1
        m.suspecters.add(origin)
        if relay and len(m.suspecters) <= self.config.confirmations:
            self._enqueue(Gossip("suspect", peer_id, *m.incarnation, origin=origin))

    def _relay_unknown(self, g: Gossip) -> None:
        """Gossip about a peer outside this node's (partial) view: relayed once, like any other.

        Epidemic spread needs every node to pass changes on, not only the few
        that hold the subject (``_absorb`` lets through only copies not seen before).
        Of the suspicions of one incarnation, only the first ``confirmations``
        origins are passed on, as a holder does: a dead node is suspected by every
        one of its ~100 holders, and relaying each origin swarm-wide put thousands of
        changes into every queue at once in a 10,000-node swarm, where they crowded out
        the refutations that keep live nodes in.
        """
        if g.kind == "suspect" and self._spreading:  # (copies seen before are not counted)
            key = (g.peer_id, g.boot, g.seq)
            relayed = self._suspicions_relayed.pop(key, 0)
            self._suspicions_relayed[key] = relayed + 1
            if len(self._suspicions_relayed) > 8 * self.config.max_queue:
                self._suspicions_relayed.popitem(last=False)
            if relayed >= self.config.confirmations:
                return
        self._enqueue(g, known=False)

    def _enqueue(self, g: Gossip, *, known: bool = True, force: bool = False) -> None:
        """Queue a change for piggybacking. A newer alive about a peer replaces all it says;
        suspicions from different origins travel side by side (they are confirmations)."""
        if not self._spreading and not force:
            return
        keys = self._queued_about.setdefault(g.peer_id, set())
        if g.kind == "alive":
            for key in keys:
                self._queue.pop(key, None)
            keys.clear()
        key = (g.peer_id, g.kind, g.origin)
        self._queue.pop(key, None)  # re-queued at the end: the newest go first
        self._queue[key] = _Outgoing(g, self._retransmits(), known)
        keys.add(key)
        if len(self._queue) > self.config.max_queue:
            # Bounded: the oldest go (sent most); among the 32 oldest, one about a peer we do not hold first.
            oldest = list(itertools.islice(self._queue, 32))
            self._dequeue(next((k for k in oldest if not self._queue[k].known), oldest[0]))

    def _dequeue(self, key: tuple[str, str, str]) -> None:
        del self._queue[key]
        keys = self._queued_about.get(key[0])
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._queued_about[key[0]]

    def _retransmits(self) -> int:
        # memberlist's rule (mult * log10 N): enough for an epidemic to reach everyone
        # whp; more only crowds the 8 piggyback slots when many changes are in flight.
        return self.config.retransmit_mult * max(1, math.ceil(math.log10(len(self._members) + 2)))

    def _piggyback(self) -> tuple[Gossip, ...]:
        """Up to ``max_piggyback`` queued changes, the newest (least sent) first."""
        out = []
        size = 0
        for key in list(itertools.islice(reversed(self._queue), self.config.max_piggyback)):
            item = self._queue[key]
            size += len(item.gossip.record) + 128
            if size > MAX_PACKET // 2:
                break
            out.append(item.gossip)
            item.left -= 1
            if item.left <= 0:
                self._dequeue(key)
        return tuple(out)

    def _sync_effect(self) -> Send:
        """A sync with a random member or, half the time, with a member declared dead.

        The second kind is how a partition heals (serf's reconnect): the packet
        tells the "dead" member so, it refutes with a higher incarnation, and
        the next exchange brings it back.
        """
        if not self._members and not self._tombstones:
            peer = self.rng.choice(sorted(self._seeds))
            return Send(peer, self._seeds[peer], self._count(self._sync_packet()), self.config.probe_timeout_s)
        if self._tombstones and (not self._members or self.rng.random() < 0.5):
            peer = self.rng.choice(list(self._tombstones))
            inc, _, ghost = self._tombstones[peer]
            packet = self._sync_packet()
            packet = SwimPacket("sync", updates=(Gossip("dead", peer, *inc), *packet.updates), have=packet.have)
            return Send(peer, ghost.record.addrs, self._count(packet), self.config.probe_timeout_s)
        peer = self.rng.choice(sorted(self._members))
        return Send(peer, self._members[peer].record.addrs, self._count(self._sync_packet()),
                    self.config.probe_timeout_s)

    def _sync_packet(self, have: tuple[Have, ...] | None = None) -> SwimPacket:
        """A sync request (``have`` None): this node's own record and what it holds of the others,
        by incarnation. A reply to one (``have``: what the requester holds): a random sample of
        the signed records it lacks or holds older, this node's own first, bounded by size.

        Why not a sample of records both ways, as before: a record is ~1.2 KB, so each sync
        moved ~20 KB each way in a 16-node swarm, nearly all of it records the other side
        already held (with one sync a node every 30 s, it was most of a shepherd's SWIM
        bytes: issue #15). A digest entry is ~70 bytes. The requester no longer teaches the
        responder its view (only itself): the responder learns it from its own syncs, each
        node pulling from a random member every ``sync_every_s``, and from the gossip.
        A request with an empty ``have`` (a joiner's) gets a plain sample."""
        held = {h.peer_id: (h.boot, h.seq) for h in have or ()}

        def lacks(peer: str, incarnation: tuple[int, int]) -> bool:
            return held.get(peer, (-1, -1)) < incarnation

        records: list[Gossip] = []
        if self._self is not None and self.announce and lacks(self.self_peer_id, self._self.incarnation):
            records.append(Gossip("alive", self.self_peer_id, *self._self.incarnation, self._self.signed_bytes))
        peers = [p for p, m in self._members.items() if m.suspect_since is None]
        self.rng.shuffle(peers)
        if have is None:
            digest = tuple(Have(p, *self._members[p].incarnation) for p in peers[:MAX_HAVE])
            return SwimPacket("sync", updates=tuple(records), have=digest)
        size = sum(len(g.record) for g in records)
        for p in peers:
            m = self._members[p]
            if not lacks(p, m.incarnation):
                continue
            if size + len(m.signed_bytes) > self.config.sync_bytes:
                break
            size += len(m.signed_bytes) + 64
            records.append(Gossip("alive", p, *m.incarnation, m.signed_bytes))
        return SwimPacket("sync", updates=tuple(records))

    # -- internals: view -------------------------------------------------------------------

    def _ping(self, target: Member, probe: int, timeout_s: float) -> Send:
        b, s = target.incarnation
        about = [self._queue[k].gossip for k in self._queued_about.get(target.record.peer_id, ()) if k[1] != "alive"]
        updates = self._piggyback()
        if about and about[0] not in updates:  # what we say about it goes to it first (a chance to refute)
            updates = (about[0], *updates[: self.config.max_piggyback - 1])
        me = self._self
        if (me is not None and self.announce and target.knows_me < me.incarnation
                and self._members.get(target.record.peer_id) is target):
            # Introduce ourselves to whom we probe: a full view admits a newcomer only on
            # such direct contact, which keeps views (nearly) symmetric (see _make_room).
            card = Gossip("alive", self.self_peer_id, *me.incarnation, me.signed_bytes)
            updates = (card, *[u for u in updates if u.peer_id != self.self_peer_id][: self.config.max_piggyback - 1])
        packet = SwimPacket("ping", probe, target.record.peer_id, b, s, updates)
        return Send(target.record.peer_id, target.record.addrs, self._count(packet), timeout_s)

    def _count(self, packet: SwimPacket) -> SwimPacket:
        self.stats.sent += 1
        return packet

    def _heard_from(self, sender: str, now: float) -> None:
        m = self._members.get(sender)
        if m is not None:
            m.last_seen = now
            if m.suspect_since is not None:
                self._clear_suspicion(m)  # it talked to us: alive (what we gossiped is refuted by its own)

    def _next_target(self) -> str | None:
        # Round-robin over a shuffled order; a pass that ends reshuffles (SWIM's bound on time to first probe).
        while True:
            if not self._order:
                self._order = list(self._members)
                self.rng.shuffle(self._order)
                if not self._order:
                    return None
            target = self._order.pop()
            if target in self._members:  # members that left since the shuffle are skipped
                return target

    def _random_member(self) -> str:
        # The probe order is a shuffled copy of the view: a uniform pick without building a list.
        while True:
            if self._order:
                p = self._order[self.rng.randrange(len(self._order))]
                if p in self._members:
                    return p
            else:
                self._order = list(self._members)
                self.rng.shuffle(self._order)

    @property
    def health(self) -> int:
        """Local health score, 0 (healthy) to ``max_health``: the factor on timeouts, less one."""
        return self._health

    def _scaled(self, seconds: float) -> float:
        return seconds * (1 + self._health)

    def _clear_suspicion(self, m: Member) -> None:
        m.suspect_since = None
        m.suspecters.clear()
        self._suspects.discard(m.record.peer_id)
        self.stats.refuted += 1

    def _protected(self, record: MemberRecord) -> bool:
        return bool(self._interest and (self._interest & (set(record.runs) | set(record.leads))))

    def _make_room(self, peer_id: str, record: MemberRecord, now: float, events: list[MembershipEvent],
                   *, direct: bool) -> bool:
        """Whether a newcomer enters the view; a full view swaps out a random unprotected member
        for a run-mate, or for a peer that contacted us itself (``direct``), and for no one else.

        Why not also for peers we only heard of: a record that spreads swarm-wide (a
        joiner, a refutation) then entered a share of *every* full view, evicting others at
        random; in-degrees drifted apart (700 holders for one node, 14 for another, in a
        2,000-node simulation), and a node few others hold is probed rarely, so its death
        went unnoticed for a minute. Admitting on direct contact, with every ping carrying
        the prober's record until the target holds it, keeps views nearly symmetric: each
        node is held by about as many nodes as it holds, so it is probed about once a period.
        """
        if len(self._members) < self.config.max_view:
            return True
        protected = self._protected(record)
        if not protected and not direct:
            return False
        victim = None
        members = list(self._members) if len(self._members) < 64 else None
        for _ in range(16):  # a random unprotected member, by sampling (no scan of a large view)
            p = self.rng.choice(members) if members else self._random_member()
            if not self._protected(self._members[p].record):
                victim = p
                break
        if victim is None:
            return protected  # (nearly) all run-mates: run-mates still enter (bounded by the run's roster)
        self._remove(victim, now, "evicted", events)
        self.stats.evicted += 1
        return True

    def _remove(self, peer_id: str, now: float, reason: str, events: list[MembershipEvent]) -> None:
        m = self._members.pop(peer_id)
        self._suspects.discard(peer_id)
        if reason == "dead":
            self._tombstones[peer_id] = (m.incarnation, now + self.config.tombstone_s, m)
            self._tombstones.move_to_end(peer_id)
            while len(self._tombstones) > self.config.max_tombstones:
                self._tombstones.popitem(last=False)
        if self._probe is not None and self._probe.target == peer_id:
            self._probe = None
        events.append(MemberLeft(peer_id, now - m.last_seen, reason))

    def _expire_tombstones(self, now: float) -> None:
        while self._tombstones:
            _, until, _ = next(iter(self._tombstones.values()))
            if until > now:
                break
            self._tombstones.popitem(last=False)

    def _suspicion_timeout(self, m: Member) -> float:
        """Lifeguard: from ``max_suspicion_s`` with one suspecter down to ``suspicion_s`` with
        ``confirmations`` of them. A dead node is probed, and suspected, by many nodes
        within a few periods; a live one behind one lossy path by one, and then its
        refutation has the time it needs to come back."""
        cfg = self.config
        c = min(len(m.suspecters), cfg.confirmations)
        frac = math.log(c) / math.log(cfg.confirmations) if cfg.confirmations > 1 and c > 0 else 1.0
        return max(cfg.suspicion_s, cfg.max_suspicion_s - (cfg.max_suspicion_s - cfg.suspicion_s) * frac)


__all__ = [
    "SWIM_PROTOCOL",
    "Effect",
    "Gossip",
    "Member",
    "MemberJoined",
    "MemberLeft",
    "MemberRecord",
    "MemberUpdated",
    "Membership",
    "MembershipEvent",
    "Refute",
    "Send",
    "SwimConfig",
    "SwimPacket",
]

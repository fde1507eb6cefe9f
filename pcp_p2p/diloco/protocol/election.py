"""The rotating elected shepherd: terms, leases, rotation, failover, fencing.

A sans-IO state machine (h11 style), one per (node, run). It is fed what the
node learns — the membership view (``on_members``), leases (``on_lease``),
commit records (``on_commit``) and the passing of time (``tick``) — each with
``now`` on the node's clock, and answers with a list of effects for the runtime
to carry out. It never reads the clock, never sleeps, never does I/O.

Why terms ranked by ``sha256(run id, term, peer id)``: every member computes
the same order for term ``k`` without exchanging a message, and the order is
reshuffled every term, so a candidate that is alive on paper but hung (it never
claims) costs one ``claim_timeout_s`` per term it ranks first in — never the
run. Why signed leases with an expiry: a shepherd that dies, hangs or is cut
off simply stops renewing, and everyone can tell from their own clock when its
authority ended. Why fencing by term: a lease lapses on the followers' clocks,
not on the holder's, so a deposed shepherd may still believe in its term; every
announcement and commit names its term and a node refuses anything from a term
below the highest lease it has accepted.

Fork choice (after a partition heals, both sides may have committed): the
winning commit is the greatest ``(term, round, theta_cid)``; a worker on the
losing side resynchronises to it (see ``docs/election.md`` for what that costs).

Every peer is a stranger, so a signature only says who sent a lease; authority
is the whole chain, checked before anything is acted on (``check_lease``):

1. the lease is for this run, signed by its holder, with sane times: claimed
   <= issued < expiry, valid for at most ``lease_s`` (+ skew), not issued more
   than ``max_skew_s`` ahead of our clock, not claimed longer ago than
   ``max_claim_age_s``;
2. the holder is an eligible candidate in this node's view (a live member that
   took up the run, is admitted to lead it, can compile, has the uptime);
3. a fresh claim (within the fresh window) ranks first for the term among the
   candidates that were already eligible when it claimed (members younger than
   the claim cannot outrank it), the previous holder left out if its lease had
   lapsed by then. An older claim — a term established in a view this node
   cannot see, the other side of a healed partition — is checked for (2), (4)
   and its age only: refusing it would split the run for good (see
   ``docs/election.md`` for what that leaves an eligible member able to do);
4. the term is reachable from the chain this node holds: while the current
   term is live only the very next term, freshly claimed, may replace it; a
   vacant node accepts at most ``claim_timeout_s``-skips ahead.

What fails (3) or (4), or names a holder the view does not list yet, is *held
back* (``HeldBack``, bounded, looked at again as the node learns more), never
followed. A commit is acted on only once the lease of its term is accepted and
it is signed by that lease's holder (or it is the commit the current lease
names as its base); a commit for a term the node cannot check yet is held the
same way, and released (``CommitChecked``) when the lease arrives. A lone
stranger's signature therefore never confers authority, and a far-future term
cannot stall the run: it is held, and at most moves the number of the next
term an honest node claims.

Lifecycle of a term, as seen by one node::

    VACANT   --tick, I rank first among live candidates-->   HOLDER   (PublishLease, BecomeShepherd;
                                                                       not while claims_paused_until)
    VACANT   --valid lease of a newer term-->                FOLLOWER (FollowShepherd)
    VACANT   --claim_timeout_s without a lease-->            VACANT   (the next term is up for claim)
    HOLDER   --tick, renew_every_s since issue-->            HOLDER   (PublishLease renewal; into the
                                                                       DHT when its copy there runs low)
    HOLDER   --commit completing rotate_every rounds-->      VACANT   (StepDown "rotation")
    HOLDER   --lease of a newer term / own lease lapsed-->   FOLLOWER/VACANT (StepDown)
    HOLDER   --resign: its set-up failed here-->             VACANT   (StepDown "resigned")
    FOLLOWER --commit completing rotate_every rounds-->      VACANT   (rotation)
    HOLDER   --tick, beat_every since the last beat-->       HOLDER   (SendHeartbeat)
    FOLLOWER --lease expiry + grace_s passed-->              VACANT   (failover)
    FOLLOWER --no beat from the holder for its window-->     VACANT   (failover; holder suspected;
                                                                       window: suspect_after_s, adaptive)
    FOLLOWER --tick 2 beats past due: we stalled, not it-->  FOLLOWER (grace: 2 heartbeats more, once)
    VACANT   --the suspected holder's heartbeat, term open--> FOLLOWER (it was slow, not dead;
                                                                       this node's patience doubles)
    FOLLOWER --the holder announced its departure-->         VACANT   (failover, at once)
"""

from __future__ import annotations

import enum
import hashlib
import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pcp_p2p.core.errors import (
    BadSignature,
    ConfigError,
    ExpiredRecord,
    HeldBack,
    NotElected,
    PcpError,
    StaleMessage,
    VerificationError,
)
from pcp_p2p.core.identity import Identity
from pcp_p2p.dht.records import KindRule
from pcp_p2p.diloco.protocol.effects import LookupCommit, Rejected
from pcp_p2p.diloco.protocol.messages import CommitRecord, sign, verify
from pcp_p2p.net.reachability import PUBLIC, RELAY_ONLY
from pcp_p2p.wire import Message, decode, wire_message

LEASE_KIND = "lease"
MAX_DEPARTED = 1024  # departures remembered; the oldest are forgotten first

# Adaptive suspicion (see ElectionConfig.suspect_s and Election.suspect_after_s).
GAP_SAMPLES = 256  # inter-arrival gaps of the holder's beats kept (64 s of beats at 0.25 s: a few rounds)
MIN_GAPS = 8  # gaps needed before they widen the window
SUSPECT_K = 1.5  # the window covers SUSPECT_K x the largest gap kept ...
SUSPECT_C = 4.0  # ... and mean + SUSPECT_C standard deviations of the gaps
MAX_PATIENCE = 8.0  # a false suspicion doubles the window, up to this factor
PATIENCE_DECAY_BEATS = 16  # on-time beats in a row that halve it again
STRETCH_BEATS = 3.0  # beats spread by beats_per_s widen the least window by this many of their extra spacing
LATE_TICK_BEATS = 2.0  # a tick this many heartbeats past due means this node itself stalled: grace, once


@wire_message("diloco.lease", max_size=4 * 1024)
class Lease(Message):
    """``holder`` is the shepherd of ``run_id`` for ``term`` until ``expiry``.

    ``claimed_at`` is when the term was first claimed (renewals keep it and move
    ``issued``/``expiry``); ``from_round``/``from_theta_cid``/``from_checkpoint_cid``
    say which committed state the term continues from (``from_checkpoint_cid`` is
    empty when the run starts from its initial θ). ``committed_round`` is the last
    round the holder has committed in this term (-1 before its first): of two claims
    of one term that meet after a partition, the one that led rounds stands
    (:func:`claim_stands`).
    """

    run_id: str
    term: int
    holder: str
    claimed_at: float
    issued: float
    expiry: float
    from_round: int
    from_theta_cid: str
    from_checkpoint_cid: str
    committed_round: int = -1
    signature: bytes = b""


@wire_message("diloco.heartbeat", max_size=1024)
class Heartbeat(Message):
    """The holder of ``term`` is alive: sent straight to the run's members every ``heartbeat_s``.

    Signed like a lease; a follower that has heard none for its suspicion window
    (``Election.suspect_after_s``: ``suspect_s`` at least, adaptive) suspects the holder
    and fails over without waiting for the lease to lapse (see ``Election.on_heartbeat``)."""

    run_id: str
    term: int
    holder: str
    sent_at: float
    every_s: float = 0.0
    """How often the holder beats each follower now (``ElectionConfig.beat_every_s``): with many
    followers the holder's beats share a budget, so they come further apart, and a follower
    must not suspect a holder for keeping to it."""
    signature: bytes = b""


def _lease_rule(name: str, signer: str, payload: Message) -> None:
    assert isinstance(payload, Lease)
    if payload.run_id != name:
        raise VerificationError("lease stored under another run id")
    if payload.holder != signer:
        raise BadSignature("a lease record must be stored by its holder")
    verify(payload, signer)


LEASE_RULE = KindRule(Lease, _lease_rule, order="seq")
"""DHT record ``/pcp/lease/<run id>``: publish with ``sign_record(..., seq=lease.term)``.

``dht.records.newer`` orders by ``(issued_at, seq)``; a lease of a higher term is
always issued later than the one it replaces on an honest clock, so the smallest
change that makes "newest term wins" hold even across clock skew is for the DHT
``select`` of this kind to order by ``(seq, issued_at)`` — see ``lease_newer``.
"""


def lease_newer(a_seq: int, a_issued: float, b_seq: int, b_issued: float) -> bool:
    """Record order for the ``lease`` kind: higher term (``seq``) first, then newer issue."""
    return (a_seq, a_issued) > (b_seq, b_issued)


# --- ranking -------------------------------------------------------------------


def term_rank(run_id: str, term: int, peer_id: str) -> bytes:
    """A candidate's rank for ``term`` (lowest leads). Everyone computes the same order."""
    return hashlib.sha256(f"pcp-term|{run_id}|{term}|{peer_id}".encode()).digest()


@dataclass(frozen=True)
class Candidate:
    """A live member as the membership view reports it."""

    peer_id: str
    uptime_s: float
    can_compile: bool = True
    reachability: str = "unknown"  # the member's own verdict (pcp_p2p.net.connectivity): public, relay-only, ...


@dataclass(frozen=True)
class ElectionConfig:
    lease_s: float = 30.0
    """How long a lease is valid after it is issued."""
    renew_every_s: float = 10.0
    """The holder re-issues its lease this often (well under ``lease_s``)."""
    grace_s: float = 2.0
    """Followers wait this long past a lease's expiry before failing over (clock skew)."""
    min_uptime_s: float = 60.0
    """A member must have been up this long to be a candidate (no flapping nodes)."""
    rotate_every: int = 10
    """Rounds per term before a planned hand-over; 0 = never rotate."""
    claim_timeout_s: float = 30.0
    """A vacant term unclaimed this long is skipped: the next term (new ranking) is up."""
    settle_s: float = 3.0
    """After start and after a term ends, how long to wait for the DHT's latest lease and
    commit before claiming (``on_lookups_done`` cuts it short)."""
    fresh_claim_s: float | None = None
    """How long after ``claimed_at`` a claim counts as fresh (default ``lease_s``): only a
    fresh claim of the very next term may replace a term that is still live."""
    max_skew_s: float = 2.0
    """How far ahead of this node's clock a lease may be issued (and how much longer than
    ``lease_s`` it may be valid)."""
    max_claim_age_s: float | None = None
    """A lease claimed longer ago than this is refused (``None``: no bound). The longest a
    term can honestly last; bounds how far back a claim may be dated."""
    max_held: int = 16
    """Leases and commits held back (not yet checkable), at most; the oldest go first."""
    rounds: int | None = None
    """The run's number of rounds: once a commit of the last one is known, no term is claimed
    (``None``: the run never ends, as far as the election knows)."""
    heartbeat_s: float = 0.0
    """The holder sends a signed :class:`Heartbeat` straight to the run's members this often
    (0: none; failover waits for the lease to lapse), or less often with many followers
    (``beats_per_s``)."""
    beats_per_s: float = 0.0
    """The holder's heartbeats per second to all its followers together, at most (0: no cap).

    Why: beats went from the holder to every follower every ``heartbeat_s``, so the holder's
    uplink paid O(N) a second for them, the largest part of its traffic that grew with the
    swarm once the Δs were off it (issue #15). Under the cap each follower is beaten every
    ``beat_every_s(followers)``, never more often than ``heartbeat_s`` nor less often than
    twice per renewal (a renewal goes to every member too, and counts as a beat). The price is
    slower failover in large runs: followers widen their least suspicion window with the spacing
    (``Election._least_window``), so at 16 members (a beat a second) a dead holder is suspected
    after ~3.75 s instead of ~1.5 s; never later than the lease's own lapse."""
    suspect_s: float | None = None
    """A follower that heard no heartbeat (nor renewal) from the holder this long suspects it
    (default ``3 * heartbeat_s``): it fails over, and leaves the holder out of the next
    term's ranking, without waiting for the lease to lapse.

    This is the *least* window (``suspect_window_s``). A fixed window is wrong on a loaded
    machine: there a live holder's beats come 1–2 s apart (its steps and py-libp2p's stream
    set-up stall), and followers that suspect it fail over back and forth, losing rounds. So
    each follower widens its own window from what it observes (``Election.suspect_after_s``):
    to ``SUSPECT_K`` x the largest recent gap between the holder's beats and to their mean +
    ``SUSPECT_C`` standard deviations (phi-accrual style), times a patience that doubles on
    every false suspicion; never beyond ``lease_s``, so suspicion still comes before the
    lease's own lapse. Beats ``heartbeat_s`` apart (a quiet machine) leave it at ``suspect_s``:
    failover there stays as fast as before."""

    def validate(self) -> ElectionConfig:
        if not (0 < self.renew_every_s < self.lease_s):
            raise ConfigError("election: need 0 < renew_every_s < lease_s")
        if self.max_skew_s < 0 or (self.max_claim_age_s is not None and self.max_claim_age_s <= 0):
            raise ConfigError("election: max_skew_s >= 0 and max_claim_age_s > 0")
        if self.grace_s < 0 or self.min_uptime_s < 0 or self.rotate_every < 0 or self.claim_timeout_s <= 0:
            raise ConfigError("election: grace_s, min_uptime_s, rotate_every >= 0 and claim_timeout_s > 0")
        if self.heartbeat_s < 0 or (self.heartbeat_s > 0 and not self.heartbeat_s < self.suspect_window_s):
            raise ConfigError("election: heartbeat_s >= 0, and below suspect_s")
        if not (math.isfinite(self.beats_per_s) and self.beats_per_s >= 0):
            raise ConfigError("election: beats_per_s >= 0 (0: no cap)")
        return self

    @property
    def heartbeats(self) -> bool:
        return self.heartbeat_s > 0

    @property
    def slowest_beat_s(self) -> float:
        """The longest spacing of a follower's beats under ``beats_per_s``: twice per renewal."""
        return max(self.heartbeat_s, self.renew_every_s / 2)

    def beat_every_s(self, followers: int) -> float:
        """How often the holder beats each of ``followers`` under ``beats_per_s``."""
        if self.beats_per_s <= 0:
            return self.heartbeat_s
        return min(self.slowest_beat_s, max(self.heartbeat_s, followers / self.beats_per_s))

    @property
    def suspect_window_s(self) -> float:
        return 3 * self.heartbeat_s if self.suspect_s is None else self.suspect_s

    @property
    def fresh_window_s(self) -> float:
        return self.lease_s if self.fresh_claim_s is None else self.fresh_claim_s


def eligible(view: Iterable[Candidate], config: ElectionConfig) -> list[str]:
    """The candidates that may lead: able to compile, up long enough, and reachable enough.

    The shepherd is who every worker pulls θ from and who pulls every Δ, so it
    must be dialable by all of them. A relay-only node (symmetric NAT) is
    reachable through a relay alone, and relays carry control traffic only: it
    never leads. A node behind a cone NAT is hole-punchable by other cone homes
    but not by a relay-only one, so while any public candidate exists only the
    public ones lead. Every member computes this from the same records, so the
    ranking stays shared.
    """
    ok = [c for c in view if c.can_compile and c.uptime_s >= config.min_uptime_s and c.reachability != RELAY_ONLY]
    public = [c for c in ok if c.reachability == PUBLIC]
    return sorted({c.peer_id for c in (public or ok)})


def ranked(run_id: str, term: int, candidates: Iterable[str]) -> list[str]:
    return sorted(set(candidates), key=lambda p: term_rank(run_id, term, p))


def claim_stands(run_id: str, a: Lease, b: Lease, fresh_s: float) -> bool:
    """Of two claims of one term by different holders, whether ``a`` stands against ``b``.

    Claims made within ``fresh_s`` of each other answered the same vacancy from views that
    differed: the better-ranked stands (every node ranks alike). Claims further apart did not:
    the later one was made by a node that had not yet heard of the term (one side of a
    healed partition claimed it a minute ago and has led rounds since; a node of the other
    side saw its own holder step down for it and claimed the same term before that lease
    reached it). The earlier claim stands then. Under the rank rule alone the late claim
    won wherever it outranked, and the run forked inside one term: each side's chain under
    one term number (tests/test_netlab_partition.py, 2026-11-24).

    A claim that has led more rounds (``committed_round``, as its holder's latest renewal
    says) stands, whatever the times and ranks: two claims made within ``fresh_s`` on
    either side of a partition both stood where they were made, the majority's side
    committed rounds under its own, and after the heal the better-ranked other claim
    deposed it while its holder refused the majority's commits ("does not hold the
    term") and the majority refused its announcements ("already committed"): the run
    stopped for good (tests/test_run_machine.py, seed 1, 2026-11-25). Ranking by
    progress first, both sides pick the claim that led rounds.
    """
    if a.committed_round != b.committed_round:
        return a.committed_round > b.committed_round
    if abs(a.claimed_at - b.claimed_at) <= fresh_s:
        return term_rank(run_id, a.term, a.holder) < term_rank(run_id, b.term, b.holder)
    return a.claimed_at < b.claimed_at


# --- effects ---------------------------------------------------------------------


@dataclass(frozen=True)
class PublishLease:
    """Send ``lease`` to every member and, when ``store``, put it in the DHT (``/pcp/lease/<run>``,
    seq = term).

    Why not every renewal into the DHT: a put is a store at up to k = 20 peers, one
    stream each, and the DHT's copy is only read by nodes that start or lost their
    term (members get every renewal directly). A renewal is stored only when the copy
    there would otherwise lapse before the renewal after next (see
    :meth:`Election.tick`), which halves the puts with the default timing (a 6 s
    lease renewed every 2 s) and keeps the DHT's copy valid throughout.
    """

    lease: Lease
    renewal: bool
    store: bool = True


@dataclass(frozen=True)
class SendHeartbeat:
    """Send ``heartbeat`` straight to every member of the run (the holder does, every ``heartbeat_s``)."""

    heartbeat: Heartbeat


@dataclass(frozen=True)
class BecomeShepherd:
    """Start a :class:`~pcp_p2p.diloco.protocol.shepherd.Shepherd` for ``term``.

    From ``checkpoint_cid`` (``Shepherd.from_checkpoint``), or from the run's
    initial θ when it is ``None``; it commits rounds up to ``end_round``
    (exclusive; ``None`` = no rotation) and then hands over.
    """

    term: int
    checkpoint_cid: str | None
    from_round: int
    end_round: int | None


@dataclass(frozen=True)
class StartFrom:
    """A state a new term can start from: a checkpoint (θ and outer momentum), or a θ with fresh
    momentum from which the term trains ``round`` (0-based) first."""

    cid: str
    checkpoint: bool
    round: int
    what: str  # for the log: what this state is, and what starting from it costs


def start_candidates(become: BecomeShepherd, lease: Lease | None, base: CommitRecord | None) -> list[StartFrom]:
    """Where the term ``become`` sets up can start, best first; empty: from the run's initial θ.

    The checkpoint the lease names (nothing lost; workers replicate every committed
    checkpoint, so this is the normal path); the committed θ (the outer momentum lost);
    the θ that commit's round started from (that round trained again, and fork choice
    takes this term's commit of it over the lost one). The last is for a holder killed
    as it committed, before anyone took a copy of either: every worker that trained the
    round holds the θ it started from. Before it, each of the three set-up attempts failed
    on the same missing blobs, for minutes, and the next holder met them missing too.
    ``base``: the best commit this node accepted; only the one the lease continues from
    names a parent. The runtime's set-up and both simulators try these in this order.
    """
    if become.checkpoint_cid is None:
        return []
    out = [StartFrom(become.checkpoint_cid, True, become.from_round, "the checkpoint")]
    if lease is None or not lease.from_theta_cid:
        return out
    out.append(StartFrom(lease.from_theta_cid, False, become.from_round, "the committed θ, zero outer momentum"))
    if base is not None and base.prev_theta_cid and (base.round + 1, base.theta_cid) == (
            become.from_round, lease.from_theta_cid):
        out.append(StartFrom(base.prev_theta_cid, False, base.round,
                             f"the θ round {base.round + 1} started from, training it again"))
    return out


@dataclass(frozen=True)
class FollowShepherd:
    """``peer`` holds ``term``: ``Worker.set_shepherd(term, peer, base=(from_round, from_theta_cid))``.

    ``from_round``/``from_theta_cid``: the commit the term continues from (a worker
    that missed it still accepts it, although its term is older).
    """

    term: int
    peer: str
    from_round: int = 0
    from_theta_cid: str = ""

    @property
    def base(self) -> tuple[int, str] | None:
        return (self.from_round, self.from_theta_cid) if self.from_theta_cid else None


@dataclass(frozen=True)
class StepDown:
    """Stop this node's shepherd of ``term`` now (its in-flight round is abandoned)."""

    term: int
    reason: str  # "rotation" | "deposed" | "lapsed" | "aged" (claim older than max_claim_age_s)


@dataclass(frozen=True)
class LookupLease:
    """Look up ``/pcp/lease/<run>`` in the DHT; feed what comes back to ``on_lease``."""


@dataclass(frozen=True)
class CommitChecked:
    """``record`` passed the authority chain: hand it to the worker (and only then).

    Emitted by ``on_commit`` for a commit it accepts, and later for a held-back
    commit once the lease of its term is accepted.
    """

    record: CommitRecord


ElectionEffect = (
    LookupLease | PublishLease | BecomeShepherd | FollowShepherd | StepDown | LookupCommit | Rejected | CommitChecked
    | SendHeartbeat
)


@dataclass
class TermRecord:
    term: int
    holder: str
    from_round: int
    rounds_served: int = 0
    # "rotation" (planned hand-over) | "failover" (holder vanished) | None: see Election.ended_label
    ended: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"term": self.term, "holder": self.holder, "rounds_served": self.rounds_served, "ended": self.ended}


def commit_key(rec: CommitRecord) -> tuple[int, int, str]:
    """Fork choice: the greatest key is the one committed state everyone converges on."""
    return (rec.term, rec.round, rec.theta_cid)


class Role(enum.Enum):
    VACANT = "vacant"
    FOLLOWER = "follower"
    HOLDER = "holder"


class Election:
    """One node's view of who leads one run. Feed it inputs; carry out its effects.

    Suspicion (a follower's, of a holder that stopped beating) adapts to what this node
    observes, because a live holder on a loaded machine is slow, not dead:

    - the gaps between the holder's beats (renewals count) are kept, the last ``GAP_SAMPLES``
      (across terms and holders: they describe the machines and links), and widen the window
      (``suspect_after_s``);
    - a suspected holder heard again (``_follow_again``: it was slow) doubles ``patience``,
      which halves again after ``PATIENCE_DECAY_BEATS`` on-time beats in a row;
    - a ``tick`` that comes ``LATE_TICK_BEATS`` heartbeats or more past the window's end means
      this node itself was not scheduled, and the holder's beats may be queued behind that
      tick: the holder gets two more heartbeats' grace, once per silence, before it is suspected.

    All of it only ever delays suspicion up to ``lease_s`` after the holder was last heard:
    the lease's lapse (+ ``grace_s``) still ends a term whose holder is really gone.
    """

    def __init__(self, run_id: str, identity: Identity, config: ElectionConfig | None = None) -> None:
        self.run_id = run_id
        self.identity = identity
        self.config = (config or ElectionConfig()).validate()
        self.view: list[str] = []  # eligible live candidates, as last reported
        self.uptime: dict[str, float] = {}  # their uptime when last reported ...
        self.view_at: float | None = None  # ... at this time
        self.lease: Lease | None = None
        self.prev_lease: Lease | None = None  # the lease the current one replaced
        self.held_leases: dict[str, Lease] = {}  # holder -> its latest lease not checkable yet
        self.held_commits: dict[tuple[int, str, str], CommitRecord] = {}  # (term, shepherd, θ) -> commit
        self.ended_by_rotation = False
        self.vacant_since: float | None = None
        self.best_commit: CommitRecord | None = None
        self.history: list[TermRecord] = []
        self.role = Role.VACANT
        self._now: float | None = None
        self.settle_until: float | None = None  # no claim before: lookups are on their way
        self.last_heard: float | None = None  # when the current holder last showed it is alive (our clock)
        self.suspected: dict[str, float] = {}  # holder -> since when this node has not heard it
        # Adaptive suspicion (see the class docstring): gaps between holders' beats, and the
        # (term, holder) the last one was measured for; the patience factor; on-time beats since
        # it last changed; and the end of the grace a late tick gave (with its last_heard).
        self.gaps: deque[float] = deque(maxlen=GAP_SAMPLES)
        self.gaps_of: tuple[int, str] | None = None
        self._gap_window: float | None = None  # what the kept gaps warrant (computed once per gap)
        self.patience = 1.0
        self.on_time = 0
        self.grace_until: float | None = None
        self.grace_for: float | None = None
        self.last_beat: float | None = None  # as the holder: when our last heartbeat (or lease) went out
        self.followers = 0  # the run's other live members, as the run machine last counted them
        self.holder_every_s = 0.0  # how often the holder said it beats each follower (its last beat)
        self.stored_expiry: float | None = None  # as the holder: when the lease last put in the DHT lapses
        self.departed: dict[str, float] = {}  # peer -> when it announced it left (its clock)
        self.anchor: Lease | None = None  # the last lease accepted before a restart (see restore)
        # The latest term's lease accepted from the network since start: with the anchor, what
        # check_final checks against. Not a lease this node claimed since: its own claim after
        # a restart says nothing of who held that term while it was down.
        self.witnessed: Lease | None = None
        # This node makes no claim before this time (the run machine's back-off after a set-up
        # that failed here): it stays a candidate, so a term it ranks first in is skipped after
        # claim_timeout_s, as for any candidate that does not claim, and the next is up.
        self.claims_paused_until: float | None = None

    # --- queries -------------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    @property
    def current_term(self) -> int | None:
        return None if self.lease is None else self.lease.term

    @property
    def holder(self) -> str | None:
        """The shepherd of the current term while its lease is valid and not handed over."""
        if self.lease is None or self.ended_by_rotation or self.role is Role.VACANT:
            return None
        return self.lease.holder

    def term_to_claim(self, now: float) -> int | None:
        """The term that is up for claim now, or ``None`` while a term is held."""
        if self.role is not Role.VACANT or self.vacant_since is None:
            return None
        base = self._claim_base(now)
        skipped = int(max(0.0, now - self.vacant_since) // self.config.claim_timeout_s)
        return base + skipped

    def standbys(self, k: int) -> list[str]:
        """The first ``k`` candidates for the term after the current one, its holder left out:
        who would claim it if the holder failed now (the ranking of a failover). Every node
        computes the same list from the same view, so each knows whether to prepare."""
        lease = self.lease
        if lease is None:
            return ranked(self.run_id, 0, self.view)[:k]
        return ranked(self.run_id, lease.term + 1, set(self.view) - {lease.holder})[:k]

    def expected_holder(self, term: int, now: float) -> str | None:
        """Who should claim ``term`` at ``now`` in this node's view (``None``: nobody eligible)."""
        return self._expected_for(term, self.lease, now)

    @property
    def next_wakeup(self) -> float | None:
        c = self.config
        if self.role is Role.HOLDER and self.lease is not None:
            due = min(self.lease.issued + c.renew_every_s, self.lease.expiry)
            if c.heartbeats and self.last_beat is not None:
                due = min(due, self.last_beat + self.beat_every)
            return due
        if self.role is Role.FOLLOWER and self.lease is not None:
            due = self.lease.expiry + c.grace_s
            if c.heartbeats and self.last_heard is not None:
                due = min(due, self.last_heard + self.suspect_after_s)
                if self.grace_until is not None and self.grace_for == self.last_heard:
                    due = max(due, min(self.grace_until, self.lease.expiry + c.grace_s))
            return due
        if self.role is Role.VACANT and self.vacant_since is not None:
            now = self.vacant_since if self._now is None else self._now
            if self.settle_until is not None and now < self.settle_until:
                return self.settle_until
            # re-rank when the next skipped term comes up (or this node may claim again)
            n = int((now - self.vacant_since) // c.claim_timeout_s)
            wake = self.vacant_since + (n + 1) * c.claim_timeout_s
            paused = self.claims_paused_until
            return paused if paused is not None and now < paused < wake else wake
        return None

    @property
    def suspect_after_s(self) -> float:
        """How long this node, a follower, waits without a beat before it suspects the holder.

        ``suspect_window_s`` at least; widened to what the holder's observed beat gaps
        warrant (``SUSPECT_K`` x the largest kept, mean + ``SUSPECT_C`` standard deviations,
        once ``MIN_GAPS`` are kept), times ``patience``; at most ``lease_s``, so a holder
        that is really gone is still suspected before its lease lapses."""
        c = self.config
        window = self._least_window
        if self._gap_window is not None:
            window = max(window, self._gap_window)
        return min(c.lease_s, window * self.patience)

    @property
    def beat_every(self) -> float:
        """How often beats come (as the holder: go) to each follower: ``beat_every_s`` of the
        followers this node counts, or what the holder said in its last beat if that is longer
        (their counts can differ for a moment), never beyond twice per renewal."""
        c = self.config
        every = c.beat_every_s(self.followers)
        if self.role is not Role.HOLDER:
            every = max(every, min(self.holder_every_s, c.slowest_beat_s))
        return every

    @property
    def _least_window(self) -> float:
        """``suspect_window_s``, widened by ``STRETCH_BEATS`` times what the beats were spread by
        (``beats_per_s``). Not scaled whole: what makes beats late on a loaded machine (a stall of
        a second or two) does not grow with their spacing, so six beats of 1 s would wait 6 s,
        the lease's own lapse, where ~4 s is as safe."""
        c = self.config
        spread = self.beat_every - c.heartbeat_s if c.heartbeats else 0.0
        return c.suspect_window_s + STRETCH_BEATS * spread

    def heartbeat(self, now: float) -> Heartbeat | None:
        """The signed heartbeat this node would send at ``now``: ``None`` unless heartbeats are on
        and it holds a term whose lease has not lapsed. Changes nothing, so a runtime may send
        it from a task of its own while the machine is busy with an input (``tick`` sends it
        too, every ``heartbeat_s``)."""
        lease = self.lease
        if not self.config.heartbeats or self.role is not Role.HOLDER or lease is None or now >= lease.expiry:
            return None
        return sign(Heartbeat(run_id=self.run_id, term=lease.term, holder=self.peer_id, sent_at=now,
                              every_s=self.beat_every), self.identity)

    def status(self, now: float) -> dict[str, Any]:
        """``term``, ``lease_expires_s``, ``shepherd_history``, for ``pcp status --json``."""
        lease = self.lease
        return {
            "term": None if lease is None else lease.term,
            "holder": self.holder,
            "role": self.role.value,
            "lease_expires_s": None if lease is None or self.holder is None else max(0.0, lease.expiry - now),
            "shepherd_history": [t.as_dict() for t in self.history],
        }

    # --- inputs ----------------------------------------------------------------------

    def start(self, now: float) -> list[ElectionEffect]:
        """The node starts taking part: the first term is vacant until a lease is seen."""
        self._now = now
        if self.vacant_since is None and self.lease is None:
            self.vacant_since = now
        self.settle_until = now + self.config.settle_s
        return [LookupLease(), LookupCommit()]

    def on_lookups_done(self, now: float) -> list[ElectionEffect]:
        """The lease and commit lookups answered (or found nothing): no need to wait longer."""
        self.settle_until = None
        return self.tick(now)

    def on_members(self, live: Iterable[Candidate], now: float) -> list[ElectionEffect]:
        self._now = now
        live = list(live)
        self.view = eligible(live, self.config)
        self.uptime = {c.peer_id: c.uptime_s for c in live if c.peer_id in self.view}
        self.view_at = now
        return self._retry_held(now) + self.tick(now)

    def restore(self, lease: Lease) -> None:
        """The last lease this node accepted before it restarted, read back from its data dir.

        Not followed (a restarted node does not remember serving or following a
        term); it is the anchor from which a run that *finished* while the node
        was down is caught up (:meth:`check_final`): by then no lease is live and
        the DHT's lease record has expired, so nothing else can vouch for the last
        commit. The caller read it from its own disk; it is checked again anyway.
        """
        if lease.run_id == self.run_id:
            verify(lease, lease.holder)
            self.anchor = lease

    def check_final(self, rec: CommitRecord, rounds: int, now: float) -> None:
        """Raise unless ``rec`` may be adopted as the run's last commit by a node that missed the end.

        Only for a node that has accepted no commit since it restarted (one that
        has follows the run's chain and checks commits against it: a forged "last
        round" must not end a run it takes part in). It may have accepted a lease:
        its own claim after the restart (it ranks first among the members still
        taking part, that is alone, once the others have finished), its own lease
        echoed back, or a lease that lapsed when the run ended. The commit must
        complete the run's last round, be signed by its shepherd, and come from the
        term of the latest lease this node knows (:meth:`restore`d, or accepted
        since; by its holder), or from a later term reachable from it: terms advance
        one per claim timeout at most, so a far-future forgery is held back, as
        ``_check_reachable`` does.
        The shepherd's admission to lead is the caller's to check. Weaker than
        the live chain (no lease of a later term is checked: they have expired),
        it is used only once the run is over and nothing newer can come.
        """
        if rec.run_id != self.run_id:
            raise VerificationError(f"commit for another run {rec.run_id:.20}")
        if rec.round + 1 < rounds:
            raise HeldBack(f"commit of round {rec.round} does not end the run ({rounds} rounds)")
        verify(rec, rec.shepherd)
        if self.best_commit is not None:
            # this node follows the run's chain since its restart: commits must pass it (check_commit)
            raise HeldBack(f"commit of term {rec.term}: its lease is not accepted here yet")
        anchor = self.anchor
        seen = self.witnessed
        if seen is not None and (anchor is None or seen.term > anchor.term):
            anchor = seen  # a term seen since the restart (its own from before, echoed back, or another's)
        if anchor is None:
            raise HeldBack("no lease of this run was accepted here before: nothing to check the commit against")
        if rec.term < anchor.term:
            raise StaleMessage(f"commit of term {rec.term}, term {anchor.term} already seen")
        if rec.term == anchor.term:
            if rec.shepherd != anchor.holder:
                raise BadSignature(f"{rec.shepherd:.16}… does not hold term {rec.term}")
            return
        limit = anchor.term + 1 + int(max(0.0, now - anchor.claimed_at) // self.config.claim_timeout_s)
        if rec.term > limit:
            raise HeldBack(f"term {rec.term} leaps ahead of the chain this node holds (at most {limit})")

    def adopt_final(self, rec: CommitRecord, rounds: int, now: float) -> list[ElectionEffect]:
        """Catch up to a run that finished while this node was down: ``rec`` passed
        :meth:`check_final` and becomes the best commit (so no term is claimed any more).
        Answers ``CommitChecked`` (or nothing if a commit as good is held already)."""
        self._now = now
        if self.best_commit is not None and commit_key(rec) <= commit_key(self.best_commit):
            return []  # this one, or one as good, is held already
        self.check_final(rec, rounds, now)
        self.held_commits.pop((rec.term, rec.shepherd, rec.theta_cid), None)
        self.best_commit = rec
        return [CommitChecked(rec)]

    def on_departure(self, peer: str, at: float, now: float) -> list[ElectionEffect]:
        """``peer`` announced at ``at`` (its clock) that it leaves the run.

        The caller has checked the announcement (signed by ``peer``, fresh, no
        replay: :class:`~pcp_p2p.diloco.protocol.departures.Departures`). The leaver is no
        candidate any more, no lease it issued up to ``at`` is taken again, and if
        it holds the current term the term ends now ("failover") instead of after
        its lease and the grace: the next term is claimed from the latest commit
        once the lookups settle.
        """
        self._now = now
        self.departed[peer] = max(at, self.departed.get(peer, at))
        while len(self.departed) > MAX_DEPARTED:
            del self.departed[min(self.departed, key=self.departed.__getitem__)]
        self.view = [p for p in self.view if p != peer]
        lease = self.lease
        if lease is None or lease.holder != peer or self.role is not Role.FOLLOWER:
            return []
        return self._end_term(now, "failover")

    def resign(self, term: int, now: float) -> list[ElectionEffect]:
        """This node holds ``term`` but cannot lead it (its set-up failed here): give the term up now
        (``StepDown(term, "resigned")``) instead of renewing a lease under which nobody leads.
        Its heartbeats stop, so followers fail over within ``suspect_s``; the next term goes to
        whoever ranks first for it: this node counts itself out of that ranking, as its followers
        do once its heartbeats stop (unless it is the only candidate: then it claims again once
        ``claims_paused_until`` has passed)."""
        self._now = now
        if self.role is not Role.HOLDER or self.lease is None or self.lease.term != term:
            return []
        self._suspect(self.peer_id, now)
        return self._end_term(now, "resigned")

    def on_heartbeat(self, hb: Heartbeat, now: float) -> list[ElectionEffect]:
        """A heartbeat arrived straight from ``hb.holder``.

        Only the holder of the lease this node accepted for ``hb.term`` counts:
        its signature is checked; one for an older term (a deposed holder, a
        delayed packet) or a term not accepted here is dropped without effect. A
        holder heard again after this node suspected it, while no later term was
        accepted, is followed again (it was slow, not dead).
        """
        self._now = now
        lease = self.lease
        if hb.run_id != self.run_id or lease is None or hb.term != lease.term or hb.holder != lease.holder:
            return []
        if hb.holder == self.peer_id:
            return []
        try:
            verify(hb, hb.holder)
        except PcpError as exc:
            return [Rejected(hb.holder, exc)]
        if hb.sent_at > now + self.config.max_skew_s:
            return [Rejected(hb.holder, ExpiredRecord(f"heartbeat sent {hb.sent_at - now:.1f} s in the future"))]
        self.holder_every_s = hb.every_s if math.isfinite(hb.every_s) else 0.0
        self._heard(hb.holder, now)
        self._follow_again(now)
        return []

    def _heard(self, holder: str, now: float) -> None:
        lease = self.lease
        if lease is not None and holder == lease.holder:
            key = (lease.term, holder)
            if key != self.gaps_of:
                # A new holder or term: no gap is measured across the change (last_heard was the
                # old holder's), but the gaps learned are kept. They describe the machines and
                # links beats cross, not one holder, and a new holder is busiest exactly when it
                # starts (its set-up): forgetting them met it with the bare least window, and on a
                # loaded swarm every new holder was deposed while it compiled (docs/diloco.md).
                self.gaps_of = key
            elif self.last_heard is not None and now > self.last_heard:
                gap = now - self.last_heard
                self.gaps.append(gap)
                if len(self.gaps) >= MIN_GAPS:  # here, not per query: next_wakeup asks after every input
                    mean, sd = statistics.fmean(self.gaps), statistics.pstdev(self.gaps)
                    self._gap_window = max(SUSPECT_K * max(self.gaps), mean + SUSPECT_C * sd)
                self.on_time = self.on_time + 1 if gap < self._least_window else 0
                if self.on_time >= PATIENCE_DECAY_BEATS and self.patience > 1.0:
                    self.patience = max(1.0, self.patience / 2)
                    self.on_time = 0
            self.last_heard = now
            self.grace_until = self.grace_for = None
        self.suspected.pop(holder, None)

    def _follow_again(self, now: float) -> None:
        """The holder of the term this node failed over from was just heard (its heartbeat or a
        renewal), and no later term was accepted: it was slow, not dead, so it is followed again
        and its term did not end after all. Not after a rotation (the term is over by plan), nor
        for this node's own lease, an expired one, or a holder that announced its departure."""
        lease = self.lease
        if (self.role is not Role.VACANT or self.ended_by_rotation or lease is None or lease.holder == self.peer_id
                or now >= lease.expiry or lease.holder in self.departed):
            return
        self.role = Role.FOLLOWER
        self.vacant_since = None
        self.settle_until = None
        # This node gave up on a holder that was only slow: it waits longer before the next time.
        self.patience = min(MAX_PATIENCE, self.patience * 2)
        self.on_time = 0
        if self.history and self.history[-1].term == lease.term and self.history[-1].ended == "failover":
            self.history[-1].ended = None

    def _suspect(self, holder: str, now: float) -> None:
        self.suspected[holder] = now
        while len(self.suspected) > MAX_DEPARTED:
            del self.suspected[min(self.suspected, key=self.suspected.__getitem__)]

    def on_lease(self, lease: Lease | bytes, now: float) -> list[ElectionEffect]:
        """A lease arrived (gossip, direct send or DHT lookup)."""
        self._now = now
        try:
            if isinstance(lease, bytes):
                lease = decode(lease, Lease)
            self.check_lease(lease, now)
        except HeldBack as exc:
            assert isinstance(lease, Lease)
            self._hold_lease(lease)
            return [Rejected(lease.holder, exc)]
        except PcpError as exc:
            return [Rejected(getattr(lease, "holder", None) if isinstance(lease, Lease) else None, exc)]
        return self._accept_lease(lease, now)

    def _accept_lease(self, lease: Lease, now: float) -> list[ElectionEffect]:
        """``lease`` passed ``check_lease``: renew, or move to its term."""
        self.held_leases.pop(lease.holder, None)
        cur = self.lease
        if cur is not None and lease.term == cur.term and lease.holder == cur.holder:
            if lease.issued > cur.issued:
                self.lease = lease  # a renewal
                self._heard(lease.holder, now)
                self._follow_again(now)
            return []
        effects: list[ElectionEffect] = []
        if cur is not None:
            effects += self._end_term(now, "deposed", successor=lease)
        if cur is not None and cur.term < lease.term:
            self.prev_lease = cur
        self.lease = lease
        self.witnessed = lease
        self.ended_by_rotation = False
        self.vacant_since = None
        self._heard(lease.holder, now)
        self.history.append(TermRecord(lease.term, lease.holder, lease.from_round))
        if lease.holder == self.peer_id:
            # our own lease echoed back after a restart: we do not remember serving it
            self.role = Role.VACANT
            self.vacant_since = now
            return [*effects, StepDown(lease.term, "lapsed"), *self._release_commits(now)]
        self.role = Role.FOLLOWER
        effects.append(FollowShepherd(lease.term, lease.holder, lease.from_round, lease.from_theta_cid))
        return effects + self._release_commits(now)

    def check_lease(self, lease: Lease, now: float) -> None:
        """Raise a typed error unless ``lease`` may replace (or renew) the current one.

        ``HeldBack`` (a ``NotElected``) means "well signed, not checkable yet":
        ``on_lease`` keeps such a lease and looks at it again later.
        """
        c = self.config
        if lease.run_id != self.run_id:
            raise VerificationError(f"lease for another run {lease.run_id:.20}")
        verify(lease, lease.holder)  # BadSignature unless the holder signed it
        left = self.departed.get(lease.holder)
        if left is not None and lease.issued <= left:
            raise StaleMessage(f"lease of term {lease.term} issued before its holder left the run")
        if not (lease.claimed_at <= lease.issued < lease.expiry):
            raise VerificationError("lease times are not claimed <= issued < expiry")
        if lease.committed_round != -1 and not (
                lease.from_round <= lease.committed_round < (c.rounds if c.rounds is not None else 2**62)):
            raise VerificationError(f"lease of term {lease.term} says round {lease.committed_round} was committed; "
                                    f"the term starts at round {lease.from_round}"
                                    + ("" if c.rounds is None else f" and the run has {c.rounds} rounds"))
        if lease.expiry - lease.issued > c.lease_s + c.max_skew_s:
            raise VerificationError(
                f"lease valid for {lease.expiry - lease.issued:.0f} s; the run allows {c.lease_s:g} s")
        cur = self.lease
        if cur is not None and lease.term < cur.term:
            raise StaleMessage(f"lease of term {lease.term}, term {cur.term} already seen")
        if lease.issued > now + c.max_skew_s:
            raise ExpiredRecord(f"lease of term {lease.term} issued {lease.issued - now:.1f} s in the future")
        if lease.expiry <= now:
            raise ExpiredRecord(f"lease of term {lease.term} expired {now - lease.expiry:.1f} s ago")
        if c.max_claim_age_s is not None and now - lease.claimed_at > c.max_claim_age_s:
            raise ExpiredRecord(f"lease of term {lease.term} claimed {now - lease.claimed_at:.0f} s ago; "
                                f"no term lasts longer than {c.max_claim_age_s:.0f} s")
        if cur is not None and lease.term == cur.term:
            if lease.holder == cur.holder:
                if lease.claimed_at != cur.claimed_at:
                    raise VerificationError("a renewal may not move the claim time")
                if lease.issued < cur.issued:
                    raise StaleMessage("an older issue of the current lease")
                return
            # two claims of one term (views differed): see claim_stands; the winner must
            # itself be entitled to the term. An incumbent this node no longer counts eligible
            # keeps nobody out: a cone home that claimed before the public nodes' records said
            # they are public saw no public candidate and ranked first; once it knows them, its
            # claim must not refuse theirs, or it holds its term alone and never trains
            # (tests/test_netlab_training.py, 2026-11-24).
            if cur.holder in self.view and not claim_stands(self.run_id, lease, cur, c.fresh_window_s):
                raise NotElected(f"term {lease.term} is already held by a better-ranked or earlier claim")
            self._check_entitled(lease, self.prev_lease, now)
            return
        self._check_reachable(lease, now)
        self._check_entitled(lease, cur, now)

    def _fresh(self, lease: Lease, now: float) -> bool:
        """Claimed within the fresh window: every node saw the same vacancy, so the rank is checked."""
        return now - lease.claimed_at <= self.config.fresh_window_s

    def _check_entitled(self, lease: Lease, prev: Lease | None, now: float) -> None:
        """The holder is an eligible candidate, and — for a fresh claim — ranked first when it claimed.

        An established term (claimed before the fresh window) is checked for
        eligibility only: it was claimed in a view this node cannot see (the
        other side of a healed partition), and refusing it would split the run
        for good. Its term is bounded by ``_check_reachable`` and its age by
        ``max_claim_age_s``; only an eligible member (admitted to lead: see
        ``admission.shepherds``) can hold one.
        """
        if lease.holder not in self.view:
            raise HeldBack(f"{lease.holder:.16}… is not an eligible candidate in this node's view")
        if not self._fresh(lease, now):
            return
        if prev is not None and prev.term >= lease.term:
            prev = None
        expected = self._expected_for(lease.term, prev, lease.claimed_at)
        if expected != lease.holder:
            raise HeldBack(f"{lease.holder:.16}… does not rank first for term {lease.term}")

    def _check_reachable(self, lease: Lease, now: float) -> None:
        """A new term must follow from the chain this node holds (no leaps)."""
        c = self.config
        cur = self.lease
        if cur is None:
            return  # nothing to build on yet: entitlement alone decides (docs/election.md)
        live = self.role is not Role.VACANT and not self.ended_by_rotation and now < cur.expiry + c.grace_s
        if live and self._fresh(lease, now):
            if lease.term == cur.term + 1:
                if lease.holder != cur.holder and self._hears_holder(now):
                    # One node's silence must not depose a holder the others still hear (it
                    # lost only its own link, or its own loop stalled): held back until this
                    # node's silence agrees, or the lease lapses.
                    raise HeldBack(f"term {cur.term}'s holder is still heard here; "
                                   f"term {lease.term} is held back")
                return  # the next term, claimed just now: others saw this one lapse
            raise HeldBack(f"term {cur.term} is live for {cur.expiry - now:.1f} s more; "
                           f"term {lease.term} is held back")
        if live:  # established elsewhere while ours lived: terms advance one per claim timeout at most
            limit = cur.term + 1 + int(max(0.0, now - cur.claimed_at) // c.claim_timeout_s)
        else:
            limit = self._claim_base(now) + self._skipped(now)
        if lease.term > limit:
            raise HeldBack(f"term {lease.term} leaps ahead of the chain this node holds (at most {limit})")

    def _hears_holder(self, now: float) -> bool:
        """Whether this node, a follower, heard the current holder within the suspicion window."""
        c = self.config
        return (c.heartbeats and self.role is Role.FOLLOWER and self.lease is not None
                and self.lease.holder not in self.suspected
                and self.last_heard is not None and now < self.last_heard + self.suspect_after_s)

    def _claim_base(self, now: float) -> int:
        """The lowest term up for claim: one past the current term, or past a held-back
        term whose holder is eligible (the other side of a healed partition). With no lease
        yet, one past the anchor: a node restarted while the DHT did not answer its lookups
        (churn) claimed term 0 again, and with another restarted node that followed it, the
        two re-trained the run from θ_0 beside the real chain, which fork choice later took
        for the run's history (slow suite, 2026-11-24: 4 of 6 rounds lost)."""
        cur = self.lease
        if cur is None:
            return 0 if self.anchor is None else self.anchor.term + 1
        base = cur.term + 1
        cap = cur.term + 1 + int(max(0.0, now - cur.claimed_at) // self.config.claim_timeout_s)
        for held in sorted(self.held_leases.values(), key=lambda h: h.term):
            if base <= held.term <= cap and held.expiry > now and held.holder in self.view:
                base = held.term + 1
        return base

    def _skipped(self, now: float) -> int:
        """Terms skipped by claim timeouts since this node went vacant (one more for skew)."""
        if self.role is not Role.VACANT or self.vacant_since is None:
            return 0
        return int(max(0.0, now - self.vacant_since) // self.config.claim_timeout_s) + 1

    def _hold_lease(self, lease: Lease) -> None:
        """Keep ``lease`` (one per holder). When full, the farthest-ahead term goes first:
        an honest held lease is for the next term or two, a stranger's may name any."""
        self.held_leases[lease.holder] = lease
        if len(self.held_leases) > self.config.max_held:
            far = max(self.held_leases, key=lambda h: (self.held_leases[h].term, self.held_leases[h].issued))
            del self.held_leases[far]

    def _retry_held(self, now: float) -> list[ElectionEffect]:
        """Look again at held-back leases (the view or the term changed); accept what now checks out."""
        effects: list[ElectionEffect] = []
        for holder, lease in sorted(self.held_leases.items(), key=lambda kv: (kv[1].term, kv[1].issued)):
            if holder not in self.held_leases:
                continue
            if lease.expiry <= now:
                del self.held_leases[holder]
                continue
            try:
                self.check_lease(lease, now)
            except HeldBack:
                continue
            except PcpError:
                del self.held_leases[holder]
                continue
            effects += self._accept_lease(lease, now)
        return effects

    def _expected_for(self, term: int, prev: Lease | None, claimed_at: float) -> str | None:
        """First-ranked candidate for ``term`` at ``claimed_at``; the claimer and every verifier use this.

        Only candidates that were already eligible at ``claimed_at`` count
        (uptime then >= ``min_uptime_s``): a member that joined after the claim
        cannot outrank the holder of an established term. The previous term's
        holder is left out when its lease had lapsed by the time of the claim
        (failover), or when this node suspects it (no heartbeat for
        ``suspect_s``): it is presumed dead even where the membership view has
        not caught up yet. A verifier that still hears it keeps it in, so a claim
        that left it out is held back there until that node's own silence agrees
        (or the lease lapses). After a rotation it stays in, and so it does when no
        other candidate is left: a sole candidate whose term ended (its set-up failed
        there, or it was suspected while merely slow) must be able to claim again, or
        the run would stall for good.
        """
        age = max(0.0, (self.view_at if self.view_at is not None else claimed_at) - claimed_at)
        cands = {p for p in self.view if self.uptime.get(p, float("inf")) - age >= self.config.min_uptime_s}
        if (prev is not None and prev.term < term and (prev.expiry <= claimed_at or prev.holder in self.suspected)
                and cands - {prev.holder}):
            cands.discard(prev.holder)
        order = ranked(self.run_id, term, cands)
        return order[0] if order else None

    def on_commit(self, rec: CommitRecord, now: float) -> list[ElectionEffect]:
        """A commit record (from the shepherd, our own, or a DHT lookup).

        Answers ``CommitChecked`` when the commit passes the authority chain;
        only then may the runtime hand it to the worker, fetch or pin anything
        it names. A commit of a term whose lease is not accepted yet is held.
        """
        self._now = now
        try:
            self.check_commit(rec)
        except HeldBack as exc:
            self._hold_commit(rec)
            return [Rejected(rec.shepherd, exc)]
        except PcpError as exc:
            return [Rejected(rec.shepherd, exc)]
        return self._accept_commit(rec, now)

    def _accept_commit(self, rec: CommitRecord, now: float) -> list[ElectionEffect]:
        self.held_commits.pop((rec.term, rec.shepherd, rec.theta_cid), None)
        if self.best_commit is None or commit_key(rec) > commit_key(self.best_commit):
            self.best_commit = rec
        effects: list[ElectionEffect] = [CommitChecked(rec)]
        lease = self.lease
        if lease is None or rec.term != lease.term or self.ended_by_rotation:
            return effects
        rec_t = self.history[-1] if self.history and self.history[-1].term == lease.term else None
        if rec_t is not None:
            rec_t.rounds_served = max(rec_t.rounds_served, rec.round + 1 - lease.from_round)
        end = self.end_round(lease)
        if end is not None and rec.round + 1 >= end:
            return effects + self._end_term(now, "rotation")
        return effects

    def check_commit(self, rec: CommitRecord) -> None:
        """Fencing and authority: a commit must come from the holder of an accepted lease of its term.

        The one exception is the commit the current lease names as its base
        (its round and θ): the lease's holder vouches for it. A well-signed
        commit of a term with no accepted lease is ``HeldBack``.
        """
        if rec.run_id != self.run_id:
            raise VerificationError(f"commit for another run {rec.run_id:.20}")
        lease = self.lease
        if lease is not None and rec.term < lease.term:
            if rec.theta_cid == lease.from_theta_cid and rec.round + 1 == lease.from_round:
                # the last commit of the term before, arriving late: the current
                # term builds on it (its lease names that θ), so it is no fork
                verify(rec, rec.shepherd)
                return
            raise StaleMessage(f"commit of term {rec.term}, term {lease.term} already seen")
        if lease is None or rec.term > lease.term:
            verify(rec, rec.shepherd)  # a forgery is refused outright, not held
            raise HeldBack(f"commit of term {rec.term}: no lease of that term is accepted here yet")
        if rec.shepherd != lease.holder:
            raise BadSignature(f"{rec.shepherd:.16}… does not hold term {rec.term}")
        verify(rec, lease.holder)

    def _hold_commit(self, rec: CommitRecord) -> None:
        """Keep ``rec`` until its term's lease is accepted; when full the farthest-ahead goes
        first (an honest held commit is for the next term, a forged one for any)."""
        self.held_commits[(rec.term, rec.shepherd, rec.theta_cid)] = rec
        while len(self.held_commits) > self.config.max_held:
            del self.held_commits[max(self.held_commits, key=lambda k: (k[0], self.held_commits[k].round))]

    def _release_commits(self, now: float) -> list[ElectionEffect]:
        """Held-back commits that the newly accepted lease makes checkable."""
        effects: list[ElectionEffect] = []
        for key, rec in sorted(self.held_commits.items(), key=lambda kv: (kv[0][0], kv[1].round)):
            if key not in self.held_commits:
                continue
            try:
                self.check_commit(rec)
            except HeldBack:
                continue
            except PcpError:
                del self.held_commits[key]
                continue
            effects += self._accept_commit(rec, now)
        return effects

    def _committed_in(self, lease: Lease) -> int:
        """The last round this node committed as the holder of ``lease``'s term (-1: none yet)."""
        best = self.best_commit
        if best is None or best.term != lease.term or best.shepherd != self.peer_id:
            return -1
        return best.round

    def end_round(self, lease: Lease) -> int | None:
        r = self.config.rotate_every
        return None if r == 0 else lease.from_round + r

    def tick(self, now: float) -> list[ElectionEffect]:
        self._now = now
        c = self.config
        lease = self.lease
        if self.role is Role.HOLDER and lease is not None:
            if now >= lease.expiry:  # we failed to renew in time (hung): others moved on
                return self._end_term(now, "lapsed")
            if c.max_claim_age_s is not None and now - lease.claimed_at >= c.max_claim_age_s - c.lease_s - c.max_skew_s:
                # no term outlives max_claim_age_s (verifiers refuse older claims): hand over
                return self._end_term(now, "aged")
            if now >= lease.issued + c.renew_every_s:
                self.last_beat = now  # the renewal goes to every member: it is a heartbeat too
                renewed = sign(
                    Lease(
                        run_id=self.run_id, term=lease.term, holder=self.peer_id, claimed_at=lease.claimed_at,
                        issued=now, expiry=now + c.lease_s, from_round=lease.from_round,
                        from_theta_cid=lease.from_theta_cid, from_checkpoint_cid=lease.from_checkpoint_cid,
                        committed_round=self._committed_in(lease),
                    ),
                    self.identity,
                )
                self.lease = renewed
                # Into the DHT only if the copy there would lapse before the renewal after next
                # (due one renew_every_s from now; half of one more is slack for a late tick
                # and the put's own time): that copy stays valid for whoever looks it up.
                store = self.stored_expiry is None or self.stored_expiry < now + 1.5 * c.renew_every_s
                if store:
                    self.stored_expiry = renewed.expiry
                return [PublishLease(renewed, renewal=True, store=store)]
            beat = self.heartbeat(now)
            if beat is not None and (self.last_beat is None or now >= self.last_beat + self.beat_every):
                self.last_beat = now
                return [SendHeartbeat(beat)]
            return []
        if self.role is Role.FOLLOWER and lease is not None:
            if now >= lease.expiry + c.grace_s:
                return self._end_term(now, "failover")
            due = None if self.last_heard is None else self.last_heard + self.suspect_after_s
            if c.heartbeats and due is not None and now >= due:
                if now - due >= LATE_TICK_BEATS * self.beat_every and self.grace_for != self.last_heard:
                    # This tick comes long after it was due: this node was not scheduled, and the
                    # holder's beats may be queued behind it. Let them in first (once per silence).
                    self.grace_for, self.grace_until = self.last_heard, now + 2 * self.beat_every
                    return []
                if self.grace_for == self.last_heard and self.grace_until is not None and now < self.grace_until:
                    return []
                self._suspect(lease.holder, now)
                return self._end_term(now, "failover")
            return []
        if self.role is Role.VACANT:
            if self.vacant_since is None:
                self.vacant_since = now
            if self.held_leases:  # a term held back while ours was live may be checkable now
                accepted = self._retry_held(now)
                if accepted:
                    return accepted
            term = self.term_to_claim(now)
            assert term is not None
            if self.settle_until is not None and now < self.settle_until:
                return []  # the latest lease and commit may be on their way: claim from those
            if self.claims_paused_until is not None and now < self.claims_paused_until:
                return []  # this node's own claims wait (see claims_paused_until)
            if self.expected_holder(term, now) == self.peer_id:
                return self._claim(term, now)
        return []

    # --- internals -----------------------------------------------------------------------

    def ended_label(self, lease: Lease, reason: str, successor: Lease | None = None) -> str:
        """How the term of ``lease`` ended, for people: ``rotation`` or ``failover``.

        ``rotation`` is a planned hand-over: the term served its rounds
        (``rotate_every``), or its claim grew too old (``aged``), or the next
        term starts where this one was due to end. ``failover`` is a holder
        that vanished or hung (its lease lapsed) before its term was done. A
        follower that sees the next term's lease before its predecessor's last
        commit learns it was a rotation from where the new lease starts.
        """
        if reason in ("rotation", "aged"):
            return "rotation"
        end = self.end_round(lease)
        if successor is not None and end is not None and successor.from_round >= end:
            return "rotation"
        return "failover"

    def _end_term(self, now: float, reason: str, successor: Lease | None = None) -> list[ElectionEffect]:
        """The current term is over for us: record why, go vacant (or follow the next)."""
        lease = self.lease
        effects: list[ElectionEffect] = []
        rec = self.history[-1] if lease is not None and self.history and self.history[-1].term == lease.term else None
        if rec is not None and lease is not None:
            label = self.ended_label(lease, reason, successor)
            # A term first taken for failed over (its last commit was late) and then
            # shown to have served all its rounds is relabelled: it was a rotation.
            if rec.ended is None or (rec.ended == "failover" and label == "rotation"):
                rec.ended = label
        if lease is None or (self.role is Role.VACANT and reason != "deposed"):
            return effects
        if self.role is Role.HOLDER:
            effects.append(StepDown(lease.term, reason))
        if reason == "rotation":
            self.ended_by_rotation = True
        self.role = Role.VACANT
        self.vacant_since = now
        if reason != "deposed":
            # The next holder must start from the latest commit, which may be in
            # the DHT only (the old shepherd died while sending it): wait for it.
            self.settle_until = now + self.config.settle_s
            effects += [LookupLease(), LookupCommit()]
            effects += self.tick(now)
        return effects

    def _claim(self, term: int, now: float) -> list[ElectionEffect]:
        best = self.best_commit
        c = self.config
        if c.rounds is not None and best is not None and best.round + 1 >= c.rounds:
            return []  # the run is over: nothing to lead (a lapsed lease now means nothing)
        lease = sign(
            Lease(
                run_id=self.run_id, term=term, holder=self.peer_id, claimed_at=now, issued=now,
                expiry=now + c.lease_s, from_round=0 if best is None else best.round + 1,
                from_theta_cid="" if best is None else best.theta_cid,
                from_checkpoint_cid="" if best is None else best.checkpoint_cid,
            ),
            self.identity,
        )
        self.lease = lease
        self.ended_by_rotation = False
        self.vacant_since = None
        self.role = Role.HOLDER
        self.suspected.pop(self.peer_id, None)  # (counted out after it resigned a term: see resign)
        self.last_beat = now  # the new lease goes to every member: the first heartbeat
        self.stored_expiry = lease.expiry
        self.history.append(TermRecord(term, self.peer_id, lease.from_round))
        return [
            PublishLease(lease, renewal=False),
            BecomeShepherd(term, lease.from_checkpoint_cid or None, lease.from_round, self.end_round(lease)),
            FollowShepherd(term, self.peer_id, lease.from_round, lease.from_theta_cid),
        ]

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

Lifecycle of a term, as seen by one node::

    VACANT   --tick, I rank first among live candidates-->   HOLDER   (PublishLease, BecomeShepherd)
    VACANT   --valid lease of a newer term-->                FOLLOWER (FollowShepherd)
    VACANT   --claim_timeout_s without a lease-->            VACANT   (the next term is up for claim)
    HOLDER   --tick, renew_every_s since issue-->            HOLDER   (PublishLease renewal)
    HOLDER   --commit completing rotate_every rounds-->      VACANT   (StepDown "rotation")
    HOLDER   --lease of a newer term / own lease lapsed-->   FOLLOWER/VACANT (StepDown)
    FOLLOWER --commit completing rotate_every rounds-->      VACANT   (rotation)
    FOLLOWER --lease expiry + grace_s passed-->              VACANT   (failover)
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pcp_p2p.dht.records import register_kind
from pcp_p2p.diloco.effects import LookupCommit, Rejected
from pcp_p2p.diloco.messages import CommitRecord, sign, verify
from pcp_p2p.errors import (
    BadSignature,
    ConfigError,
    ExpiredRecord,
    NotElected,
    PcpError,
    StaleMessage,
    VerificationError,
)
from pcp_p2p.node.identity import Identity
from pcp_p2p.wire import Message, decode, wire_message

LEASE_KIND = "lease"


@wire_message("diloco.lease", max_size=4 * 1024)
class Lease(Message):
    """``holder`` is the shepherd of ``run_id`` for ``term`` until ``expiry``.

    ``claimed_at`` is when the term was first claimed (renewals keep it and move
    ``issued``/``expiry``); ``from_round``/``from_theta_cid``/``from_checkpoint_cid``
    say which committed state the term continues from (``from_checkpoint_cid`` is
    empty when the run starts from its initial θ).
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
    signature: bytes = b""


def _lease_rule(name: str, signer: str, payload: Message) -> None:
    assert isinstance(payload, Lease)
    if payload.run_id != name:
        raise VerificationError("lease stored under another run id")
    if payload.holder != signer:
        raise BadSignature("a lease record must be stored by its holder")
    verify(payload, signer)


register_kind(LEASE_KIND, Lease, _lease_rule, order="seq")
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
    """How long after ``claimed_at`` a lease is checked against the caller's ranking
    (default ``lease_s``); an older, still-renewed term is accepted on its number."""

    def validate(self) -> ElectionConfig:
        if not (0 < self.renew_every_s < self.lease_s):
            raise ConfigError("election: need 0 < renew_every_s < lease_s")
        if self.grace_s < 0 or self.min_uptime_s < 0 or self.rotate_every < 0 or self.claim_timeout_s <= 0:
            raise ConfigError("election: grace_s, min_uptime_s, rotate_every >= 0 and claim_timeout_s > 0")
        return self

    @property
    def fresh_window_s(self) -> float:
        return self.lease_s if self.fresh_claim_s is None else self.fresh_claim_s


def eligible(view: Iterable[Candidate], config: ElectionConfig) -> list[str]:
    return sorted({c.peer_id for c in view if c.can_compile and c.uptime_s >= config.min_uptime_s})


def ranked(run_id: str, term: int, candidates: Iterable[str]) -> list[str]:
    return sorted(set(candidates), key=lambda p: term_rank(run_id, term, p))


# --- effects ---------------------------------------------------------------------


@dataclass(frozen=True)
class PublishLease:
    """Put ``lease`` in the DHT (``/pcp/lease/<run>``, seq = term) and send it to every member."""

    lease: Lease
    renewal: bool


@dataclass(frozen=True)
class BecomeShepherd:
    """Start a :class:`~pcp_p2p.diloco.shepherd.Shepherd` for ``term``.

    From ``checkpoint_cid`` (``Shepherd.from_checkpoint``), or from the run's
    initial θ when it is ``None``; it commits rounds up to ``end_round``
    (exclusive; ``None`` = no rotation) and then hands over.
    """

    term: int
    checkpoint_cid: str | None
    from_round: int
    end_round: int | None


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
    reason: str  # "rotation" | "deposed" | "lapsed"


@dataclass(frozen=True)
class LookupLease:
    """Look up ``/pcp/lease/<run>`` in the DHT; feed what comes back to ``on_lease``."""


ElectionEffect = LookupLease | PublishLease | BecomeShepherd | FollowShepherd | StepDown | LookupCommit | Rejected


@dataclass
class TermRecord:
    term: int
    holder: str
    from_round: int
    rounds_served: int = 0
    ended: str | None = None  # "rotation" | "failover" | None

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
    """One node's view of who leads one run. Feed it inputs; carry out its effects."""

    def __init__(self, run_id: str, identity: Identity, config: ElectionConfig | None = None) -> None:
        self.run_id = run_id
        self.identity = identity
        self.config = (config or ElectionConfig()).validate()
        self.view: list[str] = []  # eligible live candidates, as last reported
        self.lease: Lease | None = None
        self.ended_by_rotation = False
        self.vacant_since: float | None = None
        self.best_commit: CommitRecord | None = None
        self.history: list[TermRecord] = []
        self.role = Role.VACANT
        self._now: float | None = None
        self.settle_until: float | None = None  # no claim before: lookups are on their way

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
        base = 0 if self.lease is None else self.lease.term + 1
        skipped = int(max(0.0, now - self.vacant_since) // self.config.claim_timeout_s)
        return base + skipped

    def expected_holder(self, term: int, now: float) -> str | None:
        """Who should claim ``term`` at ``now`` in this node's view (``None``: nobody eligible)."""
        return self._expected_for(term, self.lease, now)

    @property
    def next_wakeup(self) -> float | None:
        c = self.config
        if self.role is Role.HOLDER and self.lease is not None:
            return min(self.lease.issued + c.renew_every_s, self.lease.expiry)
        if self.role is Role.FOLLOWER and self.lease is not None:
            return self.lease.expiry + c.grace_s
        if self.role is Role.VACANT and self.vacant_since is not None:
            now = self.vacant_since if self._now is None else self._now
            if self.settle_until is not None and now < self.settle_until:
                return self.settle_until
            # re-rank when the next skipped term comes up
            n = int((now - self.vacant_since) // c.claim_timeout_s)
            return self.vacant_since + (n + 1) * c.claim_timeout_s
        return None

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
        self.view = eligible(live, self.config)
        return self.tick(now)

    def on_lease(self, lease: Lease | bytes, now: float) -> list[ElectionEffect]:
        """A lease arrived (gossip, direct send or DHT lookup)."""
        self._now = now
        try:
            if isinstance(lease, bytes):
                lease = decode(lease, Lease)
            self.check_lease(lease, now)
        except PcpError as exc:
            return [Rejected(getattr(lease, "holder", None) if isinstance(lease, Lease) else None, exc)]
        cur = self.lease
        if cur is not None and lease.term == cur.term and lease.holder == cur.holder:
            if lease.issued > cur.issued:
                self.lease = lease  # a renewal
                if self.role is Role.VACANT and not self.ended_by_rotation and lease.holder != self.peer_id:
                    self.role = Role.FOLLOWER  # it came back before we failed over
                    self.vacant_since = None
            return []
        effects: list[ElectionEffect] = []
        if cur is not None:
            effects += self._end_term(now, "deposed")
        self.lease = lease
        self.ended_by_rotation = False
        self.vacant_since = None
        self.history.append(TermRecord(lease.term, lease.holder, lease.from_round))
        if lease.holder == self.peer_id:
            # our own lease echoed back after a restart: we do not remember serving it
            self.role = Role.VACANT
            self.vacant_since = now
            return effects + [StepDown(lease.term, "lapsed")]
        self.role = Role.FOLLOWER
        return effects + [FollowShepherd(lease.term, lease.holder, lease.from_round, lease.from_theta_cid)]

    def check_lease(self, lease: Lease, now: float) -> None:
        """Raise a typed error unless ``lease`` may replace (or renew) the current one."""
        if lease.run_id != self.run_id:
            raise VerificationError(f"lease for another run {lease.run_id:.20}")
        verify(lease, lease.holder)  # BadSignature unless the holder signed it
        if not (lease.claimed_at <= lease.issued < lease.expiry):
            raise VerificationError("lease times are not claimed <= issued < expiry")
        cur = self.lease
        if cur is not None and lease.term < cur.term:
            raise StaleMessage(f"lease of term {lease.term}, term {cur.term} already seen")
        if lease.expiry <= now:
            raise ExpiredRecord(f"lease of term {lease.term} expired {now - lease.expiry:.1f} s ago")
        if cur is not None:
            if lease.term == cur.term and lease.holder != cur.holder:
                # two claims of one term (views differed): the better-ranked one stands
                if term_rank(self.run_id, lease.term, lease.holder) > term_rank(self.run_id, cur.term, cur.holder):
                    raise NotElected(f"term {lease.term} is already held by a better-ranked peer")
                return
            if lease.term == cur.term:
                if lease.issued < cur.issued:
                    raise StaleMessage("an older issue of the current lease")
                return
        if now - lease.claimed_at < self.config.fresh_window_s:
            if lease.holder not in self.view:
                raise NotElected(f"{lease.holder:.16}… is not a live candidate in this node's view")
            prev = cur if cur is not None and cur.term < lease.term else None
            expected = self._expected_for(lease.term, prev, lease.claimed_at)
            if expected != lease.holder:
                raise NotElected(f"{lease.holder:.16}… does not rank first for term {lease.term}")

    def _expected_for(self, term: int, prev: Lease | None, claimed_at: float) -> str | None:
        """First-ranked live candidate for ``term``; the claimer and every verifier use this.

        The previous term's holder is left out when its lease had lapsed by the
        time of the claim (failover): it is presumed dead even where the
        membership view has not caught up yet. After a rotation it stays in.
        """
        cands = set(self.view)
        if prev is not None and prev.term < term and prev.expiry <= claimed_at:
            cands.discard(prev.holder)
        order = ranked(self.run_id, term, cands)
        return order[0] if order else None

    def on_commit(self, rec: CommitRecord, now: float) -> list[ElectionEffect]:
        """A commit record (from the shepherd, our own, or a DHT lookup)."""
        self._now = now
        try:
            self.check_commit(rec)
        except PcpError as exc:
            return [Rejected(rec.shepherd, exc)]
        if self.best_commit is None or commit_key(rec) > commit_key(self.best_commit):
            self.best_commit = rec
        lease = self.lease
        if lease is None or rec.term != lease.term or self.ended_by_rotation:
            return []
        rec_t = self.history[-1] if self.history and self.history[-1].term == lease.term else None
        if rec_t is not None:
            rec_t.rounds_served = max(rec_t.rounds_served, rec.round + 1 - lease.from_round)
        end = self.end_round(lease)
        if end is not None and rec.round + 1 >= end:
            return self._end_term(now, "rotation")
        return []

    def check_commit(self, rec: CommitRecord) -> None:
        """Fencing: a commit must come from the holder of its term, and no older term."""
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
            # no lease seen for that term yet: judge it by its signature only;
            # its lease will follow (or the commit loses the fork choice)
            verify(rec, rec.shepherd)
            return
        if rec.shepherd != lease.holder:
            raise BadSignature(f"{rec.shepherd:.16}… does not hold term {rec.term}")
        verify(rec, lease.holder)

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
            if now >= lease.issued + c.renew_every_s:
                renewed = sign(
                    Lease(
                        run_id=self.run_id, term=lease.term, holder=self.peer_id, claimed_at=lease.claimed_at,
                        issued=now, expiry=now + c.lease_s, from_round=lease.from_round,
                        from_theta_cid=lease.from_theta_cid, from_checkpoint_cid=lease.from_checkpoint_cid,
                    ),
                    self.identity,
                )
                self.lease = renewed
                return [PublishLease(renewed, renewal=True)]
            return []
        if self.role is Role.FOLLOWER and lease is not None:
            if now >= lease.expiry + c.grace_s:
                return self._end_term(now, "failover")
            return []
        if self.role is Role.VACANT:
            if self.vacant_since is None:
                self.vacant_since = now
            term = self.term_to_claim(now)
            assert term is not None
            if self.settle_until is not None and now < self.settle_until:
                return []  # the latest lease and commit may be on their way: claim from those
            if self.expected_holder(term, now) == self.peer_id:
                return self._claim(term, now)
        return []

    # --- internals -----------------------------------------------------------------------

    def _end_term(self, now: float, reason: str) -> list[ElectionEffect]:
        """The current term is over for us: record why, go vacant (or follow the next)."""
        lease = self.lease
        effects: list[ElectionEffect] = []
        if lease is None or (self.role is Role.VACANT and reason != "deposed"):
            return effects
        rec = self.history[-1] if self.history and self.history[-1].term == lease.term else None
        if rec is not None and rec.ended is None:
            rec.ended = "rotation" if reason == "rotation" else "failover"
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
        self.history.append(TermRecord(term, self.peer_id, lease.from_round))
        return [
            PublishLease(lease, renewal=False),
            BecomeShepherd(term, lease.from_checkpoint_cid or None, lease.from_round, self.end_round(lease)),
            FollowShepherd(term, self.peer_id, lease.from_round, lease.from_theta_cid),
        ]

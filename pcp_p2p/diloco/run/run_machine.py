"""One run on one node as a sans-IO machine: the election, the worker and the shepherd, combined.

The three protocol cores are pure and each tested alone: the
:class:`~pcp_p2p.diloco.protocol.election.Election` says who leads each term, the
:class:`~pcp_p2p.diloco.protocol.worker.Worker` trains and submits, the
:class:`~pcp_p2p.diloco.protocol.shepherd.Shepherd` aggregates and commits. A node runs
all three at once, and the rules that *combine* them are what decides whether a
swarm survives a kill at the wrong moment. They live here, and only here:

- **A commit is held until another node holds its checkpoint.** The shepherd's
  first ``Send`` of a commit to another node and everything after it wait
  (``ReplicateCommit``) until one worker acknowledged it (a worker acknowledges
  only once it holds the checkpoint) or a timeout passes; the rest then goes out,
  in the shepherd's order. The commit itself goes to every node it is for at
  once, so they all fetch the checkpoint side by side (through its relay tree)
  while the first ack is awaited. A shepherd killed right after committing never
  takes the only copy of θ with it. The next round's announcement to each of
  those nodes is the exception when the commit carries its update (a small
  swarm): it goes right behind the commit to that node
  (``ReplicateCommit.then``; the receiver holds it until it took the commit),
  not after the first ack.
- **A commit counts only once the election vouched for it** (``CommitChecked``):
  nothing a commit names is fetched before its term's lease is accepted.
- **Joins wait while the shepherd compiles.** ``Join``, ``Submission`` and
  ``AuditReport`` that arrive while this node sets up its term are kept and
  replayed once the set-up ends; afterwards, to a node that does not lead, they
  are refused.
- **A lost term's set-up is cancelled** (``CancelSetUp``) as soon as another node
  holds it or this one steps down; **a term whose set-up failed** (three attempts on
  a node: no checkpoint, no θ, a compile error) is given up at once
  (``Election.resign``), and this node claims no term for a while, 10 s doubling
  with each failure in a row to 5 min (a success resets it; the phase says
  ``set-up failed: <why>; next try in N s``): the run neither stalls behind a
  holder that cannot lead nor, on a sole candidate, fails again every few seconds.
- **No new term after the last round**: the election knows the run's length
  (``ElectionConfig.rounds``) and claims nothing once the final commit is known;
  a lease or a term any input would still publish or set up is dropped here
  (``PublishLease``/``BecomeShepherd``: a holder does not renew a finished run).
- **A failover keeps the round in flight**: the successor's new shepherd takes over
  the attempt its own worker holds (``Shepherd.adopt``) when its election accepted
  that attempt's shepherd for its term and the attempt starts where the new term
  does; the dead shepherd's worker is not waited for (workers send their
  submissions again on following the new term: ``Worker.set_shepherd``).
- **The election's settling waits for its own lookups only**: a claim waits until
  every lease and commit lookup it asked for answered (``on_lookups_done``).
- **Catch-up after a restart**: the run's last commit, which no live lease vouches
  for any more, is adopted from this node's anchor (the last lease it accepted)
  when the owner's lists allow its shepherd; a node without a worker looks the
  latest commit up every ``CATCH_UP_EVERY_S``.
- **Departures**: a checked ``Leave`` ends the leaver's part in the round in flight,
  is relayed once by the shepherd, and the election forgets the leaver.
- **When the run is finished**: the last round is committed and the worker holds
  its θ (or, with no worker here, the shepherd finished); or the owner stopped it.
- **Phases** shown to people: starting, electing, compiling, joining, the worker's
  own, finished, stopped.

Transitions (inputs down the side; what changes and the effects it yields):

=========================  =================================================================
input                      effect
=========================  =================================================================
``start``                  election starts: ``LookUpLease``, ``LookUpCommit(for_election)``
``on_members`` (1 s)       candidates filtered (admission, departures), uptime counted from
                           when this node first saw each (``uptime``), to the election;
                           owner-record lookups (stop, allowlist) and catch-up when due
``on_message`` Lease       election: ``PublishLease``/``SetUpShepherd``/follow/step down
``on_message`` Heartbeat   election (a follower that stops hearing them fails over);
                           the holder's ``SendHeartbeat``: one ``Send`` per run member
``on_message`` Join, Sub.  to the shepherd; kept while compiling; refused otherwise
``on_message`` Commit      election first; ``CommitChecked`` → worker; last one: adopt
``on_message`` Announce.   to the worker
``on_message`` Leave       checked; shepherd drops it (and relays); election forgets it
``on_message`` Stop/Allow  the owner's latch or allowlist
``on_blob`` / failed       to the machine that asked (``Fetch.who``)
``on_inner_done`` / failed to the worker
``on_*_lookup``            to the election / worker; the election's wait ends when all answered
``on_replicated``          the held commit and everything after it go out
``shepherd_built``         the shepherd exists (if the term is still ours): ``StoreBlob`` θ;
                           after a failover it takes over the attempt in flight (``adopt``)
``setup_ended``            compiling over: the kept joins are replayed; a held term that was
                           not set up is given up (``StepDown``) and claims back off
``tick``                   every machine's deadlines
``stop``                   the owner's order: ``Stopped``, ``RunEnded``
=========================  =================================================================

Time is passed in with every input (``now``, the pump's injected clock): round
deadlines are compared across nodes, so a real node passes its wall clock, a test
trio's ``MockClock``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pcp_p2p.blob.swarm import tree_order, worth_a_tree
from pcp_p2p.core.errors import (
    HeldBack,
    NotElected,
    OverBudget,
    PcpError,
    RemoteError,
    StaleMessage,
    VerificationError,
)
from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.protocol.admission import ALLOWLIST_KIND, Admission, AllowlistUpdate
from pcp_p2p.diloco.protocol.audit import (
    AuditReport,
    AuditRequest,
    Evidence,
    StateOffer,
    decode_evidence,
    encode_evidence,
)
from pcp_p2p.diloco.protocol.collector import GroupCollector
from pcp_p2p.diloco.protocol.departures import Departures
from pcp_p2p.diloco.protocol.effects import (
    Banned,
    Committed,
    Discarded,
    Effect,
    FetchBlob,
    Finished,
    LookupCommit,
    Rejected,
    RunInner,
    Send,
    StoreBlob,
)
from pcp_p2p.diloco.protocol.election import (
    BecomeShepherd,
    Candidate,
    CommitChecked,
    Election,
    ElectionConfig,
    ElectionEffect,
    FollowShepherd,
    Heartbeat,
    Lease,
    LookupLease,
    PublishLease,
    Role,
    SendHeartbeat,
    StepDown,
)
from pcp_p2p.diloco.protocol.lifecycle import STOP_KIND, STOP_LOOKUP_EVERY_S, STOPPED, StopLatch, StopOrder
from pcp_p2p.diloco.protocol.messages import (
    INLINE_UPDATE_BYTES,
    CommitRecord,
    Join,
    Leave,
    RoundAnnouncement,
    Submission,
)
from pcp_p2p.diloco.protocol.partial_audit import MAX_REPLAYS, PartialAudit, PartialReplay, PartialVerdict
from pcp_p2p.diloco.protocol.partials import PartialAggregate
from pcp_p2p.diloco.protocol.shepherd import Shepherd
from pcp_p2p.diloco.protocol.spec import RunSpec
from pcp_p2p.diloco.protocol.worker import InnerResult, Worker
from pcp_p2p.diloco.run.reputation import ReputationLedger
from pcp_p2p.diloco.run.run_effects import (
    Audit,
    BlobFailed,
    BlobIn,
    CancelSetUp,
    CommitAccepted,
    CommitLookedUp,
    Event,
    Fetch,
    InnerDone,
    InnerFailed,
    Leads,
    LeaseLookedUp,
    LookUpCommit,
    LookUpLease,
    LookUpOwnerRecord,
    MembersSeen,
    MessageIn,
    PublishCommit,
    ReleasePins,
    ReplicateCheckpoint,
    ReplicateCommit,
    Replicated,
    RunEffect,
    RunEnded,
    SaveLease,
    SetUpEnded,
    SetUpShepherd,
    ShepherdBuilt,
    Stopped,
    Wake,
)
from pcp_p2p.net.reachability import RELAY_ONLY
from pcp_p2p.wire import Message, encode

log = logging.getLogger("pcp.run")

REPLICATE_TIMEOUT_S = 5.0  # a held commit goes out regardless after this; below the messenger's ack timeout
HISTORY = 1000
ALLOWLIST_EVERY_S = 30.0  # how often the owner's allowlist amendments are looked up (at most)
OWNER_LOOKUP_SPACING_S = 8.0  # ... and the whole run about once per this, whatever its size (owner_lookup_every)
CATCH_UP_EVERY_S = 10.0  # how often a node without a worker looks up the run's latest commit
SETUP_BACKOFF_S = 10.0  # after a term whose set-up failed here, no claim for this long ...
SETUP_BACKOFF_MAX_S = 300.0  # ... doubling with each failure in a row, up to this; a success resets it
FIRST_LOOK_S = 5.0  # members first seen this soon after this node's first view may predate it (see candidates)

WORKER, SHEPHERD, AGGREGATOR = "worker", "shepherd", "aggregator"
REPLAY = "partial-audit:"  # + the partial's CID: a partial audit's fetches (``PartialReplay``)


@dataclass(frozen=True)
class Member:
    """What the run machine needs of one live member record (the pump reads membership)."""

    peer_id: str
    started_at: float  # on the member's own clock, as it says: a floor on its uptime, never proof of one
    can_compile: bool = True
    worker: bool = True  # role: a worker (not a client)
    in_run: bool = True  # lists this run
    reachability: str = "unknown"  # its own verdict: a relay-only member never leads (election.eligible)


@dataclass
class RunStats:
    """What this node saw of the run, for its status."""

    history: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=HISTORY))
    rejected: dict[str, int] = field(default_factory=dict)
    held: int = 0  # leases and commits held back until their authority can be checked
    audits: dict[str, int] = field(default_factory=dict)  # replays this node ran, by verdict
    first_contribution_s: float | None = None
    contributed_rounds: list[int] = field(default_factory=list)  # rounds whose commit counted this node
    bytes_submitted: int = 0  # encoded submissions sent (what this worker puts on the wire per round)
    partials_sent: int = 0  # partial aggregates this node sent as an aggregator
    partial_replays: dict[str, int] = field(default_factory=dict)  # partial audits this node ran, by verdict
    first_train_at: float | None = None  # the first inner run started
    last_commit_at: float | None = None  # the latest commit arrived
    superseded: int = 0  # commits this node had shown, replaced by fork choice (a higher term's chain)
    # commits' checkpoints this node held: built from the update, or fetched (RunRuntime._hold_checkpoint)
    checkpoints: dict[str, int] = field(default_factory=lambda: {"rebuilt": 0, "fetched": 0})


class RunMachine:
    """One run on one node: feed it inputs with the time, carry out the effects it returns."""

    def __init__(
        self, *, spec: RunSpec, run_id: str, owner: str, identity: Identity, election: Election,
        admission: Admission, ledger: ReputationLedger, target: str | None, tokens_per_s: float,
        started_at: float,
    ) -> None:
        """``target``: the best of the run's targets this machine runs (``None``: it trains nothing,
        and only follows the election). ``started_at``: when this node took the run up."""
        self.spec, self.run_id, self.owner, self.identity = spec, run_id, owner, identity
        self.peer_id = identity.peer_id  # once: ``Identity.peer_id`` derives it from the key on every read
        self.election = election
        self.admission = admission
        self.ledger = ledger
        self.departures = Departures(run_id)
        self.stop_latch = StopLatch(run_id, owner)
        self.target = target
        self.tokens_per_s = tokens_per_s
        self.started_at = started_at
        self.worker: Worker | None = None
        self.shepherd: Shepherd | None = None
        self.collector: GroupCollector | None = None  # this node's group, when an announcement names it
        self.replays: dict[str, PartialReplay] = {}  # partial audits this node runs, by the partial's CID
        self.shepherd_peer: str | None = None
        self.phase = "starting"
        self.finished = False
        self.stats = RunStats()
        self.becoming = False  # a term is being set up (compiling)
        self.becoming_term: int | None = None
        self.setup_error: str | None = None  # why this node, elected, could not set the run up
        self.members: list[Member] = []  # the latest view of live members (on_members)
        self._now = started_at
        self._out: list[RunEffect] = []
        self._early: list[tuple[str, Message]] = []  # joins kept while compiling
        self._held: list[list[Effect]] | None = None  # shepherd effects waiting on a replicating commit
        self._lookups_pending = 0
        self._seen_commit: str | None = None
        self._saved_term: int | None = None
        self._last_lookup: dict[str, float] = {}
        self._last_catch_up: float | None = None
        self._setup_failures = 0  # terms in a row whose set-up failed here (the back-off's exponent)
        self._view_began: float | None = None  # this node's first view of the members
        self._first_seen: dict[str, float] = {}  # member -> when this node first saw it (candidates)

    @classmethod
    def for_spec(
        cls, spec: RunSpec, *, run_id: str, owner: str, identity: Identity, ledger: ReputationLedger,
        target: str | None, tokens_per_s: float, started_at: float, config: ElectionConfig | None = None,
    ) -> RunMachine:
        """A machine for an already verified ``spec`` (the runtime verifies the signed spec itself)."""
        config = election_config(spec) if config is None else dataclasses.replace(config, rounds=spec.round.rounds)
        return cls(spec=spec, run_id=run_id, owner=owner, identity=identity,
                   election=Election(run_id, identity, config),
                   admission=Admission(run_id, owner, spec.admission, bans=ledger), ledger=ledger,
                   target=target, tokens_per_s=tokens_per_s, started_at=started_at)

    # -- inputs ---------------------------------------------------------------------------

    def handle(self, ev: Event, now: float) -> list[RunEffect]:
        """Feed one typed input (what a pump posts to its inbox) at ``now``; the effects."""
        if isinstance(ev, MessageIn):
            return self.on_message(ev.sender, ev.message, now)
        if isinstance(ev, BlobIn):
            return self.on_blob(ev.who, ev.cid, ev.data, now)
        if isinstance(ev, BlobFailed):
            return self.on_blob_failed(ev.who, ev.cid, ev.error, now)
        if isinstance(ev, InnerDone):
            return self.on_inner_done(ev.result, now)
        if isinstance(ev, InnerFailed):
            return self.on_inner_failed(ev.round, ev.attempt, ev.error, now)
        if isinstance(ev, CommitLookedUp):
            return self.on_commit_lookup(ev.record, ev.for_election, now)
        if isinstance(ev, LeaseLookedUp):
            return self.on_lease_lookup(ev.lease, now)
        if isinstance(ev, MembersSeen):
            return self.on_members(ev.members, now)
        if isinstance(ev, Replicated):
            return self.on_replicated(ev.commit, ev.acked, now)
        if isinstance(ev, ShepherdBuilt):
            return self.shepherd_built(ev.shepherd, now)
        if isinstance(ev, SetUpEnded):
            return self.setup_ended(ev.term, now)
        assert isinstance(ev, Wake), ev
        return []

    def restore(self, lease: Lease) -> None:
        """The lease this node accepted last before it stopped (its anchor); raises if it is bad."""
        self.election.restore(lease)
        self._saved_term = lease.term

    def start(self, now: float) -> list[RunEffect]:
        self.phase = "electing"
        self._last_catch_up = now
        return self._run(now, lambda: self._election(self.election.start(now), now))

    def on_members(self, members: list[Member], now: float) -> list[RunEffect]:
        """The live members (once a second): the election's candidates, and the lookups now due."""
        def go() -> None:
            self.members = list(members)
            self._observe(now)
            taking_part = 1 + len(self.run_members())  # (this node and the others in the run)
            if not self.stop_latch.stopped and self._due(
                    STOP_KIND, owner_lookup_every(STOP_LOOKUP_EVERY_S, taking_part), now):
                self._out.append(LookUpOwnerRecord(STOP_KIND))  # a stop this node missed while down
            if (self.worker is None and not self._final_committed() and self._last_catch_up is not None
                    and now - self._last_catch_up >= CATCH_UP_EVERY_S):
                # no worker asks for commits yet (no term followed since a restart): look the
                # latest one up now and then, so a run that ended meanwhile is caught up
                self._last_catch_up = now
                self._out.append(LookUpCommit(for_election=False))
            if self.spec.admission.mode == "allowlist" and self._due(
                    ALLOWLIST_KIND, owner_lookup_every(ALLOWLIST_EVERY_S, taking_part), now):
                self._out.append(LookUpOwnerRecord(ALLOWLIST_KIND))
            self.election.followers = len(self.run_members())
            self._election(self.election.on_members(self.candidates(now), now), now)
        return self._run(now, go)

    def on_message(self, sender: str, msg: Message, now: float) -> list[RunEffect]:
        return self._run(now, lambda: self._message(sender, msg, now))

    def _machine(self, who: str) -> Shepherd | Worker | GroupCollector | PartialReplay | None:
        if who.startswith(REPLAY):
            return self.replays.get(who[len(REPLAY):])
        return self.shepherd if who == SHEPHERD else self.collector if who == AGGREGATOR else self.worker

    def on_blob(self, who: str, cid: str, data: bytes, now: float) -> list[RunEffect]:
        def go() -> None:
            machine = self._machine(who)
            if machine is not None:
                self._round(who, machine.on_blob(cid, data, now), now)
        return self._run(now, go)

    def on_blob_failed(self, who: str, cid: str, error: PcpError, now: float) -> list[RunEffect]:
        def go() -> None:
            machine = self._machine(who)
            if machine is not None:
                self._round(who, machine.on_blob_failed(cid, error, now), now)
        return self._run(now, go)

    def on_inner_done(self, result: InnerResult, now: float) -> list[RunEffect]:
        def go() -> None:
            if self.worker is not None:
                self._round(WORKER, self.worker.on_inner_done(result, now), now)
        return self._run(now, go)

    def on_inner_failed(self, round_: int, attempt: int, error: PcpError, now: float) -> list[RunEffect]:
        def go() -> None:
            if self.worker is not None:
                self._round(WORKER, self.worker.on_inner_failed(round_, attempt, error, now), now)
        return self._run(now, go)

    def on_commit_lookup(self, rec: CommitRecord | None, for_election: bool, now: float) -> list[RunEffect]:
        def go() -> None:
            if rec is not None:
                self._on_commit(rec, now)
            if for_election:  # a worker's own lookups must not end the election's wait
                self._lookup_done(now)
        return self._run(now, go)

    def on_lease_lookup(self, lease: Lease | None, now: float) -> list[RunEffect]:
        def go() -> None:
            if lease is not None:
                self._election(self.election.on_lease(lease, now), now)
            self._lookup_done(now)
        return self._run(now, go)

    def on_replicated(self, commit: CommitRecord, acked: list[str], now: float) -> list[RunEffect]:
        """The held commit's replication ended (``acked``: who holds the checkpoint): let it out."""
        def go() -> None:
            if not acked:
                log.warning("run %s: round %d commit goes out with its checkpoint on this node only",
                            self.run_id[:16], commit.round + 1)
            held, self._held = self._held, None
            if held is None:
                return
            first, rest = held[0], held[1:]
            self._round_now(SHEPHERD, [e for e in first if not (
                isinstance(e, Send) and e.message is commit and e.to in acked)], now)
            for batch in rest:  # if another commit starts replicating, _round holds the batches after it
                self._round(SHEPHERD, batch, now)
        return self._run(now, go)

    def shepherd_built(self, shepherd: Shepherd, now: float) -> list[RunEffect]:
        """The set-up built ``shepherd``: it leads if the term is still this node's."""
        def go() -> None:
            if not self.still_holds(shepherd.term):
                log.info("run %s: term %d ended while it was being set up", self.run_id[:16], shepherd.term)
                return
            self.shepherd = shepherd
            self._setup_failures = 0  # set up: the next failure backs off from the start again
            self.election.claims_paused_until = None
            # The term's starting θ must be fetchable by the workers.
            self._round(SHEPHERD, [StoreBlob(shepherd.theta_cid, shepherd.theta_bytes)], now)
            self._take_over_attempt(shepherd, now)
        return self._run(now, go)

    def _take_over_attempt(self, shepherd: Shepherd, now: float) -> None:
        """A failover's successor takes over the attempt in flight (``Shepherd.adopt``): the one its
        own worker holds, signed by the holder of its term as this node's election knows it. The
        dead term's shepherd is not waited for; every other worker sends its submission again."""
        ann = self.worker.current if self.worker is not None else None
        if ann is None or not self.holds_term(ann.term, ann.shepherd):
            return
        self._round(SHEPHERD, shepherd.adopt(ann, now, gone={ann.shepherd} - {self.peer_id}), now)
        if shepherd.adopted is not None:
            log.info("run %s: term %d takes over round %d attempt %d of term %d", self.run_id[:16],
                     shepherd.term, ann.round + 1, ann.attempt, ann.term)

    def setup_failed(self, error: str | None) -> None:
        """A set-up attempt failed (``None``: the latest succeeded): shown as the run's phase
        here and, through the member record, on every worker."""
        self.setup_error = error

    def setup_phase(self, now: float) -> str | None:
        """Why this node, elected, could not set the run up, and when it tries again (``None``: it could)."""
        if self.setup_error is None:
            return None
        paused = self.election.claims_paused_until
        if paused is None or now >= paused or self.becoming:
            return self.setup_error
        return f"{self.setup_error}; next try in {math.ceil(paused - now):.0f} s"

    def setup_ended(self, term: int, now: float) -> list[RunEffect]:
        """The set-up of ``term`` is over (built, failed or cancelled): replay the kept joins."""
        def go() -> None:
            if self.becoming_term == term:
                self.becoming_term = None
            self.becoming = False
            if self.still_holds(term) and (self.shepherd is None or self.shepherd.term != term):
                # Held, and nobody leads it: give the term up now (its heartbeats stop, so the
                # followers fail over at once), and claim none for a while: as the only candidate
                # this node would otherwise claim the next term at once and fail again, for ever.
                # The wait doubles with each failure in a row (a success resets it); other
                # candidates claim meanwhile (Election.claims_paused_until).
                self._setup_failures += 1
                wait = min(SETUP_BACKOFF_MAX_S, SETUP_BACKOFF_S * 2 ** (self._setup_failures - 1))
                self.election.claims_paused_until = now + wait
                log.warning("run %s: term %d could not be set up here (%s); giving it up, next claim in %.0f s",
                            self.run_id[:16], term, self.setup_error, wait)
                self._election(self.election.resign(term, now), now)
            early, self._early = self._early, []
            for sender, msg in early:
                self._message(sender, msg, now)
        return self._run(now, go)

    def tick(self, now: float) -> list[RunEffect]:
        def go() -> None:
            if self.shepherd is not None:
                self._round(SHEPHERD, self.shepherd.tick(now), now)
            if self.worker is not None:
                self._round(WORKER, self.worker.tick(now), now)
            if self.collector is not None:
                self._round(AGGREGATOR, self.collector.tick(now), now)
            for pcid, replay in list(self.replays.items()):
                self._round(REPLAY + pcid, replay.tick(now), now)
            e = self.election
            followed = e.lease if e.role is Role.FOLLOWER else None
            self._election(e.tick(now), now)
            if followed is not None and e.history and e.history[-1].term == followed.term \
                    and e.history[-1].ended == "failover":
                heard = e.last_heard if e.last_heard is not None else followed.issued
                log.info("run %s: term %d's holder %s is %s (last heard %.1f s ago)", self.run_id[:16],
                         followed.term, followed.holder[-12:],
                         "suspected" if followed.holder in e.suspected else "gone: its lease lapsed", now - heard)
        return self._run(now, go)

    @property
    def next_wakeup(self) -> float | None:
        """The earliest deadline of the three machines (a past one: a worker busy training)."""
        wake = self.election.next_wakeup  # (read after every input: no list built)
        for machine in (self.shepherd, self.worker, self.collector, *self.replays.values()):
            w = machine.next_wakeup if machine is not None else None
            if w is not None and (wake is None or w < wake):
                wake = w
        return wake

    def stop(self, order: StopOrder, now: float) -> list[RunEffect]:
        """End the run on the owner's signed order; raise (typed, nothing changes) unless it holds."""
        self.stop_latch.check(order, now)
        if self.finished:
            raise StaleMessage("the run has already finished here")
        self.stop_latch.apply(order, now)
        log.warning("run %s stopped by its owner%s", self.run_id[:16], f": {order.reason}" if order.reason else "")
        def go() -> None:
            self._out.append(Stopped(order))
            self._end_stopped()
        return self._run(now, go)

    def stopped_before(self, order: StopOrder, now: float) -> list[RunEffect]:
        """The stop order this node kept before it restarted: the run ends at once (raises if bad)."""
        self.stop_latch.apply(order, now)
        return self._run(now, self._end_stopped)

    # -- queries --------------------------------------------------------------------------

    def _observe(self, now: float) -> None:
        """Note when each member of the latest view was first seen here (a member that leaves
        the view is forgotten: one that comes back is new again, so bounded by the view)."""
        if self._view_began is None:
            self._view_began = now
        first_look = now - self._view_began < FIRST_LOOK_S
        self._first_seen = {m.peer_id: self._first_seen.get(m.peer_id, -math.inf if first_look else now)
                            for m in self.members}

    def uptime(self, m: Member, now: float) -> float:
        """How long ``m`` has been up, as far as this node can tell.

        A member's ``started_at`` is its own word: a fresh key could date it back to look
        eligible at once (``min_uptime_s``), or to look eligible when an honest holder
        claimed its term and so outrank it there (``Election._expected_for``). So this node
        counts uptime from no earlier than when it first saw the member itself. Only members
        already in view during this node's first look (``FIRST_LOOK_S``) are taken at their
        word: this node cannot tell them from members that were up long before it started.
        """
        floor = self._first_seen.get(m.peer_id, now)
        return max(0.0, now - max(m.started_at, floor))

    def candidates(self, now: float) -> list[Candidate]:
        """The live members that may lead the run, as the election ranks them."""
        return [
            Candidate(m.peer_id, self.uptime(m, now), m.can_compile, m.reachability)
            for m in self.members
            # a member that cannot compile never leads (``election.eligible``): not a candidate,
            # which spares the shepherd's view of the whole run a check per member
            if m.can_compile
            # Bans are each node's own: filtering candidates on them would give nodes
            # different rankings. The owner's lists are the same everywhere.
            and m.worker and m.in_run and self.admission.may_lead(m.peer_id, local_bans=False)
            # a member that announced its departure is gone, though the view may list it a while
            and not self.departures.gone(m.peer_id, m.started_at)
        ]

    def run_members(self) -> list[str]:
        """The live members taking part in this run, this node left out."""
        return [m.peer_id for m in self.members if m.in_run and m.peer_id != self.peer_id]

    def direct_members(self) -> list[str]:
        """Live members not known to be reachable only through a relay: aggregators are drawn
        from these first (a relay-only home must not pull a group's Δs through a relay)."""
        return [m.peer_id for m in self.members if m.reachability != RELAY_ONLY]

    def departure_targets(self) -> list[str]:
        """Whom this node tells that it leaves: as the shepherd (or becoming it) the run, else the shepherd."""
        if self.finished:
            return []
        if self.shepherd is not None or self.becoming or self.election.holder == self.peer_id:
            return self.run_members()
        return [self.shepherd_peer] if self.shepherd_peer not in (None, self.peer_id) else []

    def still_holds(self, term: int) -> bool:
        return self.election.current_term == term and self.election.holder == self.peer_id

    def holds_term(self, term: int, peer: str) -> bool:
        """Whether this node accepted ``peer``'s lease of ``term`` (audit requests need it)."""
        return any(t.term == term and t.holder == peer for t in self.election.history)

    def vouch_commit(self, msg: CommitRecord) -> None:
        """The authority chain of a commit delivered directly, before anything it names is fetched:
        raises ``HeldBack`` while its lease has not arrived, another typed error if it never holds."""
        self.election.check_commit(msg)

    def check_record(self, payload: Message, now: float) -> None:
        """The authority a DHT record of this run needs: a lease or commit this node's election
        would not act on is neither stored nor selected here."""
        if isinstance(payload, Lease):
            self.election.check_lease(payload, now)
        elif isinstance(payload, CommitRecord):
            try:
                self.election.check_commit(payload)
            except HeldBack:
                # the last commit of a run that ended while this node was down: its
                # lease has expired, so the chain is checked from this node's anchor
                self._check_final(payload, now)

    # -- the combining rules --------------------------------------------------------------

    def _run(self, now: float, go: Callable[[], None]) -> list[RunEffect]:
        """Feed one input: ``go`` appends effects to a fresh list, which is returned (re-entrant:
        a stop order looked up in the DHT is fed from inside ``on_message``)."""
        outer, self._out = self._out, []
        self._now = now
        try:
            go()
            self._after_input()
            return self._out
        finally:
            self._out = outer

    def _due(self, kind: str, every: float, now: float) -> bool:
        last = self._last_lookup.get(kind)
        if last is not None and now - last < every:
            return False
        self._last_lookup[kind] = now
        return True

    def _message(self, sender: str, msg: Message, now: float) -> None:
        if isinstance(msg, Lease):
            self._election(self.election.on_lease(msg, now), now)
        elif isinstance(msg, Heartbeat):
            if sender == msg.holder:  # straight from the holder: a relayed (replayed) beat proves nobody alive
                self._election(self.election.on_heartbeat(msg, now), now)
        elif isinstance(msg, (AuditRequest, StateOffer)):
            self._out.append(Audit(sender, msg))
        elif isinstance(msg, Leave):
            self._on_leave(sender, msg, now)
        elif isinstance(msg, Evidence):
            self._on_evidence(sender, msg, now)
        elif isinstance(msg, StopOrder):  # looked up in the DHT (a direct one: ``stop``)
            try:
                self._out.extend(self.stop(msg, now))
            except StaleMessage:
                pass  # already stopped
            except RemoteError as exc:  # a bug of ours reaches the runtime's boundary
                self._reject(sender, exc)
        elif isinstance(msg, AllowlistUpdate):
            try:
                self.admission.apply(msg, now)  # owner-signed, or refused
            except StaleMessage:
                pass  # the one in force, again
            except RemoteError as exc:  # a bug of ours reaches the runtime's boundary
                self._reject(sender, exc)
        elif isinstance(msg, Submission) and self.collector is not None and self.collector.takes(msg):
            effects = self.collector.on_submission(msg, now)
            self._strike(sender, effects, now)
            self._round(AGGREGATOR, effects, now)
        elif isinstance(msg, PartialAudit):
            self._partial_audit(sender, msg, now)
        elif isinstance(msg, (Join, Submission, AuditReport, PartialAggregate, PartialVerdict)):
            if self.shepherd is None and self.becoming:
                self._early.append((sender, msg))  # still compiling: answer once the shepherd exists
                return
            if self.shepherd is None:
                self._reject(sender, VerificationError("this node is not the run's shepherd"))
                return
            effects = self.shepherd.receive(msg, now)
            self._strike(sender, effects, now)
            self._round(SHEPHERD, effects, now)
        elif isinstance(msg, CommitRecord):
            self._on_commit(msg, now)
        elif isinstance(msg, RoundAnnouncement) and self.worker is not None:
            self._round(WORKER, self.worker.receive(msg, now), now)

    def _partial_audit(self, sender: str, req: PartialAudit, now: float) -> None:
        """Replay a partial aggregate the term's shepherd drew (``PartialReplay``): only from the
        holder of the term it names, at most ``MAX_REPLAYS`` at once."""
        try:
            if sender != req.shepherd or not self.holds_term(req.term, req.shepherd):
                raise VerificationError(f"{sender:.16}… does not hold term {req.term}: no partial audit")
            if len(self.replays) >= MAX_REPLAYS:
                raise OverBudget(f"{MAX_REPLAYS} partial audits already run here")
            replay = PartialReplay(self.spec, req, self.identity, now)
        except PcpError as exc:
            self._reject(sender, exc)
            return
        if replay.partial_cid in self.replays:
            return
        self.replays[replay.partial_cid] = replay
        self._round(REPLAY + replay.partial_cid, replay.start(), now)

    def _strike(self, sender: str, effects: list[Effect], now: float) -> None:
        for e in effects:  # strike only the sender libp2p authenticated
            if isinstance(e, Rejected) and e.peer == sender:
                self.ledger.strike(sender, type(e.error).__name__, now)

    def _after_input(self) -> None:
        """After every input: the worker's phase, this node's group, a new commit's bookkeeping,
        and the run's end."""
        for pcid in [p for p, r in self.replays.items() if r.done]:
            del self.replays[pcid]
        w = self.worker
        if w is None or self.finished:
            return
        rec = w.last_commit
        now = self._now
        self._aggregate(w, now)
        if rec is not None and rec.theta_cid != self._seen_commit:
            self._seen_commit = rec.theta_cid
            self._commit_seen(rec, now)
        self.phase = w.phase.value
        if rec is not None and rec.round + 1 >= self.spec.round.rounds and w.theta_cid == rec.theta_cid:
            # The last round is committed and we hold its θ: nothing more to do here.
            self.phase = "finished"
            self.finished = True
            self._out.append(RunEnded("finished", rec.theta_cid))

    def _aggregate(self, w: Worker, now: float) -> None:
        """The aggregator's part: a collector for each attempt whose announcement (taken by the
        worker, so signed by the term's shepherd) names this node; θ_r handed to it once the
        worker holds it; dropped when the worker moves on to another attempt."""
        ann, c = w.current, self.collector
        if self.shepherd is not None:  # (a successor that was an aggregator: the workers submit to it)
            self.collector = None
            return
        if c is not None and c.ann is not ann:
            self.collector = c = None
        if c is None and ann is not None and self.peer_id in ann.aggregators:
            self.collector = c = GroupCollector(self.spec, ann, self.identity, now)
        if c is not None and c.theta is None and w.theta is not None and w.theta_cid == c.ann.theta_cid:
            self._round(AGGREGATOR, c.hold_theta(w.theta, now), now)

    def _commit_seen(self, rec: CommitRecord, now: float) -> None:
        self.stats.last_commit_at = now
        # Fork choice (Worker.on_commit): a higher term's commit may land at or below a round this
        # node already showed as committed (it sat on the losing side of a partition). Those rounds
        # are lost, not committed: the history and the rounds counted for us shed them, so status
        # never presents the losing side's chain as committed.
        # The losing branch may also end *below* the commit's round (the winner committed more
        # rounds meanwhile): what this node showed in a lower term above the round the commit's
        # term continues from (its lease's ``from_round``), or a parent round whose θ is not the
        # commit's ``prev_theta_cid``, is not on the winning chain either.
        # (The record of this commit's holder: after a heal, this node may also have claimed the
        # same term number itself, from its own side's later round, before it heard of the other.)
        base = next((t.from_round for t in reversed(self.election.history)
                     if t.term == rec.term and t.holder == rec.shepherd), None)
        history = self.stats.history
        lost = 0
        while history and (
                history[-1]["round"] >= rec.round + 1
                or (history[-1]["round"] == rec.round and history[-1]["theta"] != rec.prev_theta_cid)
                or (base is not None and history[-1]["term"] < rec.term and history[-1]["round"] > base)):
            history.pop()
            lost += 1
        if lost:
            self.stats.superseded += lost
            kept = history[-1]["round"] if history else 0
            self.stats.contributed_rounds[:] = [r for r in self.stats.contributed_rounds if r <= kept]
            log.warning("run %s: fork choice: term %d's round %d supersedes %d round(s) this node had committed",
                        self.run_id[:16], rec.term, rec.round + 1, lost)
        if rec.checkpoint_cid:
            self._out.append(ReplicateCheckpoint(rec))
        self._out.append(CommitAccepted(rec, standby=self.peer_id in self.election.standbys(STANDBYS)))
        if self.peer_id in rec.participants:
            self.stats.contributed_rounds.append(rec.round + 1)  # 1-based, as people count
            if self.stats.first_contribution_s is None:
                # From taking up the run to the first commit that counts this node.
                self.stats.first_contribution_s = round(now - self.started_at, 2)
        self.stats.history.append({
            "round": rec.round + 1, "theta": rec.theta_cid, "loss": rec.mean_loss,  # 1-based
            "val_loss": rec.val_loss, "participants": len(rec.participants), "tokens": rec.tokens,
            "term": rec.term, "shepherd": rec.shepherd,
            "at": round(now, 3),  # when this node accepted it (its clock): bench/failover.py times takeovers by it
        })
        log.info("run %s: round %d committed, loss %.4f, val %.4s, %d workers",
                 self.run_id[:16], rec.round + 1, rec.mean_loss,
                 f"{rec.val_loss:.4f}" if rec.val_loss is not None else "-", len(rec.participants))

    def _on_leave(self, sender: str, msg: Leave, now: float) -> None:
        """A member announced its departure (see :mod:`pcp_p2p.diloco.protocol.departures`): checked first;
        then the shepherd stops waiting for it and relays it, and the election forgets it."""
        try:
            self.departures.check(msg, sender, now, relayer=self.election.holder)
        except RemoteError as exc:  # a bug of ours reaches the runtime's boundary
            self._reject(sender, exc)
            return
        log.info("run %s: %s left the run", self.run_id[:16], msg.peer)
        if self.shepherd is not None:
            self._round(SHEPHERD, self.shepherd.on_leave(msg, now), now)
            if sender == msg.peer:  # relay once, never a relayed one
                self._out.extend(Send(peer, msg) for peer in self.run_members() if peer != msg.peer)
        self._election(self.election.on_departure(msg.peer, msg.at, now), now)

    def _on_evidence(self, sender: str, ev: Evidence, now: float) -> None:
        """A ban another node's shepherd recorded: checked here in full before it counts."""
        from pcp_p2p.diloco.protocol.audit import CHUNK_STEPS, verify_evidence

        try:
            offender = verify_evidence(ev, rate=self.spec.aggregation.audit_rate, is_shepherd=self.holds_term,
                                       chunk_steps=CHUNK_STEPS)
        except RemoteError as exc:  # a bug of ours reaches the runtime's boundary
            self._reject(sender, exc)
            return
        if not self.ledger.banned(offender):
            self.ledger.ban(offender, encode_evidence(ev), f"audit evidence from {sender:.16}", now)

    def _on_commit(self, rec: CommitRecord, now: float) -> None:
        """A commit record (message or lookup): the election checks its authority first; the worker
        sees it only once the election answers ``CommitChecked``. The run's last commit that the
        election holds back (the run ended while this node was down) is adopted from this node's
        anchor instead, so a restarted node still ends on the run's final θ."""
        self._election(self.election.on_commit(rec, now), now)
        if rec.round + 1 >= self.spec.round.rounds and not self._final_committed():
            try:
                self._check_final(rec, now)
                effects = self.election.adopt_final(rec, self.spec.round.rounds, now)
            except PcpError as exc:
                log.debug("run %s: the last commit cannot be adopted yet: %s", self.run_id[:16], exc)
                return
            log.info("run %s: the run ended at round %d while this node was away; catching up to θ %s",
                     self.run_id[:16], rec.round + 1, rec.theta_cid)
            self._election(effects, now)

    def _check_final(self, rec: CommitRecord, now: float) -> None:
        """``Election.check_final``, and its shepherd admitted to lead the run (the owner's lists)."""
        self.election.check_final(rec, self.spec.round.rounds, now)
        if not self.admission.may_lead(rec.shepherd, local_bans=False):
            raise NotElected(f"{rec.shepherd:.16}… may not lead this run")

    def _commit_checked(self, rec: CommitRecord, now: float) -> None:
        if rec.round + 1 >= self.spec.round.rounds and self.target is not None:
            # the run's last commit: a node catching up after the end has no term to
            # follow, only this θ to fetch (no Join: nobody leads the run any more)
            # The election vouched for its shepherd: that node held the term, whatever this one
            # claimed meanwhile (a node back after the end may have claimed the same term number
            # alone before the DHT answered; its worker then refused the run's last commit as not
            # its shepherd's and never finished: slow-suite run W2, test_node_stops).
            if self.worker is None:
                self.worker = self._new_worker({rec.term: rec.shepherd})
            self.worker.shepherds[rec.term] = rec.shepherd
        if self.worker is not None:
            self._round(WORKER, self.worker.on_commit(rec, now), now)
            accepted = self.worker.last_commit  # (a stale record moves nothing)
            if accepted is not None:
                self._out.append(ReleasePins(accepted.round))

    def _new_worker(self, shepherds: dict[int, str]) -> Worker:
        assert self.target is not None
        return Worker(spec=self.spec, run_id=self.run_id, identity=self.identity, shepherds=shepherds,
                      target=self.target, tokens_per_s=self.tokens_per_s)

    def _lookup_done(self, now: float) -> None:
        if self._lookups_pending > 0:
            self._lookups_pending -= 1
            if self._lookups_pending == 0:
                self._election(self.election.on_lookups_done(now), now)

    def _final_committed(self) -> bool:
        best = self.election.best_commit
        return best is not None and best.round + 1 >= self.spec.round.rounds

    def _election(self, effects: list[ElectionEffect], now: float) -> None:
        self._now = now
        if self._final_committed():
            # The run is over: no new terms (a lapsed lease now means nothing).
            effects = [e for e in effects if not isinstance(e, (PublishLease, BecomeShepherd))]
        for e in effects:
            if isinstance(e, PublishLease):
                self._out.append(e)
                if not e.renewal:
                    log.info("run %s: this node claims term %d", self.run_id[:16], e.lease.term)
            elif isinstance(e, BecomeShepherd):
                self.becoming, self.becoming_term = True, e.term
                self.phase = "compiling"
                self._out += [Leads(True), SetUpShepherd(e)]
            elif isinstance(e, FollowShepherd):
                if e.peer != self.peer_id and self.becoming_term is not None and e.term >= self.becoming_term:
                    self._out.append(CancelSetUp(f"term {e.term} is held by {e.peer}"))
                self._follow(e, now)
            elif isinstance(e, StepDown):
                if e.term == self.becoming_term:
                    self._out.append(CancelSetUp(f"stepped down from term {e.term} ({e.reason})"))
                if self.shepherd is not None and self.shepherd.term == e.term:
                    self.shepherd = None
                self.becoming = False
                self._out.append(Leads(False))
                log.info("run %s: stepping down from term %d (%s)", self.run_id[:16], e.term, e.reason)
            elif isinstance(e, SendHeartbeat):
                self._out += [Send(peer, e.heartbeat) for peer in self.run_members()]
            elif isinstance(e, LookupLease):
                self._lookups_pending += 1  # on_lookups_done once every asked lookup answered
                self._out.append(LookUpLease())
            elif isinstance(e, LookupCommit):
                self._lookups_pending += 1
                self._out.append(LookUpCommit(for_election=True))
            elif isinstance(e, CommitChecked):
                self._commit_checked(e.record, now)
            elif isinstance(e, Rejected):
                if isinstance(e.error, HeldBack):
                    self.stats.held += 1  # not refused: kept until it can be checked
                else:
                    self._reject(e.peer or "?", e.error)
        lease = self.election.lease
        if lease is not None and (self._saved_term is None or lease.term > self._saved_term):
            self._saved_term = lease.term
            self._out.append(SaveLease(lease))

    def _follow(self, e: FollowShepherd, now: float) -> None:
        """The shepherd of ``e.term`` is ``e.peer``: our worker joins it."""
        if e.peer != self.peer_id or self.shepherd_peer != e.peer:
            log.info("run %s: term %d is led by %s%s", self.run_id[:16], e.term, e.peer,
                     " (this node)" if e.peer == self.peer_id else "")
        self.shepherd_peer = e.peer
        if self.target is None:
            return
        if self.worker is None:
            self.worker = self._new_worker({e.term: e.peer})
            if e.base is not None:
                self.worker.term_base[e.term] = e.base
            self.phase = "joining"
            self._round(WORKER, self.worker.start(now), now)
        else:
            self._round(WORKER, self.worker.set_shepherd(e.term, e.peer, now, base=e.base), now)

    def _round(self, who: str, effects: list[Effect], now: float) -> None:
        """A round machine's effects; a commit's first send to another node holds the rest."""
        self._now = now
        if who == SHEPHERD:
            if self._held is not None:  # a commit is replicating: keep the shepherd's order
                self._held.append(effects)
                return
            found = next(((i, e.message) for i, e in enumerate(effects) if isinstance(e, Send)
                          and isinstance(e.message, CommitRecord) and e.to != self.peer_id), None)
            if found is not None:
                first, commit = found
                # From the commit's own Committed on (its DHT record, our election's view of
                # it): a commit held is nowhere, or a node reading the DHT would follow a
                # commit whose checkpoint died with this node.
                first = next((i for i, e in enumerate(effects[:first]) if isinstance(e, Committed)
                              and e.record is commit), first)
                self._round_now(who, effects[:first], now)
                held = effects[first:]
                peers = [e.to for e in held if isinstance(e, Send)
                         and e.message is commit and e.to != self.peer_id]
                # Every node the commit is for at once (one ack suffices): each accepts it only
                # once it holds the checkpoint, so none is left on a commit nobody holds, and
                # they all fetch it side by side through its relay tree (pcp_p2p.blob.swarm), so
                # the origin's uplink still carries one copy. Asking two first and the rest
                # after one ack put two checkpoint fetches in a row on every round's path: about
                # 2.8 s a round on the network lab's 20 Mbit/s, 40 ms links (docs/connectivity.md).
                # Participants in tree order first (the likeliest alive, the root first).
                tree = tree_order(commit.checkpoint_cid, [p for p in commit.participants if p != self.peer_id])
                rank = {p: i for i, p in enumerate(tree)}
                targets = sorted(peers, key=lambda p: (p not in commit.participants, rank.get(p, len(rank))))
                # A small update rides with the commit: each participant builds the checkpoint
                # without fetching it first (messages.CommitWithUpdate). Small: one copy, and the
                # copies to all the targets, as for a fetch straight from the origin (else the
                # shepherd's uplink would carry N copies where the relay tree carries one).
                update = next((e.data for e in effects if isinstance(e, StoreBlob) and e.cid == commit.update_cid
                               and len(e.data) <= INLINE_UPDATE_BYTES
                               and not worth_a_tree(len(targets), len(e.data))), b"")
                # With it, the next round's announcement to each of those nodes goes right behind its
                # commit (the receiver holds it until it took the commit, RunRuntime.deliver): behind
                # the first ack and this machine's next step it came 0.5-0.7 s after a worker had built
                # the checkpoint, its early run waiting (docs/connectivity.md, run 12). Only then: with
                # 16 workers on one machine, announcements held at every receiver while the checkpoint
                # came down the tree went with a shepherd change and rounds twice as long (not traced).
                follow = [e for e in held if update and isinstance(e, Send) and isinstance(e.message, RoundAnnouncement)
                          and e.message.round == commit.round + 1 and e.to in peers]
                self._held = [[e for e in held if not any(e is f for f in follow)]]
                self._out.append(ReplicateCommit(commit, tuple(targets), REPLICATE_TIMEOUT_S,
                                                 then=tuple((f.to, f.message) for f in follow), update=bytes(update)))
                return
        self._round_now(who, effects, now)

    def _round_now(self, who: str, effects: list[Effect], now: float) -> None:
        for e in effects:
            if isinstance(e, Send):
                if isinstance(e.message, Submission):
                    self.stats.bytes_submitted += len(encode(e.message))
                elif isinstance(e.message, PartialAggregate):
                    self.stats.partials_sent += 1
                elif isinstance(e.message, PartialVerdict):
                    v = e.message.verdict
                    self.stats.partial_replays[v] = self.stats.partial_replays.get(v, 0) + 1
                self._out.append(e)
            elif isinstance(e, FetchBlob):
                self._out.append(Fetch(who, e.cid, e.hint))
            elif isinstance(e, RunInner):
                if self.stats.first_train_at is None:
                    self.stats.first_train_at = now
                self._out.append(e)
            elif isinstance(e, LookupCommit):
                self._out.append(LookUpCommit(for_election=False))
            elif isinstance(e, Rejected):
                self._reject(e.peer or "?", e.error)
            elif isinstance(e, Committed):
                for p in e.record.participants:
                    self.ledger.credit(p, now)
                self.ledger.flush(now)
                self._out += [PublishCommit(e.record), ReleasePins(e.record.round)]
                self._election(self.election.on_commit(e.record, now), now)
            elif isinstance(e, Banned):
                self.ledger.ban(e.peer, e.evidence, e.reason, now)
                log.warning("run %s: %s banned: %s", self.run_id[:16], e.peer, e.reason)
                # The evidence proves itself: every member records the ban, so the
                # next term's shepherd refuses the offender too.
                if e.shared:
                    evidence = decode_evidence(e.evidence)
                    self._out.extend(Send(p, evidence) for p in self.run_members() if p != e.peer)
            elif isinstance(e, Discarded):
                log.warning("run %s: round %d attempt %d discarded: %s", self.run_id[:16], e.round + 1,
                            e.attempt, e.error)
                self._out.append(e)  # (for a simulator's record; a node only logs it)
            elif isinstance(e, Finished):
                log.info("run %s finished at round %d (θ %s)", self.run_id[:16], e.round, e.theta_cid)
                self._out.append(e)
                if self.worker is None and not self.finished:
                    self.phase = "finished"
                    self.finished = True
                    self._out.append(RunEnded("finished", None))
            else:  # StoreBlob, CancelInner, ShiftInner
                self._out.append(e)

    def _reject(self, peer: str, exc: PcpError) -> None:
        key = type(exc).__name__
        self.stats.rejected[key] = self.stats.rejected.get(key, 0) + 1
        self._out.append(Rejected(peer, exc))

    def _end_stopped(self) -> None:
        self.shepherd = None
        self.phase = STOPPED
        final = (self.worker.theta_cid if self.worker is not None else None) or ""
        self.finished = True
        self._out += [Leads(False), RunEnded(STOPPED, final)]


SETTLE_S = 3.0  # the longest the election waits for the DHT's lease and commit before claiming
MAX_TERM_S = 24 * 3600.0  # the longest a term may last when the run never rotates


def max_claim_age(spec: RunSpec) -> float:
    """How long a term may honestly last, so how far back a lease's claim may be dated.

    ``rotate_every`` rounds, each at most a round deadline plus the join grace,
    three times over for attempts retried without quorum, plus the claim's own
    wait; a holder steps down before its claim gets this old (``Election.tick``).
    """
    e, r = spec.election, spec.round
    if e.rotate_every == 0:
        return MAX_TERM_S
    return e.rotate_every * (r.deadline_s + 10.0) * 3 + e.claim_timeout_s + 2 * e.lease_s


# Hot standbys: the nodes ranked first for the next term (the current holder left out) build the
# takeover's artifacts and evaluator ahead. Not every node: sixteen compiles at once on one machine
# starved a local swarm for minutes, and a volunteer's CPU is not spent on a takeover that the
# ranking gives to someone else. Three covers the successor and two behind it (a standby that
# fails in turn, or a skipped claim); a node that moves up later builds at the next commit.
STANDBYS = 3
HEARTBEATS_PER_RENEWAL = 8  # the shepherd's direct heartbeats per lease renewal (2 s renewals: every 0.25 s)
# the holder's beats per second, all followers together (ElectionConfig.beats_per_s): up to 3
# followers are beaten every 0.25 s as before, 6 every 0.5 s, 12 and more every second
HOLDER_BEATS_PER_S = 12.0
SUSPECT_AFTER_BEATS = 6  # heartbeats missed in a row before followers suspect the shepherd (1.5 s)
# (Before the runtime fed the machine off its event loop, a commit kept a shepherd from
# sending for over a second on a loaded 2-core machine, and even 3 s of silence deposed
# busy shepherds now and then: see the essay in runtime.py.)


def owner_lookup_every(floor_s: float, members: int) -> float:
    """How long each member waits between lookups of an owner's record (a stop, an allowlist
    amendment): ``floor_s`` at least, and spaced so that the whole run looks it up about once
    per ``OWNER_LOOKUP_SPACING_S`` whatever its size.

    Why: until the owner stores one, the record is not there, and a lookup of a missing record
    asks every closest peer (each answer names up to 20 peers with their signed records), and
    every member's lookups reach the same closest peers. At 16 members each looking every
    30 s, the shepherd spent about 5 KB/s answering and making them (issue #15). The price:
    a member that missed the owner's direct send learns of a stop ``members x 8`` seconds
    later at worst (two minutes at 16), instead of 30 s.
    """
    return max(floor_s, members * OWNER_LOOKUP_SPACING_S)


def election_config(spec: RunSpec, settle_s: float = SETTLE_S) -> ElectionConfig:
    """The election of ``spec``'s run, as every node runs it.

    Heartbeat timing is derived from the spec's renewal interval (not spec
    fields of its own: every member still times out alike, and a run's id,
    a hash of its spec, does not change with this release)."""
    e = spec.election
    return ElectionConfig(
        lease_s=e.lease_s, renew_every_s=e.renew_every_s, grace_s=e.grace_s,
        min_uptime_s=e.min_uptime_s, rotate_every=e.rotate_every, claim_timeout_s=e.claim_timeout_s,
        settle_s=settle_s, max_skew_s=e.max_skew_s, max_claim_age_s=max_claim_age(spec),
        rounds=spec.round.rounds,
        heartbeat_s=e.renew_every_s / HEARTBEATS_PER_RENEWAL,
        beats_per_s=HOLDER_BEATS_PER_S,
        suspect_s=SUSPECT_AFTER_BEATS * e.renew_every_s / HEARTBEATS_PER_RENEWAL,
    ).validate()

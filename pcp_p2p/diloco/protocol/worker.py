"""The worker's side of a DiLoCo round, as a sans-IO state machine.

Like the shepherd (see the essay in :mod:`pcp_p2p.diloco.protocol.shepherd`), the worker
is a plain object: inputs with ``now``, effects out, no I/O, no clock. Its job
per round: check that the announcement comes from the shepherd of its term,
fetch what it lacks (θ_r by CID, hash-checked; the artifact for its target),
ask the executor to run inner steps for the round's time budget (``RunInner``:
fast hardware does more steps, slow fewer, capped by its assignment; the budget
counts from the announcement's arrival, :data:`MIN_BUDGET_SHARE`), then send
the signed pseudo-gradient Δ = θ_r − θ_local, compressed with the run's codec.

Two rules keep every worker on the same trajectory:

- A worker trains round ``r+1`` only from *exactly* the θ named by the commit
  record of round ``r`` — an announcement that names another θ is refused, and
  the θ bytes are hash-checked against the CID before use.
- Commit records only move forward: a commit for a lower round than the last
  one seen is refused (:class:`StaleMessage`); the same round with another θ is
  refused too. After a commit the worker prefetches the new θ, so a surviving
  worker always ends holding the last committed θ.

The inner AdamW state is opaque here (``inner_state``), handed to the executor
with each ``RunInner`` and taken back with its result: it survives across
rounds, as DiLoCo intends, and dies with the worker process. With an
error-feedback codec (``topk2``) the worker also keeps its ``residual``, what
its payloads left out of its Δs so far, on the same rule as the inner state,
and trains each round from θ − residual (:func:`~pcp_p2p.diloco.algorithm.sparse.local_start`). For audits
(:mod:`~pcp_p2p.diloco.protocol.audit`) the submission names the state it started from
and ended with, and the worker moves on to a new state only once a commit
lists it as a participant of the round it submitted: a submission that was
lost, refused or discarded never becomes a start state, so the worker's
states form the same chain the shepherd sees (``audit.StateChain``). For the
same reason a worker whose submission of round r is still pending does not
train a later round until it has seen a commit of round r or later: only that
commit says whether round r's inner state and residual are its new start
(an announcement can overtake the commit it builds on: a failover, a lost
commit). It looks the commit up meanwhile (``LookupCommit``) and, if none
comes within a quarter of the round's time budget, drops the pending state
and trains from the last settled one (the shepherd accepts any committed state
as a start, so the round still counts).

**Overlap** (``round.overlap``; docs/diloco.md, "Overlap"): on submitting round r
the worker starts round r+1 at once, *early*, from its own end point of round r
and round r's inner state, on the assignment it expects (the same roster
position, attempt 0's seed), while its Δ travels and the shepherd combines.
When the commit of r lists it and the announcement of r+1 assigns it (with the
same step cap and artifact), it *adopts* the early run: once θ_{r+1} is held it
tells the run its real start and its announced assignment (``ShiftInner``), and
the run moves its parameters by the difference and keeps the progress of its
steps so far; the Δ is measured from θ_{r+1} as always, so the shepherd's side
does not change. Anything else (a commit without it, a round it is not in,
another artifact) cancels the early run and the round starts as without overlap.

A late joiner sends ``Join`` and looks up the latest commit record (the DHT's
latest-checkpoint record), which makes it prefetch that θ; the first
announcement that assigns it names the same θ — it contributes from that round on. A
worker that finds itself missing from an announcement (evicted, or its Join was
lost) joins again, at most once per announcement.

Transitions::

    IDLE       --announcement assigning me-->   FETCHING (or TRAINING if θ held)
    FETCHING   --all blobs arrived-->           TRAINING (RunInner), unless held for a commit
    FETCHING   --held: the commit, or the hold's end-->  TRAINING (RunInner)
    FETCHING   --fetch failed-->                IDLE
    TRAINING   --inner done-->                  SUBMITTED (Send Submission)
    TRAINING   --inner failed-->                IDLE
    SUBMITTED  --(overlap) at once-->           SUBMITTED, the next round's early run in flight
    any        --announcement fitting the early run-->  TRAINING (adopted; ShiftInner once θ and the
                                                commit are in; its result is the round's)
    any        --newer announcement-->          FETCHING/TRAINING (CancelInner first)
    any        --commit-->                      IDLE (prefetch new θ)
    SUBMITTED  --a new term from the same θ-->  SUBMITTED (Join; the submission sent again)

A failover does not throw the round in flight away: when the next term starts
from the θ the worker is training from (the lease's base), the worker joins the
new shepherd and sends it the submission it signed for the attempt in flight
(or, still training, sends it there when done), which the new shepherd may take
over (:meth:`~pcp_p2p.diloco.protocol.shepherd.Shepherd.adopt`).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pcp_p2p.core.cid import check_cid, cid_of
from pcp_p2p.core.errors import (
    BadSignature,
    HashMismatch,
    MalformedMessage,
    PcpError,
    RejectedUpdate,
    StaleMessage,
    VerificationError,
)
from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.algorithm.data import assignment_seed
from pcp_p2p.diloco.algorithm.params import Params, codec_of, unpack_tensors
from pcp_p2p.diloco.algorithm.sparse import encode_with_feedback, local_start
from pcp_p2p.diloco.protocol.effects import (
    EARLY,
    CancelInner,
    Effect,
    FetchBlob,
    LookupCommit,
    Rejected,
    RunInner,
    Send,
    ShiftInner,
    StoreBlob,
)
from pcp_p2p.diloco.protocol.messages import (
    INLINE_DELTA_LIMIT,
    CommitRecord,
    DataAssignment,
    GroupPart,
    Join,
    RoundAnnouncement,
    Submission,
    sign,
    verify,
)
from pcp_p2p.diloco.protocol.partials import announced_groups
from pcp_p2p.diloco.protocol.spec import RunSpec
from pcp_p2p.wire import Message

KEEP_SUBMITTED = 16
MAX_DROPPED_BY = 64
"""Aggregators a worker remembers leaving it out (the oldest is forgotten first)."""
"""Own submissions kept (signed, as sent): an audit request names one of the last rounds."""

HOLD_FOR_COMMIT = 0.25
"""The longest a worker holds a round's training for the commit of its pending submission, as a
fraction of the round's time budget: the commit usually arrives within a round trip (or the lookup
finds it); past this the round's own work is worth more than the state it would have settled."""

MIN_BUDGET_SHARE = 0.25
"""The least of the round's time budget an inner run gets, however long its θ took to arrive.

A run's budget counts from the announcement's arrival, not from the end of the fetch: every
worker then submits about one budget after the announcement went out, whoever fetched fast,
so the round is not as long as its slowest fetch plus a whole budget, and the fast fetchers do
not wait that difference out idle after submitting (they train it instead). A worker whose
fetch took most of the budget still trains this share of it: a contribution, a little late."""


class WorkerPhase(enum.Enum):
    IDLE = "idle"
    FETCHING = "fetching"
    TRAINING = "training"
    SUBMITTED = "submitted"


@dataclass(frozen=True)
class InnerResult:
    """What the executor hands back for a ``RunInner``."""

    round: int
    attempt: int
    theta: Params  # θ_local after the inner steps
    steps: int
    losses: tuple[float, ...]
    inner_state: Any
    state_in: str = ""  # digest of the inner state the run started from (FRESH_STATE, or "" untracked)
    state_out: str = ""  # digest of the inner state it ended with ("" untracked)
    group: tuple[GroupPart, ...] = ()  # a worker group's split of the round (Submission.group)
    shifted_at: int | None = None  # an early run: the steps it trained before its shift


@dataclass
class EarlyRun:
    """The inner run of ``round`` a worker started before its announcement (``round.overlap``)."""

    round: int
    assignment: DataAssignment  # expected: round − 1's position and cap, attempt 0's seed
    artifact_cid: str | None
    state_in: Any  # round − 1's end state, the run's start: it must be the settled one
    state_digest: str  # its digest, as the run's result names its start ("" untracked)
    ann: RoundAnnouncement | None = None  # the announcement it was adopted for
    shifted: bool = False


def pseudo_gradient(theta: Params, theta_local: Params) -> Params:
    """Δ = θ_r − θ_local in float32, exactly as a worker submits it (an audit recomputes it)."""
    return {k: theta[k] - np.asarray(theta_local[k], dtype=np.float32) for k in theta}


class Worker:
    """One worker's view of a run."""

    def __init__(
        self,
        *,
        spec: RunSpec,
        run_id: str,
        identity: Identity,
        shepherds: dict[int, str],
        target: str,
        tokens_per_s: float,
    ) -> None:
        """``shepherds``: term -> the peer id holding that term's lease (later: from the DHT)."""
        self.spec = spec
        self.run_id = run_id
        self.identity = identity
        self.shepherds = dict(shepherds)
        self.term_base: dict[int, tuple[int, str]] = {}
        self.target = target
        self.tokens_per_s = tokens_per_s
        self.phase = WorkerPhase.IDLE
        self.term = max(self.shepherds, default=0)
        self.current: RoundAnnouncement | None = None
        self.theta: Params | None = None
        self.theta_cid: str | None = None
        self.held_artifacts: set[str] = set()
        self.wanted: set[str] = set()
        self.inner_state: Any = None
        # Error feedback (codecs with ``error_feedback``, see pcp_p2p.diloco.algorithm.sparse): what the
        # payloads sent so far left out of this worker's Δs; its inner steps start from
        # θ − residual (sparse.local_start). It follows the inner state's rule:
        # the residual of a submission becomes current only once a commit lists us for it (a
        # lost or refused round's Δ is lost whole, so its residual must not count either). It
        # lives here, not in the executor, so it survives an executor restart.
        self.residual: Params | None = None
        self.pending_residual: Params | None = None
        # (round, attempt, inner state) submitted, waiting for a commit naming us
        self.pending_state: tuple[int, int, Any] | None = None
        # While set, the current announcement waits for a commit that settles pending_state (until then)
        self.held_until: float | None = None
        # When the current announcement reached us: its inner run's budget counts from here
        self.announced_at = 0.0
        self.last_commit: CommitRecord | None = None
        self.early: EarlyRun | None = None  # the next round's inner run, started early (overlap)
        self.early_rounds = 0  # submissions that came from an adopted early run
        self.early_failed: PcpError | None = None  # an early run failed: this worker trains when announced
        # their steps before the shift over all their steps: the τ the exchange cost (docs/diloco.md)
        self.early_shares: deque[float] = deque(maxlen=32)
        self.joined_for: tuple[int, int, int] | None = None
        self.submitted: list[Submission] = []
        self.last_heard = 0.0
        # (round, aggregator) of the last submission sent to an aggregator; a commit of that round
        # that does not list this worker marks the aggregator: from then on, a round that puts this
        # worker in its group sends the Δ to the shepherd itself (docs/diloco.md, "Aggregators")
        self.via: tuple[int, str] | None = None
        self.dropped_by: deque[str] = deque(maxlen=MAX_DROPPED_BY)

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    @property
    def shepherd(self) -> str | None:
        return self.shepherds.get(self.term)

    def set_shepherd(
        self, term: int, peer_id: str, now: float | None = None, base: tuple[int, str] | None = None
    ) -> list[Effect]:
        """A new term's lease was seen (rotation or failover): join its shepherd.

        From here on, announcements and commits of older terms are stale — except
        the commit the new term continues from, ``base`` = (its round + 1, its θ
        CID) as the lease names it: a worker that missed it (a lost message) must
        still be able to take it from a DHT lookup.
        """
        self.shepherds[term] = peer_id
        if base is not None:
            self.term_base[term] = base
        if term < self.term:
            return []
        self.term = term
        if now is not None:
            self.last_heard = now
        self.joined_for = None
        effects = self._join()
        ann = self.current
        if ann is not None and self.phase is WorkerPhase.SUBMITTED and self._carries_over(ann):
            sub = next((s for s in reversed(self.submitted)
                        if (s.term, s.round, s.attempt) == (ann.term, ann.round, ann.attempt)), None)
            if sub is not None:
                effects.append(Send(peer_id, sub))
        return effects

    def _carries_over(self, ann: RoundAnnouncement) -> bool:
        """Whether ``ann``, of an older term, is the attempt the current term may take over: the
        term starts from the round ``ann`` trains and the θ it trains from."""
        return ann.term < self.term and self.term_base.get(self.term) == (ann.round, ann.theta_cid)

    # --- inputs --------------------------------------------------------------

    def start(self, now: float) -> list[Effect]:
        """Join, and look up the latest commit so a late joiner prefetches its θ."""
        self.last_heard = now
        return [*self._join(), LookupCommit()]

    @property
    def next_wakeup(self) -> float:
        """When silence from the shepherd becomes suspicious (one round deadline), or a hold ends."""
        silence = self.last_heard + self.spec.round.deadline_s
        return silence if self.held_until is None else min(silence, self.held_until)

    def tick(self, now: float) -> list[Effect]:
        """After a deadline of silence: look up the latest commit and join again.

        Covers a lost commit record, a lost Join, and eviction after missed rounds.
        A hold for a commit that has not come by its end is released here.
        """
        if self.held_until is not None and now >= self.held_until:
            self.held_until = None
            self.pending_state = None  # not known to be committed: train from the settled state
            self.pending_residual = None
            if self._adopted() is not None:
                return self._maybe_shift(now)
            return self._train(now) if self.phase is WorkerPhase.FETCHING and not self.wanted else []
        if now < self.next_wakeup or self.phase in (WorkerPhase.FETCHING, WorkerPhase.TRAINING):
            return []
        self.last_heard = now
        self.joined_for = None
        # Joining again is idempotent for the shepherd, and after a deadline of
        # silence this worker cannot know whether it is still on the roster.
        return [LookupCommit(), *self._join()]

    def receive(self, msg: Message, now: float) -> list[Effect]:
        if isinstance(msg, RoundAnnouncement):
            return self.on_announcement(msg, now)
        if isinstance(msg, CommitRecord):
            return self.on_commit(msg, now)
        return [Rejected(None, MalformedMessage(f"a worker does not take {type(msg).__name__}"))]

    def _check_from_shepherd(self, msg: RoundAnnouncement | CommitRecord) -> None:
        if msg.run_id != self.run_id:
            raise VerificationError(f"message for another run {msg.run_id:.20}")
        if msg.term < self.term:
            base = self.term_base.get(self.term)
            is_base = (
                isinstance(msg, CommitRecord) and base is not None and (msg.round + 1, msg.theta_cid) == base
            )
            if not is_base:
                raise StaleMessage(f"term {msg.term} is older than the current term {self.term}")
            verify(msg, self.shepherds.get(msg.term, msg.shepherd))
            return
        expected = self.shepherds.get(msg.term)
        if expected is None or msg.shepherd != expected:
            raise BadSignature(f"{msg.shepherd:.16}… is not the shepherd of term {msg.term}")
        verify(msg, expected)

    def on_announcement(self, ann: RoundAnnouncement, now: float) -> list[Effect]:
        try:
            self._check_from_shepherd(ann)
            committed = self.last_commit
            if committed is not None and ann.term > committed.term:
                pass  # a new term may restart from an earlier commit (failover, fork choice)
            elif committed is not None:
                if ann.round <= committed.round:
                    raise StaleMessage(
                        f"announcement of round {ann.round + 1}, already committed {committed.round + 1}")
                if ann.round == committed.round + 1 and ann.theta_cid != committed.theta_cid:
                    raise VerificationError("announcement does not start from the committed θ")
            cur = self.current
            if cur is not None and (ann.term, ann.round, ann.attempt) <= (cur.term, cur.round, cur.attempt):
                if (ann.term, ann.round, ann.attempt) == (cur.term, cur.round, cur.attempt):
                    return []  # duplicate delivery
                raise StaleMessage(f"announcement of round {ann.round + 1}.{ann.attempt}, "
                                   f"already at {cur.round + 1}.{cur.attempt}")
        except PcpError as exc:
            return [Rejected(ann.shepherd, exc)]
        self.term = ann.term
        self.last_heard = now
        early = self.early if self.early is not None and self._early_fits(self.early, ann) else None
        effects = self._cancel_inner(keep_early=early is not None)
        self.current = ann
        self.held_until = None
        self.announced_at = now
        if ann.assignment_for(self.peer_id) is None:
            self.phase = WorkerPhase.IDLE
            return effects + self._join(ann)
        artifact = ann.artifacts.get(self.target)
        if ann.artifacts and artifact is None:
            self.phase = WorkerPhase.IDLE
            return [*effects, Rejected(ann.shepherd, RejectedUpdate(f"no artifact for target {self.target}"))]
        self.wanted = set()
        if self.theta_cid != ann.theta_cid:
            self.wanted.add(ann.theta_cid)
        if artifact is not None and artifact not in self.held_artifacts:
            self.wanted.add(artifact)
        held = self.pending_state is not None and self.pending_state[0] < ann.round
        if held:
            # The commit of our pending round has not reached us: hold until it says which state to start from.
            self.held_until = now + HOLD_FOR_COMMIT * ann.time_budget_s
            effects.append(LookupCommit())
        fetches: list[Effect] = [FetchBlob(cid, hint=ann.shepherd) for cid in sorted(self.wanted)]
        if early is not None:
            # Adopt the early run: it trains on while θ (and the commit it builds on) arrive.
            early.ann = ann
            self.phase = WorkerPhase.TRAINING
            return effects + fetches + self._maybe_shift(now)
        if not held and not self.wanted:
            return effects + self._train(now)
        self.phase = WorkerPhase.FETCHING
        return effects + fetches

    def on_blob(self, cid: str, data: bytes, now: float) -> list[Effect]:
        try:
            check_cid(cid, data)
        except HashMismatch as exc:
            return [Rejected(None, exc), FetchBlob(cid)]  # ask again (another provider)
        except PcpError as exc:
            return [Rejected(None, exc)]
        ann = self.current
        is_theta = (ann is not None and cid == ann.theta_cid) or (
            self.last_commit is not None and cid == self.last_commit.theta_cid
        )
        if is_theta:
            try:
                self.theta = unpack_tensors(data)
            except PcpError as exc:  # signed CID, undecodable bytes: this round is lost
                if self.phase is WorkerPhase.FETCHING:
                    self.phase = WorkerPhase.IDLE
                return [Rejected(None, exc)]
            self.theta_cid = cid
        elif cid in self.wanted:
            self.held_artifacts.add(cid)  # the glue keeps the bytes; we only note the CID
        else:
            return []  # a late or duplicate delivery nobody asked for any more
        self.wanted.discard(cid)
        if self._adopted() is not None:
            return self._maybe_shift(now)
        if self.phase is WorkerPhase.FETCHING and not self.wanted and self.held_until is None:
            return self._train(now)
        return []

    def on_blob_failed(self, cid: str, error: PcpError, now: float) -> list[Effect]:
        if cid in self.wanted and (self.phase is WorkerPhase.FETCHING or self._adopted() is not None):
            effects = self._cancel_inner()  # an adopted early run cannot be shifted without θ
            self.phase = WorkerPhase.IDLE
            self.held_until = None
            return [*effects, Rejected(None, error)]
        return []

    def on_inner_done(self, result: InnerResult, now: float) -> list[Effect]:
        ann = self.current
        if result.attempt == EARLY:
            early = self._adopted()
            if (early is None or not early.shifted or ann is None or result.round != ann.round
                    or result.state_in != early.state_digest):
                return []  # cancelled, or an older early run of the same round
            self.early = None
            self.early_rounds += 1
            if result.shifted_at is not None and result.steps:
                self.early_shares.append(result.shifted_at / result.steps)
            result = replace(result, attempt=ann.attempt)  # the adopted run's result is the round's
        if (
            self.phase is not WorkerPhase.TRAINING
            or ann is None
            or (result.round, result.attempt) != (ann.round, ann.attempt)
            or self.theta is None
        ):
            return []  # superseded: the round moved on while we trained
        delta = pseudo_gradient(self.theta, result.theta)
        codec = self.spec.round.delta_codec
        try:
            payload, residual = encode_with_feedback(codec_of(codec), delta)
        except PcpError as exc:  # NaN/inf: the inner loop diverged; submit nothing
            self.phase = WorkerPhase.IDLE
            return [Rejected(self.peer_id, exc)]
        effects: list[Effect] = []
        # (a failover while training: the new term's shepherd may take the attempt over)
        successor = self.shepherd if self._carries_over(ann) else None
        to = successor or ann.shepherd
        if ann.aggregators and successor is None:
            via = announced_groups(ann).get(self.peer_id, ann.shepherd)
            to = ann.shepherd if via in self.dropped_by else via
        if len(payload) <= INLINE_DELTA_LIMIT and to == ann.shepherd:
            delta_cid, inline = None, payload
        else:
            delta_cid, inline = cid_of(payload), None
            effects.append(StoreBlob(delta_cid, payload))
        sub = sign(
            Submission(
                run_id=self.run_id,
                term=ann.term,
                round=ann.round,
                attempt=ann.attempt,
                worker=self.peer_id,
                base_theta_cid=ann.theta_cid,
                codec=codec,
                delta_cid=delta_cid,
                delta_inline=inline,
                steps=result.steps,
                tokens=result.steps * self.spec.tokens_per_step,
                losses=tuple(float(x) for x in result.losses),
                state_in=result.state_in,
                state_out=result.state_out,
                group=result.group,
            ),
            self.identity,
        )
        self.pending_state = (ann.round, ann.attempt, result.inner_state)
        self.pending_residual = residual
        self.submitted.append(sub)
        del self.submitted[:-KEEP_SUBMITTED]  # an audit asks about a recent round only
        self.phase = WorkerPhase.SUBMITTED
        self.via = (ann.round, to) if to in ann.aggregators else None
        return [*effects, Send(to, sub), *self._start_early(ann, result)]

    def on_inner_failed(self, round_: int, attempt: int, error: PcpError, now: float) -> list[Effect]:
        ann = self.current
        early = self.early
        if attempt == EARLY:
            if early is not None and early.round == round_:
                self.early = None
                if early.ann is not None and early.ann is ann and self.phase is WorkerPhase.TRAINING:
                    self.phase = WorkerPhase.IDLE  # the adopted round is lost, as any failed run's
            # Once is enough to stop trying: an engine that cannot run early (a worker group's)
            # would fail every round, and a run that diverged early would have as announced.
            self.early_failed = error
            return [Rejected(None, error)]
        if self.phase is WorkerPhase.TRAINING and ann is not None and (ann.round, ann.attempt) == (round_, attempt):
            self.phase = WorkerPhase.IDLE
        return [Rejected(None, error)]

    def on_commit(self, rec: CommitRecord, now: float) -> list[Effect]:
        try:
            self._check_from_shepherd(rec)
            last = self.last_commit
            if last is not None and rec.term > last.term and rec.round <= last.round:
                # Fork choice: a higher term's commit wins even at a lower round
                # (the losing side of a partition resynchronises; its rounds are lost).
                # Only the current term's holder gets here (_check_from_shepherd).
                pass
            elif last is not None:
                if rec.round < last.round:
                    raise StaleMessage(f"commit of round {rec.round + 1} after round {last.round + 1} was committed")
                if rec.round == last.round:
                    if rec.theta_cid == last.theta_cid:
                        return []  # duplicate delivery
                    raise StaleMessage(f"a second, different commit for round {rec.round + 1}")
        except PcpError as exc:
            return [Rejected(rec.shepherd, exc)]
        self.term = max(self.term, rec.term)
        self.last_heard = now
        self.last_commit = rec
        if self.via is not None and self.via[0] == rec.round:
            if self.peer_id not in rec.participants and self.via[1] not in self.dropped_by:
                self.dropped_by.append(self.via[1])  # it left us out (or its partial was refused)
            self.via = None
        self._settle_state(rec)
        effects: list[Effect] = []
        ann = self.current
        if ann is not None and ann.round > rec.round:
            # The next round's announcement overtook this commit: it already named
            # θ_{r+1} and whatever it needs is being fetched or trained on; it may
            # have been held for exactly this commit.
            if self.held_until is not None and self.pending_state is None:
                self.held_until = None
                if self._adopted() is not None:
                    return self._maybe_shift(now)
                if self.phase is WorkerPhase.FETCHING and not self.wanted:
                    return self._train(now)
            return effects
        self.held_until = None
        early = self.early
        keep = early is not None and early.round == rec.round + 1 and self.inner_state is early.state_in
        effects += self._cancel_inner(keep_early=keep)  # kept: it builds on this commit, which lists us
        self.phase = WorkerPhase.IDLE
        if self.theta_cid != rec.theta_cid:
            self.wanted = {rec.theta_cid}
            effects.append(FetchBlob(rec.theta_cid, hint=rec.shepherd))
        return effects

    # --- internals -------------------------------------------------------------

    def _adopted(self) -> EarlyRun | None:
        """The early run that is the current round's inner run, if it is."""
        early = self.early
        if early is None or early.ann is None or early.ann is not self.current:
            return None
        return early if self.phase is WorkerPhase.TRAINING else None

    def _cancel_inner(self, keep_early: bool = False) -> list[Effect]:
        """Stop the current round's inner run, and the early run unless ``keep_early``."""
        effects: list[Effect] = []
        early = self.early
        cur = self.current
        if self.phase is WorkerPhase.TRAINING and cur is not None and self._adopted() is None:
            effects.append(CancelInner(cur.round, cur.attempt))
        if early is not None and not keep_early:
            effects.append(CancelInner(early.round, EARLY))
            self.early = None
        return effects

    def _start_early(self, ann: RoundAnnouncement, result: InnerResult) -> list[Effect]:
        """On submitting ``ann``'s round, start the next one from where this one ended (overlap)."""
        mine = ann.assignment_for(self.peer_id)
        if (not self.spec.round.overlap or self.early_failed is not None or mine is None
                or ann.round + 1 >= self.spec.round.rounds):
            return []
        # The shepherd numbers shards by roster position and seeds them by (round, attempt,
        # position): with the same roster, round r+1's attempt 0 assigns exactly this.
        expected = replace(mine, seed=assignment_seed(self.run_id, ann.round + 1, 0, mine.shard))
        artifact = ann.artifacts.get(self.target)
        self.early = EarlyRun(ann.round + 1, expected, artifact, result.inner_state, result.state_out)
        return [RunInner(round=ann.round + 1, attempt=EARLY, theta=result.theta, theta_cid="",
                         artifact_cid=artifact, assignment=expected, time_budget_s=ann.time_budget_s,
                         inner_state=result.inner_state)]

    def _early_fits(self, early: EarlyRun, ann: RoundAnnouncement) -> bool:
        """Whether ``ann`` is the round the early run trains, with its artifact and the same step cap.

        The assignment itself may differ (a join or a departure renumbers the shards, and then
        every worker's): the shift then carries the announced one, whose batches the run takes
        from there on. Requiring the expected assignment would make overlap useless under churn.
        A run adopted already belongs to its announcement: a retried attempt trains anew.
        """
        mine = ann.assignment_for(self.peer_id)
        return (early.ann is None and ann.round == early.round and mine is not None
                and mine.max_steps == early.assignment.max_steps
                and ann.artifacts.get(self.target) == early.artifact_cid)

    def _maybe_shift(self, now: float) -> list[Effect]:
        """Tell the adopted early run its real start once θ and the commit it builds on are in.

        The run started from round r's end state, so it is valid only if round r's commit
        listed us (that state is the settled one now); if not, or if the hold for that commit
        gave up, it is cancelled and the round trains from the settled state, as without overlap.
        """
        early = self._adopted()
        if early is None or early.shifted or early.ann is None:
            return []
        if self.theta is None or self.theta_cid != early.ann.theta_cid or self.held_until is not None:
            return []  # θ on its way, or the commit of round r not seen yet
        if self.pending_state is not None or self.inner_state is not early.state_in:
            effects = self._cancel_inner()
            if self.wanted:  # (the artifact: a restarted executor)
                self.phase = WorkerPhase.FETCHING
                return effects
            return effects + self._train(now)
        mine = early.ann.assignment_for(self.peer_id)
        assert mine is not None  # (_early_fits)
        early.shifted = True
        return [ShiftInner(early.round, local_start(self.theta, self.residual), mine)]

    def _settle_state(self, rec: CommitRecord) -> None:
        """Start from the submitted inner state once a commit lists us for its round."""
        pending = self.pending_state
        if pending is None or rec.round < pending[0]:
            return
        if (rec.round, rec.attempt) == pending[:2] and self.peer_id in rec.participants:
            self.inner_state = pending[2]
            self.residual = self.pending_residual
        self.pending_state = None  # committed, or its round was committed without it
        self.pending_residual = None

    def _join(self, ann: RoundAnnouncement | None = None) -> list[Effect]:
        shepherd = ann.shepherd if ann is not None else self.shepherd
        if shepherd is None:
            return []
        if ann is not None:
            tag = (ann.term, ann.round, ann.attempt)
            if self.joined_for == tag:
                return []
            self.joined_for = tag
        msg = sign(
            Join(run_id=self.run_id, worker=self.peer_id, target=self.target, tokens_per_s=self.tokens_per_s),
            self.identity,
        )
        return [Send(shepherd, msg)]

    def _train(self, now: float) -> list[Effect]:
        ann = self.current
        assert ann is not None and self.theta is not None and self.theta_cid == ann.theta_cid
        assignment = ann.assignment_for(self.peer_id)
        assert assignment is not None
        self.phase = WorkerPhase.TRAINING
        spent = max(0.0, now - self.announced_at)  # fetching θ or the artifact, or held for a commit
        budget = max(MIN_BUDGET_SHARE * ann.time_budget_s, ann.time_budget_s - spent)
        return [
            RunInner(
                round=ann.round,
                attempt=ann.attempt,
                theta=local_start(self.theta, self.residual),  # θ itself unless error feedback holds a residual
                theta_cid=ann.theta_cid,
                artifact_cid=ann.artifacts.get(self.target),
                assignment=assignment,
                time_budget_s=budget,
                inner_state=self.inner_state,
            )
        ]

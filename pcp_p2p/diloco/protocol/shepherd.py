"""The shepherd's side of a DiLoCo round, as a sans-IO state machine.

Why a state machine and not a coroutine that awaits submissions: the same logic
must run over libp2p, over the in-memory network of the unit tests and inside
a simulator of many nodes, with faults injected and a mock clock. So the
shepherd is a plain object. It is fed inputs — ``on_join``, ``on_submission``,
``on_blob``, ``on_blob_failed``, ``on_leave``, ``tick`` — each with ``now`` (seconds on the
shepherd's clock), and it answers with a list of :mod:`effects
<pcp_p2p.diloco.protocol.effects>` for the caller to carry out. It never reads the clock,
never sleeps, never does I/O; ``next_wakeup`` says when it next wants a ``tick``.

A round attempt goes: announce (θ_r's CID, artifacts, a data assignment and a
step cap per worker, a deadline) → collect submissions (each checked by
:class:`~pcp_p2p.diloco.protocol.aggregate.RoundAggregator` and, with ``score``, on
held-out data; a refusal is a ``Rejected`` effect and the round goes on) → when
every assigned worker has reported, or the deadline passed with at least
``min_quorum`` accepted, *commit*: Δ̄ by the spec's robust rule
(:mod:`~pcp_p2p.diloco.algorithm.robust`: norm screen, capped token weights, trimmed mean
by default), outer Nesterov step, the val-jump guard (a θ whose validation loss
jumps is not committed: the most suspect submission is dropped and the rest
recombined, or the attempt discarded), θ blob + checkpoint blob + signed
:class:`~pcp_p2p.diloco.protocol.messages.CommitRecord` to every member, all in one
input — there is no state in which the step is half-applied. If the deadline
passes without quorum the attempt is *discarded* (``Discarded``) and the same
round is announced again with ``attempt + 1``: fresh data seeds, the same θ_r.

**Aggregators** (``aggregation.aggregators``, docs/diloco.md "Aggregators"): above
``aggregate_above`` workers the announcement names a few members; each combines its
group's Δs and sends a signed partial aggregate (``on_partial``: checked before its Δ
is fetched; the group is then one entry of the round's combine and stands for its
workers in the commit). At each commit a drawn share of partials goes to another member
to replay (``PartialDesk``); a mismatch it reports is replayed here before a ban.

Membership is a roster of workers that sent a signed ``Join``. The first
announcement waits :attr:`Shepherd.join_grace_s` after the quorum has joined, so
workers that start together train together. A joiner is assigned from the next
announcement on (never mid-round); a worker that announces its departure
(``Leave``) leaves the roster and counts as decided in the round in flight. A worker that misses
:data:`EVICT_AFTER_MISSES` attempts in a row leaves the roster; a live worker
that finds itself unassigned simply joins again. The roster holds at most
:data:`MAX_ROSTER` workers.

The whole outer state — θ, momentum, round — is recoverable from the latest
checkpoint (:meth:`Shepherd.from_checkpoint`), and every message carries the
shepherd's ``term``: whoever holds the next term continues from the last commit,
and the committed round number never goes backwards.

**Taking an attempt over** (:meth:`Shepherd.adopt`). When a shepherd dies mid-round
its workers have trained, or are training, from the very θ the next term
starts from. Announcing that round again would throw their work away and cost
a whole round on top of the failover; instead the successor adopts the
attempt in flight: the dead term's signed announcement (its assignments, data
seeds and step caps) becomes the one this shepherd collects for, the workers
send it the submissions they signed for that attempt, and it commits them
under its own term. Every check on a submission still applies (signature, the
announcement's assignment and caps, the robust rule, the score and the
val-jump guard); the only rounds adopted are those that start from the θ the
term continues from, so nothing is combined that another θ produced. An
adopted attempt is audited like any other: each request names the dead term
(the submission's, which the draw hashes) and this one
(``AuditRequest.shepherd_term``, the lease the auditors check it holds).

Transitions (``*`` = every input not listed leaves the phase unchanged)::

    WAITING     --tick, quorum joined + grace-->       COLLECTING  (announce)
    WAITING     --adopt, the predecessor's attempt-->  COLLECTING  (a failover: no announcement)
    COLLECTING  --all reported / deadline, quorum-->   COLLECTING  (commit; announce r+1)
    COLLECTING  --... last round committed-->          FINISHED    (commit)
    COLLECTING  --deadline, no quorum-->               COLLECTING  (discard; announce again)
    COLLECTING  --... roster fell below quorum-->      WAITING     (discard)
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Collection
from typing import TypedDict, Unpack

import numpy as np

from pcp_p2p.core.cid import check_cid, cid_of
from pcp_p2p.core.errors import (
    ConfigError,
    HashMismatch,
    LocalError,
    PcpError,
    PeerGone,
    QuorumError,
    RejectedUpdate,
    StaleMessage,
    VerificationError,
)
from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.algorithm import data as data_mod
from pcp_p2p.diloco.algorithm.checkpoint import (
    Checkpoint,
    checkpoint_theta_bytes,
    decode_checkpoint,
    encode_checkpoint,
    round_metrics,
)
from pcp_p2p.diloco.algorithm.outer import OuterState
from pcp_p2p.diloco.algorithm.params import Params, pack_tensors, unpack_tensors
from pcp_p2p.diloco.algorithm.update import step_update
from pcp_p2p.diloco.protocol.aggregate import RoundAggregator, RoundResult, max_steps_for_speed
from pcp_p2p.diloco.protocol.audit import AuditReport
from pcp_p2p.diloco.protocol.audit_desk import AuditDesk
from pcp_p2p.diloco.protocol.deadlines import ArrivalDeadline
from pcp_p2p.diloco.protocol.effects import (
    Banned,
    Committed,
    Discarded,
    Effect,
    FetchBlob,
    Finished,
    Rejected,
    Send,
    StoreBlob,
)
from pcp_p2p.diloco.protocol.election import StartFrom
from pcp_p2p.diloco.protocol.messages import (
    CommitRecord,
    DataAssignment,
    Join,
    Leave,
    RoundAnnouncement,
    Submission,
    sign,
    verify,
)
from pcp_p2p.diloco.protocol.partial_audit import PartialDesk, PartialVerdict
from pcp_p2p.diloco.protocol.partials import (
    PartialAggregate,
    announced_groups,
    check_partial,
    choose_aggregators,
    decode_group_delta,
)
from pcp_p2p.diloco.protocol.spec import RunSpec
from pcp_p2p.wire import Message

EVICT_AFTER_MISSES = 2
MAX_ROSTER = 1024
"""Workers on the roster at most: identities are free, and every one is assigned a shard
and named in each announcement (whose size is bounded)."""
SCORE_ABSOLUTE = 4.0
"""A submission scoring worse than θ_r by more than this many ``score_tolerance`` is refused
on arrival; within that, it must not be worse than the round's median by more than one."""


class Phase(enum.Enum):
    WAITING = "waiting"
    COLLECTING = "collecting"
    FINISHED = "finished"


TRANSITIONS: dict[Phase, set[Phase]] = {
    Phase.WAITING: {Phase.WAITING, Phase.COLLECTING},
    Phase.COLLECTING: {Phase.COLLECTING, Phase.WAITING, Phase.FINISHED},
    Phase.FINISHED: {Phase.FINISHED},
}


class ShepherdOptions(TypedDict, total=False):
    """The optional arguments of :class:`Shepherd` (what :meth:`Shepherd.from_checkpoint` passes on)."""

    artifacts: dict[str, str] | None
    evaluate: Callable[[Params], float] | None
    end_round: int | None
    dataset_cid: str
    admit: Callable[[str], str | None] | None
    score: Callable[[Params], float] | None
    val_loss: float | None
    audits: AuditDesk | None
    direct: Callable[[], Collection[str]] | None


class Shepherd:
    """Runs the rounds of one run for one term. Feed it inputs; carry out its effects."""

    def __init__(
        self,
        *,
        spec: RunSpec,
        run_id: str,
        identity: Identity,
        term: int,
        state: OuterState,
        artifacts: dict[str, str] | None = None,
        evaluate: Callable[[Params], float] | None = None,
        end_round: int | None = None,
        dataset_cid: str = "",
        admit: Callable[[str], str | None] | None = None,
        score: Callable[[Params], float] | None = None,
        val_loss: float | None = None,
        audits: AuditDesk | None = None,
        direct: Callable[[], Collection[str]] | None = None,
    ) -> None:
        """``evaluate`` (optional, pure): validation loss of a θ, put in commit records
        and used by the val-jump guard (``aggregation.val_jump``).

        ``score`` (optional, pure, cheap): loss of a θ on a small held-out batch.
        With it each submission is scored as the θ its worker claims to hold,
        θ_r − Δ_k: refused on arrival if that is worse than θ_r by more than
        ``SCORE_ABSOLUTE`` × ``aggregation.score_tolerance`` nats, and at the
        commit if worse than the higher of θ_r and the round's median submission
        by more than the tolerance (:meth:`_score_outliers`).

        ``val_loss`` (optional): θ's validation loss as the last commit recorded
        it (:meth:`from_checkpoint` takes it from the checkpoint's metrics); if
        unknown and ``evaluate`` is set, θ is evaluated once at the first commit.

        ``end_round`` (optional): the term ends by rotation once this many rounds
        are committed — the shepherd commits round ``end_round - 1`` and then
        announces nothing more (``handed_over``); the next term's holder goes on.

        ``admit`` (optional, pure): None if a peer may take part in the run, else
        the reason it may not (:meth:`~pcp_p2p.diloco.protocol.admission.Admission.why_not`:
        the run's allowlist and this node's bans). Asked on every join and every
        submission, so a peer removed or banned mid-run is refused from then on.
        None admits every peer that signs its messages.

        ``audits`` (optional): the term's :class:`~pcp_p2p.diloco.protocol.audit_desk.AuditDesk`.
        With it every submission must commit to its inner states (and start from an
        allowed one), each commit draws the audited submissions, and ``AuditReport``
        inputs may end in a ``Banned`` effect (the worker also leaves the roster).

        ``direct`` (optional): the members that can be dialled without a relay, asked once
        per announcement when the spec turns aggregators on: they are drawn first
        (:func:`~pcp_p2p.diloco.protocol.partials.choose_aggregators`). None: every member alike.
        """
        self.spec = spec.validate()
        self.admit = admit
        self.audits = audits
        self.direct = direct
        self.run_id = run_id
        self.identity = identity
        self.term = term
        self.state = state
        self.artifacts = dict(artifacts or {})
        self.dataset_cid = dataset_cid  # the tokenised dataset blob workers train on ("" = their local copy)
        stray = set(self.artifacts) - set(spec.targets)
        if stray:
            raise ConfigError(f"artifacts for targets the run spec does not allow: {sorted(stray)}")
        self.evaluate = evaluate
        self.score = score
        self.val_loss = val_loss  # of the current θ (the previous commit's), for the val-jump guard
        self._base_score: tuple[str, float] | None = None  # (θ CID, score(θ)), once per θ
        self._guard_fails = 0  # attempts of this round the val-jump guard discarded
        self.phase = Phase.WAITING if state.round < spec.round.rounds else Phase.FINISHED
        self.roster: dict[str, Join] = {}
        self.misses: dict[str, int] = {}  # assigned attempts missed since the last contribution
        # Each attempt's deadline follows the arrivals seen (median + k·MAD per worker), inside
        # [time_budget_s + slack, round.deadline_s]: see pcp_p2p.diloco.protocol.deadlines.
        self.deadlines = ArrivalDeadline(spec.round.time_budget_s, spec.round.deadline_s)
        self.announced_at = 0.0
        self.attempt = 0
        self.round_agg: RoundAggregator | None = None
        self.pending: dict[str, list[Submission]] = {}  # Δ blob CID -> submissions naming it
        # partial aggregates whose Δ is being fetched: its CID -> (the partial, its checked submissions)
        self.pending_partials: dict[str, tuple[PartialAggregate, tuple[Submission, ...]]] = {}
        self.partials_in: set[str] = set()  # aggregators whose partial this attempt took (one each)
        self._group_map: tuple[RoundAnnouncement, dict[str, str]] | None = None
        self.taken: dict[str, PartialAggregate] = {}  # aggregator -> its partial this attempt took
        self.partials_combined = 0  # partial aggregates in this term's commits
        g = self.spec.aggregation
        # another member replays a drawn share of the partials (pcp_p2p.diloco.protocol.partial_audit)
        self.partial_audits = (PartialDesk(self.spec, run_id, identity)
                               if g.aggregators > 0 and g.partial_audit_rate > 0 else None)
        self.theta_bytes = pack_tensors(state.theta, "fp32")
        self.theta_cid = state.theta_cid
        self.commits: list[CommitRecord] = []
        self.quorum_since: float | None = None
        self.end_round = end_round
        self.handed_over = end_round is not None and state.round >= end_round
        self.adopted: RoundAnnouncement | None = None  # the predecessor's attempt, taken over (adopt)
        self.close_at: float | None = None  # the adopted attempt's deadline (its own may have passed)

    @classmethod
    def from_checkpoint(
        cls, *, spec: RunSpec, run_id: str, identity: Identity, term: int, checkpoint: bytes,
        **kw: Unpack[ShepherdOptions],
    ) -> Shepherd:
        """A shepherd for ``term`` continuing from a checkpoint blob (failover, rotation)."""
        ckpt = decode_checkpoint(checkpoint)
        if ckpt.run_id != run_id:
            raise VerificationError(f"checkpoint belongs to run {ckpt.run_id:.20}")
        if term < ckpt.term:
            raise StaleMessage(f"term {term} is older than the checkpoint's term {ckpt.term}")
        kw.setdefault("val_loss", ckpt.metrics.get("val_loss"))  # the val-jump guard's yardstick
        return cls(spec=spec, run_id=run_id, identity=identity, term=term, state=ckpt.state, **kw)

    @classmethod
    def from_start(
        cls, point: StartFrom, blob: bytes, *, spec: RunSpec, run_id: str, identity: Identity, term: int,
        **kw: Unpack[ShepherdOptions],
    ) -> Shepherd:
        """A shepherd for ``term`` from one of its lease's starting states
        (:func:`~pcp_p2p.diloco.protocol.election.start_candidates`) and that state's blob."""
        if point.checkpoint:
            return cls.from_checkpoint(spec=spec, run_id=run_id, identity=identity, term=term, checkpoint=blob, **kw)
        state = OuterState.initial(unpack_tensors(blob), round=point.round)
        return cls(spec=spec, run_id=run_id, identity=identity, term=term, state=state, **kw)

    # --- inputs ------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    @property
    def join_grace_s(self) -> float:
        """How long to wait for more joiners once a quorum has joined (first round, or after a stall)."""
        return min(10.0, 0.1 * self.spec.round.deadline_s)

    @property
    def deadline(self) -> float | None:
        """When the attempt in flight closes (``None``: no attempt is open)."""
        if self.phase is not Phase.COLLECTING or self.round_agg is None:
            return None
        return self.close_at if self.close_at is not None else self.round_agg.announcement.deadline

    @property
    def next_wakeup(self) -> float | None:
        """The round's next deadline, or an audit request due to be sent again, whichever is first."""
        wake = self._round_wakeup
        resend = self.audits.next_wakeup if self.audits is not None else None
        return resend if wake is None or (resend is not None and resend < wake) else wake

    @property
    def _round_wakeup(self) -> float | None:
        if self.phase is Phase.COLLECTING and self.round_agg is not None:
            return self.deadline
        if self.phase is Phase.WAITING and self.quorum_since is not None:
            return self.quorum_since + self.join_grace_s
        return None

    def receive(self, msg: Message, now: float) -> list[Effect]:
        """Dispatch a decoded message by type."""
        if isinstance(msg, Join):
            return self.on_join(msg, now)
        if isinstance(msg, Submission):
            return self.on_submission(msg, now)
        if isinstance(msg, AuditReport):
            return self.on_audit_report(msg, now)
        if isinstance(msg, Leave):
            return self.on_leave(msg, now)
        if isinstance(msg, PartialAggregate):
            return self.on_partial(msg, now)
        if isinstance(msg, PartialVerdict):
            return self.on_partial_verdict(msg, now)
        return [Rejected(None, RejectedUpdate(f"a shepherd does not take {type(msg).__name__}"))]

    def adopt(self, ann: RoundAnnouncement, now: float, gone: Collection[str] = ()) -> list[Effect]:
        """Take over ``ann``, the attempt in flight of the term before this one (failover).

        Only right after set-up (no round announced yet) and only for the round
        this term starts with, from the same θ; anything else is ignored (``[]``),
        and the term announces its first round as usual. The caller has checked
        that ``ann`` was signed by the holder of its term. ``gone``: assigned
        workers that will not report (the dead shepherd's own worker): decided at
        once, so the attempt closes as soon as the others have reported. It closes
        at its announcement's deadline, but no sooner than one ``time_budget_s``
        from now (the workers must first see this term's lease, which each takes
        only once its own silence agrees, and send their submissions again) and no
        later than two: a worker that got the announcement has trained by then,
        and one still missing never got it (the shepherd died while announcing) and
        must not hold the round up to the announcement's full deadline.
        """
        if (self.phase is not Phase.WAITING or self.handed_over or self.commits or ann.run_id != self.run_id
                or ann.term >= self.term or ann.round != self.state.round or ann.theta_cid != self.theta_cid):
            return []
        self.attempt = ann.attempt
        self.adopted = ann
        budget = self.spec.round.time_budget_s
        self.close_at = min(max(ann.deadline, now + budget), now + 2 * budget)
        agg = self.round_agg = RoundAggregator(self.spec, ann, self.state.theta)
        self._clear_pending()
        self._set_phase(Phase.COLLECTING)
        for w in sorted(set(gone) & agg.assigned):
            agg.refuse(w, PeerGone(f"{w:.16}… led the term that ended"))
        return self._maybe_close(now) if agg.reported else []

    def on_audit_report(self, report: AuditReport, now: float) -> list[Effect]:
        if self.audits is None:
            return [Rejected(report.auditor, StaleMessage("this shepherd asked for no audits"))]
        try:
            effects = self.audits.on_report(report, now)
        except PcpError as exc:
            return [Rejected(report.auditor, exc)]
        return self._banned(effects)

    def _not_admitted(self, peer: str) -> RejectedUpdate | None:
        """The refusal for a peer the run does not admit (it also leaves the roster), or None.

        Checked before any signature: a refusal that depends only on the peer id
        costs a flood of strangers' messages nothing to refuse, and a forged
        message naming a non-admitted peer changes nothing that peer had.
        """
        reason = self.admit(peer) if self.admit is not None else None
        if reason is None:
            return None
        self.roster.pop(peer, None)
        self.misses.pop(peer, None)
        return RejectedUpdate(f"{peer:.16}… is not admitted to this run: {reason}")

    def on_join(self, msg: Join, now: float) -> list[Effect]:
        try:
            if msg.run_id != self.run_id:
                raise RejectedUpdate(f"join for another run {msg.run_id:.20}")
            refusal = self._not_admitted(msg.worker)
            if refusal is not None:
                raise refusal
            verify(msg, msg.worker)
            if self.artifacts and msg.target not in self.artifacts:
                raise RejectedUpdate(f"no artifact for target {msg.target!r:.40} in this run")
            if msg.worker not in self.roster and len(self.roster) >= MAX_ROSTER:
                self._free_a_seat()
        except PcpError as exc:
            return [Rejected(msg.worker, exc)]
        self.roster[msg.worker] = msg
        self.misses[msg.worker] = 0
        if self.phase is Phase.WAITING and len(self.roster) >= self.spec.round.min_quorum and not self.handed_over:
            if self.quorum_since is None:
                self.quorum_since = now
        return []

    def on_leave(self, msg: Leave, now: float) -> list[Effect]:
        """A worker announced that it leaves (a graceful stop): nobody waits for it any more.

        It leaves the roster (no seat in the next announcement), and in the round
        in flight it counts as decided, so the round closes as soon as every other
        assigned worker has reported instead of waiting out its deadline for a
        submission that will never come. A Δ it already submitted still counts
        (accepted, or still being fetched: that fetch decides it). If the quorum is
        out of reach without the leaver, the attempt is discarded at once. The caller
        checks freshness and replays (:class:`~pcp_p2p.diloco.protocol.departures.Departures`);
        the signature is checked here, so no one can announce another's departure.
        """
        try:
            if msg.run_id != self.run_id:
                raise RejectedUpdate(f"departure from another run {msg.run_id:.20}")
            verify(msg, msg.peer)
        except PcpError as exc:
            return [Rejected(msg.peer, exc)]
        self.roster.pop(msg.peer, None)
        self.misses.pop(msg.peer, None)
        agg = self.round_agg
        if self.phase is not Phase.COLLECTING or agg is None or msg.peer not in agg.assigned - agg.reported:
            return []
        if any(sub.worker == msg.peer for subs in self.pending.values() for sub in subs) or any(
                sub.worker == msg.peer for _, subs in self.pending_partials.values() for sub in subs):
            return []  # its Δ is on its way here
        agg.refuse(msg.peer, PeerGone(f"{msg.peer:.16}… left the run"))
        if agg.workers_in(agg.accepted) + len(agg.assigned - agg.reported) < self.spec.round.min_quorum:
            return self._discard(now, " (workers left; the quorum is out of reach)")
        return self._maybe_close(now)

    def _free_a_seat(self) -> None:
        """The roster is full: the member that missed the most rounds makes room; if every
        member is contributing, the join is refused. So identities that join and never
        submit cannot lock honest newcomers out, and contributors never lose their seat."""
        if not any(self.misses.values()):  # nobody missed a round: refused in O(R) in C, not a sort
            # per join (a full roster hears every seatless worker's join again each deadline)
            raise RejectedUpdate(f"the roster is full ({MAX_ROSTER} workers, all contributing)")
        # the first of the sorted roster among those that missed the most (no sort: O(R))
        most = max(self.misses.get(w, 0) for w in self.roster)
        idle = min(w for w in self.roster if self.misses.get(w, 0) == most)
        if most == 0:
            raise RejectedUpdate(f"the roster is full ({MAX_ROSTER} workers, all contributing)")
        self.roster.pop(idle)
        self.misses.pop(idle, None)

    def _clear_pending(self) -> None:
        self.pending.clear()
        self.pending_partials.clear()
        self.partials_in.clear()
        self.taken.clear()

    def on_submission(self, sub: Submission, now: float) -> list[Effect]:
        agg = self.round_agg
        refusal = self._not_admitted(sub.worker)
        if refusal is not None:
            if agg is not None and self._is_current(sub) and sub.worker in agg.assigned - set(agg.accepted):
                return self._refuse(sub, refusal, now)  # decided: the round need not wait for it
            return [Rejected(sub.worker, refusal)]
        if sub.term < self.term and not (agg is not None and self._is_current(sub)):
            return []  # its attempt, offered again after a failover, was not taken over here: no fault
        if self.phase is not Phase.COLLECTING or agg is None:
            return [Rejected(sub.worker, StaleMessage("no round is open"))]
        try:
            if not agg.check_header(sub):
                return []  # the same submission again
        except PcpError as exc:
            return [Rejected(sub.worker, exc)]
        if self.adopted is None and sub.worker in agg.announcement.aggregators:
            return self._refuse(sub, RejectedUpdate(f"{sub.worker:.16}… aggregates this round: its Δ comes "
                                                    "in its partial aggregate"), now)
        if self.audits is not None:
            try:
                self.audits.check(sub)  # it must commit to an inner state it may start from
            except PcpError as exc:
                return self._refuse(sub, exc, now)
        if sub.delta_inline is not None:
            return self._admit(sub, sub.delta_inline, now)
        assert sub.delta_cid is not None
        waiting = self.pending.setdefault(sub.delta_cid, [])
        waiting.append(sub)
        return [FetchBlob(sub.delta_cid, hint=sub.worker)] if len(waiting) == 1 else []

    def on_partial(self, p: PartialAggregate, now: float) -> list[Effect]:
        """An aggregator's partial aggregate: its authority chain first, then its Δ is fetched.

        Refused whole (the aggregator's fault; its workers are decided when the round closes
        without them, and send their next Δ here): a partial for an attempt this term took over
        (its workers submit here), from a signer that is not admitted or not one of the round's
        aggregators, failing :func:`~pcp_p2p.diloco.protocol.partials.check_partial`, a second
        partial from the same aggregator, or listing a worker that is not admitted, whose Δ came
        here itself, or whose submission a check here refuses.
        """
        agg = self.round_agg
        if self.phase is not Phase.COLLECTING or agg is None:
            return [Rejected(p.aggregator, StaleMessage("no round is open"))]
        ann = agg.announcement
        try:
            if self.adopted is not None:
                raise StaleMessage("this attempt was taken over: its workers submit to the shepherd")
            refusal = self._not_admitted(p.aggregator)
            if refusal is not None:
                raise refusal
            subs = check_partial(p, ann, ann.aggregators, self._groups(ann))
            if p.aggregator in self.partials_in:
                raise RejectedUpdate(f"{p.aggregator:.16}… sent a second partial aggregate")
            for sub in subs:
                refusal = self._not_admitted(sub.worker)
                if refusal is not None:
                    raise RejectedUpdate(f"the partial lists a worker that is not admitted: {refusal}")
                if agg.seen(sub.worker):
                    raise RejectedUpdate(f"the partial lists {sub.worker:.16}…, whose Δ came here itself")
            for sub in subs:
                agg.check_header(sub)
                if self.audits is not None:
                    self.audits.check(sub)
        except PcpError as exc:
            return [Rejected(p.aggregator, exc)]
        self.partials_in.add(p.aggregator)
        self.pending_partials[p.delta_cid] = (p, subs)
        return [FetchBlob(p.delta_cid, hint=p.aggregator)]

    def _groups(self, ann: RoundAnnouncement) -> dict[str, str]:
        """The attempt's worker -> aggregator map, computed once per announcement."""
        if self._group_map is None or self._group_map[0] is not ann:
            self._group_map = (ann, announced_groups(ann))
        return self._group_map[1]

    def _partial_in(self, cid: str, data: bytes | None, error: PcpError | None, now: float) -> list[Effect]:
        """A partial's Δ arrived (``data``) or could not be fetched (``error``)."""
        p, subs = self.pending_partials.pop(cid)
        agg = self.round_agg
        if agg is None or not self._is_current(subs[0]):
            return []
        try:
            if error is not None:
                raise error
            assert data is not None
            check_cid(cid, data)
            delta = decode_group_delta(data, self.state.theta, self.spec, subs)
            score = self._score(p.aggregator, delta)
        except PcpError as exc:
            for sub in subs:
                agg.refuse(sub.worker, exc)
            return [Rejected(p.aggregator, exc), *self._maybe_close(now)]
        group = [w for w, a in self._groups(agg.announcement).items() if a == p.aggregator]
        agg.admit_group(p.aggregator, subs, delta, p.tokens, p.mean_loss, score, group)
        self.taken[p.aggregator] = p
        if self.adopted is None:
            for sub in subs:
                self.deadlines.observe(sub.worker, now - self.announced_at)
        return self._maybe_close(now)

    def on_partial_verdict(self, v: PartialVerdict, now: float) -> list[Effect]:
        """An auditor's verdict on a partial this term asked it to replay."""
        if self.partial_audits is None:
            return [Rejected(v.auditor, StaleMessage("this shepherd asked for no partial audits"))]
        try:
            effects = self.partial_audits.on_verdict(v, now)
        except PcpError as exc:
            return [Rejected(v.auditor, exc)]
        return effects

    def _banned(self, effects: list[Effect]) -> list[Effect]:
        for e in effects:
            if isinstance(e, Banned):
                self.roster.pop(e.peer, None)
                self.misses.pop(e.peer, None)
        return effects

    def on_blob(self, cid: str, data: bytes, now: float) -> list[Effect]:
        """A Δ blob asked for with ``FetchBlob`` arrived."""
        if cid in self.pending_partials:
            return self._partial_in(cid, data, None, now)
        if self.partial_audits is not None and self.partial_audits.wants(cid):
            return self._banned(self.partial_audits.on_blob(cid, data, None, now))
        subs = self.pending.pop(cid, [])
        effects: list[Effect] = []
        try:
            check_cid(cid, data)
        except HashMismatch as exc:
            for sub in subs:
                if self._is_current(sub):
                    effects += self._refuse(sub, exc, now)
            return effects
        for sub in subs:  # (two workers may send byte-identical Δs)
            if self._is_current(sub):  # the first may have closed the round
                effects += self._admit(sub, data, now)
        return effects

    def on_blob_failed(self, cid: str, error: PcpError, now: float) -> list[Effect]:
        if cid in self.pending_partials:
            return self._partial_in(cid, None, error, now)
        if self.partial_audits is not None and self.partial_audits.wants(cid):
            return self.partial_audits.on_blob(cid, None, error, now)
        effects: list[Effect] = []
        for sub in self.pending.pop(cid, []):
            if self._is_current(sub):
                effects += self._refuse(sub, error, now)
        return effects

    def tick(self, now: float) -> list[Effect]:
        resent = self.audits.tick(now) if self.audits is not None else []
        return resent + self._round_tick(now)

    def _round_tick(self, now: float) -> list[Effect]:
        agg = self.round_agg
        if self.phase is Phase.WAITING:
            wake = self._round_wakeup
            if (wake is not None and now >= wake and len(self.roster) >= self.spec.round.min_quorum
                    and not self.handed_over):
                return self._announce(now)
            return []
        deadline = self.deadline
        if agg is None or deadline is None or now < deadline:
            return []
        if agg.workers_in(agg.accepted) >= self.spec.round.min_quorum:
            return self._commit(now)
        return self._discard(now)

    # --- internals -----------------------------------------------------------

    def _is_current(self, sub: Submission) -> bool:
        """Whether ``sub`` (already header-checked) belongs to the attempt now open."""
        agg = self.round_agg
        if self.phase is not Phase.COLLECTING or agg is None:
            return False
        a = agg.announcement
        return (sub.term, sub.round, sub.attempt) == (a.term, a.round, a.attempt)

    def _set_phase(self, phase: Phase) -> None:
        if phase not in TRANSITIONS[self.phase]:
            raise LocalError(f"shepherd: illegal transition {self.phase} -> {phase}")
        self.phase = phase

    def _admit(self, sub: Submission, payload: bytes, now: float) -> list[Effect]:
        agg = self.round_agg
        assert agg is not None
        try:
            delta = agg.check_delta(sub, payload)
            score = self._score(sub.worker, delta)
        except PcpError as exc:
            return self._refuse(sub, exc, now)
        agg.admit(sub, delta, score)
        if self.adopted is None:  # (an adopted attempt's arrivals say nothing of the workers' speed)
            self.deadlines.observe(sub.worker, now - self.announced_at)
        return self._maybe_close(now)

    def _score(self, who: str, delta: Params) -> float | None:
        """Held-out loss of θ_r − Δ (the θ the worker claims to hold); raises if too much worse.

        Why θ_r − Δ and not θ after the whole round: it judges this worker alone,
        and an honest worker's own step should not hurt held-out loss; a random,
        sign-flipped or blown-up Δ does, by far more than the tolerance.
        """
        tol = self.spec.aggregation.score_tolerance
        if self.score is None or tol < 0:
            return None
        if self._base_score is None or self._base_score[0] != self.theta_cid:
            self._base_score = (self.theta_cid, float(self.score(self.state.theta)))
        base = self._base_score[1]
        theta = self.state.theta
        s = float(self.score({k: theta[k] - delta[k] for k in theta}))
        if not s <= base + SCORE_ABSOLUTE * tol:  # NaN too
            raise RejectedUpdate(
                f"{who:.16}…: held-out loss of θ−Δ is {s:.4g}, θ's is {base:.4g} "
                f"({s - base:+.3g} nats, more than {SCORE_ABSOLUTE:g} x the tolerance {tol:g})"
            )
        return s

    def _score_outliers(self, agg: RoundAggregator) -> dict[str, PcpError]:
        """Submissions that score worse than the round's median submission by more than the tolerance.

        Why the median: after its inner steps an honest worker's θ_k often scores
        a little *worse* than θ_r on held-out data (it fits its own shard; 0.05–0.09
        nats on the tiny GPT after 50 steps), by about as much as the other honest
        workers. A bound at θ_r's score tight enough to catch a sign-flipped Δ then
        refuses honest workers; the round's median submission moves with them, so
        the bound is the higher of the two (never tighter than at θ_r). Needs three
        scored submissions (the median of two is their mean).
        """
        tol = self.spec.aggregation.score_tolerance
        scores = {w: a.score for w, a in agg.accepted.items() if a.score is not None}
        if tol < 0 or not scores or self._base_score is None:
            return {}
        base = self._base_score[1]
        # the median only loosens the bound (honest workers that all overfit a little), never tightens it
        ref = max(base, float(np.median(list(scores.values())))) if len(scores) >= 3 else base
        return {w: RejectedUpdate(f"{w:.16}…: held-out loss of θ−Δ is {s:.4g}; θ's is {base:.4g}, the round's "
                                  f"reference {ref:.4g} (tolerance {tol:g} nats)")
                for w, s in sorted(scores.items()) if s > ref + tol}

    def _refuse(self, sub: Submission, exc: PcpError, now: float) -> list[Effect]:
        assert self.round_agg is not None
        self.round_agg.refuse(sub.worker, exc)
        return [Rejected(sub.worker, exc), *self._maybe_close(now)]

    def _maybe_close(self, now: float) -> list[Effect]:
        """Close early once every assigned worker has been decided."""
        agg = self.round_agg
        assert agg is not None
        if agg.reported != agg.assigned:
            return []
        if agg.workers_in(agg.accepted) >= self.spec.round.min_quorum:
            return self._commit(now)
        return self._discard(now)

    def _announce(self, now: float) -> list[Effect]:
        workers = sorted(self.roster)
        r = self.state.round
        assignments = tuple(
            DataAssignment(
                worker=w,
                shard=i,
                num_shards=len(workers),
                seed=data_mod.assignment_seed(self.run_id, r, self.attempt, i),
                max_steps=max_steps_for_speed(self.spec, self.roster[w].tokens_per_s),
            )
            for i, w in enumerate(workers)
        )
        ann = sign(
            RoundAnnouncement(
                aggregators=self._aggregators(workers),
                run_id=self.run_id,
                term=self.term,
                round=r,
                attempt=self.attempt,
                theta_cid=self.theta_cid,
                artifacts=self.artifacts,
                time_budget_s=self.spec.round.time_budget_s,
                deadline=now + self.deadlines.deadline_s(workers),
                assignments=assignments,
                shepherd=self.peer_id,
                dataset_cid=self.dataset_cid,
            ),
            self.identity,
        )
        self.announced_at = now
        self.round_agg = RoundAggregator(self.spec, ann, self.state.theta)
        self._clear_pending()
        self._set_phase(Phase.COLLECTING)
        return [StoreBlob(self.theta_cid, self.theta_bytes), *(Send(w, ann) for w in workers)]

    def _aggregators(self, workers: list[str]) -> tuple[str, ...]:
        """This attempt's aggregators: () unless the spec turns them on and the roster is above
        ``aggregate_above``; never the shepherd (its own Δ is here already); the workers this
        term's last commit counted first."""
        g = self.spec.aggregation
        if g.aggregators <= 0 or len(workers) <= g.aggregate_above:
            return ()
        direct = self.direct() if self.direct is not None else workers
        # (a fresh key in an open run is not trusted with a group before it has contributed once)
        proven = self.commits[-1].participants if self.commits else ()
        return choose_aggregators([w for w in workers if w != self.peer_id], set(direct), g.aggregators,
                                  self.theta_cid, proven)

    def _count_misses(self, accepted: set[str]) -> None:
        agg = self.round_agg
        assert agg is not None
        reported = agg.reported  # (a set built per call: once, not once per worker)
        for w in agg.assigned:
            if w not in self.roster:  # left, evicted or banned meanwhile: nothing to count
                self.misses.pop(w, None)
            elif w in accepted:
                self.misses[w] = 0
            else:
                if w not in reported and self.adopted is None:  # silent until the deadline (a refused Δ did arrive)
                    self.deadlines.missed(w, agg.announcement.deadline - self.announced_at)
                self.misses[w] = self.misses.get(w, 0) + 1
                if self.misses[w] >= EVICT_AFTER_MISSES:
                    self.roster.pop(w, None)
                    self.misses.pop(w, None)  # forgotten with it: strangers' identities must not pile up
        self.deadlines.forget(self.roster)

    def _discard(self, now: float, why: str = "") -> list[Effect]:
        agg = self.round_agg
        assert agg is not None
        err = QuorumError(
            f"round {self.state.round + 1} attempt {self.attempt}: {agg.workers_in(agg.accepted)} accepted, "
            f"quorum {self.spec.round.min_quorum}{why}"
        )
        effects: list[Effect] = [Discarded(self.state.round, self.attempt, err)]
        self._count_misses(set(agg.participants()))
        self.attempt += 1
        self.round_agg = None
        self.adopted = self.close_at = None
        if len(self.roster) >= self.spec.round.min_quorum:
            return effects + self._announce(now)
        self._set_phase(Phase.WAITING)
        self.quorum_since = None
        return effects

    def _val_limit(self) -> float:
        """The highest val loss a commit may have: ``last·(1+val_jump)^(1+f)``.

        ``f`` counts this round's attempts the guard already discarded. Near a
        loss floor honest noise alone can exceed a fixed limit on every attempt;
        loosening it per failed attempt means that cannot stall the run, while
        each attempt still drops the suspects first.
        """
        assert self.val_loss is not None
        return self.val_loss * (1 + self.spec.aggregation.val_jump) ** (1 + self._guard_fails)

    def _suspect(self, agg: RoundAggregator, kept: Collection[str], norms: dict[str, float]) -> str:
        """The submission to drop first: worst held-out score, else largest norm (ties: by id)."""
        return max(
            sorted(kept),
            key=lambda w: (agg.accepted[w].score if agg.accepted[w].score is not None else -math.inf, norms[w]),
        )

    def _candidate(self) -> tuple[tuple[RoundResult, OuterState, float | None, bytes] | None, list[Effect]]:
        """The round's outcome: combine, step, evaluate; drop suspects while val loss jumps.

        Returns ``((result, new state, val loss, update blob) or None, Rejected effects)``;
        the state is the last one stepped by the update blob (the outer step as
        ``outer.update_codec`` carries it, :mod:`pcp_p2p.diloco.algorithm.update`), so a node
        holding the last checkpoint rebuilds the next one from the blob bit for bit.
        None when fewer than ``min_quorum`` remain after the norm screen and the
        val-jump guard. Workers refused here are moved from ``accepted`` to
        ``refused``, so they are not participants and count as missing.
        """
        agg = self.round_agg
        assert agg is not None
        g, quorum = self.spec.aggregation, self.spec.round.min_quorum
        guard = self.evaluate is not None and g.val_jump > 0
        if guard and self.val_loss is None:
            assert self.evaluate is not None
            self.val_loss = float(self.evaluate(self.state.theta))
        # a worker banned (or removed by the owner) after its Δ was accepted is not combined
        dropped: dict[str, PcpError] = {
            w: refusal for w in sorted(agg.accepted) if (refusal := self._not_admitted(w)) is not None
        }
        dropped.update(self._score_outliers(agg))
        screened: dict[str, RejectedUpdate] = {}
        outcome: tuple[RoundResult, OuterState, float | None, bytes] | None = None
        guard_dropped = False  # only the guard's own drops loosen its limit for the next attempt
        outer = self.spec.outer
        while agg.workers_in(agg.accepted) - agg.workers_in(dropped) >= quorum:
            result = agg.combine(exclude=dropped)
            screened = result.screened
            if agg.workers_in(result.weights) < quorum:
                break
            update, new_state = step_update(self.state, result.delta, outer.update_codec, lr=outer.lr,
                                            momentum=outer.momentum)
            val_loss = float(self.evaluate(new_state.theta)) if self.evaluate is not None else None
            if not guard or val_loss is None or self.val_loss is None or val_loss <= self._val_limit():
                outcome = (result, new_state, val_loss, update)
                break
            suspect = self._suspect(agg, result.weights, result.norms)
            guard_dropped = True
            dropped[suspect] = RejectedUpdate(
                f"{suspect:.16}… dropped from round {self.state.round + 1}: with it val loss {val_loss:.4g} "
                f"exceeds the limit {self._val_limit():.4g} (last commit {self.val_loss:.4g})"
            )
        if outcome is None and guard_dropped:
            self._guard_fails += 1
        refused: dict[str, PcpError] = {**screened, **dropped}
        for w, err in sorted(refused.items()):
            agg.accepted.pop(w, None)
            agg.refuse(w, err)
        return outcome, [Rejected(w, err) for w, err in sorted(refused.items())]

    def _commit(self, now: float) -> list[Effect]:
        agg = self.round_agg
        assert agg is not None
        outcome, rejected = self._candidate()
        if outcome is None:
            return rejected + self._discard(now, " after the norm screen and the val-jump guard")
        result, new_state, val_loss, update = outcome
        tokens, mean_loss = result.tokens, result.mean_loss
        prev_cid = self.theta_cid
        metrics = round_metrics(tokens, mean_loss, val_loss)
        ckpt_bytes, theta_cid = encode_checkpoint(Checkpoint(self.run_id, self.term, new_state, metrics),
                                                  with_momentum=self.spec.outer.momentum != 0)
        ckpt_cid, update_cid = cid_of(ckpt_bytes), cid_of(update)
        participants = agg.participants()
        record = sign(
            CommitRecord(
                run_id=self.run_id,
                term=self.term,
                round=self.state.round,
                attempt=self.attempt,
                prev_theta_cid=prev_cid,
                theta_cid=theta_cid,
                checkpoint_cid=ckpt_cid,
                participants=participants,
                tokens=tokens,
                mean_loss=mean_loss,
                val_loss=val_loss,
                shepherd=self.peer_id,
                update_cid=update_cid,
            ),
            self.identity,
        )
        # From here on the new state is the state: one assignment, never half.
        self._count_misses(set(participants))
        self.state = new_state
        self.val_loss = val_loss
        self._guard_fails = 0
        self.theta_bytes = checkpoint_theta_bytes(ckpt_bytes)  # the checkpoint's θ bundle is the θ blob
        self.theta_cid = theta_cid
        self.attempt = 0
        self.round_agg = None
        self.adopted = self.close_at = None
        self.commits.append(record)
        recipients = sorted(set(self.roster) | set(participants))
        effects: list[Effect] = [
            *rejected,
            StoreBlob(theta_cid, self.theta_bytes),
            StoreBlob(ckpt_cid, ckpt_bytes),
            StoreBlob(update_cid, update),
            Committed(record),
            *(Send(w, record) for w in recipients),
        ]
        if self.audits is not None:  # drawn with the new θ's CID, which no worker knew when it submitted
            effects += self.audits.on_commit(
                agg.announcement, {w: agg.submissions[w] for w in participants}, theta_cid,
                {w: j.target for w, j in self.roster.items()}, term=self.term, now=now,
            )
        self.partials_combined += len(agg.groups)
        if self.partial_audits is not None and agg.groups:  # (drawn with the new θ's CID too)
            effects += self.partial_audits.on_commit(
                agg.announcement, [self.taken[a] for a in agg.groups if a in self.taken], participants,
                agg.theta, theta_cid, self.term)
        if new_state.round >= self.spec.round.rounds:
            self._set_phase(Phase.FINISHED)
            return [*effects, Finished(new_state.round, theta_cid)]
        if self.end_round is not None and new_state.round >= self.end_round:
            self.handed_over = True  # rotation: the next term announces round end_round
        elif len(self.roster) >= self.spec.round.min_quorum:
            return effects + self._announce(now)
        self._set_phase(Phase.WAITING)
        self.quorum_since = None
        return effects

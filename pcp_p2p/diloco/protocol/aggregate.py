"""Admission and combination of pseudo-gradients for one round attempt.

The aggregator is the only place a worker's numbers touch the global state, so
it refuses anything it cannot vouch for, each with a typed error the shepherd
logs before the round goes on without that submission:

=====================================  ========================================
check                                  error
=====================================  ========================================
submission for another run             :class:`RejectedUpdate`
signature not by the named worker      :class:`BadSignature`
older term / round / attempt (replay)  :class:`StaleMessage`
newer term / round / attempt           :class:`RejectedUpdate`
trained from another θ than announced  :class:`StaleMessage`
worker not assigned in this attempt    :class:`RejectedUpdate`
second, different submission           :class:`RejectedUpdate`
tokens != steps·B·T, or steps above    :class:`RejectedUpdate`
the worker's speed-derived maximum
undecodable payload                    :class:`RejectedUpdate` (cause chained)
wrong tensor names or shapes           :class:`RejectedUpdate`
NaN or infinite values                 :class:`RejectedUpdate`
norm above the absolute bound          :class:`RejectedUpdate` (sanity cap)
held-out loss of θ−Δ worse than θ's    :class:`RejectedUpdate` (shepherd, when
by more than ``score_tolerance``       it has a ``score``)
norm above ``norm_vs_median`` x the    :class:`RejectedUpdate` (at combine time)
round's median norm
in a commit whose val loss jumps       :class:`RejectedUpdate` (shepherd drops
more than ``val_jump``                 the most suspect and recombines)
=====================================  ========================================

Absolute norm bound (a sanity cap only). An AdamW step moves a coordinate by
``lr·|m̂|/√v̂`` plus weight decay ``lr·wd·|θ|``. By Cauchy–Schwarz ``|m̂|/√v̂ ≤
c = (1−β1)/√(1−β2) / √(1−β1²/β2)`` (≈2.3 for β=(0.9, 0.99)), so after ``s``
steps an honest Δ has ``‖Δ‖ ≤ s·lr·(c·√P + wd·‖θ‖)``. The bound used is twice
that (int8 rounding, schedules that touch the peak rate), or
``round.max_delta_norm`` when the spec sets one. Anything above cannot have
come from the announced optimiser — but the bound is loose (tens of times ‖θ‖
on a small model), so what actually bounds a worker is relative to its peers.

Combining (:meth:`RoundAggregator.combine`, :mod:`~pcp_p2p.diloco.algorithm.robust`):
norm screen against the round's median, token weights capped at ``max_share``
(fast hardware that processed more tokens still counts for more, but no one
dominates), then the spec's rule — ``trimmed_mean`` by default,
``centered_clip``, or the plain weighted ``mean``.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

from pcp_p2p.core.errors import PcpError, RejectedUpdate, StaleMessage
from pcp_p2p.diloco.algorithm import robust
from pcp_p2p.diloco.algorithm.params import Params, codec_of, global_norm, num_params
from pcp_p2p.diloco.protocol.messages import DataAssignment, RoundAnnouncement, Submission, verify
from pcp_p2p.diloco.protocol.spec import RunSpec


def adam_step_bound(beta1: float, beta2: float) -> float:
    """Upper bound on ``|m̂/√v̂|`` per coordinate for Adam with these betas."""
    if beta1 * beta1 >= beta2:
        return 10.0  # unbounded in theory; a generous constant in practice
    return (1 - beta1) / math.sqrt(1 - beta2) / math.sqrt(1 - beta1 * beta1 / beta2) + 1.0


def delta_norm_bound(spec: RunSpec, theta: Params, steps: int) -> float:
    """The largest ‖Δ‖ an honest worker can produce in ``steps`` inner steps."""
    if spec.round.max_delta_norm > 0:
        return spec.round.max_delta_norm
    i = spec.inner
    c = adam_step_bound(i.beta1, i.beta2)
    per_step = i.lr * (c * math.sqrt(num_params(theta)) + i.weight_decay * global_norm(theta))
    return 2.0 * max(1, steps) * per_step


def max_steps_for_speed(spec: RunSpec, tokens_per_s: float) -> int:
    """Inner steps a worker of this measured speed may do in one round's time budget."""
    if not math.isfinite(tokens_per_s) or tokens_per_s <= 0:
        return 1
    by_speed = math.ceil(tokens_per_s * spec.round.time_budget_s * spec.round.token_slack / spec.tokens_per_step)
    return max(1, min(spec.round.max_inner_steps, by_speed))


def check_decoded(delta: Params, theta: Params, spec: RunSpec, steps: int) -> None:
    """A decoded Δ (a worker's, or a group's combine) has θ's tensors, names and shapes, only
    finite values, and a norm within what ``steps`` honest AdamW steps allow; else
    :class:`RejectedUpdate`, naming what is wrong."""
    if list(delta) != list(theta):
        raise RejectedUpdate("pseudo-gradient has other tensors than θ")
    for name, d in delta.items():
        if d.shape != theta[name].shape:
            raise RejectedUpdate(f"{name}: shape {d.shape}, θ has {theta[name].shape}")
        if not np.all(np.isfinite(d)):
            raise RejectedUpdate(f"{name}: NaN or infinite values")
    norm = global_norm(delta)
    bound = delta_norm_bound(spec, theta, steps)
    if not norm <= bound:
        raise RejectedUpdate(f"‖Δ‖ = {norm:.4g} above the bound {bound:.4g} for {steps} steps")


@dataclass
class Accepted:
    worker: str
    tokens: int
    losses: tuple[float, ...]
    delta: Params
    score: float | None = None  # held-out loss of θ − Δ, when the shepherd scores


@dataclass(frozen=True)
class RoundResult:
    """What :meth:`RoundAggregator.combine` made of a round's submissions."""

    delta: Params
    tokens: int  # claimed tokens of the workers combined (not capped: what was trained)
    mean_loss: float  # their final training loss, weighted like their Δs
    weights: dict[str, float]  # worker -> capped share of the combination
    screened: dict[str, RejectedUpdate]  # refused by the norm screen
    norms: dict[str, float]  # ‖Δ‖ of every submission offered


@dataclass
class RoundAggregator:
    """Collects the submissions of one announced round attempt."""

    spec: RunSpec
    announcement: RoundAnnouncement
    theta: Params
    accepted: dict[str, Accepted] = field(default_factory=dict)
    refused: dict[str, PcpError] = field(default_factory=dict)
    _seen: dict[str, bytes] = field(default_factory=dict)
    submissions: dict[str, Submission] = field(default_factory=dict)
    # accepted partial aggregates: aggregator -> the workers its group combined (the group's Δ is
    # ``accepted[aggregator]``; its workers' signed submissions are in ``submissions``)
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # assigned workers an accepted partial decided without combining them: its group's workers it
    # left out (their Δ missed the group) are not waited for, since they submit to it, not here
    closed_out: set[str] = field(default_factory=set)
    # the announcement's assignments by worker, indexed on first use: a lookup per
    # submission that scanned them made a round of R workers cost R² (R up to MAX_ROSTER)
    _by_worker: dict[str, DataAssignment] | None = field(default=None, init=False, repr=False)
    _assigned: frozenset[str] = field(default=frozenset(), init=False, repr=False)

    def _assignment(self, worker: str) -> DataAssignment | None:
        if self._by_worker is None:
            self._by_worker = {}
            for a in self.announcement.assignments:
                self._by_worker.setdefault(a.worker, a)  # the first, as ``assignment_for`` finds it
            self._assigned = frozenset(self._by_worker)
        return self._by_worker.get(worker)

    @property
    def assigned(self) -> frozenset[str]:
        if self._by_worker is None:
            self._assignment("")
        return self._assigned

    @property
    def reported(self) -> set[str]:
        """Assigned workers whose submission has been decided (accepted or refused): an accepted
        group decides its aggregator and every worker it combined."""
        done = set(self.accepted) | (set(self.refused) & self.assigned) | self.closed_out
        for members in self.groups.values():
            done.update(members)
        return done

    def participants(self) -> tuple[str, ...]:
        """The workers whose Δs the accepted entries carry (a group stands for its workers)."""
        out: set[str] = set()
        for key in self.accepted:
            out.update(self.groups.get(key, (key,)))
        return tuple(sorted(out))

    def workers_in(self, keys: Collection[str]) -> int:
        """How many workers the entries ``keys`` stand for (a group counts its workers): what a
        quorum counts, so a round of g partials is not g submissions."""
        return sum(len(self.groups.get(k, (k,))) for k in keys)

    def seen(self, worker: str) -> bool:
        """Whether a submission of ``worker`` passed :meth:`check_header` in this attempt."""
        return worker in self._seen

    def check_header(self, sub: Submission) -> bool:
        """Everything that can be checked without the payload.

        Returns False for an exact duplicate of an already admitted submission
        (idempotent: the network may deliver twice); raises for everything bad.
        """
        a = self.announcement
        if sub.run_id != a.run_id:
            raise RejectedUpdate(f"submission for another run {sub.run_id:.20}")
        verify(sub, sub.worker)
        tag, cur = (sub.term, sub.round, sub.attempt), (a.term, a.round, a.attempt)
        if tag < cur:
            raise StaleMessage(f"submission for term/round/attempt {tag}, current {cur}")
        if tag > cur:
            raise RejectedUpdate(f"submission for future term/round/attempt {tag}, current {cur}")
        if sub.base_theta_cid != a.theta_cid:
            raise StaleMessage("submission trained from another θ than announced")
        assignment = self._assignment(sub.worker)
        if assignment is None:
            raise RejectedUpdate(f"{sub.worker:.16}… is not assigned in this round")
        if sub.worker in self._seen:
            if self._seen[sub.worker] == sub.signature:
                return False
            raise RejectedUpdate(f"{sub.worker:.16}… submitted twice with different content")
        bt = self.spec.tokens_per_step
        if sub.steps < 1 or sub.tokens != sub.steps * bt:
            raise RejectedUpdate(f"tokens {sub.tokens} != steps {sub.steps} x {bt} tokens per step")
        if sub.steps > assignment.max_steps:
            raise RejectedUpdate(
                f"{sub.worker:.16}… claims {sub.steps} steps; its measured speed allows "
                f"at most {assignment.max_steps} in {a.time_budget_s:g} s"
            )
        if sub.group:  # a worker group's split must tile its assignment and add up (audits replay it)
            from pcp_p2p.diloco.protocol.audit import CHUNK_STEPS
            from pcp_p2p.diloco.protocol.group_replay import check_split

            check_split(sub, assignment, CHUNK_STEPS)
        if len(sub.losses) > sub.steps or not all(math.isfinite(x) for x in sub.losses):
            raise RejectedUpdate("losses: more than one per step, or not finite")
        if (sub.delta_cid is None) == (sub.delta_inline is None):
            raise RejectedUpdate("exactly one of delta_cid / delta_inline must be set")
        if sub.codec != self.spec.round.delta_codec:
            raise RejectedUpdate(f"codec {sub.codec!r:.20}, the run uses {self.spec.round.delta_codec!r}")
        self._seen[sub.worker] = sub.signature
        return True

    def check_delta(self, sub: Submission, payload: bytes) -> Params:
        """Decode and check a payload (already hash-checked if it came by CID)."""
        try:
            limit = 4 * num_params(self.theta) + (1 << 20)  # fp32 at most, plus the header
            delta = codec_of(sub.codec).decode(payload, limit, like=self.theta)
        except PcpError as exc:
            raise RejectedUpdate(f"undecodable pseudo-gradient: {exc}") from exc
        check_decoded(delta, self.theta, self.spec, sub.steps)
        return delta

    def admit(self, sub: Submission, delta: Params, score: float | None = None) -> None:
        self.accepted[sub.worker] = Accepted(sub.worker, sub.tokens, sub.losses, delta, score)
        self.submissions[sub.worker] = sub  # what an audit of this round replays against

    def admit_group(self, aggregator: str, subs: Collection[Submission], delta: Params, tokens: int,
                    mean_loss: float, score: float | None = None, group: Collection[str] = ()) -> None:
        """A partial aggregate's Δ (its submissions already header-checked): one entry, weighing
        its workers' tokens, combined with the round's other entries by the same rule. ``group``:
        the workers that submit to this aggregator; those not combined and not seen here are
        decided too (their Δs went to the group, which closed without them)."""
        self.accepted[aggregator] = Accepted(aggregator, tokens, (mean_loss,), delta, score)
        self.groups[aggregator] = tuple(sorted(s.worker for s in subs))
        self.closed_out.update(w for w in group if w in self.assigned and w not in self._seen)
        for sub in subs:
            self.submissions[sub.worker] = sub

    def refuse(self, worker: str, error: PcpError) -> None:
        """Refuse ``worker``'s entry; a refused group refuses every worker it combined."""
        self.refused[worker] = error
        for member in self.groups.pop(worker, ()):
            self.refused[member] = error

    def combine(self, exclude: Collection[str] = ()) -> RoundResult:
        """Combine the accepted submissions (less ``exclude``) by the spec's policy.

        Norm screen → capped token weights → ``spec.aggregation.rule``
        (:func:`~pcp_p2p.diloco.algorithm.robust.aggregate`), workers in sorted order so
        every replay gives the same bits. Pure: the caller decides what to do
        with the workers screened out (the shepherd refuses them).
        """
        subs = {k: a for k, a in sorted(self.accepted.items()) if k not in exclude}
        if not subs:
            raise ValueError("no accepted submissions")
        agg = robust.aggregate(
            {k: a.delta for k, a in subs.items()}, {k: float(a.tokens) for k, a in subs.items()},
            self.spec.aggregation,
        )
        loss = 0.0
        for k, w in agg.weights.items():
            losses = subs[k].losses
            tail = losses[-max(1, len(losses) // 10) :] if losses else (float("nan"),)
            loss += w * float(np.mean(tail))
        tokens = sum(subs[k].tokens for k in agg.weights)
        return RoundResult(agg.delta, tokens, loss, agg.weights, agg.screened, agg.norms)

    def mean(self) -> tuple[Params, int, float]:
        """(combined Δ, tokens of the workers combined, their weighted mean final loss).

        Kept for callers of the old token-weighted mean; the rule is now the
        spec's (``aggregation.rule = "mean"``, ``max_share = 1``,
        ``norm_vs_median = 0`` give the old plain token-weighted mean).
        """
        r = self.combine()
        return r.delta, r.tokens, r.mean_loss

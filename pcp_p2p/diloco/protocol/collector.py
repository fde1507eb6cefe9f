"""An aggregator's side of one round attempt, as a sans-IO machine (issue #15, item 3).

Why a machine of its own: an aggregator is an ordinary worker that the announcement
names (:attr:`~pcp_p2p.diloco.protocol.messages.RoundAnnouncement.aggregators`); for that
attempt it also takes its group's submissions, fetches their Δs from the workers that
made them, combines them by the shepherd's own rule
(:func:`~pcp_p2p.diloco.protocol.partials.combine_group`) and sends the shepherd one
signed :class:`~pcp_p2p.diloco.protocol.partials.PartialAggregate`. The shepherd's
downlink then carries one update-sized Δ per group instead of one Δ per worker. The
rules (who aggregates, who is in whose group, what a partial must prove) are in
:mod:`~pcp_p2p.diloco.protocol.partials`; this holds only the collecting.

Like the shepherd and the worker it is fed inputs with ``now`` and answers with
:mod:`effects <pcp_p2p.diloco.protocol.effects>`; the run machine routes to it the
submissions of its group and the blobs it asked for.

A group closes when every worker of it has been decided (its Δ arrived, or it was
refused) and θ_r is held (:meth:`GroupCollector.hold_theta`), or at ``close_at``
(:func:`close_time`: a little before the announcement's deadline, after the workers'
time budget), so the partial and its Δ reach the shepherd before it closes the attempt.
A worker whose Δ missed the group is not combined; it sees itself missing from the
commit and from then on sends its Δ to the shepherd itself whenever that aggregator is
its group's (:attr:`~pcp_p2p.diloco.protocol.worker.Worker.dropped_by`): an aggregator
that drops workers loses them.

Transitions::

    COLLECTING --every group member decided, θ held--> CLOSED (StoreBlob Δ, Send partial)
    COLLECTING --tick at close_at-->                    CLOSED (the same, with what arrived)
"""

from __future__ import annotations

from pcp_p2p.core.cid import check_cid, cid_of
from pcp_p2p.core.errors import HashMismatch, PcpError, RejectedUpdate, StaleMessage
from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.algorithm.params import Params
from pcp_p2p.diloco.protocol.aggregate import RoundAggregator
from pcp_p2p.diloco.protocol.effects import Effect, FetchBlob, Rejected, Send, StoreBlob
from pcp_p2p.diloco.protocol.messages import RoundAnnouncement, Submission, sign
from pcp_p2p.diloco.protocol.partials import PartialAggregate, announced_groups, combine_group
from pcp_p2p.diloco.protocol.spec import RunSpec
from pcp_p2p.wire import encode

CLOSE_SHARE = 0.15
"""An incomplete group closes this share of the time to the announcement's deadline before it
(but no sooner than halfway through the slack the deadline leaves after the time budget): the
rest is for the partial and its Δ to reach the shepherd."""


def close_time(ann: RoundAnnouncement, now: float) -> float:
    """When a group that has not heard from every worker closes: the deadline less a margin of
    ``CLOSE_SHARE`` of the time left, or of half the slack after the workers' time budget if
    that is less (a 60 s budget with a 66 s deadline closes at 63 s, after the workers trained)."""
    left = max(0.0, ann.deadline - now)
    return now + left - min(CLOSE_SHARE * left, max(0.0, left - ann.time_budget_s) / 2)


class GroupCollector:
    """Collects and combines one group's submissions for one announced attempt."""

    def __init__(self, spec: RunSpec, ann: RoundAnnouncement, identity: Identity, now: float) -> None:
        """``ann``: an announcement the worker took (its shepherd's signature checked) naming
        this node among its aggregators."""
        self.spec, self.ann, self.identity = spec, ann, identity
        me = identity.peer_id
        if me not in ann.aggregators:
            raise ValueError("this node is not an aggregator of the announcement")
        self.peer_id = me
        self.group = frozenset(w for w, a in announced_groups(ann).items() if a == me)
        self.close_at = close_time(ann, now)
        self.theta: Params | None = None
        self.headers = RoundAggregator(spec, ann, {})  # header checks only (signatures, caps, replays)
        self.waiting: dict[str, list[Submission]] = {}  # Δ CID -> the submissions naming it
        self.offered: dict[str, tuple[Submission, bytes]] = {}  # worker -> its submission and Δ bytes
        self.refused: dict[str, PcpError] = {}
        self.closed = False
        self.partial: PartialAggregate | None = None  # what it sent, once closed

    def hold_theta(self, theta: Params, now: float) -> list[Effect]:
        """θ_r, to check the Δs against: the node's worker fetched it for the round (the run
        machine passes it on, decoded once), so the aggregator costs no second copy."""
        if self.theta is None and not self.closed:
            self.theta = theta
            return self._maybe_close(now)
        return []

    @property
    def next_wakeup(self) -> float | None:
        return None if self.closed else self.close_at

    def takes(self, sub: Submission) -> bool:
        """Whether ``sub`` is for this attempt and from a worker of this group (else the shepherd's)."""
        a = self.ann
        return ((sub.run_id, sub.term, sub.round, sub.attempt) == (a.run_id, a.term, a.round, a.attempt)
                and sub.worker in self.group)

    def on_submission(self, sub: Submission, now: float) -> list[Effect]:
        if self.closed:
            return [Rejected(sub.worker, StaleMessage(f"the group of {self.peer_id:.16}… closed"))]
        try:
            if not self.headers.check_header(sub):
                return []  # the same submission again
            if sub.delta_cid is None:
                raise RejectedUpdate("a submission to an aggregator names its Δ by CID")
        except PcpError as exc:
            self.refused[sub.worker] = exc
            return [Rejected(sub.worker, exc), *self._maybe_close(now)]
        waiting = self.waiting.setdefault(sub.delta_cid, [])
        waiting.append(sub)
        return [FetchBlob(sub.delta_cid, hint=sub.worker)] if len(waiting) == 1 else []

    def on_blob(self, cid: str, data: bytes, now: float) -> list[Effect]:
        if self.closed:
            return []
        subs = self.waiting.pop(cid, [])
        try:
            check_cid(cid, data)
        except HashMismatch as exc:
            return self._refuse_all(subs, exc, now)
        for sub in subs:
            self.offered[sub.worker] = (sub, data)
        return self._maybe_close(now)

    def on_blob_failed(self, cid: str, error: PcpError, now: float) -> list[Effect]:
        if self.closed:
            return []
        return self._refuse_all(self.waiting.pop(cid, []), error, now)

    def tick(self, now: float) -> list[Effect]:
        if self.closed or now < self.close_at:
            return []
        return self._close()

    def _refuse_all(self, subs: list[Submission], exc: PcpError, now: float) -> list[Effect]:
        for sub in subs:
            self.refused[sub.worker] = exc
        return [*(Rejected(s.worker, exc) for s in subs), *self._maybe_close(now)]

    def _maybe_close(self, now: float) -> list[Effect]:
        if self.theta is None or not (set(self.offered) | set(self.refused)) >= self.group:
            return []
        return self._close()

    def _close(self) -> list[Effect]:
        """Combine what arrived, store the group's Δ and send the shepherd the partial."""
        self.closed = True
        if self.theta is None or not self.offered:
            return []
        try:
            group = combine_group(self.spec, self.ann, self.theta, list(self.offered.values()))
        except PcpError as exc:
            return [Rejected(None, exc)]
        a = self.ann
        partial = sign(PartialAggregate(
            run_id=a.run_id, term=a.term, round=a.round, attempt=a.attempt, theta_cid=a.theta_cid,
            aggregator=self.peer_id, submissions=tuple(encode(s) for s in group.combined),
            delta_cid=cid_of(group.delta_blob), tokens=sum(s.tokens for s in group.combined),
            mean_loss=group.result.mean_loss,
        ), self.identity)
        self.partial = partial
        return [StoreBlob(partial.delta_cid, group.delta_blob), Send(a.shepherd, partial),
                *(Rejected(w, e) for w, e in sorted(group.refused.items()))]

"""The shepherd's side of audits, as a sans-IO machine: draw, ask, escalate, ban.

:mod:`~pcp_p2p.diloco.protocol.audit` holds the messages and the pure checks; this is the
bookkeeping the shepherd keeps around them, so that ``Shepherd`` itself only
calls three methods:

- :meth:`AuditDesk.check` on every submission before it is accepted (a
  submission that commits to no inner state, or starts from a state that is not
  the end of one of its worker's committed rounds, cannot be audited and is
  refused);
- :meth:`AuditDesk.on_commit` when a round commits: the draw (seeded by the new
  θ's CID, which no worker knew when it submitted) picks the audited
  submissions; each gets a signed :class:`~pcp_p2p.diloco.protocol.audit.AuditRequest`
  sent to its auditor and to the audited worker, and the submission is stored
  as the blob the request names;
- :meth:`AuditDesk.on_report` for each :class:`~pcp_p2p.diloco.protocol.audit.AuditReport`.

Why two reports before a ban. One auditor's MISMATCH proves only that two
parties disagree; a second replay, by another auditor of the same target, says
which one lied. On a first MISMATCH the desk asks a second auditor (the same
draw picks it among the others); two agreeing MISMATCH reports become
:class:`~pcp_p2p.diloco.protocol.audit.Evidence` that any node can re-verify
(``verify_evidence``), and the effect :class:`Banned` tells the runtime to record
it in the run's ledger. UNAVAILABLE (the worker did not serve its state, the
auditor could not fetch) is no proof and closes the case without a ban.

Transitions of one case (keyed by the submission's CID)::

    OPEN(1 request)  --MATCH / UNAVAILABLE-->      closed
    OPEN(1 request)  --MISMATCH, 2nd auditor-->    OPEN(2 requests)   (Send request to it)
    OPEN(1 request)  --MISMATCH, nobody else-->    closed             (no second opinion: no ban)
    OPEN(2 requests) --MISMATCH agreeing-->        closed             (Banned)
    OPEN(2 requests) --MATCH / UNAVAILABLE-->      closed             (the first auditor is the suspect)

At most ``max_open`` cases are kept; the oldest go first.

**Asked again.** An auditor may refuse a request it has no room for (``OverBudget``: its
own audits in flight), and a refusal or a lost message says nothing to this desk; the
case would stay open until it is dropped, and a contradicted worker would go unbanned
(with ``audit_rate`` 1 and three workers each runs several replays at once: the
strangers' swarm test lost its second opinions so, one run in five). So a request
that has had no report after ``resend_s`` is sent again, to the same auditor and
worker, at most ``MAX_RESENDS`` times (``tick``; an auditor runs one job per round and
worker, so a request that was only slow is not replayed twice).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from pcp_p2p.core.errors import PcpError, StaleMessage, VerificationError
from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.protocol.audit import (
    CHUNK_STEPS,
    MISMATCH,
    AuditReport,
    AuditRequest,
    StateChain,
    decode_evidence,
    digest_of,
    encode_evidence,
    make_evidence,
    pick_auditor,
    plan_audits,
    verify_evidence,
)
from pcp_p2p.diloco.protocol.effects import Banned, Effect, Send, StoreBlob
from pcp_p2p.diloco.protocol.messages import RoundAnnouncement, Submission, sign, verify

MAX_OPEN = 64
MAX_RESENDS = 4


@dataclass
class _Case:
    submission_bytes: bytes
    targets: dict[str, str]  # the roster's worker -> target when the round committed
    requests: list[AuditRequest] = field(default_factory=list)
    mismatches: list[tuple[AuditRequest, AuditReport]] = field(default_factory=list)
    asked_at: float = 0.0  # when the latest request went out (or was last sent again)
    resends: int = 0


class AuditDesk:
    """One shepherd term's audits. Feed it submissions, commits and reports; carry out its effects."""

    def __init__(self, run_id: str, identity: Identity, rate: float, *, max_open: int = MAX_OPEN,
                 resend_s: float = 10.0) -> None:
        self.resend_s = resend_s
        self.run_id = run_id
        self.identity = identity
        self.rate = rate
        self.chain = StateChain()
        self.max_open = max_open
        self.open: dict[str, _Case] = {}
        self.audited = 0
        self.matched = 0
        self.banned: list[str] = []

    def check(self, sub: Submission) -> None:
        """``RejectedUpdate`` unless ``sub`` can be audited (state digests, an allowed start)."""
        self.chain.check(sub)

    @property
    def next_wakeup(self) -> float | None:
        """When the oldest unanswered request is due to be sent again (None: nothing to resend)."""
        due = [c.asked_at + self.resend_s for c in self.open.values() if c.resends < MAX_RESENDS]
        return min(due) if due else None

    def tick(self, now: float) -> list[Effect]:
        """Send again each request that has had no report for ``resend_s``."""
        effects: list[Effect] = []
        for case in self.open.values():
            if case.resends < MAX_RESENDS and now >= case.asked_at + self.resend_s:
                req = case.requests[-1]
                case.resends += 1
                case.asked_at = now
                effects += [Send(req.auditor, req), Send(req.worker, req)]
        return effects

    def on_commit(
        self, announcement: RoundAnnouncement, accepted: Mapping[str, Submission], beacon: str,
        targets: Mapping[str, str], *, term: int, now: float = 0.0,
    ) -> list[Effect]:
        """The round committed with ``accepted``: extend the chains and send the drawn audits.

        ``term``: the committing shepherd's. An attempt taken over from the term before
        (``Shepherd.adopt``) is audited like any other: its submissions and announcement
        name the dead term, and each request also names ``term``, the one whose lease
        the auditors check this shepherd holds (``AuditRequest.shepherd_term``)."""
        self.chain.committed(accepted.values())
        effects: list[Effect] = []
        for planned in plan_audits(run_id=self.run_id, rate=self.rate, identity=self.identity,
                                   announcement=announcement, accepted=accepted, beacon=beacon,
                                   targets=targets, shepherd_term=term):
            req = planned.request
            self.open[req.submission_cid] = _Case(planned.submission_bytes, dict(targets), [req], asked_at=now)
            self.audited += 1
            effects += [StoreBlob(req.submission_cid, planned.submission_bytes),
                        Send(req.auditor, req), Send(req.worker, req)]
        while len(self.open) > self.max_open:
            del self.open[next(iter(self.open))]
        return effects

    def on_report(self, report: AuditReport, now: float) -> list[Effect]:
        """A report from an auditor this desk asked; raises a PcpError for anything else."""
        case = self.open.get(report.submission_cid)
        if case is None:
            raise StaleMessage("an audit report for no open audit")
        req = next((r for r in case.requests if r.auditor == report.auditor), None)
        if req is None or report.request_digest != digest_of(req):
            raise VerificationError(f"{report.auditor:.16}… was not asked to audit this submission")
        verify(report, report.auditor)
        if report.verdict != MISMATCH:
            del self.open[report.submission_cid]
            self.matched += report.verdict != "unavailable"
            return []
        case.mismatches.append((req, report))
        if len(case.mismatches) >= 2:
            del self.open[report.submission_cid]
            return self._ban(case)
        second = self._second_auditor(case, req)
        if second is None:
            del self.open[report.submission_cid]  # nobody else can replay it: no ban on one word
            return []
        case.requests.append(second)
        case.asked_at, case.resends = now, 0
        return [Send(second.auditor, second), Send(second.worker, second)]

    def _second_auditor(self, case: _Case, first: AuditRequest) -> AuditRequest | None:
        asked = {r.auditor for r in case.requests}
        peers = [w for w, t in case.targets.items() if t == first.target and w not in asked]
        auditor = pick_auditor(self.run_id, first.term, first.round, first.attempt, first.worker, peers,
                               first.beacon)
        if auditor is None:
            return None
        return sign(dataclasses.replace(first, auditor=auditor, signature=b""), self.identity)

    def _ban(self, case: _Case) -> list[Effect]:
        requests = [r for r, _ in case.mismatches]
        reports = [rep for _, rep in case.mismatches]
        try:
            evidence = make_evidence(case.submission_bytes, requests, reports)
            data = encode_evidence(evidence)
            offender = verify_evidence(decode_evidence(data), rate=self.rate,
                                       is_shepherd=lambda term, peer: peer == self.identity.peer_id,
                                       chunk_steps=CHUNK_STEPS)
        except PcpError:
            return []  # the two reports do not make a proof (they disagree on what differs)
        self.banned.append(offender)
        return [Banned(offender, data, f"audit: two replays contradict round {requests[0].round + 1}")]

    def status(self) -> dict[str, int]:
        return {"audited": self.audited, "matched": self.matched, "open": len(self.open),
                "banned": len(self.banned)}

"""Audits of partial aggregates: another aggregator replays a drawn partial, the shepherd confirms a lie.

Why. A partial aggregate (:mod:`~pcp_p2p.diloco.protocol.partials`) is a pure function of
signed inputs, so a lie is proven by recomputing it from the listed Δs
(:func:`~pcp_p2p.diloco.protocol.partials.replay_partial`). But the listed Δs are a whole
group's: if the shepherd replayed partials itself it would fetch N·rate Δs a round, and
its downlink, which aggregators exist to spare, would grow with the swarm again. So the
replay is done by another member, as a worker's round is audited by another worker:

1. **The draw** (:func:`partial_drawn`): when a round commits, each accepted partial is
   audited with probability ``aggregation.partial_audit_rate``, by a hash of the new θ's
   CID (which no aggregator knew when it combined) and the partial; the auditor is
   another aggregator of the round (well connected by the choice of aggregators), or else
   another participant, drawn by the same hash (:func:`partial_auditor`). The shepherd
   sends it a signed :class:`PartialAudit` carrying the announcement and the partial.
2. **The replay** (:class:`PartialReplay`, on the auditor): the request is the term's
   shepherd's (the run machine checks the lease), the announcement is signed by its
   shepherd, the partial passes :func:`~pcp_p2p.diloco.protocol.partials.check_partial`;
   then θ_r and every listed Δ are fetched (each from its worker) and the partial is
   recomputed. The verdict (:class:`PartialVerdict`: match, mismatch, unavailable) goes
   back to the shepherd.
3. **The judgement** (:class:`PartialDesk`, on the shepherd): a match or an unavailable
   verdict closes the case. A mismatch is not believed on one word: the shepherd fetches
   the listed Δs and replays the partial itself, once, for that partial only. A confirmed
   lie bans the aggregator (:class:`~pcp_p2p.diloco.protocol.effects.Banned`, with the
   signed partial as the evidence); a refuted one is refused as the auditor's
   (``VerificationError``). So an honest round costs the shepherd one small message per
   drawn partial, and a lie costs it one group's Δs.

What it does not do yet: the ban is this shepherd's (its ledger, hence its admission and
the next aggregator draws); it is not sent to the other members, whose check of the
evidence would need the listed Δs as well (``Banned.shared`` is false).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Collection, Iterable

from pcp_p2p.core.cid import check_cid, cid_of
from pcp_p2p.core.errors import HashMismatch, PcpError, StaleMessage, VerificationError
from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.algorithm.params import Params, unpack_tensors
from pcp_p2p.diloco.protocol.effects import Banned, Effect, FetchBlob, Rejected, Send
from pcp_p2p.diloco.protocol.messages import RoundAnnouncement, sign, verify
from pcp_p2p.diloco.protocol.partials import (
    PartialAggregate,
    announced_groups,
    check_partial,
    listed,
    replay_partial,
)
from pcp_p2p.diloco.protocol.spec import RunSpec
from pcp_p2p.wire import HARD_MAX_SIZE, Message, decode, encode, wire_message

MATCH, MISMATCH, UNAVAILABLE = "match", "mismatch", "unavailable"
OPEN_ROUNDS = 2
"""A shepherd keeps the partial audits of about this many rounds open (at most ``OPEN_ROUNDS`` x
``aggregation.aggregators``, the oldest dropped first): each holds its round's θ_r (shared by
the round's cases), to replay a reported mismatch."""
MAX_REPLAYS = 2
"""Partial audits an auditor runs at once (each holds a group's Δs while it runs)."""
REPLAY_TIMEOUT_S = 120.0
"""An auditor that has not fetched everything by then reports ``unavailable``."""


@wire_message("diloco.partial-audit", max_size=HARD_MAX_SIZE)
class PartialAudit(Message):
    """The shepherd asks ``auditor`` to replay one partial aggregate of a committed round."""

    run_id: str
    term: int  # the asking shepherd's
    shepherd: str
    auditor: str
    beacon: str  # the CID of the θ whose commit drew this audit
    announcement: bytes  # the attempt's signed RoundAnnouncement
    partial: bytes  # the signed PartialAggregate
    signature: bytes = b""


@wire_message("diloco.partial-verdict", max_size=4096)
class PartialVerdict(Message):
    """An auditor's verdict on the partial a :class:`PartialAudit` named."""

    run_id: str
    term: int
    auditor: str
    partial_cid: str  # cid_of(the partial's bytes)
    verdict: str  # MATCH | MISMATCH | UNAVAILABLE
    detail: str
    signature: bytes = b""


PARTIAL_AUDIT_MESSAGES: tuple[type[Message], ...] = (PartialAudit, PartialVerdict)


def _draw(*parts: object) -> int:
    h = hashlib.sha256("|".join(["pcp-partial-audit/1", *map(str, parts)]).encode()).digest()
    return int.from_bytes(h[:8], "big")


def partial_drawn(run_id: str, partial_cid: str, beacon: str, rate: float) -> bool:
    """Whether the partial ``partial_cid`` is audited: a pure function of public values."""
    return rate > 0 and (rate >= 1 or _draw("drawn", run_id, partial_cid, beacon) < rate * 2.0**64)


def partial_auditor(run_id: str, partial: PartialAggregate, aggregators: Iterable[str], participants: Iterable[str],
                    beacon: str) -> str | None:
    """Who replays ``partial``: another aggregator of its round, else a participant it did not
    list (never its aggregator, never one of its own workers); None when there is nobody."""
    own = {partial.aggregator, *(s.worker for s in listed(partial))}
    for pool in (set(aggregators) - own, set(participants) - own):
        if pool:
            return min(sorted(pool), key=lambda c: _draw("auditor", run_id, cid_of(encode(partial)), beacon, c))
    return None


# --- the auditor's side --------------------------------------------------------------------


class PartialReplay:
    """One partial audit on the auditor: fetch θ_r and the listed Δs, recompute, report."""

    def __init__(self, spec: RunSpec, req: PartialAudit, identity: Identity, now: float) -> None:
        """Checks what can be checked before anything is fetched (raises a ``PcpError``): the
        request is for this node and signed by its shepherd (whose lease the caller checked),
        the announcement is signed by its shepherd, the partial passes ``check_partial``."""
        if req.auditor != identity.peer_id:
            raise VerificationError("a partial audit for another auditor")
        verify(req, req.shepherd)
        self.ann = decode(req.announcement, RoundAnnouncement)
        verify(self.ann, self.ann.shepherd)
        if self.ann.run_id != req.run_id or self.ann.term > req.term:
            raise StaleMessage("a partial audit of another run or a later term")
        self.partial = decode(req.partial, PartialAggregate)
        self.subs = check_partial(self.partial, self.ann, self.ann.aggregators, announced_groups(self.ann))
        self.spec, self.req, self.identity = spec, req, identity
        self.partial_cid = cid_of(req.partial)
        self.until = now + REPLAY_TIMEOUT_S
        self.theta: Params | None = None
        self.payloads: dict[str, bytes] = {}
        self.wanted = {s.delta_cid: s.worker for s in self.subs if s.delta_cid is not None}
        self.done = False

    def start(self) -> list[Effect]:
        return [FetchBlob(self.ann.theta_cid, hint=self.req.shepherd),
                *(FetchBlob(cid, hint=w) for cid, w in sorted(self.wanted.items()))]

    @property
    def next_wakeup(self) -> float | None:
        return None if self.done else self.until

    def tick(self, now: float) -> list[Effect]:
        if self.done or now < self.until:
            return []
        return self._verdict(UNAVAILABLE, f"not every Δ arrived in {REPLAY_TIMEOUT_S:g} s")

    def on_blob(self, cid: str, data: bytes, now: float) -> list[Effect]:
        if self.done:
            return []
        try:
            check_cid(cid, data)
            if cid == self.ann.theta_cid:
                self.theta = unpack_tensors(data)
            elif cid in self.wanted:
                self.payloads[self.wanted[cid]] = data
        except PcpError as exc:
            return self._verdict(UNAVAILABLE, f"{cid[-12:]}: {exc}")
        if self.theta is None or len(self.payloads) < len(self.wanted):
            return []
        try:
            replay_partial(self.partial, self.payloads, self.spec, self.ann, self.theta)
        except HashMismatch as exc:
            return self._verdict(MISMATCH, str(exc))
        except PcpError as exc:
            return self._verdict(UNAVAILABLE, str(exc))
        return self._verdict(MATCH, "")

    def on_blob_failed(self, cid: str, error: PcpError, now: float) -> list[Effect]:
        return [] if self.done else self._verdict(UNAVAILABLE, f"{cid[-12:]}: {error}")

    def _verdict(self, verdict: str, detail: str) -> list[Effect]:
        self.done = True
        self.payloads.clear()
        self.theta = None
        v = sign(PartialVerdict(run_id=self.req.run_id, term=self.req.term, auditor=self.identity.peer_id,
                                partial_cid=self.partial_cid, verdict=verdict, detail=detail[:1000]), self.identity)
        return [Send(self.req.shepherd, v)]


# --- the shepherd's side -------------------------------------------------------------------


@dataclasses.dataclass
class _Case:
    request: PartialAudit
    partial: PartialAggregate
    ann: RoundAnnouncement
    theta: Params  # θ_r, to replay a reported mismatch
    payloads: dict[str, bytes] = dataclasses.field(default_factory=dict)
    wanted: dict[str, str] = dataclasses.field(default_factory=dict)  # Δ CID -> worker, while confirming


class PartialDesk:
    """One shepherd term's partial audits: draw them at each commit, judge the verdicts."""

    def __init__(self, spec: RunSpec, run_id: str, identity: Identity) -> None:
        self.spec, self.run_id, self.identity = spec, run_id, identity
        self.max_open = OPEN_ROUNDS * max(1, spec.aggregation.aggregators)
        self.rate = spec.aggregation.partial_audit_rate
        self.open: dict[str, _Case] = {}  # partial CID -> case
        self.audited = self.matched = 0
        self.banned: list[str] = []

    def on_commit(self, ann: RoundAnnouncement, partials: Collection[PartialAggregate], participants: Iterable[str],
                  theta: Params, beacon: str, term: int) -> list[Effect]:
        """The round committed with ``partials``: ask an auditor for each drawn one."""
        effects: list[Effect] = []
        people = tuple(participants)
        for p in sorted(partials, key=lambda p: p.aggregator):
            raw = encode(p)
            pcid = cid_of(raw)
            if not partial_drawn(self.run_id, pcid, beacon, self.rate):
                continue
            auditor = partial_auditor(self.run_id, p, ann.aggregators, people, beacon)
            if auditor is None:
                continue
            req = sign(PartialAudit(run_id=self.run_id, term=term, shepherd=self.identity.peer_id, auditor=auditor,
                                    beacon=beacon, announcement=encode(ann), partial=raw), self.identity)
            self.open[pcid] = _Case(req, p, ann, theta)
            self.audited += 1
            effects.append(Send(auditor, req))
        while len(self.open) > self.max_open:
            del self.open[next(iter(self.open))]
        return effects

    def wants(self, cid: str) -> bool:
        return any(cid in c.wanted for c in self.open.values())

    def on_verdict(self, v: PartialVerdict, now: float) -> list[Effect]:
        """A verdict from the auditor this desk asked; raises a ``PcpError`` for anything else."""
        case = self.open.get(v.partial_cid)
        if case is None:
            raise StaleMessage("a partial verdict for no open audit")
        if v.auditor != case.request.auditor:
            raise VerificationError(f"{v.auditor:.16}… was not asked to audit this partial")
        verify(v, v.auditor)
        if v.verdict != MISMATCH:
            del self.open[v.partial_cid]
            self.matched += v.verdict == MATCH
            return []
        if case.wanted:
            return []  # (the same verdict again: already confirming)
        # not on one word: fetch the group's Δs and replay it here, once
        case.wanted = {s.delta_cid: s.worker for s in listed(case.partial) if s.delta_cid is not None}
        return [FetchBlob(cid, hint=w) for cid, w in sorted(case.wanted.items())]

    def on_blob(self, cid: str, data: bytes | None, error: PcpError | None, now: float) -> list[Effect]:
        """A Δ asked for to confirm a mismatch arrived (``data``) or could not be fetched."""
        for pcid, case in list(self.open.items()):
            worker = case.wanted.get(cid)
            if worker is None:
                continue
            try:
                if error is not None:
                    raise error
                assert data is not None
                check_cid(cid, data)
            except PcpError:
                del self.open[pcid]  # cannot be confirmed: no ban, no blame
                return []
            case.payloads[worker] = data
            if len(case.payloads) < len(case.wanted):
                return []
            del self.open[pcid]
            return self._judge(case)
        return []

    def _judge(self, case: _Case) -> list[Effect]:
        p = case.partial
        try:
            replay_partial(p, case.payloads, self.spec, case.ann, case.theta)
        except HashMismatch as exc:
            self.banned.append(p.aggregator)
            return [Banned(p.aggregator, encode(p), f"partial aggregate of round {p.round + 1}: {exc}",
                           shared=False)]
        except PcpError:
            return []
        return [Rejected(case.request.auditor, VerificationError(
            f"{case.request.auditor:.16}… reported a mismatch the shepherd's own replay does not show"))]

    def status(self) -> dict[str, int]:
        return {"audited": self.audited, "matched": self.matched, "open": len(self.open),
                "banned": len(self.banned)}

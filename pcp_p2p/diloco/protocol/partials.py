"""Partial aggregates: a round's combine split over a few aggregators, each provable (issue #15, item 3).

Why. Every worker sends its Δ to the shepherd, so the shepherd's downlink carries N
Δs a round and grows with the swarm: at planetary scale one home link is the wall.
With aggregators, a few well-connected members each combine the Δs of one group of
workers and send the shepherd one partial aggregate: the shepherd takes g partials
instead of N Δs.

What this module holds: the protocol's rules (no I/O, no clock). The round uses them
when the spec sets ``aggregation.aggregators`` and the roster is above
``aggregation.aggregate_above``: the shepherd names the attempt's aggregators in its
announcement, a worker sends its Δ to its group's, an aggregator collects and combines
its group (:mod:`~pcp_p2p.diloco.protocol.collector`), the shepherd checks each partial
and combines them with any Δ sent to it directly
(:meth:`~pcp_p2p.diloco.protocol.shepherd.Shepherd.on_partial`), and a drawn share of
partials is replayed by another member (:mod:`~pcp_p2p.diloco.protocol.partial_audit`).
See docs/diloco.md, "Aggregators".

- **Who aggregates** (:func:`choose_aggregators`): a deterministic draw from the roster,
  members that can be dialled directly first (a relay-only home must not carry N Δs
  through a relay), ordered by a hash of the round's beacon and the peer id, so every
  member computes the same set and nobody can place itself.
- **Who sends to whom** (:func:`group_map`): each aggregator in its own group, the other
  workers ordered by a hash of the beacon and dealt in turn: groups of N/g, ± 1.
- **The partial** (:class:`PartialAggregate`): the aggregator's signed statement of what
  it combined: the workers' signed submissions themselves (by CID: their Δs stay where
  they are), the CID of the group's combined Δ (encoded with the commit's update codec,
  ``outer.update_codec``: a deterministic encoding, so a replay still compares CIDs), and
  the group's tokens and loss.
- **The group's combine** (:func:`combine_group`) is the shepherd's own rule
  (:class:`~pcp_p2p.diloco.protocol.aggregate.RoundAggregator`: every check of a
  submission, the norm screen, capped weights, the spec's robust rule) run on the
  group: a pure function of signed inputs, byte for byte.
- **Checking a partial** (:func:`check_partial`): the authority chain before anything
  it names is fetched: the signer is this round's aggregator for every worker it
  lists, each listed submission is signed by its worker, for this round, from the
  announced θ, by CID, and no worker is listed twice.
- **Proving a lie** (:func:`replay_partial`): anyone holding the listed Δs recomputes
  the group's combine and compares CIDs; the partial, signed by the aggregator, and the
  workers' signed submissions are the whole evidence. A worker's round needs its
  auditor to re-train it; an aggregator's needs only the arithmetic, so it can be
  checked as often as the Δs' bytes allow (``aggregation.partial_audit_rate`` of the
  partials, by another member: :mod:`~pcp_p2p.diloco.protocol.partial_audit`).

Robust aggregation and partial sums (the tension, and the choice). The robust rules
need every Δ: a trimmed mean of sums is not a trimmed mean. The choice here is two
levels (bucketing: Karimireddy, He, Jaggi, ICLR 2022, "Byzantine-robust learning on
heterogeneous datasets via bucketing"): each group is combined by the full rule, so a
hostile worker is bounded inside its group exactly as today; the shepherd combines the
g group results by the same rule, weighted by tokens (each partial is one entry of the
shepherd's :class:`~pcp_p2p.diloco.protocol.aggregate.RoundAggregator`, beside any Δ sent
to it directly), so a hostile aggregator is bounded like a hostile worker, and a lying
one is provable besides. What is lost: a worker's Δ is screened against its group's median norm, not
the round's, and with groups of two or fewer the norm screen cannot fire; so groups
are kept at ``MIN_GROUP`` or more workers (fewer aggregators when the roster is small).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import HashMismatch, PcpError, RejectedUpdate, StaleMessage
from pcp_p2p.diloco.algorithm.params import Params, codec_of, unpack_tensors
from pcp_p2p.diloco.protocol.aggregate import RoundAggregator, RoundResult, check_decoded
from pcp_p2p.diloco.protocol.messages import RoundAnnouncement, Submission, verify
from pcp_p2p.diloco.protocol.spec import RunSpec
from pcp_p2p.wire import HARD_MAX_SIZE, Message, decode, wire_message

MIN_GROUP = 3
"""The fewest workers an aggregator is given: the norm screen needs three to fire."""
MAX_PARTIAL_SUBMISSIONS = 512
"""The most submissions one partial may list (a signed header of ~300 bytes each)."""


def _rank(beacon: str, *names: str) -> bytes:
    return hashlib.sha256("\x00".join(("pcp-aggregators/1", beacon, *names)).encode()).digest()


def choose_aggregators(roster: Sequence[str], direct: Collection[str], count: int, beacon: str,
                       proven: Collection[str] = ()) -> tuple[str, ...]:
    """This round's aggregators: at most ``count``, and at most one per ``MIN_GROUP`` members.

    Members in ``proven`` (the shepherd's choice: those its last commit counted) come
    first, so a key that joined an open run a moment ago is drawn only when too few
    others are left; then those in ``direct`` (dialable without a relay); each class
    ordered by a hash of ``beacon`` (a value nobody chose for this round, such as the θ
    it starts from) and the peer id. Every member computes the same tuple from the same
    inputs. ``()`` when the roster is too small for two groups: the shepherd combines alone.
    """
    members = sorted(set(roster))
    k = min(count, len(members) // MIN_GROUP)
    if k < 2:
        return ()
    proven = set(proven)
    order = sorted(members, key=lambda p: (p not in proven, p not in direct, _rank(beacon, p)))
    return tuple(order[:k])


def group_map(workers: Collection[str], aggregators: Sequence[str], beacon: str) -> dict[str, str]:
    """worker -> the aggregator it submits to, for every worker and aggregator.

    An aggregator is in its own group (its Δ never travels to another). The other workers,
    ordered by a hash of ``beacon`` and their id, are dealt to the aggregators in turn, so
    groups differ in size by one at most: with ``choose_aggregators``' one aggregator per
    ``MIN_GROUP`` members every group has ``MIN_GROUP`` workers or more, as the norm screen
    needs. (Hashing each worker to an aggregator independently left groups of one or two.)
    Every member computes the same map from the same announcement.
    """
    if not aggregators:
        raise ValueError("no aggregators this round")
    out = {a: a for a in aggregators}
    others = sorted((w for w in set(workers) if w not in out), key=lambda w: _rank(beacon, w))
    for i, w in enumerate(others):
        out[w] = aggregators[i % len(aggregators)]
    return out


def announced_groups(ann: RoundAnnouncement) -> dict[str, str]:
    """The announcement's :func:`group_map` (its workers, its aggregators, its θ as the beacon);
    ``{}`` when it names no aggregators."""
    if not ann.aggregators:
        return {}
    return group_map([a.worker for a in ann.assignments], ann.aggregators, ann.theta_cid)


@wire_message("diloco.partial", max_size=HARD_MAX_SIZE)
class PartialAggregate(Message):
    """An aggregator's signed statement: these signed submissions, combined, give this Δ."""

    run_id: str
    term: int
    round: int
    attempt: int
    theta_cid: str  # the θ the round trained from (the announcement's)
    aggregator: str
    submissions: tuple[bytes, ...]  # the encoded, signed Submissions combined, in worker order
    delta_cid: str  # the group's combined Δ, encoded with ``outer.update_codec``
    tokens: int  # the combined workers' tokens
    mean_loss: float
    signature: bytes = b""


@dataclass(frozen=True)
class GroupResult:
    """What :func:`combine_group` made of one group's submissions."""

    result: RoundResult
    delta_blob: bytes  # the combined Δ as ``outer.update_codec`` encodes it: what the partial names by CID
    combined: tuple[Submission, ...]  # the submissions it combined, in worker order
    refused: dict[str, PcpError]  # refused by a check or by the screen, with why


def combine_group(spec: RunSpec, ann: RoundAnnouncement, theta: Params,
                  offered: Sequence[tuple[Submission, bytes]]) -> GroupResult:
    """The group's combine: every submission checked (header and payload) and the spec's rule
    applied, as the shepherd does for a whole round. Pure: the same offers give the same
    bytes whoever runs it (the aggregator, or anyone replaying it). ``offered`` holds each
    submission with its payload (its Δ's bytes, already checked against its CID)."""
    agg = RoundAggregator(spec, ann, theta)
    for sub, payload in sorted(offered, key=lambda x: x[0].worker):
        try:
            if agg.check_header(sub):
                agg.admit(sub, agg.check_delta(sub, payload))
        except PcpError as exc:
            agg.refuse(sub.worker, exc)
    if not agg.accepted:
        raise RejectedUpdate("no submission of the group could be combined")
    result = agg.combine()
    refused = {**agg.refused, **result.screened}
    combined = tuple(agg.submissions[w] for w in sorted(result.weights))
    return GroupResult(result, codec_of(spec.outer.update_codec).encode(result.delta), combined, refused)


def listed(partial: PartialAggregate) -> tuple[Submission, ...]:
    """The submissions a partial lists, decoded (:class:`MalformedMessage` for bytes that are not one)."""
    return tuple(decode(raw, Submission) for raw in partial.submissions)


def check_partial(partial: PartialAggregate, ann: RoundAnnouncement, aggregators: Sequence[str],
                  groups: Mapping[str, str]) -> tuple[Submission, ...]:
    """The authority chain of a partial, before anything it names is fetched; its submissions.

    Raises (nothing is fetched, nothing counts): :class:`BadSignature` unless the named
    aggregator signed it, or for a listed submission its worker did not sign;
    :class:`StaleMessage` for another round, attempt or θ; :class:`RejectedUpdate` for a
    signer that is not one of this round's aggregators, a worker that is not assigned or
    not in the signer's group, a worker listed twice, a submission carried inline (a
    partial lists Δs by CID), or tokens that are not the listed ones' sum.
    """
    verify(partial, partial.aggregator)
    if (partial.run_id, partial.term) != (ann.run_id, ann.term):
        raise StaleMessage(f"partial for run/term {partial.run_id:.16}/{partial.term}, not this one")
    if (partial.round, partial.attempt, partial.theta_cid) != (ann.round, ann.attempt, ann.theta_cid):
        raise StaleMessage(f"partial for round {partial.round} attempt {partial.attempt}, "
                           f"current {ann.round}/{ann.attempt} (or another θ)")
    if partial.aggregator not in aggregators:
        raise RejectedUpdate(f"{partial.aggregator:.16}… is not an aggregator of round {ann.round}")
    if not 0 < len(partial.submissions) <= MAX_PARTIAL_SUBMISSIONS:
        raise RejectedUpdate(f"a partial lists 1..{MAX_PARTIAL_SUBMISSIONS} submissions, "
                             f"not {len(partial.submissions)}")
    subs = listed(partial)
    workers = [s.worker for s in subs]
    if workers != sorted(set(workers)):
        raise RejectedUpdate("a partial lists each worker once, in order")
    assigned = {a.worker for a in ann.assignments}
    for sub in subs:
        if sub.worker not in assigned:
            raise RejectedUpdate(f"{sub.worker:.16}… is not assigned in round {ann.round}")
        if groups.get(sub.worker) != partial.aggregator:
            raise RejectedUpdate(f"{sub.worker:.16}… submits to another aggregator")
        if (sub.run_id, sub.term, sub.round, sub.attempt, sub.base_theta_cid) != (
                ann.run_id, ann.term, ann.round, ann.attempt, ann.theta_cid):
            raise StaleMessage(f"{sub.worker:.16}…'s submission is not for this round attempt")
        if sub.delta_cid is None or sub.delta_inline is not None:
            raise RejectedUpdate("a partial lists Δs by CID (an inline Δ goes to the shepherd)")
        verify(sub, sub.worker)
    if partial.tokens != sum(s.tokens for s in subs):
        raise RejectedUpdate(f"a partial's tokens {partial.tokens} are not its submissions' "
                             f"{sum(s.tokens for s in subs)}")
    return subs


def replay_partial(partial: PartialAggregate, payloads: Mapping[str, bytes], spec: RunSpec,
                   ann: RoundAnnouncement, theta: Params) -> None:
    """Recompute a (checked) partial from its submissions' Δs (``payloads``: worker -> bytes,
    each already checked against its CID) and raise :class:`HashMismatch` unless it gives the
    Δ the partial names, from exactly the submissions it lists: the aggregator lied, and
    the partial with the listed submissions is the proof anyone can check the same way."""
    subs = listed(partial)
    missing = [s.worker for s in subs if s.worker not in payloads]
    if missing:
        raise ValueError(f"no payload for {len(missing)} listed submissions")
    group = combine_group(spec, ann, theta, [(s, payloads[s.worker]) for s in subs])
    if tuple(s.worker for s in group.combined) != tuple(s.worker for s in subs):
        raise HashMismatch(f"aggregator {partial.aggregator:.16}… lists submissions its own rule refuses: "
                           f"{sorted(group.refused)}")
    if cid_of(group.delta_blob) != partial.delta_cid:
        raise HashMismatch(f"aggregator {partial.aggregator:.16}…'s Δ is not the combine of what it lists")


def decode_group_delta(blob: bytes, theta: Params, spec: RunSpec, subs: Sequence[Submission]) -> Params:
    """A partial's Δ (already checked against its CID) as the shepherd combines it.

    :class:`RejectedUpdate` for bytes that do not decode to θ's tensors, names and shapes,
    that hold NaN or infinite values, or whose norm is above what the listed workers'
    steps allow (a combine of bounded Δs is bounded by the largest bound)."""
    try:
        delta = unpack_tensors(blob, max_bytes=4 * sum(v.size for v in theta.values()) + (1 << 20))
    except PcpError as exc:
        raise RejectedUpdate(f"undecodable partial aggregate: {exc}") from exc
    check_decoded(delta, theta, spec, max(s.steps for s in subs))  # (the submission's own checks)
    return delta

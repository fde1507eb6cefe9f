"""Partial aggregates (issue #15, item 3): who aggregates, the authority chain of a partial,
a lying aggregator proven by replay, and the two-level robust combine.

The rules alone (:mod:`pcp_p2p.diloco.protocol.partials`); the round that uses them: tests/test_aggregators.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_diloco_byzantine import SPEC  # (the absolute norm cap out of the way: the screen is what is tested)

from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import BadSignature, HashMismatch, RejectedUpdate, StaleMessage
from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.algorithm import robust
from pcp_p2p.diloco.algorithm.params import Params, pack_tensors, unpack_tensors
from pcp_p2p.diloco.protocol.messages import DataAssignment, RoundAnnouncement, Submission, sign
from pcp_p2p.diloco.protocol.partials import (
    MIN_GROUP,
    PartialAggregate,
    check_partial,
    choose_aggregators,
    combine_group,
    group_map,
    replay_partial,
)
from pcp_p2p.diloco.protocol.spec import run_id_of, sign_spec
from pcp_p2p.wire import decode, encode

RUN = run_id_of(sign_spec(SPEC, Identity(bytes([1]) * 32)))
THETA = {"w": np.zeros((3, 4), np.float32)}
SHEPHERD = Identity(bytes([2]) * 32)
PEERS = [Identity(bytes([10 + i]) * 32) for i in range(12)]
BY_ID = {p.peer_id: p for p in PEERS}
BEACON = "bafk-theta-beacon"


def announcement(workers: list[str]) -> RoundAnnouncement:
    tid = cid_of(pack_tensors(THETA))
    return sign(RoundAnnouncement(
        run_id=RUN, term=0, round=3, attempt=0, theta_cid=tid, artifacts={}, time_budget_s=10.0, deadline=100.0,
        assignments=tuple(DataAssignment(w, k, len(workers), 7, 20) for k, w in enumerate(sorted(workers))),
        shepherd=SHEPHERD.peer_id), SHEPHERD)


ANN = announcement([p.peer_id for p in PEERS])
AGGREGATORS = choose_aggregators(list(BY_ID), set(BY_ID), 3, BEACON)
GROUPS = group_map(list(BY_ID), AGGREGATORS, BEACON)


def delta_for(worker: str, scale: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(int.from_bytes(worker.encode()[-4:], "big"))
    return (0.01 * scale * (1.0 + 0.1 * rng.standard_normal((3, 4)))).astype(np.float32)


def submit(worker: Identity, delta: np.ndarray, steps: int = 5) -> tuple[Submission, bytes]:
    payload = pack_tensors({"w": delta}, "fp32")
    sub = sign(Submission(
        run_id=RUN, term=0, round=3, attempt=0, worker=worker.peer_id, base_theta_cid=ANN.theta_cid, codec="fp32",
        delta_cid=cid_of(payload), delta_inline=None, steps=steps, tokens=steps * SPEC.tokens_per_step,
        losses=(2.0, 1.5)), worker)
    return sub, payload


def top_level(deltas: dict[str, Params], tokens: dict[str, int]) -> robust.Aggregate:
    """The shepherd's combine across groups: its RoundAggregator's rule, each group one entry."""
    return robust.aggregate(deltas, {a: float(t) for a, t in tokens.items()}, SPEC.aggregation)


def group(aggregator: str) -> list[str]:
    return sorted(w for w in BY_ID if GROUPS[w] == aggregator)


def offers(aggregator: str, scale: dict[str, float] | None = None) -> list[tuple[Submission, bytes]]:
    return [submit(BY_ID[w], delta_for(w, (scale or {}).get(w, 1.0))) for w in group(aggregator)]


def partial_of(aggregator: str, offered: list[tuple[Submission, bytes]], **change: object) -> PartialAggregate:
    g = combine_group(SPEC, ANN, THETA, offered)
    p = PartialAggregate(run_id=RUN, term=0, round=3, attempt=0, theta_cid=ANN.theta_cid, aggregator=aggregator,
                         submissions=tuple(encode(s) for s in g.combined), delta_cid=cid_of(g.delta_blob),
                         tokens=sum(s.tokens for s in g.combined), mean_loss=g.result.mean_loss)
    return sign(dataclasses.replace(p, **change), BY_ID[aggregator])  # type: ignore[arg-type]


# --- who aggregates, and for whom ---------------------------------------------------------------


def test_aggregators_are_drawn_the_same_by_everyone_and_direct_members_come_first() -> None:
    ids = list(BY_ID)
    relayed = set(ids[:9])  # only three members can be dialled directly
    direct = set(ids) - relayed
    picked = choose_aggregators(ids, direct, 4, BEACON)
    assert len(picked) == 4 and set(picked[:3]) == direct
    assert choose_aggregators(list(reversed(ids)), direct, 4, BEACON) == picked  # whatever the order
    # a draw per beacon: nobody holds a place for good
    assert len({choose_aggregators(ids, direct, 4, f"beacon {i}") for i in range(20)}) > 1
    # members a commit counted come before keys that have contributed nothing, direct or not
    proven = set(ids[:4])
    assert set(choose_aggregators(ids, direct, 4, BEACON, proven)) == proven
    assert len(choose_aggregators(ids, direct, 100, BEACON)) == len(ids) // MIN_GROUP
    assert choose_aggregators(ids[: 2 * MIN_GROUP - 1], direct, 4, BEACON) == ()  # too few for two groups


@pytest.mark.parametrize("n", [6, 7, 12, 31, 100])
def test_every_worker_has_one_aggregator_and_the_groups_are_even(n: int) -> None:
    ids = [Identity(bytes([i % 256, i // 256]) * 16).peer_id for i in range(n)]
    aggs = choose_aggregators(ids, set(ids), 8, BEACON)
    groups = group_map(ids, aggs, BEACON)
    assert set(groups) == set(ids) and set(groups.values()) == set(aggs)
    assert all(groups[a] == a for a in aggs)  # an aggregator's Δ stays with it
    sizes = [list(groups.values()).count(a) for a in aggs]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= MIN_GROUP  # the screen can fire in every group
    assert group_map(list(reversed(ids)), aggs, BEACON) == groups  # whatever the order


# --- the authority chain of a partial -----------------------------------------------------------


def test_an_honest_partial_checks_and_replays() -> None:
    for a in AGGREGATORS:
        offered = offers(a)
        p = decode(encode(partial_of(a, offered)), PartialAggregate)
        subs = check_partial(p, ANN, AGGREGATORS, GROUPS)
        assert [s.worker for s in subs] == group(a)
        replay_partial(p, {s.worker: pay for s, pay in offered}, SPEC, ANN, THETA)


def test_a_partial_is_refused_before_anything_it_names_is_fetched() -> None:
    a, other = AGGREGATORS[0], AGGREGATORS[1]
    offered = offers(a)
    good = partial_of(a, offered)
    stranger = Identity.generate()
    cases: list[tuple[PartialAggregate, type[Exception], str | None]] = [
        (dataclasses.replace(good, tokens=good.tokens + 1), BadSignature, None),  # changed after signing
        (sign(dataclasses.replace(good, aggregator=stranger.peer_id), stranger), RejectedUpdate, "not an aggregator"),
        (partial_of(other, offered), RejectedUpdate, "another aggregator"),  # not its group
        (partial_of(a, offered, round=4), StaleMessage, None),
        (partial_of(a, offered, theta_cid="bafk-other"), StaleMessage, None),
        (partial_of(a, offered, tokens=good.tokens * 2), RejectedUpdate, "tokens"),
        (partial_of(a, offered, submissions=good.submissions[:1] * 2), RejectedUpdate, "once"),
        (partial_of(a, offered, submissions=()), RejectedUpdate, "1.."),
    ]
    forged = dataclasses.replace(decode(good.submissions[0], Submission), steps=20, tokens=20 * SPEC.tokens_per_step)
    cases.append((partial_of(a, offered, submissions=(encode(forged), *good.submissions[1:]),
                             tokens=good.tokens + 15 * SPEC.tokens_per_step), BadSignature, None))
    w0 = BY_ID[group(a)[0]]
    inline = sign(dataclasses.replace(decode(good.submissions[0], Submission), delta_cid=None,
                                      delta_inline=pack_tensors({"w": delta_for(w0.peer_id)})), w0)
    cases.append((partial_of(a, offered, submissions=(encode(inline), *good.submissions[1:])), RejectedUpdate,
                  "by CID"))
    for bad, error, match in cases:
        with pytest.raises(error, match=match):
            check_partial(bad, ANN, AGGREGATORS, GROUPS)


# --- a lying aggregator, proven by replay -------------------------------------------------------


def test_an_aggregator_that_lies_about_the_sum_is_proven_wrong_by_anyone_holding_the_deltas() -> None:
    a = AGGREGATORS[0]
    offered = offers(a)
    payloads = {s.worker: pay for s, pay in offered}
    other = pack_tensors({"w": np.ones((3, 4), np.float32)}, "fp32")
    lie = partial_of(a, offered, delta_cid=cid_of(other))
    check_partial(lie, ANN, AGGREGATORS, GROUPS)  # its authority is fine: only the arithmetic is wrong
    with pytest.raises(HashMismatch, match="not the combine"):
        replay_partial(lie, payloads, SPEC, ANN, THETA)


def test_an_aggregator_that_lists_a_delta_its_rule_refuses_is_proven_wrong() -> None:
    a = AGGREGATORS[0]
    workers = group(a)
    assert len(workers) >= MIN_GROUP
    offered = offers(a, {workers[0]: 50.0})  # 50x the others' norm: the screen refuses it
    honest = combine_group(SPEC, ANN, THETA, offered)
    assert workers[0] in honest.refused and workers[0] not in [s.worker for s in honest.combined]
    # the aggregator combines it anyway (a plain mean of all) and lists every submission
    mean = np.mean([unpack_tensors(pay)["w"] for _, pay in offered], axis=0)
    lie = partial_of(a, offered, submissions=tuple(encode(s) for s, _ in offered),
                     tokens=sum(s.tokens for s, _ in offered), delta_cid=cid_of(pack_tensors({"w": mean})))
    check_partial(lie, ANN, AGGREGATORS, GROUPS)
    with pytest.raises(HashMismatch, match="refuses"):
        replay_partial(lie, {s.worker: pay for s, pay in offered}, SPEC, ANN, THETA)


# --- the two levels of the robust combine -------------------------------------------------------


def test_a_hostile_worker_is_bounded_in_its_group_and_a_hostile_aggregator_across_groups() -> None:
    honest = {w: delta_for(w) for w in BY_ID}
    target = np.mean(list(honest.values()), axis=0)
    results, tokens = {}, {}
    for a in AGGREGATORS:  # one worker of the first group sends 40x its Δ
        g = combine_group(SPEC, ANN, THETA, offers(a, {group(a)[0]: 40.0} if a == AGGREGATORS[0] else None))
        results[a], tokens[a] = g.result.delta, g.result.tokens
    clean = top_level(results, tokens).delta["w"]
    assert np.max(np.abs(clean - target)) < 0.2 * np.max(np.abs(target))
    # an aggregator that sends a Δ of its choosing (its own sum, 1000x) is screened across the groups
    results[AGGREGATORS[1]] = {"w": 1000.0 * target}
    hostile = top_level(results, tokens)
    assert AGGREGATORS[1] in hostile.screened
    assert np.max(np.abs(hostile.delta["w"] - target)) < 0.2 * np.max(np.abs(target))

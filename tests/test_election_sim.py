"""The election in a whole in-memory swarm (trio MockClock, seeded): every node is a
candidate and a worker, the elected one is the shepherd.

After every scenario: the run finishes, every live node holds the same committed θ
and agrees on the term, the winning θ history is one unbroken chain of rounds
0..R-1, and no commit that reached the DHT is lost unless a higher term fenced it.
"""

from __future__ import annotations

import dataclasses

import pytest

from pcp_p2p.core.errors import StaleMessage
from pcp_p2p.diloco.protocol.election import ElectionConfig
from pcp_p2p.diloco.protocol.spec import parse_spec
from pcp_p2p.testing.election_sim import (
    FAULT_POINTS,
    ElectionSimConfig,
    ElectionSimResult,
    Partition,
    ShepherdFault,
    simulate_election,
)
from pcp_p2p.testing.quadratic import settled_loss

ROUNDS = 6
SPEC = parse_spec(
    f"""
[inner]
lr = 0.02
batch_size = 4
seq_len = 8
[round]
time_budget_s = 10.0
deadline_s = 20.0
max_inner_steps = 20
rounds = {ROUNDS}
min_quorum = 2
# These sims test the protocol under faults; the guards against bad Δs are tested in
# tests/test_diloco_byzantine.py, on a version of the toy they fit. Here the quadratic's
# shards are strongly non-IID (an honest θ_k scores up to ~0.16 worse than θ on held-out
# coordinates) and its loss has no floor (honest rounds move it by several x near the end).
[aggregation]
score_tolerance = 0.25
val_jump = 0.0
"""
)
BASE = ElectionSimConfig(spec=SPEC)


def with_election(**kw) -> ElectionSimConfig:
    return dataclasses.replace(BASE, election=dataclasses.replace(BASE.election, **kw))


def check(r: ElectionSimResult, *, fenced_ok: bool = False) -> None:
    assert r.finished, f"not finished: chain {[(c.term, c.round) for c in r.chain]}"
    assert r.final is not None and r.final.round == ROUNDS - 1
    assert [c.round for c in r.chain] == list(range(ROUNDS))
    for a, b in zip(r.chain, r.chain[1:]):
        assert b.prev_theta_cid == a.theta_cid and b.term >= a.term
    assert set(r.theta_cids.values()) == {r.final.theta_cid}  # every live node on the same θ
    assert len(set(r.terms.values())) == 1  # and on the same term
    assert settled_loss(r.val_losses) < 0.5 * r.initial_val_loss, r.val_losses  # training made progress across terms
    on_chain = {(c.term, c.round, c.theta_cid) for c in r.chain}
    off_chain = [c for c in r.published if (c.term, c.round, c.theta_cid) not in on_chain]
    if fenced_ok:  # only commits of a term that a higher one superseded at that round
        by_round = {c.round: c for c in r.chain}
        assert all(c.term < by_round[c.round].term for c in off_chain)
    else:
        assert off_chain == []  # no published commit was lost


def ended(r: ElectionSimResult) -> list[str | None]:
    return [h["ended"] for h in r.history]


async def test_no_faults_one_term_serves_the_whole_run(autojump_clock):
    r = await simulate_election(BASE)
    check(r)
    assert r.history == [{"term": 0, "holder": r.history[0]["holder"], "rounds_served": ROUNDS, "ended": None}]
    assert r.rejected == []


async def test_rotation_every_k_rounds(autojump_clock):
    r = await simulate_election(with_election(rotate_every=2))
    check(r)
    assert [c.term for c in r.chain] == [0, 0, 1, 1, 2, 2]
    assert ended(r)[:3] == ["rotation"] * 3
    assert [h["rounds_served"] for h in r.history[:3]] == [2, 2, 2]
    # late rotation commits are refused by workers only as stale (never a fork)
    assert all(isinstance(e, StaleMessage) for _, _, e in r.rejected)


@pytest.mark.parametrize("point", FAULT_POINTS)
async def test_shepherd_killed(autojump_clock, point):
    r = await simulate_election(dataclasses.replace(BASE, faults=(ShepherdFault(2, point),)))
    check(r)
    assert ended(r)[0] == "failover" and len(r.history) >= 2
    dead = r.history[0]["holder"]
    assert dead not in r.alive and all(h["holder"] != dead for h in r.history[1:])
    # the round in flight was discarded and re-run by the next term from the last commit
    assert [c.term for c in r.chain[:2]] == [0, 0] and r.chain[2].term > 0


@pytest.mark.parametrize("point", ["collect", "aggregate"])
async def test_deposed_shepherd_returns_and_is_fenced(autojump_clock, point):
    # It must wake while the run still goes on (after 40 s the successor, which takes the
    # attempt in flight over, had finished the run before the zombie's stale commit went out).
    r = await simulate_election(dataclasses.replace(BASE, faults=(ShepherdFault(2, point, "hang", 30.0),)))
    check(r, fenced_ok=True)
    zombie = r.history[0]["holder"]
    assert zombie in r.alive  # it came back, follows the new term and holds the final θ
    assert ended(r)[0] == "failover"
    fenced = [e for _, peer, e in r.rejected if peer == zombie and isinstance(e, StaleMessage)]
    assert fenced, "the zombie's announcement/commit of term 0 should have been refused"
    assert all(c.term >= 1 for c in r.chain[2:])


async def test_partition_heals_and_everyone_converges_on_the_higher_term(autojump_clock):
    # Healed while the run is still going (each side has committed rounds of its own by
    # 70 s; the whole run takes about 80 s): see the xfail below for a partition that
    # outlasts the run.
    cfg = dataclasses.replace(BASE, nodes=6, partition=Partition(30.0, 70.0, frozenset({0, 1, 2})))
    r = await simulate_election(cfg)
    check(r, fenced_ok=True)
    terms = {c.term for c in r.published}
    assert len(terms) >= 2  # both sides committed while cut off ...
    losing = [c for c in r.published if c not in r.chain]
    assert losing and all(c.term < r.final.term for c in losing)  # ... and the lower term lost
    assert len(r.alive) == 6


@pytest.mark.xfail(strict=True, reason="known gap: a node that finished the run on the losing side of a "
                   "partition stops there (a finished run takes no commit any more, and no lease is renewed "
                   "after the last round), so the sides do not converge once it heals")
async def test_a_partition_that_outlasts_the_run_converges_once_healed(autojump_clock):
    cfg = dataclasses.replace(BASE, nodes=6, partition=Partition(30.0, 110.0, frozenset({0, 1, 2})))
    check(await simulate_election(cfg), fenced_ok=True)


@pytest.mark.parametrize("seed", [1, 2])
async def test_lossy_network_with_a_failover(autojump_clock, seed):
    cfg = dataclasses.replace(BASE, drop=0.1, delay=(0.0, 1.0), seed=seed, faults=(ShepherdFault(1, "collect"),))
    check(await simulate_election(cfg))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3, 15))
async def test_many_seeds_rotation_failover_and_loss(autojump_clock, seed):
    cfg = dataclasses.replace(
        with_election(rotate_every=2), drop=0.1, delay=(0.0, 1.0), seed=seed,
        faults=(ShepherdFault(3, FAULT_POINTS[seed % 4]),),
    )
    check(await simulate_election(cfg))


def test_default_election_config_is_valid():
    assert ElectionConfig().validate().lease_s > ElectionConfig().renew_every_s

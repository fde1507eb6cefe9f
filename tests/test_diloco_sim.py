"""The in-memory swarm on trio's MockClock, with seeded fault injection.

Every test asserts the protocol's invariants: the run finishes, committed round
numbers strictly increase (0, 1, 2, ...: no gaps, no repeats), every surviving
worker ends holding exactly the final committed θ, and training made progress.
"""

from __future__ import annotations

import numpy as np
import pytest

from pcp_p2p.core.errors import StaleMessage
from pcp_p2p.diloco.protocol.effects import RunInner
from pcp_p2p.diloco.protocol.messages import DataAssignment
from pcp_p2p.diloco.protocol.spec import parse_spec
from pcp_p2p.testing.diloco_sim import KILL_PHASES, Faults, SimConfig, SimResult, WorkerPlan, simulate
from pcp_p2p.testing.quadratic import Quadratic


def spec(rounds: int = 6, quorum: int = 2):
    return parse_spec(
        f"""
[inner]
lr = 0.02
batch_size = 4
seq_len = 8
[round]
time_budget_s = 10.0
deadline_s = 20.0
max_inner_steps = 40
rounds = {rounds}
min_quorum = {quorum}
# These sims test the protocol under faults; the guards against bad Δs are tested in
# tests/test_diloco_byzantine.py, on a version of the toy they fit. Here the quadratic's
# shards are strongly non-IID (an honest θ_k scores up to ~0.16 worse than θ on held-out
# coordinates) and its loss has no floor (honest rounds move it by several x near the end).
[aggregation]
score_tolerance = 0.25
val_jump = 0.0
"""
    )


SPEEDS = (128.0, 64.0, 64.0, 32.0)  # tokens/s: 40, 20, 20, 10 steps of 32 tokens in 10 s


def check_invariants(r: SimResult, rounds: int) -> None:
    assert r.finished, f"run did not finish: {len(r.commits)} commits, rejected {r.rejected[:3]}"
    assert [c.round for c in r.commits] == list(range(rounds))
    assert r.final_theta_cid == r.commits[-1].theta_cid
    for c_prev, c in zip(r.commits, r.commits[1:]):
        assert c.prev_theta_cid == c_prev.theta_cid  # one chain of θ, nothing skipped
    assert r.alive and set(r.worker_theta_cids.values()) == {r.final_theta_cid}
    assert r.val_losses[-1] < 0.5 * r.initial_val_loss


async def test_clean_run_every_worker_ends_on_the_same_theta(autojump_clock):
    r = await simulate(SimConfig(spec=spec(), workers=tuple(WorkerPlan(tokens_per_s=s) for s in SPEEDS)))
    check_invariants(r, 6)
    assert r.discarded == [] and r.rejected == []
    assert all(len(c.participants) == 4 for c in r.commits)
    # token weighting: the fast worker's 39 steps and the slow one's 9 all count (the budget counts
    # from the announcement's arrival, and fetching θ took 0.05 of its 10 s: a step less each)
    assert r.commits[0].tokens == (39 + 19 + 19 + 9) * 32


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_dropped_delayed_duplicated_messages(autojump_clock, seed):
    faults = Faults(drop=0.15, duplicate=0.2, delay=(0.0, 3.0))
    cfg = SimConfig(spec=spec(), workers=tuple(WorkerPlan(tokens_per_s=s) for s in SPEEDS),
                    faults=faults, seed=seed)
    r = await simulate(cfg)
    check_invariants(r, 6)
    # only stale leftovers may be refused: nothing honest is rejected as bad
    assert all(isinstance(e, StaleMessage) for _, _, e in r.rejected), r.rejected


@pytest.mark.parametrize("phase", KILL_PHASES)
async def test_worker_killed_at_each_phase(autojump_clock, phase):
    plans = [WorkerPlan(tokens_per_s=s) for s in SPEEDS]
    plans[1] = WorkerPlan(tokens_per_s=SPEEDS[1], kill_at=(2, phase))
    r = await simulate(SimConfig(spec=spec(), workers=tuple(plans), seed=7))
    check_invariants(r, 6)
    assert len(r.killed) == 1 and len(r.alive) == 3
    (dead,) = r.killed
    assert dead in r.commits[1].participants
    assert all(dead not in c.participants for c in r.commits[3:])


async def test_round_without_quorum_is_retried_and_a_late_joiner_restores_it(autojump_clock):
    # quorum 3 of 3; one dies in round 1 -> attempts are discarded until the dead
    # worker is evicted and a late joiner (t = 200 s) brings the roster back to 3.
    plans = (
        WorkerPlan(tokens_per_s=64.0),
        WorkerPlan(tokens_per_s=64.0),
        WorkerPlan(tokens_per_s=64.0, kill_at=(1, "training")),
        WorkerPlan(tokens_per_s=32.0, join_at=200.0),
    )
    r = await simulate(SimConfig(spec=spec(rounds=4, quorum=3), workers=plans, seed=3))
    check_invariants(r, 4)
    assert (1, 0) in r.discarded  # the round the worker died in had no quorum...
    assert r.commits[1].round == 1 and r.commits[1].attempt >= 1  # ...and was rerun
    late = [p for p in r.alive if all(p not in c.participants for c in r.commits[:1])]
    assert late and all(late[0] in c.participants for c in r.commits[1:])
    assert r.end_time > 200.0


async def test_late_joiner_contributes_from_the_next_round(autojump_clock):
    plans = (*(WorkerPlan(tokens_per_s=s) for s in SPEEDS[:3]), WorkerPlan(tokens_per_s=64.0, join_at=15.0))
    r = await simulate(SimConfig(spec=spec(), workers=plans, seed=5))
    check_invariants(r, 6)
    assert len(r.commits[0].participants) == 3
    assert all(len(c.participants) == 4 for c in r.commits[2:])


@pytest.mark.parametrize(
    "seed", [*range(8), *(pytest.param(s, marks=pytest.mark.slow) for s in range(8, 60))]
)
async def test_heavy_fault_sweep(autojump_clock, seed):
    """30% loss, 30% duplicates, 0-5 s delays, one kill at a random phase, one late joiner."""
    import random

    rr = random.Random(seed)
    plans = [WorkerPlan(tokens_per_s=s) for s in SPEEDS]
    k = rr.randrange(4)
    plans[k] = WorkerPlan(tokens_per_s=SPEEDS[k], kill_at=(rr.randrange(5), rr.choice(KILL_PHASES)))
    plans.append(WorkerPlan(tokens_per_s=48.0, join_at=rr.uniform(0, 100)))
    faults = Faults(drop=0.3, duplicate=0.3, delay=(0.0, 5.0))
    r = await simulate(SimConfig(spec=spec(), workers=tuple(plans), faults=faults, seed=seed))
    check_invariants(r, 6)
    assert all(isinstance(e, StaleMessage) for _, _, e in r.rejected), r.rejected


# --- the toy objective itself ----------------------------------------------------------------


@pytest.mark.parametrize("shards", [2, 3, 4, 7])
def test_the_toys_shard_optima_are_equally_far_from_the_optimum_and_average_to_it(shards):
    # on a line (the toy before 2026-11-28) two of four shards sat at θ* and the others twice as far
    # as with three; honest Δs then differed by more than the norm screen allows
    q = Quadratic.make(np.random.default_rng(5), (8, 4))
    optima = [q.shard_optimum(s, shards) for s in range(shards)]
    dist = [np.sqrt(sum(float(np.sum((o[k] - q.optimum[k]) ** 2)) for k in o)) for o in optima]
    assert max(dist) < 1.0001 * min(dist) and min(dist) > 0.5
    for k in q.optimum:
        assert np.allclose(np.mean([o[k] for o in optima], axis=0), q.optimum[k], atol=1e-5)
    iid = Quadratic.make(np.random.default_rng(5), (8, 4), spread=0.0)  # no spread: every shard at θ*
    assert all(np.array_equal(iid.shard_optimum(s, shards)[k], iid.optimum[k]) for s in range(shards) for k in "wb")


def test_the_toys_inner_run_leaves_the_state_it_started_from_as_it_was():
    # a worker keeps its settled state to train from again if a submission is not committed;
    # an inner run that updated the moments in place would change that state too
    q = Quadratic.make(np.random.default_rng(5), (8, 4))
    s = spec()
    run0 = RunInner(0, 0, q.initial(), "cid", None, DataAssignment("w", 0, 4, 1, 10), 10.0, None)
    settled = q.inner(run0, 10, s).inner_state
    before = {part: {k: v.copy() for k, v in settled[part].items()} for part in ("m", "v")}
    q.inner(RunInner(1, 0, q.initial(), "cid", None, DataAssignment("w", 0, 4, 2, 10), 10.0, settled), 10, s)
    for part in ("m", "v"):
        for k, v in before[part].items():
            assert np.array_equal(settled[part][k], v), (part, k)

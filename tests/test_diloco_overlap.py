"""Overlap (``round.overlap``): the worker's early run of the next round, adopted, shifted or cancelled.

The rules are in :mod:`pcp_p2p.diloco.protocol.worker` ("Overlap"); the engine's side
(the shift on the real executor) is tested in ``test_overlap_engine.py``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pcp_p2p.core.errors import ConfigError, ExecutorError
from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.algorithm.outer import OuterState
from pcp_p2p.diloco.algorithm.params import Params, codec_of, pack_tensors
from pcp_p2p.diloco.protocol.effects import (
    EARLY,
    CancelInner,
    Committed,
    FetchBlob,
    LookupCommit,
    RunInner,
    Send,
    ShiftInner,
    StoreBlob,
)
from pcp_p2p.diloco.protocol.messages import CommitRecord, Join, RoundAnnouncement, Submission, sign
from pcp_p2p.diloco.protocol.shepherd import Phase, Shepherd
from pcp_p2p.diloco.protocol.spec import parse_spec, run_id_of, sign_spec
from pcp_p2p.diloco.protocol.worker import InnerResult, Worker, WorkerPhase
from pcp_p2p.testing.inprocess import pump_run

TOML = """
[inner]
lr = 0.01
batch_size = 2
seq_len = 4
[round]
time_budget_s = 10.0
deadline_s = 20.0
max_inner_steps = 20
rounds = 4
min_quorum = 2
delta_codec = "fp32"
overlap = {overlap}
[aggregation]
audit_rate = 0.0
"""
SPEC = parse_spec(TOML.format(overlap="true"))
SYNC = parse_spec(TOML.format(overlap="false"))
THETA0 = {"w": np.arange(12, dtype=np.float32).reshape(3, 4) / 10, "b": np.ones(4, np.float32)}
OWNER = Identity(bytes([1]) * 32)
RUN_ID = run_id_of(sign_spec(SPEC, OWNER))
IDS = [Identity(bytes([10 + i]) * 32) for i in range(3)]


def sent(effects, kind):
    return [e.message for e in effects if isinstance(e, Send) and isinstance(e.message, kind)]


def of(effects, kind):
    return [e for e in effects if isinstance(e, kind)]


def moved(theta: Params, by: float) -> Params:
    return {k: (v - by).astype(np.float32) for k, v in theta.items()}


class Swarm:
    """A shepherd with three joined workers, round 0 announced; worker 0 is a real ``Worker``."""

    def __init__(self) -> None:
        self.shepherd = Shepherd(spec=SPEC, run_id=RUN_ID, identity=OWNER, term=0, state=OuterState.initial(THETA0))
        effects = []
        for i in IDS:
            join = sign(Join(run_id=RUN_ID, worker=i.peer_id, target="cpu", tokens_per_s=100.0), i)
            effects += self.shepherd.on_join(join, now=0.0)
        effects += self.shepherd.tick(now=self.shepherd.join_grace_s)
        self.ann = sent(effects, RoundAnnouncement)[-1]
        self.w = Worker(spec=SPEC, run_id=RUN_ID, identity=IDS[0], shepherds={0: OWNER.peer_id}, target="cpu",
                        tokens_per_s=100.0)
        self.w.theta, self.w.theta_cid = dict(THETA0), self.ann.theta_cid

    def others_submit(self, ann: RoundAnnouncement, now: float) -> list:
        effects = []
        for who in IDS[1:]:
            sub = Submission(run_id=RUN_ID, term=ann.term, round=ann.round, attempt=ann.attempt, worker=who.peer_id,
                             base_theta_cid=ann.theta_cid, codec="fp32", delta_cid=None,
                             delta_inline=pack_tensors({k: np.full_like(v, 0.01) for k, v in THETA0.items()}, "fp32"),
                             steps=10, tokens=10 * SPEC.tokens_per_step, losses=(1.0,) * 10)
            effects += self.shepherd.on_submission(sign(sub, who), now=now)
        return effects

    def round0(self, state: str = "state-0") -> tuple[RunInner, Submission]:
        """Worker 0 trains and submits round 0: (its early run of round 1, its submission)."""
        (run,) = of(self.w.on_announcement(self.ann, now=0.0), RunInner)
        effects = self.w.on_inner_done(InnerResult(0, 0, moved(run.theta, 0.01), 10, (1.0,) * 10, state), now=5.0)
        (sub,) = sent(effects, Submission)
        (early,) = of(effects, RunInner)
        return early, sub

    def round0_committed(self) -> tuple[RunInner, CommitRecord, RoundAnnouncement, bytes]:
        """Round 0 commits with everyone, worker 0 included: (its early run, the commit, round 1's
        announcement, θ_1's bytes), none of them delivered to worker 0 yet."""
        early, sub = self.round0()
        return early, *self.commit(self.shepherd.on_submission(sub, now=5.0) + self.others_submit(self.ann, now=5.0))

    def commit(self, effects: list) -> tuple[CommitRecord, RoundAnnouncement, bytes]:
        (rec,) = [e.record for e in effects if isinstance(e, Committed)]
        ann = sent(effects, RoundAnnouncement)[0]
        theta = next(e.data for e in effects if isinstance(e, StoreBlob) and e.cid == rec.theta_cid)
        return rec, ann, theta


def test_overlap_needs_audits_off():
    with pytest.raises(ConfigError, match="audit_rate"):
        parse_spec(TOML.format(overlap="true").replace("audit_rate = 0.0", "audit_rate = 0.05"))


def test_on_submitting_the_worker_trains_the_next_round_early_and_adopts_it_when_announced():
    s = Swarm()
    early, sub = s.round0()
    assert (early.round, early.attempt, early.inner_state) == (1, EARLY, "state-0")
    np.testing.assert_array_equal(early.theta["w"], moved(THETA0, 0.01)["w"])  # its own end point
    rec, ann1, theta1 = s.commit(s.shepherd.on_submission(sub, now=5.0) + s.others_submit(s.ann, now=5.0))
    assert ann1.assignment_for(s.w.peer_id) == early.assignment  # it predicted the assignment exactly
    assert of(s.w.on_commit(rec, now=6.0), CancelInner) == []  # the commit lists it: the early run stays
    effects = s.w.on_announcement(ann1, now=6.1)
    assert of(effects, RunInner) == [] and of(effects, CancelInner) == []  # adopted, not restarted
    assert [f.cid for f in of(effects, FetchBlob)] == [rec.theta_cid] and s.w.phase is WorkerPhase.TRAINING
    (shift,) = of(s.w.on_blob(rec.theta_cid, theta1, now=6.2), ShiftInner)
    assert shift.round == 1
    for k in THETA0:
        np.testing.assert_array_equal(shift.to[k], s.w.theta[k])  # the announced θ_1 (no residual in fp32)
    local = moved(shift.to, 0.02)
    effects = s.w.on_inner_done(InnerResult(1, EARLY, local, 10, (1.0,) * 10, "state-1"), now=12.0)
    (sub1,) = sent(effects, Submission)
    assert (sub1.round, sub1.attempt, sub1.base_theta_cid) == (1, 0, ann1.theta_cid)
    delta = codec_of("fp32").decode(sub1.delta_inline)
    np.testing.assert_allclose(delta["w"], 0.02, rtol=1e-5)  # measured from θ_1, the shift included
    (early2,) = of(effects, RunInner)
    assert (early2.round, early2.attempt, early2.inner_state) == (2, EARLY, "state-1")
    assert s.shepherd.on_submission(sub1, now=12.0) == []  # the shepherd takes it as any submission


def test_a_commit_without_the_worker_cancels_the_early_run_and_the_round_trains_from_the_settled_state():
    s = Swarm()
    effects = s.others_submit(s.ann, now=3.0) + s.shepherd.tick(now=100.0)  # committed before worker 0 reports
    rec, ann1, theta1 = s.commit(effects)
    s.round0()  # (its submission comes too late for round 0)
    assert s.w.peer_id not in rec.participants
    assert of(s.w.on_commit(rec, now=101.0), CancelInner) == [CancelInner(1, EARLY)]
    s.w.on_blob(rec.theta_cid, theta1, now=101.1)
    (run,) = of(s.w.on_announcement(ann1, now=101.2), RunInner)
    assert (run.round, run.attempt, run.inner_state) == (1, 0, None)  # the settled state, not round 0's


def test_an_announcement_with_another_assignment_adopts_the_early_run_with_the_announced_data():
    # a join renumbers every shard: the early run is kept, and its shift carries the new assignment
    s = Swarm()
    early, sub = s.round0()
    newcomer = Identity(bytes([13]) * 32)
    effects = s.shepherd.on_join(sign(Join(run_id=RUN_ID, worker=newcomer.peer_id, target="cpu",
                                           tokens_per_s=100.0), newcomer), now=4.0)
    rec, ann1, theta1 = s.commit(effects + s.shepherd.on_submission(sub, now=5.0) + s.others_submit(s.ann, 5.0))
    mine = ann1.assignment_for(s.w.peer_id)
    assert mine is not None and mine != early.assignment  # four shards now
    s.w.on_commit(rec, now=6.0)
    s.w.on_blob(rec.theta_cid, theta1, now=6.1)
    effects = s.w.on_announcement(ann1, now=6.2)
    assert of(effects, CancelInner) == [] and of(effects, RunInner) == []
    (shift,) = of(effects, ShiftInner)
    assert shift.assignment == mine


def test_an_announcement_that_does_not_assign_the_worker_cancels_the_early_run():
    s = Swarm()
    _, rec, ann1, _ = s.round0_committed()
    s.w.on_commit(rec, now=6.0)
    without = sign(dataclasses.replace(
        ann1, assignments=tuple(a for a in ann1.assignments if a.worker != s.w.peer_id)), OWNER)
    effects = s.w.on_announcement(without, now=6.2)
    assert of(effects, CancelInner) == [CancelInner(1, EARLY)] and of(effects, RunInner) == []
    # the cancelled run's late result is not taken for the round
    assert s.w.on_inner_done(InnerResult(1, EARLY, moved(THETA0, 1.0), 10, (1.0,) * 10, "x"), now=7.0) == []


def test_an_adopted_run_is_shifted_only_once_the_commit_it_builds_on_lists_the_worker():
    s = Swarm()
    _, rec, ann1, theta1 = s.round0_committed()
    effects = s.w.on_announcement(ann1, now=6.0)  # overtakes the commit
    assert of(effects, LookupCommit) and of(effects, RunInner) == []
    assert of(s.w.on_blob(rec.theta_cid, theta1, now=6.1), ShiftInner) == []  # held for the commit
    (shift,) = of(s.w.on_commit(rec, now=6.2), ShiftInner)
    assert shift.round == 1 and s.w.inner_state == "state-0"


def test_a_hold_that_ends_without_the_commit_cancels_the_adopted_run_and_trains_from_the_settled_state():
    s = Swarm()
    _, rec, ann1, theta1 = s.round0_committed()
    s.w.on_announcement(ann1, now=6.0)
    s.w.on_blob(rec.theta_cid, theta1, now=6.1)
    effects = s.w.tick(now=s.w.next_wakeup)
    assert of(effects, CancelInner) == [CancelInner(1, EARLY)]
    (run,) = of(effects, RunInner)
    assert (run.round, run.attempt, run.inner_state) == (1, 0, None)


def test_an_early_run_that_fails_leaves_the_round_to_its_announcement():
    # (a worker group's engine refuses early runs: the round is then trained when announced)
    s = Swarm()
    _, sub = s.round0()
    assert s.w.on_inner_failed(1, EARLY, ExecutorError("no early runs here"), now=5.1)
    rec, ann1, theta1 = s.commit(s.shepherd.on_submission(sub, now=5.0) + s.others_submit(s.ann, now=5.0))
    s.w.on_commit(rec, now=6.0)
    s.w.on_blob(rec.theta_cid, theta1, now=6.1)
    (run,) = of(s.w.on_announcement(ann1, now=6.2), RunInner)
    assert (run.round, run.attempt, run.inner_state) == (1, 0, "state-0")
    # and it does not try again: an engine that cannot run early would fail every round
    effects = s.w.on_inner_done(InnerResult(1, 0, moved(run.theta, 0.01), 10, (1.0,) * 10, "state-1"), now=12.0)
    assert sent(effects, Submission) and of(effects, RunInner) == []


def test_no_early_run_after_the_last_round_or_without_overlap():
    s = Swarm()
    s.w.spec = SYNC
    _, = of(s.w.on_announcement(s.ann, now=0.0), RunInner)
    effects = s.w.on_inner_done(InnerResult(0, 0, moved(THETA0, 0.01), 10, (1.0,) * 10, "s"), now=5.0)
    assert of(effects, RunInner) == []
    last = dataclasses.replace(s.ann, round=SPEC.round.rounds - 1)
    s.w.spec = SPEC
    assert s.w._start_early(last, InnerResult(last.round, 0, THETA0, 10, (), "s")) == []


def _inner(worker: str, e: RunInner) -> InnerResult:
    """A deterministic inner loop: θ moves by a step fixed by the assignment's seed."""
    rng = np.random.default_rng(e.assignment.seed)
    theta = {k: (v - 0.01 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in e.theta.items()}
    return InnerResult(e.round, e.attempt, theta, 10, (1.0,) * 10, f"{worker[:8]}-{e.round}")


def _run(spec) -> tuple[list[CommitRecord], int]:
    shepherd = Shepherd(spec=spec, run_id=RUN_ID, identity=OWNER, term=0, state=OuterState.initial(THETA0))
    workers = {i.peer_id: Worker(spec=spec, run_id=RUN_ID, identity=i, shepherds={0: OWNER.peer_id},
                                 target="cpu", tokens_per_s=100.0) for i in IDS}
    log = pump_run(shepherd, workers, _inner)
    assert shepherd.phase is Phase.FINISHED
    return log.commits, log.early_runs


def test_an_overlapped_run_whose_exchange_takes_no_time_commits_exactly_the_synchronous_rounds():
    sync, no_early = _run(SYNC)
    overlapped, early = _run(SPEC)
    assert no_early == 0
    assert early == len(IDS) * (SPEC.round.rounds - 1)  # every round after the first, every worker
    assert [(c.round, c.participants, c.theta_cid) for c in overlapped] == [
        (c.round, c.participants, c.theta_cid) for c in sync]


def test_a_retried_attempt_does_not_take_over_an_adopted_early_run():
    s = Swarm()
    _, rec, ann1, theta1 = s.round0_committed()
    s.w.on_commit(rec, now=6.0)
    s.w.on_blob(rec.theta_cid, theta1, now=6.1)
    assert of(s.w.on_announcement(ann1, now=6.2), ShiftInner)  # adopted for attempt 0, shifted
    retry = sign(dataclasses.replace(ann1, attempt=1), OWNER)  # (attempt 0 discarded, say)
    effects = s.w.on_announcement(retry, now=30.0)
    assert of(effects, CancelInner) == [CancelInner(1, EARLY)]
    (run,) = of(effects, RunInner)
    assert (run.round, run.attempt) == (1, 1)
    assert s.w.on_inner_done(InnerResult(1, EARLY, moved(THETA0, 1.0), 10, (1.0,) * 10, "x"), now=31.0) == []

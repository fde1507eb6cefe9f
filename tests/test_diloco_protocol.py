"""The round state machines fed by hand: every bad input is refused with a typed
error, and the round still commits with the honest submissions."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest

from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import (
    BadSignature,
    ConfigError,
    HashMismatch,
    QuorumError,
    RejectedUpdate,
    StaleMessage,
)
from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.algorithm.checkpoint import decode_checkpoint
from pcp_p2p.diloco.algorithm.outer import OuterState
from pcp_p2p.diloco.algorithm.params import pack_tensors, params_cid
from pcp_p2p.diloco.protocol.effects import (
    CancelInner,
    Committed,
    Discarded,
    FetchBlob,
    LookupCommit,
    Rejected,
    RunInner,
    Send,
    StoreBlob,
)
from pcp_p2p.diloco.protocol.messages import CommitRecord, Join, RoundAnnouncement, Submission, sign
from pcp_p2p.diloco.protocol.shepherd import Shepherd
from pcp_p2p.diloco.protocol.spec import parse_spec, run_id_of, sign_spec
from pcp_p2p.diloco.protocol.worker import InnerResult, Worker, WorkerPhase

SPEC = parse_spec(
    """
[inner]
lr = 0.01
batch_size = 2
seq_len = 4
[round]
time_budget_s = 10.0
deadline_s = 20.0
max_inner_steps = 20
rounds = 5
min_quorum = 2
delta_codec = "fp32"
"""
)
BT = SPEC.tokens_per_step
THETA0 = {"w": np.arange(12, dtype=np.float32).reshape(3, 4) / 10, "b": np.ones(4, np.float32)}


def ident(i: int) -> Identity:
    return Identity(bytes([i]) * 32)


OWNER = ident(1)
RUN_ID = run_id_of(sign_spec(SPEC, OWNER))


def sent(effects, kind):
    return [e.message for e in effects if isinstance(e, Send) and isinstance(e.message, kind)]


def rejections(effects):
    return [e.error for e in effects if isinstance(e, Rejected)]


class Round:
    """A shepherd with three joined workers and round 0 announced."""

    def __init__(self, spec=SPEC, n=3, tokens_per_s=100.0):
        self.spec = spec
        self.shepherd = Shepherd(
            spec=spec, run_id=RUN_ID, identity=OWNER, term=0, state=OuterState.initial(THETA0)
        )
        self.ids = [ident(10 + i) for i in range(n)]
        effects = []
        for i in self.ids:
            join = sign(Join(run_id=RUN_ID, worker=i.peer_id, target="cpu", tokens_per_s=tokens_per_s), i)
            effects += self.shepherd.on_join(join, now=0.0)
        assert sent(effects, RoundAnnouncement) == []  # waits for more joiners first
        assert self.shepherd.next_wakeup == self.shepherd.join_grace_s
        effects += self.shepherd.tick(now=self.shepherd.join_grace_s)
        anns = sent(effects, RoundAnnouncement)
        assert anns, "the shepherd announces once the quorum has joined"
        self.ann = anns[-1]

    def submission(self, who: Identity, delta=None, steps=10, ann=None, **over) -> Submission:
        ann = ann or self.ann
        delta = delta if delta is not None else {k: np.full_like(v, 0.01) for k, v in THETA0.items()}
        sub = Submission(
            run_id=ann.run_id,
            term=ann.term,
            round=ann.round,
            attempt=ann.attempt,
            worker=who.peer_id,
            base_theta_cid=ann.theta_cid,
            codec="fp32",
            delta_cid=None,
            delta_inline=pack_tensors(delta, "fp32"),
            steps=steps,
            tokens=steps * BT,
            losses=(1.0,) * steps,
        )
        return sign(dataclasses.replace(sub, **over), who)

    def honest_rest_commits(self, skip: int = 0) -> CommitRecord:
        """The other workers submit honestly and the round commits."""
        effects = []
        for who in self.ids[skip:]:
            effects += self.shepherd.on_submission(self.submission(who), now=3.0)
        effects += self.shepherd.tick(now=100.0)
        commits = [e.record for e in effects if isinstance(e, Committed)]
        assert len(commits) == 1, rejections(effects)
        return commits[0]


def nan_payload(value: float) -> bytes:
    """An fp32 bundle with one value replaced by NaN/inf (the encoder refuses to make one)."""
    good = pack_tensors({k: np.full_like(v, 0.5) for k, v in THETA0.items()}, "fp32")
    needle = struct.pack("<f", 0.5)
    i = good.rindex(needle)
    return good[:i] + struct.pack("<f", value) + good[i + 4 :]


# --- aggregator: each bad submission refused, round goes on ----------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_delta_is_rejected(bad):
    r = Round()
    sub = r.submission(r.ids[0])
    sub = sign(dataclasses.replace(sub, delta_inline=nan_payload(bad)), r.ids[0])
    errs = rejections(r.shepherd.on_submission(sub, now=3.0))
    assert len(errs) == 1 and isinstance(errs[0], RejectedUpdate)
    rec = r.honest_rest_commits(skip=1)
    assert r.ids[0].peer_id not in rec.participants and len(rec.participants) == 2


def test_absurd_norm_is_rejected():
    r = Round()
    huge = {k: np.full_like(v, 1e3) for k, v in THETA0.items()}
    errs = rejections(r.shepherd.on_submission(r.submission(r.ids[0], delta=huge), now=3.0))
    assert len(errs) == 1 and isinstance(errs[0], RejectedUpdate) and "bound" in str(errs[0])
    r.honest_rest_commits(skip=1)


@pytest.mark.parametrize(
    "delta",
    [
        {"w": np.zeros((4, 3), np.float32), "b": np.zeros(4, np.float32)},  # transposed
        {"w": np.zeros((3, 4), np.float32)},  # a tensor missing
        {"w": np.zeros((3, 4), np.float32), "b": np.zeros(4, np.float32), "x": np.zeros(1, np.float32)},
    ],
    ids=["transposed", "missing", "extra"],
)
def test_wrong_shapes_are_rejected(delta):
    r = Round()
    errs = rejections(r.shepherd.on_submission(r.submission(r.ids[0], delta=delta), now=3.0))
    assert len(errs) == 1 and isinstance(errs[0], RejectedUpdate)
    r.honest_rest_commits(skip=1)


def test_submission_replayed_from_an_earlier_round_is_stale():
    r = Round()
    old = r.submission(r.ids[0])
    rec = r.honest_rest_commits()
    assert rec.round == 0 and r.shepherd.state.round == 1
    errs = rejections(r.shepherd.on_submission(old, now=150.0))
    assert len(errs) == 1 and isinstance(errs[0], StaleMessage)
    assert r.shepherd.state.round == 1 and r.shepherd.round_agg.accepted == {}


def test_submission_for_another_run_is_rejected():
    r = Round()
    errs = rejections(r.shepherd.on_submission(r.submission(r.ids[0], run_id=cid_of(b"other")), now=3.0))
    assert len(errs) == 1 and isinstance(errs[0], RejectedUpdate) and "another run" in str(errs[0])
    r.honest_rest_commits(skip=1)


def test_submission_from_an_unknown_peer_is_rejected():
    r = Round()
    stranger = ident(99)
    errs = rejections(r.shepherd.on_submission(r.submission(stranger), now=3.0))
    assert len(errs) == 1 and isinstance(errs[0], RejectedUpdate) and "not assigned" in str(errs[0])
    rec = r.honest_rest_commits()
    assert stranger.peer_id not in rec.participants


def test_forged_submission_signature_is_rejected():
    r = Round()
    sub = r.submission(r.ids[0])
    forged = dataclasses.replace(sub, tokens=sub.tokens)  # same content...
    forged = dataclasses.replace(forged, signature=ident(98).sign(b"x"))  # ...wrong key
    errs = rejections(r.shepherd.on_submission(forged, now=3.0))
    assert len(errs) == 1 and isinstance(errs[0], BadSignature)


def test_worker_claiming_more_tokens_than_its_speed_allows_is_rejected():
    # 100 tokens/s x 10 s x slack 1.5 / 8 tokens per step -> at most 188 steps, capped at 20
    r = Round(tokens_per_s=8.0)  # 8 tok/s x 10 s x 1.5 / 8 -> 15 steps
    assert all(a.max_steps == 15 for a in r.ann.assignments)
    errs = rejections(r.shepherd.on_submission(r.submission(r.ids[0], steps=20), now=3.0))
    assert len(errs) == 1 and isinstance(errs[0], RejectedUpdate) and "speed" in str(errs[0])
    # tokens that do not match steps x B x T are refused too
    sub = r.submission(r.ids[1], steps=10, tokens=10 * BT * 100)
    errs = rejections(r.shepherd.on_submission(sub, now=3.0))
    assert len(errs) == 1 and isinstance(errs[0], RejectedUpdate)


def test_duplicate_delivery_is_idempotent():
    r = Round()
    sub = r.submission(r.ids[0])
    assert r.shepherd.on_submission(sub, now=3.0) == []
    assert r.shepherd.on_submission(sub, now=1.1) == []
    assert list(r.shepherd.round_agg.accepted) == [r.ids[0].peer_id]


PLAIN_MEAN = dataclasses.replace(
    SPEC, aggregation=dataclasses.replace(SPEC.aggregation, rule="mean", max_share=1.0, norm_vs_median=0.0)
)


@pytest.mark.parametrize(
    "spec, mean",
    [
        (PLAIN_MEAN, (15 * 0.01 + 5 * 0.04) / 20),  # token-weighted
        (SPEC, (0.01 + 0.04) / 2),  # default: max_share 0.5 caps 75 % / 25 % at equal shares
    ],
    ids=["plain-mean", "capped-trimmed-mean"],
)
def test_token_weighted_mean_and_nesterov_step(spec, mean):
    r = Round(spec=spec)
    d1 = {k: np.full_like(v, 0.01) for k, v in THETA0.items()}
    d2 = {k: np.full_like(v, 0.04) for k, v in THETA0.items()}
    effects = r.shepherd.on_submission(r.submission(r.ids[0], delta=d1, steps=15), now=3.0)
    effects += r.shepherd.on_submission(r.submission(r.ids[1], delta=d2, steps=5), now=3.0)
    effects += r.shepherd.tick(now=100.0)  # third worker never reports
    (rec,) = [e.record for e in effects if isinstance(e, Committed)]
    # first outer step from v = 0: v = d, theta = theta - lr (mu v + d) = theta - lr (1 + mu) d
    expect = THETA0["w"] - 0.7 * (1 + 0.9) * mean
    np.testing.assert_allclose(r.shepherd.state.theta["w"], expect, rtol=1e-6)
    np.testing.assert_allclose(r.shepherd.state.momentum["w"], mean, rtol=1e-6)
    assert rec.tokens == 20 * BT and rec.participants == tuple(sorted([r.ids[0].peer_id, r.ids[1].peer_id]))
    assert rec.theta_cid == params_cid(r.shepherd.state.theta)
    # the checkpoint blob holds exactly the committed state
    blobs = {e.cid: e.data for e in effects if isinstance(e, StoreBlob)}
    ckpt = decode_checkpoint(blobs[rec.checkpoint_cid])
    assert ckpt.state.round == 1 and params_cid(ckpt.state.theta) == rec.theta_cid


# --- quorum, deadline, retry -------------------------------------------------------


def test_round_without_quorum_is_discarded_and_retried():
    r = Round()
    e = r.shepherd.on_submission(r.submission(r.ids[0]), now=3.0)
    assert e == []
    assert r.shepherd.tick(now=21.9) == []  # before the deadline nothing happens
    effects = r.shepherd.tick(now=22.0)
    (disc,) = [x for x in effects if isinstance(x, Discarded)]
    assert isinstance(disc.error, QuorumError)
    anns = sent(effects, RoundAnnouncement)
    assert len({a.signature for a in anns}) == 1
    ann = anns[0]
    assert (ann.round, ann.attempt, ann.theta_cid) == (0, 1, r.ann.theta_cid)
    assert r.shepherd.state.round == 0  # nothing applied
    # a submission for the discarded attempt is stale now; the retry commits
    errs = rejections(r.shepherd.on_submission(r.submission(r.ids[0]), now=23.0))
    assert isinstance(errs[0], StaleMessage)
    r.ann = ann
    rec = r.honest_rest_commits()
    assert (rec.round, rec.attempt) == (0, 1)


def test_everyone_reported_commits_before_the_deadline():
    r = Round()
    effects = []
    for who in r.ids:
        effects += r.shepherd.on_submission(r.submission(who), now=3.0)
    assert any(isinstance(e, Committed) for e in effects)
    anns = sent(effects, RoundAnnouncement)
    assert len({a.signature for a in anns}) == 1
    ann = anns[0]
    assert ann.round == 1


def test_failover_shepherd_continues_from_the_checkpoint():
    r = Round()
    effects = []
    for who in r.ids:
        effects += r.shepherd.on_submission(r.submission(who), now=3.0)
    (rec,) = [e.record for e in effects if isinstance(e, Committed)]
    blobs = {e.cid: e.data for e in effects if isinstance(e, StoreBlob)}
    new = Shepherd.from_checkpoint(
        spec=SPEC, run_id=RUN_ID, identity=ident(2), term=1, checkpoint=blobs[rec.checkpoint_cid]
    )
    assert new.state.round == 1 and new.theta_cid == rec.theta_cid
    for k in THETA0:
        np.testing.assert_array_equal(new.state.momentum[k], r.shepherd.state.momentum[k])
    with pytest.raises(StaleMessage):
        Shepherd.from_checkpoint(spec=SPEC, run_id=RUN_ID, identity=ident(2), term=-1,
                                 checkpoint=blobs[rec.checkpoint_cid])


# --- worker side -------------------------------------------------------------------


def make_worker(i: int = 10) -> Worker:
    return Worker(spec=SPEC, run_id=RUN_ID, identity=ident(i), shepherds={0: OWNER.peer_id},
                  target="cpu", tokens_per_s=100.0)


def test_worker_round_trip_and_hash_checked_theta():
    r = Round()
    w = make_worker(10)
    effects = w.on_announcement(r.ann, now=0.0)
    (fetch,) = [e for e in effects if isinstance(e, FetchBlob)]
    assert fetch.cid == r.ann.theta_cid and w.phase is WorkerPhase.FETCHING
    good = pack_tensors(THETA0, "fp32")
    tampered = pack_tensors({k: v + 1 for k, v in THETA0.items()}, "fp32")
    effects = w.on_blob(fetch.cid, tampered, now=0.1)
    assert isinstance(rejections(effects)[0], HashMismatch) and w.phase is WorkerPhase.FETCHING
    assert any(isinstance(e, FetchBlob) for e in effects)  # asks again
    (run,) = [e for e in w.on_blob(fetch.cid, good, now=0.2) if isinstance(e, RunInner)]
    local = {k: v - 0.02 for k, v in run.theta.items()}
    effects = w.on_inner_done(InnerResult(0, 0, local, 10, (1.0,) * 10, "adam-state"), now=10.0)
    (sub,) = sent(effects, Submission)
    assert w.inner_state is None and w.pending_state == (0, 0, "adam-state")  # until a commit takes it
    assert r.shepherd.on_submission(sub, now=10.1) == []
    assert r.shepherd.round_agg.accepted[w.peer_id].tokens == 10 * BT


def test_announcement_not_signed_by_the_runs_shepherd_is_rejected():
    r = Round()
    w = make_worker(10)
    impostor = ident(66)
    fake = sign(dataclasses.replace(r.ann, shepherd=impostor.peer_id), impostor)
    errs = rejections(w.on_announcement(fake, now=0.0))
    assert len(errs) == 1 and isinstance(errs[0], BadSignature)
    forged = dataclasses.replace(r.ann, deadline=r.ann.deadline + 1)  # the real shepherd's name, stale sig
    errs = rejections(w.on_announcement(forged, now=0.0))
    assert len(errs) == 1 and isinstance(errs[0], BadSignature)
    assert w.phase is WorkerPhase.IDLE and w.current is None
    assert any(isinstance(e, FetchBlob) for e in w.on_announcement(r.ann, now=0.0))


def test_commit_with_a_lower_round_is_rejected():
    r = Round()
    rec0 = r.honest_rest_commits()
    sh = r.shepherd
    effects = []
    for who in r.ids:
        ann = sh.round_agg.announcement
        effects += sh.on_submission(r.submission(who, ann=ann), now=200.0)
    (rec1,) = [e.record for e in effects if isinstance(e, Committed)]
    assert (rec0.round, rec1.round) == (0, 1)
    w = make_worker(10)
    w.on_commit(rec1, now=300.0)
    errs = rejections(w.on_commit(rec0, now=301.0))
    assert len(errs) == 1 and isinstance(errs[0], StaleMessage)
    assert w.last_commit == rec1
    # a second, different commit for the same round is refused too
    other = sign(dataclasses.replace(rec1, theta_cid=rec0.theta_cid), OWNER)
    assert isinstance(rejections(w.on_commit(other, now=302.0))[0], StaleMessage)
    # and an announcement that does not start from the committed θ
    ann2 = sh.round_agg.announcement
    bad_ann = sign(dataclasses.replace(ann2, theta_cid=rec0.theta_cid), OWNER)
    assert rejections(w.on_announcement(bad_ann, now=303.0))


def test_newer_announcement_cancels_training_and_old_result_is_ignored():
    r = Round()
    w = make_worker(10)
    w.theta, w.theta_cid = dict(THETA0), r.ann.theta_cid
    w.held_artifacts = set()
    assert any(isinstance(e, RunInner) for e in w.on_announcement(r.ann, now=0.0))
    retry = sign(dataclasses.replace(r.ann, attempt=1), OWNER)
    effects = w.on_announcement(retry, now=25.0)
    assert any(isinstance(e, CancelInner) for e in effects)
    assert any(isinstance(e, RunInner) and e.attempt == 1 for e in effects)
    assert w.on_inner_done(InnerResult(0, 0, dict(THETA0), 5, (1.0,), None), now=26.0) == []


def test_term_change_makes_old_shepherd_stale():
    r = Round()
    w = make_worker(10)
    w.set_shepherd(1, ident(2).peer_id)
    errs = rejections(w.on_announcement(r.ann, now=0.0))  # term 0 after term 1 was seen
    assert len(errs) == 1 and isinstance(errs[0], StaleMessage)
    ann1 = sign(dataclasses.replace(r.ann, term=1, shepherd=ident(2).peer_id), ident(2))
    assert any(isinstance(e, FetchBlob) for e in w.on_announcement(ann1, now=3.0))


def test_large_delta_travels_as_a_hash_checked_blob(monkeypatch):
    import pcp_p2p.diloco.protocol.worker as worker_mod

    monkeypatch.setattr(worker_mod, "INLINE_DELTA_LIMIT", 16)
    r = Round()
    subs, blobs = [], {}
    for i in (10, 11):
        w = make_worker(i)
        w.theta, w.theta_cid = dict(THETA0), r.ann.theta_cid
        (run,) = [e for e in w.on_announcement(r.ann, now=2.0) if isinstance(e, RunInner)]
        local = {k: v - 0.01 * (i - 9) for k, v in run.theta.items()}
        effects = w.on_inner_done(InnerResult(0, 0, local, 10, (1.0,), None), now=12.0)
        (sub,) = sent(effects, Submission)
        assert sub.delta_inline is None and sub.delta_cid is not None
        blobs.update({e.cid: e.data for e in effects if isinstance(e, StoreBlob)})
        (fetch,) = [e for e in r.shepherd.on_submission(sub, now=12.1) if isinstance(e, FetchBlob)]
        assert fetch.cid == sub.delta_cid and fetch.hint == w.peer_id
        subs.append(sub)
    # the first arrives intact, the second corrupted: refused with HashMismatch, round goes on
    assert r.shepherd.on_blob(subs[0].delta_cid, blobs[subs[0].delta_cid], now=12.2) == []
    corrupt = bytearray(blobs[subs[1].delta_cid])
    corrupt[-1] ^= 1
    errs = rejections(r.shepherd.on_blob(subs[1].delta_cid, bytes(corrupt), now=12.3))
    assert len(errs) == 1 and isinstance(errs[0], HashMismatch)
    assert list(r.shepherd.round_agg.accepted) == [subs[0].worker]


def test_diverged_inner_loop_submits_nothing():
    r = Round()
    w = make_worker(10)
    w.theta, w.theta_cid = dict(THETA0), r.ann.theta_cid
    w.on_announcement(r.ann, now=2.0)
    nan_theta = {k: np.full_like(v, np.nan) for k, v in THETA0.items()}
    effects = w.on_inner_done(InnerResult(0, 0, nan_theta, 10, (1.0,), None), now=12.0)
    assert sent(effects, Submission) == [] and len(rejections(effects)) == 1
    assert w.phase is WorkerPhase.IDLE


def test_silent_worker_looks_up_the_commit_and_joins_again():
    w = make_worker(10)
    effects = w.start(now=0.0)
    assert len(sent(effects, Join)) == 1 and any(isinstance(e, LookupCommit) for e in effects)
    assert w.tick(now=SPEC.round.deadline_s - 1) == []
    effects = w.tick(now=SPEC.round.deadline_s)
    assert any(isinstance(e, LookupCommit) for e in effects) and sent(effects, Join)
    assert w.tick(now=SPEC.round.deadline_s + 1) == []  # once per deadline, not every tick


def test_join_is_checked():
    sh = Shepherd(spec=SPEC, run_id=RUN_ID, identity=OWNER, term=0, state=OuterState.initial(THETA0),
                  artifacts={"cpu-x86_64-v3": cid_of(b"vmfb")})
    w = ident(10)
    cases = [
        (sign(Join(run_id=cid_of(b"other"), worker=w.peer_id, target="cpu-x86_64-v3", tokens_per_s=1.0), w),
         RejectedUpdate),
        (sign(Join(run_id=RUN_ID, worker=w.peer_id, target="cuda-sm_80", tokens_per_s=1.0), w), RejectedUpdate),
        (sign(Join(run_id=RUN_ID, worker=w.peer_id, target="cpu-x86_64-v3", tokens_per_s=1.0), ident(11)),
         BadSignature),
    ]
    for join, err in cases:
        errs = rejections(sh.on_join(join, now=0.0))
        assert len(errs) == 1 and isinstance(errs[0], err)
    assert sh.roster == {}
    ok = sign(Join(run_id=RUN_ID, worker=w.peer_id, target="cpu-x86_64-v3", tokens_per_s=1.0), w)
    assert sh.on_join(ok, now=0.0) == [] and list(sh.roster) == [w.peer_id]


def test_artifacts_must_be_for_allowed_targets():
    with pytest.raises(ConfigError, match="does not allow"):
        Shepherd(spec=SPEC, run_id=RUN_ID, identity=OWNER, term=0, state=OuterState.initial(THETA0),
                 artifacts={"metal-spirv": cid_of(b"vmfb")})


def test_identical_delta_blobs_from_two_workers_are_both_counted(monkeypatch):
    import pcp_p2p.diloco.protocol.worker as worker_mod

    monkeypatch.setattr(worker_mod, "INLINE_DELTA_LIMIT", 16)
    r = Round(n=2)
    blobs, fetches = {}, []
    for i in (10, 11):
        w = make_worker(i)
        w.theta, w.theta_cid = dict(THETA0), r.ann.theta_cid
        w.on_announcement(r.ann, now=2.0)
        local = {k: v - 0.01 for k, v in THETA0.items()}  # the same Δ from both
        effects = w.on_inner_done(InnerResult(0, 0, local, 10, (1.0,), None), now=12.0)
        blobs.update({e.cid: e.data for e in effects if isinstance(e, StoreBlob)})
        fetches += [e for e in r.shepherd.on_submission(sent(effects, Submission)[0], now=12.1)
                    if isinstance(e, FetchBlob)]
    assert len(blobs) == 1 and len(fetches) == 1  # one CID, fetched once
    effects = r.shepherd.on_blob(fetches[0].cid, blobs[fetches[0].cid], now=12.2)
    (rec,) = [e.record for e in effects if isinstance(e, Committed)]
    assert len(rec.participants) == 2
    assert r.shepherd.round_agg.accepted == {}  # nothing leaked into the next round


# --- a failover's successor takes the attempt in flight over ----------------------------


def successor(term: int = 1) -> Shepherd:
    """The next term's shepherd, on another node, starting from the same committed θ."""
    return Shepherd(spec=SPEC, run_id=RUN_ID, identity=ident(2), term=term, state=OuterState.initial(THETA0))


def test_successor_commits_the_dead_terms_attempt_without_announcing_again():
    r = Round()
    dead_worker = r.ids[0]  # (the dead shepherd's own worker: it will never report)
    new = successor()
    assert new.adopt(r.ann, now=5.0, gone={dead_worker.peer_id}) == []
    # closes at the announcement's deadline, but within one to two time budgets of the takeover
    assert new.adopted == r.ann
    assert new.deadline == min(max(r.ann.deadline, 5.0 + SPEC.round.time_budget_s), 5.0 + 2 * SPEC.round.time_budget_s)
    effects = []
    for who in r.ids[1:]:  # the submissions they signed for term 0, sent again
        effects += new.on_submission(r.submission(who), now=6.0)
    assert sent(effects, RoundAnnouncement) == []  # round 1 waits for joins: nobody joined this term yet
    (rec,) = [e.record for e in effects if isinstance(e, Committed)]
    assert (rec.term, rec.round, rec.attempt, rec.shepherd) == (1, 0, r.ann.attempt, ident(2).peer_id)
    assert rec.participants == tuple(sorted(w.peer_id for w in r.ids[1:]))
    # the same θ the dead shepherd would have committed from the same two submissions
    for who in r.ids[1:]:
        r.shepherd.on_submission(r.submission(who), now=6.0)
    (old,) = [e.record for e in r.shepherd.tick(now=100.0) if isinstance(e, Committed)]
    assert old.theta_cid == rec.theta_cid


def test_successor_checks_every_adopted_submission_as_its_own():
    r = Round()
    new = successor()
    new.adopt(r.ann, now=5.0)
    forged = dataclasses.replace(r.submission(r.ids[1]), steps=11)  # signature no longer matches
    assert isinstance(rejections(new.on_submission(forged, now=6.0))[0], BadSignature)
    greedy = r.submission(r.ids[2], steps=10_000)
    assert isinstance(rejections(new.on_submission(greedy, now=6.0))[0], RejectedUpdate)


@pytest.mark.parametrize("change", ["round", "theta", "same term"])
def test_only_the_attempt_from_the_terms_own_start_is_adopted(change):
    r = Round()
    new = successor()
    ann = {"round": dataclasses.replace(r.ann, round=1),
           "theta": dataclasses.replace(r.ann, theta_cid=params_cid({"w": THETA0["w"] + 1})),
           "same term": dataclasses.replace(r.ann, term=1)}[change]
    assert new.adopt(sign(ann, OWNER), now=5.0) == [] and new.adopted is None and new.deadline is None
    # an old term's submission offered to a shepherd that took nothing over: ignored, no fault
    assert new.on_submission(r.submission(r.ids[1]), now=6.0) == []


def test_worker_sends_its_submission_again_to_the_next_term_that_starts_from_its_theta():
    r = Round()
    w = make_worker(10)
    w.theta, w.theta_cid = dict(THETA0), r.ann.theta_cid
    w.on_announcement(r.ann, now=0.0)
    effects = w.on_inner_done(InnerResult(0, 0, {k: v - 0.02 for k, v in THETA0.items()}, 10, (1.0,) * 10, None),
                              now=10.0)
    (sub,) = sent(effects, Submission)
    new = ident(2).peer_id
    effects = w.set_shepherd(1, new, now=12.0, base=(0, r.ann.theta_cid))
    assert [e.to for e in effects if isinstance(e, Send)] == [new, new]
    assert sent(effects, Submission) == [sub] and len(sent(effects, Join)) == 1
    # a term that starts from another commit takes nothing over: join only
    w2 = make_worker(10)
    w2.theta, w2.theta_cid = dict(THETA0), r.ann.theta_cid
    w2.on_announcement(r.ann, now=0.0)
    w2.on_inner_done(InnerResult(0, 0, dict(THETA0), 10, (1.0,) * 10, None), now=10.0)
    assert sent(w2.set_shepherd(1, new, now=12.0, base=(1, "other")), Submission) == []


def test_worker_still_training_submits_to_the_next_term_that_starts_from_its_theta():
    r = Round()
    w = make_worker(10)
    w.theta, w.theta_cid = dict(THETA0), r.ann.theta_cid
    assert any(isinstance(e, RunInner) for e in w.on_announcement(r.ann, now=0.0))
    new = ident(2).peer_id
    assert sent(w.set_shepherd(1, new, now=5.0, base=(0, r.ann.theta_cid)), Submission) == []
    effects = w.on_inner_done(InnerResult(0, 0, dict(THETA0), 10, (1.0,) * 10, None), now=10.0)
    assert [(e.to, type(e.message)) for e in effects if isinstance(e, Send)] == [(new, Submission)]


def _overtaken_commit(r: Round, w: Worker):
    """``w`` submitted round 0 with inner state "state-0"; the round committed; returns
    (commit of round 0, announcement of round 1, θ_1's bytes) without delivering them."""
    w.theta, w.theta_cid = dict(THETA0), r.ann.theta_cid
    (run,) = [e for e in w.on_announcement(r.ann, now=0.0) if isinstance(e, RunInner)]
    local = {k: v - 0.01 for k, v in run.theta.items()}
    (sub,) = sent(w.on_inner_done(InnerResult(0, 0, local, 10, (1.0,) * 10, "state-0"), now=5.0), Submission)
    effects = r.shepherd.on_submission(sub, now=5.0)
    for who in r.ids[1:]:
        effects += r.shepherd.on_submission(r.submission(who), now=5.0)
    (rec,) = [e.record for e in effects if isinstance(e, Committed)]
    assert w.peer_id in rec.participants
    ann1 = sent(effects, RoundAnnouncement)[0]  # the same message goes to each worker
    theta1 = next(e.data for e in effects if isinstance(e, StoreBlob) and e.cid == rec.theta_cid)
    return rec, ann1, theta1


def test_an_announcement_that_overtakes_the_commit_waits_for_it_to_settle_the_inner_state():
    r = Round()
    w = make_worker(10)
    rec, ann1, theta1 = _overtaken_commit(r, w)
    effects = w.on_announcement(ann1, now=6.0)  # before the commit of the round we submitted
    assert any(isinstance(e, LookupCommit) for e in effects)
    assert not any(isinstance(e, RunInner) for e in w.on_blob(rec.theta_cid, theta1, now=6.1))
    assert w.phase is WorkerPhase.FETCHING and w.inner_state is None  # held: not from the stale state
    (run,) = [e for e in w.on_commit(rec, now=6.2) if isinstance(e, RunInner)]
    assert (run.round, run.inner_state) == (1, "state-0") and w.inner_state == "state-0"


def test_a_hold_for_a_commit_that_never_comes_ends_and_the_round_trains_from_the_settled_state():
    r = Round()
    w = make_worker(10)
    rec, ann1, theta1 = _overtaken_commit(r, w)
    w.on_announcement(ann1, now=6.0)
    assert w.on_blob(rec.theta_cid, theta1, now=6.1) == []
    assert w.next_wakeup == 6.0 + ann1.time_budget_s / 4 and w.tick(now=w.next_wakeup - 0.01) == []
    (run,) = [e for e in w.tick(now=w.next_wakeup) if isinstance(e, RunInner)]
    assert run.inner_state is None and w.pending_state is None
    assert w.on_commit(rec, now=9.0) == []  # the late commit changes nothing for the round in flight


@pytest.mark.parametrize("arrives_after, share", [(0.0, 1.0), (0.3, 0.7), (0.9, 0.25)])
def test_the_inner_budget_counts_from_the_announcements_arrival(arrives_after, share):
    # every worker submits about one budget after the announcement, however long its θ took
    # (down to a quarter of the budget): the fast fetchers do not idle out the slowest fetch
    r = Round()
    w = make_worker(10)
    budget = r.ann.time_budget_s
    (fetch,) = [e for e in w.on_announcement(r.ann, now=5.0) if isinstance(e, FetchBlob)]
    effects = w.on_blob(fetch.cid, pack_tensors(THETA0, "fp32"), now=5.0 + arrives_after * budget)
    (run,) = [e for e in effects if isinstance(e, RunInner)]
    assert run.time_budget_s == pytest.approx(share * budget)

"""Audits by deterministic replay, without an executor: the draw, the state chain, the
messages and the evidence any node can re-verify (forgeries refused)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import (
    BadSignature,
    HashMismatch,
    MalformedMessage,
    NotElected,
    RejectedUpdate,
    StaleMessage,
    VerificationError,
)
from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.algorithm.params import codec_of, pack_tensors, params_cid
from pcp_p2p.diloco.protocol import audit
from pcp_p2p.diloco.protocol.audit import (
    MATCH,
    MISMATCH,
    UNAVAILABLE,
    AuditJob,
    InnerState,
    StateChain,
    decode_evidence,
    encode_evidence,
    inner_state_digest,
    make_evidence,
    plan_audits,
    should_audit,
    verify_evidence,
)
from pcp_p2p.diloco.protocol.audit_desk import MAX_RESENDS, AuditDesk
from pcp_p2p.diloco.protocol.effects import Banned, Send, StoreBlob
from pcp_p2p.diloco.protocol.messages import (
    FRESH_STATE,
    CommitRecord,
    DataAssignment,
    RoundAnnouncement,
    Submission,
    sign,
)
from pcp_p2p.diloco.protocol.worker import InnerResult, Worker, pseudo_gradient
from pcp_p2p.executor.executor_child import state_digest
from pcp_p2p.wire import decode, encode

RUN = "bafkrei-run"
THETA = {"w": np.linspace(-1, 1, 600, dtype=np.float32).reshape(20, 30), "b": np.ones(7, np.float32)}
CHUNK = 5


def ident(i: int) -> Identity:
    return Identity(bytes([i]) * 32)


SHEP, W, A1, A2, OUT = ident(1), ident(10), ident(11), ident(12), ident(13)


def state(seed: int, step: int = 20) -> InnerState:
    rng = np.random.default_rng(seed)
    m = {k: rng.normal(size=a.shape).astype(np.float32) for k, a in THETA.items()}
    v = {k: np.abs(rng.normal(size=a.shape)).astype(np.float32) for k, a in THETA.items()}
    return InnerState(m, v, step)


def local_theta(scale: float = 0.01) -> dict[str, np.ndarray]:
    return {k: a - scale * np.sign(a + 0.1) for k, a in THETA.items()}


ASSIGN = DataAssignment(worker=W.peer_id, shard=0, num_shards=3, seed=42, max_steps=23)


def announcement() -> RoundAnnouncement:
    return sign(RoundAnnouncement(
        run_id=RUN, term=2, round=7, attempt=0, theta_cid=params_cid(THETA), artifacts={"cpu-x": "bafkrei-art"},
        time_budget_s=10.0, deadline=100.0, assignments=(ASSIGN,), shepherd=SHEP.peer_id, dataset_cid="bafk-ds",
    ), SHEP)


def submission(who: Identity = W, *, theta_local=None, state_in=FRESH_STATE, state_out="s" * 64,
               steps=20, losses=(2.0, 1.5), codec="int8") -> tuple[Submission, bytes]:
    theta_local = local_theta() if theta_local is None else theta_local
    payload = codec_of(codec).encode(pseudo_gradient(THETA, theta_local))
    sub = sign(Submission(
        run_id=RUN, term=2, round=7, attempt=0, worker=who.peer_id, base_theta_cid=params_cid(THETA),
        codec=codec, delta_cid=None, delta_inline=payload, steps=steps, tokens=steps * 8, losses=losses,
        state_in=state_in, state_out=state_out,
    ), who)
    return sub, encode(sub)


def is_shepherd(term: int, peer: str) -> bool:
    return term == 2 and peer == SHEP.peer_id


def selected_request(sub_bytes: bytes, auditor: Identity = A1, beacon: str | None = None) -> audit.AuditRequest:
    """A request for a beacon the draw selects at rate 0.05 (found by trying beacons)."""
    if beacon is None:
        beacon = next(b for b in (f"bafk-theta-{i}" for i in range(10_000))
                      if should_audit(RUN, 2, 7, 0, W.peer_id, 0.05, b))
    return sign(audit.AuditRequest(
        run_id=RUN, term=2, round=7, attempt=0, worker=W.peer_id, submission_cid=cid_of(sub_bytes),
        beacon=beacon, assignment=ASSIGN, target="cpu-x", artifact_cid="bafkrei-art", dataset_cid="bafk-ds",
        auditor=auditor.peer_id, shepherd=SHEP.peer_id, shepherd_term=2,
    ), SHEP)


# --- the draw ------------------------------------------------------------------------------


def test_selection_is_deterministic_and_follows_the_rate():
    args = (RUN, 2, 7, 0, W.peer_id)
    assert should_audit(*args, 0.05, "b1") == should_audit(*args, 0.05, "b1")
    assert not should_audit(*args, 0.0, "b1") and should_audit(*args, 1.0, "b1")
    hits = sum(should_audit(RUN, 2, r, 0, W.peer_id, 0.05, f"beacon{r}") for r in range(20_000))
    assert 850 <= hits <= 1150  # 5% of 20000 = 1000, ±~5 sigma
    # the beacon matters: a worker cannot know its draw before the commit
    draws = {should_audit(*args, 0.5, f"b{i}") for i in range(40)}
    assert draws == {True, False}


def test_auditor_pick_is_deterministic_and_never_the_worker():
    peers = [W.peer_id, A1.peer_id, A2.peer_id, OUT.peer_id]
    pick = audit.pick_auditor(RUN, 2, 7, 0, W.peer_id, peers, "b")
    assert pick in peers and pick != W.peer_id
    assert pick == audit.pick_auditor(RUN, 2, 7, 0, W.peer_id, list(reversed(peers)), "b")
    assert audit.pick_auditor(RUN, 2, 7, 0, W.peer_id, [W.peer_id], "b") is None
    picks = {audit.pick_auditor(RUN, 2, r, 0, W.peer_id, peers, "b") for r in range(60)}
    assert picks == set(peers) - {W.peer_id}  # spread over all candidates


def test_plan_audits_selects_by_the_draw_and_same_target_auditors():
    ann = announcement()
    sub, sub_bytes = submission()
    targets = {W.peer_id: "cpu-x", A1.peer_id: "cpu-x", OUT.peer_id: "cpu-other"}
    req = selected_request(sub_bytes)
    planned = plan_audits(run_id=RUN, rate=0.05, identity=SHEP, announcement=ann,
                          accepted={W.peer_id: sub}, beacon=req.beacon, targets=targets, shepherd_term=2)
    assert len(planned) == 1
    (p,) = planned
    assert p.request.auditor == A1.peer_id  # the only other worker of the same target
    assert p.request.submission_cid == cid_of(p.submission_bytes) and p.request.assignment == ASSIGN
    audit.check_request(p.request, run_id=RUN, rate=0.05, is_shepherd=is_shepherd)
    # not drawn: nothing planned; no same-target peer: nothing planned
    assert plan_audits(run_id=RUN, rate=0.0, identity=SHEP, announcement=ann, accepted={W.peer_id: sub},
                       beacon=req.beacon, targets=targets, shepherd_term=2) == []
    assert plan_audits(run_id=RUN, rate=1.0, identity=SHEP, announcement=ann, accepted={W.peer_id: sub},
                       beacon=req.beacon, targets={W.peer_id: "cpu-x", OUT.peer_id: "cpu-other"},
                       shepherd_term=2) == []


def test_request_from_a_non_shepherd_or_not_drawn_is_refused():
    _, sub_bytes = submission()
    req = selected_request(sub_bytes)
    audit.check_request(req, run_id=RUN, rate=0.05, is_shepherd=is_shepherd)
    forged = sign(dataclasses.replace(req, shepherd=OUT.peer_id), OUT)
    with pytest.raises(NotElected):
        audit.check_request(forged, run_id=RUN, rate=0.05, is_shepherd=is_shepherd)
    with pytest.raises(BadSignature):  # the shepherd's id, someone else's signature
        audit.check_request(dataclasses.replace(forged, shepherd=SHEP.peer_id), run_id=RUN, rate=0.05,
                            is_shepherd=is_shepherd)
    unselected = next(b for b in (f"x{i}" for i in range(1000)) if not should_audit(RUN, 2, 7, 0, W.peer_id, 0.05, b))
    with pytest.raises(RejectedUpdate):  # a shepherd picking a victim the draw did not select
        audit.check_request(sign(dataclasses.replace(req, beacon=unselected), SHEP), run_id=RUN, rate=0.05,
                            is_shepherd=is_shepherd)
    with pytest.raises(VerificationError):
        audit.check_request(req, run_id="another-run", rate=0.05, is_shepherd=is_shepherd)


# --- inner state ---------------------------------------------------------------------------


def test_inner_state_blob_round_trips_and_its_digest_is_the_executors():
    st = state(1, step=35)
    blob = audit.encode_inner_state(st)
    back = audit.decode_inner_state(blob, THETA)
    assert back.step == 35 and all(np.array_equal(back.m[k], st.m[k]) and np.array_equal(back.v[k], st.v[k])
                                   for k in THETA)
    d = inner_state_digest(back)
    # the executor child hashes the manifest's m/*, v/*, step in this order
    assert d == state_digest(35, [*((f"m/{k}", st.m[k]) for k in THETA), *((f"v/{k}", st.v[k]) for k in THETA)])
    assert d != inner_state_digest(st._replace(step=36))
    bumped = {k: a.copy() for k, a in st.m.items()}
    bumped["b"][3] = np.nextafter(bumped["b"][3], np.float32(9))
    assert d != inner_state_digest(st._replace(m=bumped))  # one ulp anywhere changes the name
    with pytest.raises(MalformedMessage):
        audit.decode_inner_state(blob, {"w": THETA["w"]})  # names another model
    with pytest.raises(MalformedMessage):
        audit.decode_inner_state(blob[:5], THETA)


def test_state_chain_allows_fresh_or_a_committed_end_state():
    chain = StateChain(keep=2)
    s0, _ = submission(state_in=FRESH_STATE, state_out="a" * 64)
    chain.check(s0)
    chain.committed([s0])
    chain.check(submission(state_in="a" * 64, state_out="b" * 64)[0])
    with pytest.raises(RejectedUpdate):  # a state it never committed to
        chain.check(submission(state_in="f" * 64, state_out="b" * 64)[0])
    with pytest.raises(RejectedUpdate):  # no commitment at all: cannot be audited
        chain.check(submission(state_in="", state_out="")[0])
    chain.committed([submission(state_in="a" * 64, state_out="b" * 64)[0]])
    chain.committed([submission(state_in="b" * 64, state_out="c" * 64)[0]])
    with pytest.raises(RejectedUpdate):  # only the last `keep` committed end states
        chain.check(submission(state_in="a" * 64)[0])
    chain.check(submission(state_in="b" * 64)[0])
    # unknown worker: any start state unless strict; a restored chain is strict
    other = submission(A1, state_in="z" * 64)[0]
    chain.check(other)
    restored = StateChain.from_dict(chain.to_dict(), keep=2)
    restored.check(submission(state_in="c" * 64)[0])
    with pytest.raises(RejectedUpdate):
        restored.check(other)


def test_worker_moves_to_a_new_inner_state_only_once_a_commit_takes_it():
    from pcp_p2p.diloco.protocol.spec import RunSpec

    w = Worker(spec=RunSpec(), run_id=RUN, identity=W, shepherds={2: SHEP.peer_id}, target="cpu-x",
               tokens_per_s=1.0)

    def commit(round_, attempt, participants):
        return sign(CommitRecord(run_id=RUN, term=2, round=round_, attempt=attempt, prev_theta_cid="p",
                                 theta_cid=f"t{round_}", checkpoint_cid="c", participants=participants,
                                 tokens=1, mean_loss=1.0, val_loss=None, shepherd=SHEP.peer_id), SHEP)

    w.pending_state = (7, 0, "s1")
    w.on_commit(commit(7, 1, (A1.peer_id,)), now=1.0)  # round 7 committed without us
    assert w.inner_state is None and w.pending_state is None
    w.pending_state = (8, 0, "s2")
    w.on_commit(commit(8, 0, (W.peer_id, A1.peer_id)), now=2.0)
    assert w.inner_state == "s2" and w.pending_state is None


def test_a_submission_carries_the_states_of_its_inner_result():
    sub, _ = submission(state_in="a" * 64, state_out="b" * 64)
    back = decode(encode(sub), Submission)
    assert (back.state_in, back.state_out) == ("a" * 64, "b" * 64)
    r = InnerResult(0, 0, THETA, 5, (1.0,), "b" * 64)
    assert (r.state_in, r.state_out) == ("", "")  # old producers: untracked


# --- the auditor's job, judged, and evidence -----------------------------------------------


def run_job(sub_bytes: bytes, auditor: Identity, theta_local, state_out: str, losses, served=None,
            served_state: InnerState | None = None) -> audit.AuditReport:
    req = selected_request(sub_bytes, auditor)
    job = AuditJob(req, auditor, chunk_steps=CHUNK)
    assert job.wanted() == [req.submission_cid]
    job.on_blob(req.submission_cid, sub_bytes)
    theta_bytes = pack_tensors(THETA, "fp32")
    assert job.wanted() == [params_cid(THETA)]
    job.on_blob(params_cid(THETA), theta_bytes)
    if served_state is not None:
        assert not job.ready()
        blob = audit.encode_inner_state(served_state)
        job.on_offer(audit.make_offer(req, job.sub.state_in, blob, W))
        assert job.wanted() == [cid_of(blob)]
        job.on_blob(cid_of(blob), blob)
        assert job.replay_input().state.step == served_state.step
    assert job.ready() and not job.impossible_steps()
    return job.finish(theta_local, state_out, losses)


def test_an_honest_round_matches_and_a_tampered_delta_is_caught():
    _, sub_bytes = submission(state_out="e" * 64)
    ok = run_job(sub_bytes, A1, local_theta(), "e" * 64, (2.0, 1.5))
    assert ok.verdict == MATCH and ok.differs == () and ok.max_abs_diff == 0.0
    # the worker submitted a Δ scaled by 3 (or anything else than it computed)
    bad = {k: THETA[k] - 3 * (THETA[k] - a) for k, a in local_theta().items()}
    _, bad_bytes = submission(theta_local=bad, state_out="e" * 64)
    rep = run_job(bad_bytes, A1, local_theta(), "e" * 64, (2.0, 1.5))
    assert rep.verdict == MISMATCH and rep.differs == ("delta",) and rep.max_abs_diff > 0.01
    # forged end state and losses are caught too
    _, lie_bytes = submission(state_out="9" * 64, losses=(0.1, 0.1))
    rep2 = run_job(lie_bytes, A1, local_theta(), "e" * 64, (2.0, 1.5))
    assert rep2.differs == ("state_out", "losses")


def test_the_served_state_must_be_the_committed_one():
    st = state(3)
    sub, sub_bytes = submission(state_in=inner_state_digest(st), state_out="e" * 64)
    rep = run_job(sub_bytes, A1, local_theta(), "e" * 64, (2.0, 1.5), served_state=st)
    assert rep.verdict == MATCH
    req = selected_request(sub_bytes, A1)
    job = AuditJob(req, A1, chunk_steps=CHUNK)
    job.on_blob(req.submission_cid, sub_bytes)
    job.on_blob(params_cid(THETA), pack_tensors(THETA, "fp32"))
    other = audit.encode_inner_state(state(4))
    with pytest.raises(VerificationError):  # offers a digest other than it signed
        job.on_offer(audit.make_offer(req, inner_state_digest(state(4)), other, W))
    job.on_offer(audit.make_offer(req, sub.state_in, other, W))  # right name, wrong bytes
    with pytest.raises(HashMismatch):
        job.on_blob(cid_of(other), other)
    assert not job.ready()
    gone = job.give_up("no state served before the deadline")
    assert gone.verdict == UNAVAILABLE and gone.reason
    with pytest.raises(BadSignature):  # an offer signed by someone else
        job.on_offer(sign(dataclasses.replace(audit.make_offer(req, sub.state_in, other, W), worker=W.peer_id),
                          OUT))


def evidence_for_tampered() -> tuple[audit.Evidence, bytes]:
    bad = {k: THETA[k] - 3 * (THETA[k] - a) for k, a in local_theta().items()}
    _, bad_bytes = submission(theta_local=bad, state_out="e" * 64)
    reports = [run_job(bad_bytes, a, local_theta(), "e" * 64, (2.0, 1.5)) for a in (A1, A2)]
    requests = [selected_request(bad_bytes, a) for a in (A1, A2)]
    return make_evidence(bad_bytes, requests, reports), bad_bytes


def test_evidence_verifies_anywhere_and_round_trips_as_bytes():
    ev, _ = evidence_for_tampered()
    data = encode_evidence(ev)
    back = decode_evidence(data)
    assert back == ev and back.differs == ("delta",)
    assert verify_evidence(back, rate=0.05, is_shepherd=is_shepherd) == W.peer_id
    one = dataclasses.replace(ev, requests=ev.requests[:1], reports=ev.reports[:1])
    with pytest.raises(VerificationError):  # one report is not enough by default
        verify_evidence(one)
    assert verify_evidence(one, min_reports=1) == W.peer_id
    with pytest.raises(VerificationError):  # a report paired with another auditor's request
        verify_evidence(dataclasses.replace(ev, requests=ev.requests[::-1]))


def test_forged_evidence_is_refused():
    ev, bad_bytes = evidence_for_tampered()
    r0, r1 = ev.reports
    # a report altered after signing
    with pytest.raises(BadSignature):
        verify_evidence(dataclasses.replace(ev, reports=(dataclasses.replace(r0, delta_cid="bafk-x"), r1)))
    # a report signed by a third party in an auditor's name
    with pytest.raises(BadSignature):
        verify_evidence(dataclasses.replace(ev, reports=(sign(dataclasses.replace(r0, auditor=A1.peer_id), OUT), r1)))
    # the same auditor twice
    with pytest.raises(VerificationError):
        verify_evidence(dataclasses.replace(ev, requests=(ev.requests[0],) * 2, reports=(r0, r0)))
    # a submission the worker never signed (the accuser edits it)
    sub = decode(bad_bytes, Submission)
    edited = encode(dataclasses.replace(sub, steps=25))
    with pytest.raises(VerificationError):
        verify_evidence(dataclasses.replace(ev, submission=edited))
    # a submission re-signed by the accuser in the worker's name
    forged = encode(sign(dataclasses.replace(sub, worker=W.peer_id), OUT))
    with pytest.raises(VerificationError):
        verify_evidence(dataclasses.replace(ev, submission=forged))
    # a request not from the shepherd of its term
    with pytest.raises(NotElected):
        verify_evidence(ev, is_shepherd=lambda term, peer: False)
    # reports that agree with the worker (an honest Δ) are no evidence
    _, honest_bytes = submission(state_out="e" * 64)
    reports = [run_job(honest_bytes, a, local_theta(), "e" * 64, (2.0, 1.5)) for a in (A1, A2)]
    fake = audit.Evidence(honest_bytes, tuple(selected_request(honest_bytes, a) for a in (A1, A2)),
                          tuple(reports), ("delta",))
    with pytest.raises(VerificationError):
        verify_evidence(fake)
    # two auditors who disagree with each other
    liar = sign(dataclasses.replace(r1, state_out="0" * 64, differs=("delta", "state_out")), A2)
    with pytest.raises(VerificationError):
        verify_evidence(dataclasses.replace(ev, reports=(r0, liar)))
    # a mismatch made up by an auditor who states a different differs than the messages show
    with pytest.raises(VerificationError):
        verify_evidence(dataclasses.replace(ev, differs=("delta", "losses")))


def test_an_impossible_step_claim_is_evidence_without_a_replay():
    _, sub_bytes = submission(steps=7)  # not whole chunks of 5
    reports = []
    for a in (A1, A2):
        req = selected_request(sub_bytes, a)
        job = AuditJob(req, a, chunk_steps=CHUNK)
        job.on_blob(req.submission_cid, sub_bytes)
        assert job.impossible_steps()
        reports.append(job.finish_impossible())
    ev = make_evidence(sub_bytes, [selected_request(sub_bytes, a) for a in (A1, A2)], reports)
    assert verify_evidence(ev, chunk_steps=CHUNK) == W.peer_id
    _, fine = submission(steps=20)
    fine_reqs = tuple(selected_request(fine, a) for a in (A1, A2))
    fake = audit.Evidence(fine, fine_reqs, tuple(
        sign(dataclasses.replace(r, request_digest=audit.digest_of(q), submission_cid=cid_of(fine)), a)
        for r, q, a in zip(reports, fine_reqs, (A1, A2))), ("steps",))
    with pytest.raises(VerificationError):
        verify_evidence(fake, chunk_steps=CHUNK)


def test_mutated_evidence_bytes_raise_only_pcp_errors():
    from pcp_p2p.core.errors import PcpError

    ev, _ = evidence_for_tampered()
    data = encode_evidence(ev)
    rng = np.random.default_rng(0)
    accepted = 0
    for _ in range(300):
        raw = bytearray(data)
        for i in rng.integers(0, len(raw), size=int(rng.integers(1, 4))):
            raw[i] = int(rng.integers(0, 256))
        try:
            assert verify_evidence(decode_evidence(bytes(raw))) == W.peer_id
            accepted += 1  # every byte is covered by a signature or re-derived: none may pass
        except PcpError:
            pass
    assert accepted == 0


def test_a_garbage_state_blob_is_refused_with_a_typed_error():
    st = state(3)
    sub, sub_bytes = submission(state_in=inner_state_digest(st), state_out="e" * 64)
    req = selected_request(sub_bytes, A1)
    job = AuditJob(req, A1, chunk_steps=CHUNK)
    job.on_blob(req.submission_cid, sub_bytes)
    job.on_blob(params_cid(THETA), pack_tensors(THETA, "fp32"))
    junk = b"\x00" * 8 + b"not a tensor bundle"
    job.on_offer(audit.make_offer(req, sub.state_in, junk, W))
    with pytest.raises(MalformedMessage):
        job.on_blob(cid_of(junk), junk)
    assert not job.ready()


def test_the_hooks_on_a_real_shepherd_round():
    """What the lead wires: chain check on submission, chain + plan_audits at the commit."""
    from test_diloco_protocol import OWNER, RUN_ID, Round

    from pcp_p2p.diloco.protocol.effects import Committed

    r = Round()
    chain = StateChain(strict=True)
    subs = [r.submission(who, state_in=FRESH_STATE, state_out=f"{i}" * 64) for i, who in enumerate(r.ids)]
    effects = []
    for sub in subs:
        chain.check(sub)
        effects += r.shepherd.on_submission(sub, now=3.0)
    (record,) = [e.record for e in effects if isinstance(e, Committed)]  # all reported: committed
    accepted = {s.worker: s for s in subs if s.worker in record.participants}
    chain.committed(accepted.values())
    targets = {who.peer_id: "cpu" for who in r.ids}
    planned = plan_audits(run_id=RUN_ID, rate=1.0, identity=OWNER, announcement=r.ann, accepted=accepted,
                          beacon=record.theta_cid, targets=targets, shepherd_term=0)
    assert {p.request.worker for p in planned} == set(accepted)
    for p in planned:
        audit.check_request(p.request, run_id=RUN_ID, rate=1.0, is_shepherd=lambda t, peer: peer == OWNER.peer_id)
        sub = audit.check_submission(p.request, p.submission_bytes)
        assert audit.state_to_export(p.request, sub, sub.worker) is None  # started fresh: nothing to serve
    # the next round may start from each worker's committed end state, not from another's
    nxt = r.submission(r.ids[0], state_in="0" * 64, state_out="a" * 64)
    chain.check(nxt)
    with pytest.raises(RejectedUpdate):
        chain.check(r.submission(r.ids[0], state_in="1" * 64, state_out="a" * 64))


def test_an_attempt_taken_over_after_a_failover_is_audited_under_the_successors_term():
    """A shepherd dies right after announcing: its successor commits the attempt (``Shepherd.adopt``)
    and the commit draws audits like any other. Each request names the dead term (the submission's,
    which the draw hashes) and the successor's own, which is the lease the auditors check."""
    from test_diloco_protocol import RUN_ID, SPEC, THETA0, Round
    from test_diloco_protocol import ident as protocol_ident

    from pcp_p2p.diloco.algorithm.outer import OuterState
    from pcp_p2p.diloco.protocol.effects import Committed
    from pcp_p2p.diloco.protocol.messages import Join
    from pcp_p2p.diloco.protocol.shepherd import Shepherd

    r = Round()  # term 0: round 0 announced to three workers
    heir = protocol_ident(2)
    new = Shepherd(spec=SPEC, run_id=RUN_ID, identity=heir, term=1, state=OuterState.initial(THETA0),
                   audits=AuditDesk(RUN_ID, heir, 1.0))
    assert new.adopt(r.ann, now=5.0) == [] and new.adopted == r.ann
    effects = []
    for i, who in enumerate(r.ids):  # each follows the new term: joins it, sends its signed Δ again
        effects += new.on_join(sign(Join(run_id=RUN_ID, worker=who.peer_id, target="cpu", tokens_per_s=100.0),
                                    who), now=6.0)
        effects += new.on_submission(r.submission(who, state_in=FRESH_STATE, state_out=f"{i}" * 64), now=6.0)
    (record,) = [e.record for e in effects if isinstance(e, Committed)]
    assert (record.term, record.shepherd) == (1, heir.peer_id)
    requests = {e.message for e in effects if isinstance(e, Send) and isinstance(e.message, audit.AuditRequest)}
    assert {q.worker for q in requests} == set(record.participants) == {w.peer_id for w in r.ids}
    blobs = {e.cid: e.data for e in effects if isinstance(e, StoreBlob)}

    def heir_holds(term: int, peer: str) -> bool:  # an auditor's election: it accepted term 1's lease only
        return (term, peer) == (1, heir.peer_id)

    for q in requests:
        assert (q.term, q.shepherd_term, q.shepherd) == (0, 1, heir.peer_id)
        audit.check_request(q, run_id=RUN_ID, rate=1.0, is_shepherd=heir_holds)
        assert audit.check_submission(q, blobs[q.submission_cid]).term == 0
    q = next(iter(requests))
    with pytest.raises(NotElected):  # asking in the dead term's name: the heir never held it
        audit.check_request(sign(dataclasses.replace(q, shepherd_term=0, signature=b""), heir), run_id=RUN_ID,
                            rate=1.0, is_shepherd=heir_holds)
    with pytest.raises(VerificationError):  # a term before the submission's never asks for it
        audit.check_request(sign(dataclasses.replace(q, term=2, signature=b""), heir), run_id=RUN_ID, rate=1.0,
                            is_shepherd=lambda term, peer: True)


# --- the shepherd's desk: draw, escalate, ban ---------------------------------------------------


def desk_with_case(tampered: bool) -> tuple[AuditDesk, audit.AuditRequest, bytes]:
    """A desk whose commit drew W's (tampered or honest) submission, auditors A1 and A2 available."""
    bad = {k: THETA[k] - 3 * (THETA[k] - a) for k, a in local_theta().items()}
    sub, sub_bytes = submission(theta_local=bad if tampered else None, state_out="e" * 64)
    beacon = selected_request(sub_bytes).beacon
    desk = AuditDesk(RUN, SHEP, 0.05)
    targets = {W.peer_id: "cpu-x", A1.peer_id: "cpu-x", A2.peer_id: "cpu-x", OUT.peer_id: "other"}
    effects = desk.on_commit(announcement(), {W.peer_id: sub}, beacon, targets, term=2)
    (req,) = {e.message for e in effects if isinstance(e, Send)}
    assert isinstance(req, audit.AuditRequest) and req.auditor in (A1.peer_id, A2.peer_id)
    assert [e for e in effects if isinstance(e, StoreBlob)] == [StoreBlob(req.submission_cid, sub_bytes)]
    assert {e.to for e in effects if isinstance(e, Send)} == {req.auditor, W.peer_id}
    return desk, req, sub_bytes


def replay_report(req: audit.AuditRequest, sub_bytes: bytes) -> audit.AuditReport:
    auditor = {A1.peer_id: A1, A2.peer_id: A2}[req.auditor]
    job = AuditJob(req, auditor, chunk_steps=CHUNK)
    job.on_blob(req.submission_cid, sub_bytes)
    job.on_blob(params_cid(THETA), pack_tensors(THETA, "fp32"))
    return job.finish(local_theta(), "e" * 64, (2.0, 1.5))  # what an honest executor computes


def test_the_desk_bans_only_on_two_agreeing_replays() -> None:
    desk, req, sub_bytes = desk_with_case(tampered=True)
    first = desk.on_report(replay_report(req, sub_bytes), 1.0)  # MISMATCH: ask a second auditor
    (second,) = {e.message for e in first if isinstance(e, Send)}
    assert second.auditor != req.auditor and second.auditor in (A1.peer_id, A2.peer_id)
    assert not [e for e in first if isinstance(e, Banned)]
    out = desk.on_report(replay_report(second, sub_bytes), 2.0)
    (ban,) = [e for e in out if isinstance(e, Banned)]
    assert ban.peer == W.peer_id and desk.open == {}
    assert verify_evidence(decode_evidence(ban.evidence), rate=0.05, is_shepherd=is_shepherd) == W.peer_id


def test_a_request_with_no_report_is_sent_again_a_few_times_and_the_second_opinion_too() -> None:
    """An auditor over its budget refuses a request, and nothing tells the desk: it asks again."""
    desk, req, sub_bytes = desk_with_case(tampered=True)  # (asked at 0)
    assert desk.next_wakeup == desk.resend_s and desk.tick(desk.resend_s - 0.1) == []
    again = desk.tick(desk.resend_s)
    assert {(e.to, e.message) for e in again if isinstance(e, Send)} == {(req.auditor, req), (req.worker, req)}
    now = desk.resend_s
    for _ in range(MAX_RESENDS - 1):
        now += desk.resend_s
        assert desk.tick(now)
    assert desk.next_wakeup is None and desk.tick(now + 100) == []  # then it stops asking
    # the first report comes after all: the second auditor is asked, and asked again if silent
    (second,) = {e.message for e in desk.on_report(replay_report(req, sub_bytes), now + 1) if isinstance(e, Send)}
    assert desk.next_wakeup == now + 1 + desk.resend_s
    assert {e.message for e in desk.tick(now + 1 + desk.resend_s) if isinstance(e, Send)} == {second}
    (ban,) = [e for e in desk.on_report(replay_report(second, sub_bytes), now + 20) if isinstance(e, Banned)]
    assert ban.peer == W.peer_id and desk.next_wakeup is None


def test_the_desk_closes_an_honest_audit_and_refuses_unasked_or_forged_reports() -> None:
    desk, req, sub_bytes = desk_with_case(tampered=False)
    report = replay_report(req, sub_bytes)
    other = A2 if req.auditor == A1.peer_id else A1
    unasked = sign(dataclasses.replace(report, auditor=other.peer_id, signature=b""), other)
    with pytest.raises(VerificationError):
        desk.on_report(unasked, 1.0)
    with pytest.raises(BadSignature):  # the asked auditor's name, someone else's key
        desk.on_report(sign(dataclasses.replace(report, signature=b""), OUT), 1.0)
    assert desk.on_report(report, 1.0) == [] and desk.open == {} and desk.matched == 1
    with pytest.raises(StaleMessage):  # the case is closed: a replay of the report changes nothing
        desk.on_report(report, 2.0)

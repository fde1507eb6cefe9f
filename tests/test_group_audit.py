"""Auditing a worker group's round: its signed split is replayed part by part on a real IREE executor
and recombined with the group's own arithmetic; an honest group matches bit for bit, a tampered Δ or
split is caught, a split that does not tile its assignment is refused with a typed error."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import HashMismatch, MalformedMessage, RejectedUpdate
from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.algorithm.params import pack_tensors, params_cid
from pcp_p2p.diloco.protocol import audit, group_replay
from pcp_p2p.diloco.protocol.group_split import combine, group_state, mean_losses, sub_assignments
from pcp_p2p.diloco.protocol.messages import FRESH_STATE, DataAssignment, GroupPart, Submission, sign
from pcp_p2p.wire import decode, encode

W, A1, A2, SHEP = (Identity(bytes([i]) * 32) for i in (30, 31, 32, 33))
RUN = "bafk-group-audit-run"
CHUNK = 5
TPS = 128  # tokens per step (batch 4 x seq 32)
ASSIGN = DataAssignment(worker=W.peer_id, shard=1, num_shards=3, seed=77, max_steps=20)


def group_sub(parts: tuple[GroupPart, ...], *, payload: bytes = b"x", losses: tuple[float, ...] = (1.0,),
              **over: object) -> Submission:
    done = [p for p in parts if p.steps]
    fields = dict(
        run_id=RUN, term=0, round=1, attempt=0, worker=W.peer_id, base_theta_cid="bafk-theta", codec="fp32",
        delta_cid=None, delta_inline=payload, steps=sum(p.steps for p in parts),
        tokens=sum(p.steps for p in parts) * TPS, losses=losses,
        state_in=group_state({p.rank: p.state_in for p in done}),
        state_out=group_state({p.rank: p.state_out for p in done}), group=parts,
    )
    fields.update(over)
    return sign(Submission(**fields), W)  # type: ignore[arg-type]


PARTS = (GroupPart(0, 10, 10, FRESH_STATE, "a" * 64), GroupPart(1, 10, 5, FRESH_STATE, "b" * 64))


def test_a_consistent_split_passes_and_survives_the_codec() -> None:
    sub = group_sub(PARTS)
    group_replay.check_split(sub, ASSIGN, CHUNK)
    assert decode(encode(sub), Submission).group == PARTS
    assert not audit.impossible_claim(sub, ASSIGN, CHUNK)
    group_replay.check_split(dataclasses.replace(sub, group=()), ASSIGN, CHUNK)  # a lone worker: nothing to check


@pytest.mark.parametrize("why, parts, over", [
    ("over the cap", (GroupPart(0, 15, 10, FRESH_STATE, "a" * 64), GroupPart(1, 10, 5, FRESH_STATE, "b" * 64)), {}),
    ("not whole chunks", (GroupPart(0, 10, 7, FRESH_STATE, "a" * 64), GroupPart(1, 10, 5, FRESH_STATE, "b" * 64)),
     {}),
    ("steps above a part's cap", (GroupPart(0, 5, 10, FRESH_STATE, "a" * 64),), {}),
    ("ranks out of order", tuple(reversed(PARTS)), {}),
    ("claims more steps than its parts", PARTS, {"steps": 20, "tokens": 20 * TPS}),
    ("a state_out its parts do not name", PARTS, {"state_out": "grp-" + "0" * 64}),
    ("an idle part naming states", (PARTS[0], GroupPart(1, 10, 0, FRESH_STATE, "")), {}),
    ("a part without states", (PARTS[0], GroupPart(1, 10, 5, "", "")), {}),
    ("too many parts", (*(GroupPart(r, 0, 0, "", "") for r in range(300)), PARTS[0]), {}),
])
def test_a_split_that_does_not_tile_or_add_up_is_refused(why: str, parts: tuple[GroupPart, ...],
                                                          over: dict) -> None:
    sub = group_sub(parts, **over)
    with pytest.raises(RejectedUpdate):
        group_replay.check_split(sub, ASSIGN, CHUNK)
    assert audit.impossible_claim(sub, ASSIGN, CHUNK), why


def test_only_a_sum_of_three_or_more_parts_gets_a_rounding_allowance() -> None:
    import numpy as np

    theta = {"w": np.array([1.0, -2.0, 0.5], np.float32)}
    delta = {"w": np.array([1e-3, -2e-3, 0.0], np.float32)}
    assert group_replay.group_tolerance(group_sub(PARTS), theta, delta) == 0.0  # one float64 addition: exact
    three = (*PARTS, GroupPart(2, 5, 5, FRESH_STATE, "e" * 64))
    tol = group_replay.group_tolerance(group_sub(three), theta, delta)
    assert tol == 2.0 * float(np.spacing(np.float32(2.0)))  # fp32 codec: two float32 ulps of max |θ|, no more


def test_group_state_bundle_is_checked() -> None:
    blob = group_replay.encode_group_state({2: b"two", 0: b"zero"})
    assert group_replay.decode_group_state(blob, [0, 2]) == {0: b"zero", 2: b"two"}
    with pytest.raises(MalformedMessage):
        group_replay.decode_group_state(blob, [0])
    with pytest.raises(MalformedMessage):
        group_replay.decode_group_state(blob[:-1], [0, 2])


def test_the_state_chain_holds_per_rank_for_a_group() -> None:
    chain = audit.StateChain()
    first = group_sub(PARTS)
    chain.check(first)
    chain.committed([first])
    # rank 1 sat the next round out: rank 0 alone starts from its committed end state (the group's name differs)
    alone = group_sub((GroupPart(0, 20, 10, "a" * 64, "c" * 64), GroupPart(1, 0, 0, "", "")))
    assert alone.state_in != first.state_out
    chain.check(alone)
    forged = group_sub((GroupPart(0, 10, 10, "a" * 64, "c" * 64), GroupPart(1, 10, 5, "f" * 64, "d" * 64)))
    with pytest.raises(RejectedUpdate):
        chain.check(forged)  # rank 1's start is no committed end state
    again = audit.StateChain.from_dict(chain.to_dict())
    again.check(alone)
    with pytest.raises(RejectedUpdate):
        again.check(forged)
    with pytest.raises(RejectedUpdate):
        audit.StateChain(strict=True).check(alone)  # no chain known, strict: fresh only


def _request(sub_bytes: bytes, auditor: Identity, assignment: DataAssignment = ASSIGN) -> audit.AuditRequest:
    beacon = next(b for b in (f"b{i}" for i in range(5000)) if audit.should_audit(RUN, 0, 1, 0, W.peer_id, 0.05, b))
    return sign(audit.AuditRequest(
        run_id=RUN, term=0, round=1, attempt=0, worker=W.peer_id, submission_cid=cid_of(sub_bytes), beacon=beacon,
        assignment=assignment, target="t", artifact_cid="a", dataset_cid="d", auditor=auditor.peer_id,
        shepherd=SHEP.peer_id, shepherd_term=0,
    ), SHEP)


def test_a_bad_split_is_evidence_without_a_replay() -> None:
    bad = encode(group_sub(PARTS, steps=20, tokens=20 * TPS))
    reqs, reports = [], []
    for who in (A1, A2):
        req = _request(bad, who)
        job = audit.AuditJob(req, who, chunk_steps=CHUNK)
        job.on_blob(req.submission_cid, bad)
        assert job.impossible_steps()
        reqs.append(req)
        reports.append(job.finish_impossible())
    ev = audit.make_evidence(bad, reqs, reports)
    assert audit.verify_evidence(ev, rate=0.05, chunk_steps=CHUNK) == W.peer_id


# --- the real replay on IREE ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines():
    pytest.importorskip("jax")
    pytest.importorskip("iree.compiler")
    from pcp_p2p.executor.cpu import local_cpu

    if local_cpu().arch != "x86_64":
        pytest.skip("these tests build x86-64 artifacts")
    from test_audit_replay import engine

    made = [engine(), engine(), engine()]  # rank 0, rank 1, the auditor: three executor processes
    yield made
    for e in made:
        e.executor.close()


def _group_round(ranks, theta, starts, assignment, caps, round_):
    """What GroupEngine does, in one process: each rank trains its sub-shard; θ_group by split.combine."""
    from pcp_p2p.diloco.protocol.effects import RunInner

    results = []
    for eng, sub_a, start in zip(ranks, sub_assignments(assignment, caps), starts):
        eff = RunInner(round=round_, attempt=0, theta=theta, theta_cid=params_cid(theta), artifact_cid=None,
                       assignment=sub_a, time_budget_s=1e6, inner_state=start)
        results.append(eng.run(eff, threading.Event()))
    tps = ranks[0].spec.tokens_per_step
    theta_group = combine(theta, [(r.theta, r.steps * tps) for r in results])
    parts = tuple(GroupPart(k, caps[k], r.steps, r.state_in, r.state_out) for k, r in enumerate(results))
    return results, theta_group, parts


def _submit(theta, theta_local, results, parts, tps, **over):
    from pcp_p2p.diloco.algorithm.params import codec_of
    from pcp_p2p.diloco.protocol.worker import pseudo_gradient

    steps = sum(r.steps for r in results)
    fields = dict(
        run_id=RUN, term=0, round=1, attempt=0, worker=W.peer_id, base_theta_cid=params_cid(theta), codec="fp32",
        delta_cid=None, delta_inline=codec_of("fp32").encode(pseudo_gradient(theta, theta_local)), steps=steps,
        tokens=steps * tps, losses=mean_losses([r.losses for r in results]),
        state_in=group_state({p.rank: p.state_in for p in parts if p.steps}),
        state_out=group_state({p.rank: p.state_out for p in parts if p.steps}), group=parts,
    )
    fields.update(over)
    sub = sign(Submission(**fields), W)  # type: ignore[arg-type]
    return sub, encode(sub)


def _audit(auditor, who, sub_bytes, theta, state_blob, assignment):
    req = _request(sub_bytes, who, assignment)
    job = audit.AuditJob(req, who, chunk_steps=CHUNK)
    job.on_blob(req.submission_cid, sub_bytes)
    job.on_blob(params_cid(theta), pack_tensors(theta, "fp32"))
    if state_blob is not None:
        assert not job.ready()
        job.on_offer(audit.make_offer(req, job.sub.state_in, state_blob, W))
        job.on_blob(cid_of(state_blob), state_blob)
    assert job.ready() and not job.impossible_steps()
    reps = [auditor.replay(*inp) for inp in job.replay_inputs()]
    return req, job.finish_replays(reps)


def test_an_honest_group_round_replays_bit_for_bit_and_a_tampered_one_is_caught(engines) -> None:
    from pcp_p2p.diloco.protocol.audit import CHUNK_STEPS
    from pcp_p2p.diloco.run.engine import initial_theta

    assert CHUNK_STEPS == CHUNK
    rank0, rank1, auditor = engines
    tps = rank0.spec.tokens_per_step
    assignment = dataclasses.replace(ASSIGN, max_steps=20)
    theta0 = initial_theta(rank0.spec, 65)
    # round 0 from fresh moments (nothing to serve), then round 1 from each rank's kept end state
    res0, g0, parts0 = _group_round([rank0, rank1], theta0, [None, None], assignment, [10, 10], 0)
    sub0, sub0_bytes = _submit(theta0, g0, res0, parts0, tps)
    assert sub0.state_in == FRESH_STATE
    _, rep0 = _audit(auditor, A1, sub0_bytes, theta0, None, assignment)
    assert rep0.verdict == audit.MATCH and rep0.max_abs_diff == 0.0, rep0

    theta1 = {k: v - 0.5 * (theta0[k] - g0[k]) for k, v in theta0.items()}
    res1, g1, parts1 = _group_round([rank0, rank1], theta1, [r.inner_state for r in res0], assignment, [15, 5], 1)
    assert [p.state_in for p in parts1] == [p.state_out for p in parts0]
    # the group's state bundle: each rank exports its own kept start state (what GroupEngine.export_state gathers)
    bundle = group_replay.encode_group_state({0: rank0.export_state(parts1[0].state_in),
                                              1: rank1.export_state(parts1[1].state_in)})
    sub1, sub1_bytes = _submit(theta1, g1, res1, parts1, tps)
    group_replay.check_split(sub1, assignment, CHUNK)  # what the shepherd checks before accepting it
    _, rep1 = _audit(auditor, A1, sub1_bytes, theta1, bundle, assignment)
    assert rep1.verdict == audit.MATCH and rep1.delta_cid == audit.delta_cid_of(sub1), rep1

    # a boosted Δ: two auditors' replays contradict it, and the evidence verifies
    boosted = {k: theta1[k] - 1.5 * (theta1[k] - g1[k]) for k in theta1}
    _, bad = _submit(theta1, boosted, res1, parts1, tps)
    req_a, rep_a = _audit(auditor, A1, bad, theta1, bundle, assignment)
    req_b, rep_b = _audit(rank1, A2, bad, theta1, bundle, assignment)
    assert rep_a.verdict == rep_b.verdict == audit.MISMATCH and rep_a.differs == ("delta",)
    ev = audit.decode_evidence(audit.encode_evidence(audit.make_evidence(bad, [req_a, req_b], [rep_a, rep_b])))
    assert audit.verify_evidence(ev, rate=0.05) == W.peer_id

    # a split that passes every check but is not the one trained (a third, idle rank: K = 3 cuts other
    # sub-shards): only the replay can tell, and it does
    three = (*parts1, GroupPart(2, 0, 0, "", ""))
    _, lying = _submit(theta1, g1, res1, three, tps)
    group_replay.check_split(decode(lying, Submission), assignment, CHUNK)
    _, rep_s = _audit(auditor, A1, lying, theta1, bundle, assignment)
    assert rep_s.verdict == audit.MISMATCH and "delta" in rep_s.differs

    # a served state bundle that is not the one the parts signed is refused, typed
    req = _request(sub1_bytes, A1, assignment)
    job = audit.AuditJob(req, A1, chunk_steps=CHUNK)
    job.on_blob(req.submission_cid, sub1_bytes)
    job.on_blob(params_cid(theta1), pack_tensors(theta1, "fp32"))
    wrong = group_replay.encode_group_state({0: rank0.export_state(parts1[0].state_in),
                                             1: rank0.export_state(parts1[0].state_in)})
    job.on_offer(audit.make_offer(req, sub1.state_in, wrong, W))
    with pytest.raises(HashMismatch):
        job.on_blob(cid_of(wrong), wrong)
    assert not job.ready()

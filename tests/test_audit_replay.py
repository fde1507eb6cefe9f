"""An audit's replay on the real IREE CPU executor: an honest round reproduces bit for bit in
another executor process, a tampered Δ is caught, and a kept state restarts exactly."""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("iree.compiler")

from conftest_compile import artifact, artifact_file, shepherd

from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.algorithm.data import CharDataset
from pcp_p2p.diloco.algorithm.params import codec_of, pack_tensors, params_cid
from pcp_p2p.diloco.protocol import audit
from pcp_p2p.diloco.protocol.audit import CHUNK_STEPS
from pcp_p2p.diloco.protocol.effects import RunInner
from pcp_p2p.diloco.protocol.messages import FRESH_STATE, DataAssignment, Submission, sign
from pcp_p2p.diloco.protocol.spec import InnerOptimizer, RunSpec
from pcp_p2p.diloco.protocol.worker import pseudo_gradient
from pcp_p2p.diloco.run.engine import InnerEngine, initial_theta, program_options
from pcp_p2p.executor.cpu import best_cpu_target, local_cpu
from pcp_p2p.executor.executor import Executor
from pcp_p2p.wire import encode

if local_cpu().arch != "x86_64":
    pytest.skip("these tests build x86-64 artifacts", allow_module_level=True)

SPEC = RunSpec(inner=InnerOptimizer(batch_size=4, seq_len=32)).validate()
TEXT = "".join(f"{i} To be, or not to be, that is the question; whether 'tis nobler.\n" for i in range(400))
DATASET = CharDataset.from_text(TEXT)
RUN = "bafk-replay-run"
W, A1, A2 = (Identity(bytes([i]) * 32) for i in (20, 21, 22))
NEVER = threading.Event()


def engine() -> InnerEngine:
    target = best_cpu_target().name
    opts = program_options(SPEC)
    art = artifact("train", target, opts)
    ex = Executor.start(artifact_file("train", target, opts), art.manifest, expected_signer=shepherd().peer_id)
    return InnerEngine(ex, SPEC, DATASET)


@pytest.fixture(scope="module")
def engines():
    worker, auditor = engine(), engine()
    yield worker, auditor
    worker.executor.close()
    auditor.executor.close()


def run(eng: InnerEngine, theta, inner_state, round_: int, seed: int, steps: int = 10):
    a = DataAssignment(worker=W.peer_id, shard=1, num_shards=3, seed=seed, max_steps=steps)
    eff = RunInner(round=round_, attempt=0, theta=theta, theta_cid=params_cid(theta), artifact_cid=None,
                   assignment=a, time_budget_s=1e6, inner_state=inner_state)
    return eng.run(eff, NEVER), a


def submit(theta, result, theta_local=None) -> tuple[Submission, bytes]:
    payload = codec_of("int8").encode(pseudo_gradient(theta, result.theta if theta_local is None else theta_local))
    sub = sign(Submission(
        run_id=RUN, term=0, round=1, attempt=0, worker=W.peer_id, base_theta_cid=params_cid(theta), codec="int8",
        delta_cid=None, delta_inline=payload, steps=result.steps, tokens=result.steps * SPEC.tokens_per_step,
        losses=result.losses, state_in=result.state_in, state_out=result.state_out,
    ), W)
    return sub, encode(sub)


def audit_report(auditor: InnerEngine, who: Identity, sub_bytes: bytes, assignment, theta, state_blob):
    beacon = next(b for b in (f"b{i}" for i in range(5000)) if audit.should_audit(RUN, 0, 1, 0, W.peer_id, 0.05, b))
    req = sign(audit.AuditRequest(
        run_id=RUN, term=0, round=1, attempt=0, worker=W.peer_id, submission_cid=cid_of(sub_bytes), beacon=beacon,
        assignment=assignment, target="t", artifact_cid="a", dataset_cid="d", auditor=who.peer_id,
        shepherd=shepherd().peer_id, shepherd_term=0,
    ), shepherd())
    job = audit.AuditJob(req, who, chunk_steps=CHUNK_STEPS)
    job.on_blob(req.submission_cid, sub_bytes)
    job.on_blob(params_cid(theta), pack_tensors(theta, "fp32"))
    if state_blob is not None:
        job.on_offer(audit.make_offer(req, job.sub.state_in, state_blob, W))
        job.on_blob(cid_of(state_blob), state_blob)
    assert job.ready()
    inp = job.replay_input()
    rep = auditor.replay(inp.theta, inp.state, inp.assignment, inp.steps)
    return req, job.finish(rep.theta, rep.state_out, rep.losses)


def test_replay_in_another_process_reproduces_an_honest_round_and_catches_a_tampered_one(engines):
    worker, auditor = engines
    theta0 = initial_theta(SPEC, 65)
    # round 0 from fresh moments, round 1 from round 0's end state (what the chain allows)
    r0, _ = run(worker, theta0, None, 0, seed=5)
    assert r0.state_in == FRESH_STATE and r0.steps == 10 and len(r0.state_out) == 64
    theta1 = {k: v - 0.5 * (theta0[k] - r0.theta[k]) for k, v in theta0.items()}
    r1, a1 = run(worker, theta1, r0.inner_state, 1, seed=6)
    assert r1.state_in == r0.state_out != r1.state_out
    # the worker serves its start state; the auditor (another executor process) replays
    blob = worker.export_state(r1.state_in)
    assert audit.inner_state_digest(audit.decode_inner_state(blob, theta1)) == r1.state_in
    sub, sub_bytes = submit(theta1, r1)
    _, report = audit_report(auditor, A1, sub_bytes, a1, theta1, blob)
    assert report.verdict == audit.MATCH, report
    assert report.max_abs_diff == 0.0 and report.delta_cid == audit.delta_cid_of(sub)  # bit for bit
    # a Δ scaled by 1.5 (an attacker's "stronger" update) is caught by two auditors: evidence
    boosted = {k: theta1[k] - 1.5 * (theta1[k] - r1.theta[k]) for k in theta1}
    _, bad_bytes = submit(theta1, r1, theta_local=boosted)
    req_a, rep_a = audit_report(auditor, A1, bad_bytes, a1, theta1, blob)
    req_b, rep_b = audit_report(worker, A2, bad_bytes, a1, theta1, blob)  # any same-target executor
    assert rep_a.verdict == rep_b.verdict == audit.MISMATCH and rep_a.differs == ("delta",)
    ev = audit.decode_evidence(audit.encode_evidence(audit.make_evidence(bad_bytes, [req_a, req_b], [rep_a, rep_b])))
    assert audit.verify_evidence(ev, rate=0.05) == W.peer_id


def test_the_childs_digest_is_the_one_any_node_computes(engines):
    worker, _ = engines
    theta0 = initial_theta(SPEC, 65)
    worker.executor.load_state(theta0)  # fresh moments, step 0, in the manifest's order
    assert worker.executor.inner_digest() == audit.inner_state_digest(audit.fresh_state(theta0))
    r0, _ = run(worker, theta0, None, 0, seed=11)
    st = worker.executor.read_inner(tag=r0.state_out)
    assert audit.inner_state_digest(audit.InnerState(st.m, st.v, st.step)) == r0.state_out and st.step == 10


def test_a_kept_state_restarts_exactly_and_an_unknown_one_starts_fresh(engines):
    worker, _ = engines
    theta0 = initial_theta(SPEC, 65)
    r0, _ = run(worker, theta0, None, 0, seed=7)
    first, _ = run(worker, theta0, r0.inner_state, 1, seed=8)
    run(worker, theta0, first.inner_state, 2, seed=9)  # the device state moves on (a later round)
    again, _ = run(worker, theta0, r0.inner_state, 1, seed=8)  # a retry from the committed state
    assert again.state_in == r0.state_out and again.state_out == first.state_out
    assert all(np.array_equal(again.theta[k], first.theta[k]) for k in theta0)
    lost, _ = run(worker, theta0, "0" * 64, 3, seed=9)
    assert lost.state_in == FRESH_STATE
    fresh, _ = run(worker, theta0, None, 0, seed=7)
    assert fresh.state_out == r0.state_out  # fresh twice: the same round, the same bytes

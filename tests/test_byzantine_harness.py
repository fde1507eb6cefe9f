"""The Byzantine workers of ``bench/byzantine.py`` send what they claim to send.

Each attacker runs in a real in-process swarm (Shepherd, honest Workers, wire
codec, signatures) with a cheap deterministic numpy inner loop in place of the
model, so the checks are on the submissions as the shepherd receives them:
well-formed and signed by the attacker, and carrying exactly the lie its class
names (a sign flip is −honest, a scaled Δ is s·honest under the bound, ...).
"""

from __future__ import annotations

import numpy as np
import pytest

from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.algorithm.outer import OuterState
from pcp_p2p.diloco.algorithm.params import Params, codec_of, global_norm
from pcp_p2p.diloco.protocol.aggregate import delta_norm_bound
from pcp_p2p.diloco.protocol.effects import RunInner
from pcp_p2p.diloco.protocol.messages import Submission, verify
from pcp_p2p.diloco.protocol.shepherd import Phase, Shepherd
from pcp_p2p.diloco.protocol.spec import parse_spec, run_id_of, sign_spec
from pcp_p2p.diloco.protocol.worker import InnerResult, Worker
from pcp_p2p.testing.byzantine import (
    KINDS,
    UNDER_BOUND,
    ByzantineWorker,
    RandomDelta,
    ScaledHonest,
    SignFlip,
    StaleReplay,
    TokenInflation,
)
from pcp_p2p.testing.inprocess import RunLog, pump_run

H = 10  # steps an honest worker trains per round
ROUNDS = 3
SPEC = parse_spec(f"""
name = "byzantine-harness"
[inner]
lr = 0.001
batch_size = 2
seq_len = 4
[round]
time_budget_s = 60.0
deadline_s = 120.0
max_inner_steps = {10 * H}
rounds = {ROUNDS}
min_quorum = 3
delta_codec = "int8"
[aggregation]
rule = "mean"
max_share = 1.0
norm_vs_median = 0.0
score_tolerance = -1.0
val_jump = 0.0
""")  # every defence off: these tests are about what the attackers send, not what stops them
HONEST_SPEED = H * SPEC.tokens_per_step / SPEC.round.time_budget_s  # its cap: ceil(1.5·H) steps


def honest_delta(e: RunInner) -> Params:
    """The Δ the fake inner loop produces for an assignment: fixed by its seed, shrinking with θ."""
    rng = np.random.default_rng(e.assignment.seed)
    return {k: (1e-3 * H * rng.standard_normal(v.shape)).astype(np.float32) for k, v in e.theta.items()}


def fake_inner(calls: list[str]):
    def run(worker: str, e: RunInner) -> InnerResult:
        calls.append(worker)
        d = honest_delta(e)
        theta = {k: (v - d[k]).astype(np.float32) for k, v in e.theta.items()}
        return InnerResult(e.round, e.attempt, theta, H, tuple(2.0 - 0.01 * i for i in range(H)), None)

    return run


def swarm(attacker: type[ByzantineWorker], **kw: object) -> tuple[ByzantineWorker, Shepherd, RunLog, list[str]]:
    rng = np.random.default_rng(7)
    owner = Identity(rng.bytes(32))
    run_id = run_id_of(sign_spec(SPEC, owner))
    theta0 = {"w": np.ones((8, 8), np.float32), "b": np.full(32, 0.5, np.float32)}
    shepherd = Shepherd(spec=SPEC, run_id=run_id, identity=owner, term=0, state=OuterState.initial(theta0))
    common = dict(spec=SPEC, run_id=run_id, shepherds={0: owner.peer_id}, target="cpu-x86_64-v3",
                  tokens_per_s=HONEST_SPEED)
    workers: dict[str, Worker] = {}
    for _ in range(3):
        w = Worker(identity=Identity(rng.bytes(32)), **common)  # type: ignore[arg-type]
        workers[w.peer_id] = w
    bad = attacker(identity=Identity(rng.bytes(32)), seed=1, **common, **kw)  # type: ignore[arg-type]
    workers[bad.peer_id] = bad
    calls: list[str] = []
    log = pump_run(shepherd, workers, fake_inner(calls))
    assert shepherd.phase is Phase.FINISHED
    return bad, shepherd, log, calls


def decoded(sub: Submission) -> Params:
    assert sub.delta_inline is not None
    return codec_of(sub.codec).decode(sub.delta_inline)


def assert_well_formed(bad: ByzantineWorker, shepherd: Shepherd) -> None:
    """Every submission is signed by the attacker, billed consistently, for this run, and decodes."""
    assert len(bad.submitted) == ROUNDS
    for r, sub in enumerate(bad.submitted):
        verify(sub, bad.peer_id)
        assert (sub.run_id, sub.term, sub.round) == (bad.run_id, 0, r)
        assert sub.tokens == sub.steps * SPEC.tokens_per_step
        assert all(np.isfinite(v).all() for v in decoded(sub).values())


def close(a: Params, b: Params) -> bool:
    """Equal up to the int8 codec's rounding (half a step of a block's scale, ≤ max/254)."""
    return all(np.allclose(a[k], b[k], rtol=0, atol=float(np.abs(b[k]).max()) / 200 + 1e-12) for k in b)


def test_sign_flip_sends_exactly_minus_honest() -> None:
    bad, shepherd, _, calls = swarm(SignFlip)
    assert_well_formed(bad, shepherd)
    assert bad.last_honest is not None and bad.last_forged is not None
    for k, v in bad.last_honest.items():
        np.testing.assert_array_equal(bad.last_forged[k], -v)
    assert close(decoded(bad.submitted[-1]), {k: -v for k, v in bad.last_honest.items()})
    assert calls.count(bad.peer_id) == ROUNDS  # it does the work, then lies about its direction


def test_scaled_honest_is_the_largest_multiple_under_the_bound() -> None:
    bad, shepherd, _, _ = swarm(ScaledHonest, scale=10.0)
    assert_well_formed(bad, shepherd)
    h, f = bad.last_honest, bad.last_forged
    assert h is not None and f is not None
    bound = delta_norm_bound(SPEC, bad.last_base, H)  # type: ignore[arg-type]
    s = float(f["w"].ravel()[0] / h["w"].ravel()[0])
    assert s == pytest.approx(min(10.0, UNDER_BOUND * bound / global_norm(h)), rel=1e-5)
    assert s > 1.0 and global_norm(f) <= bound
    for k in h:
        np.testing.assert_allclose(f[k], s * h[k], rtol=1e-6)


def test_random_delta_sits_just_under_the_bound_without_training() -> None:
    bad, shepherd, _, calls = swarm(RandomDelta, claim_steps=H)
    assert_well_formed(bad, shepherd)
    assert bad.peer_id not in calls  # never ran an inner step
    sub = bad.submitted[-1]
    assert sub.steps == H
    assert bad.last_honest is None and bad.last_forged is not None
    bound = delta_norm_bound(SPEC, bad.last_base, H)  # type: ignore[arg-type]
    assert global_norm(bad.last_forged) == pytest.approx(UNDER_BOUND * bound, rel=1e-5)
    assert global_norm(decoded(sub)) == pytest.approx(UNDER_BOUND * bound, rel=1e-2)


def test_token_inflation_claims_the_speed_and_the_maximum_steps() -> None:
    bad, shepherd, _, calls = swarm(TokenInflation)
    assert_well_formed(bad, shepherd)
    assert shepherd.roster[bad.peer_id].tokens_per_s == 1e12
    sub = bad.submitted[-1]
    assert sub.steps == SPEC.round.max_inner_steps == 10 * H  # all the spec allows, 10x what it trained
    assert calls.count(bad.peer_id) == ROUNDS
    h, f = bad.last_honest, bad.last_forged
    assert h is not None and f is not None
    bound = delta_norm_bound(SPEC, bad.last_base, sub.steps)  # type: ignore[arg-type]
    s = float(f["w"].ravel()[0] / h["w"].ravel()[0])
    assert s == pytest.approx(min(10.0, UNDER_BOUND * bound / global_norm(h)), rel=1e-5)


def test_stale_replay_trains_once_then_replays_its_first_delta() -> None:
    bad, shepherd, log, calls = swarm(StaleReplay)
    assert_well_formed(bad, shepherd)
    assert calls.count(bad.peer_id) == 1
    first = decoded(bad.submitted[0])
    for sub in bad.submitted[1:]:
        assert close(decoded(sub), first)
        assert sub.base_theta_cid != bad.submitted[0].base_theta_cid  # re-signed for the new θ
    # the verbatim replays of the first submission were refused as stale, one per later round
    assert log.rejected_from(bad.peer_id).count("StaleMessage") == ROUNDS - 1


def test_every_kind_is_registered() -> None:
    assert set(KINDS) == {"random", "sign_flip", "scaled", "token_inflation", "stale_replay"}

"""An early inner run on the real IREE executor: the shift moves the parameters and keeps the rest.

The engine's side of overlap (:class:`~pcp_p2p.diloco.run.engine.ShiftSlot`): an early
run takes its real start between chunks, waits for it once its budget is spent, and a
cancel ends the wait. The worker's rules are tested in ``test_diloco_overlap.py``.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("iree.compiler")

from test_audit_replay import SPEC, engine  # the same tiny train artifact and data, built once

from pcp_p2p.core.errors import ExecutorError, InvalidInput
from pcp_p2p.diloco.protocol.audit import CHUNK_STEPS
from pcp_p2p.diloco.protocol.effects import EARLY, RunInner, ShiftInner
from pcp_p2p.diloco.protocol.messages import DataAssignment
from pcp_p2p.diloco.protocol.worker import InnerResult
from pcp_p2p.diloco.run.engine import InnerEngine, ShiftSlot, initial_theta

STEPS = 2 * CHUNK_STEPS


@pytest.fixture(scope="module")
def eng():
    e = engine()
    yield e
    e.executor.close()


def in_thread(eng: InnerEngine, eff: RunInner, slot: ShiftSlot,
              cancelled: threading.Event | None = None) -> tuple[threading.Thread, list[InnerResult]]:
    """Start ``eff`` in a thread (as the runtime does) and return once it waits for its shift."""
    out: list[InnerResult] = []
    t = threading.Thread(target=lambda: out.append(eng.run(eff, cancelled or threading.Event(), slot)))
    t.start()
    assert slot.waiting.wait(timeout=60)
    return t, out


ASSIGNMENT = DataAssignment(worker="w", shard=0, num_shards=2, seed=5, max_steps=STEPS)


def inner(theta, attempt: int, budget_s: float = 1e6, a: DataAssignment = ASSIGNMENT) -> RunInner:
    return RunInner(round=1, attempt=attempt, theta=theta, theta_cid="", artifact_cid=None, assignment=a,
                    time_budget_s=budget_s, inner_state=None)


def starts():
    theta = initial_theta(SPEC, 65)  # the compiled artifact's vocabulary (the dataset's ids fit in it)
    rng = np.random.default_rng(3)
    to = {k: (v + 0.01 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in theta.items()}
    return theta, to


def close(a, b) -> None:
    """Equal up to float rounding: start + (to − start) is not ``to`` bit for bit, and AdamW's
    normalised steps carry that through a run (~3e-6 after 20 steps; the shift itself is ~1e-2)."""
    for k in b:
        np.testing.assert_allclose(a[k], b[k], rtol=0, atol=2e-5)


def test_a_shift_before_the_first_step_is_a_run_from_the_announced_start(eng):
    theta, to = starts()
    slot = ShiftSlot()
    slot.shift(ShiftInner(1, to, ASSIGNMENT))
    early = eng.run(inner(theta, EARLY), threading.Event(), slot)
    plain = eng.run(inner(to, 0), threading.Event())
    assert early.steps == plain.steps == STEPS and (early.shifted_at, plain.shifted_at) == (0, None)
    close(early.theta, plain.theta)
    assert early.losses == pytest.approx(plain.losses, abs=1e-5)


def test_a_shift_after_the_last_step_moves_the_end_point_by_the_difference(eng):
    # (a one-chunk assignment: every step is done before the shift, which moves the end point)
    theta, to = starts()
    one = DataAssignment(worker="w", shard=0, num_shards=2, seed=5, max_steps=CHUNK_STEPS)
    slot = ShiftSlot()
    t, out = in_thread(eng, inner(theta, EARLY, a=one), slot)
    assert t.is_alive()  # its steps are done, and it waits for its start
    slot.shift(ShiftInner(1, to, one))
    t.join(timeout=60)
    (early,) = out
    plain = eng.run(inner(theta, 0, a=one), threading.Event())
    assert early.steps == plain.steps == early.shifted_at == CHUNK_STEPS
    close(early.theta, {k: plain.theta[k] + (to[k] - theta[k]) for k in theta})


def test_a_run_past_its_budget_still_trains_a_chunk_after_its_shift(eng):
    theta, to = starts()
    slot = ShiftSlot()
    t, out = in_thread(eng, inner(theta, EARLY, budget_s=0.0), slot)
    assert t.is_alive()  # one chunk (the first always runs), then waiting
    slot.shift(ShiftInner(1, to, ASSIGNMENT))
    t.join(timeout=60)
    (early,) = out
    assert (early.shifted_at, early.steps) == (CHUNK_STEPS, 2 * CHUNK_STEPS)


def test_a_cancel_ends_an_early_runs_wait_and_it_needs_a_slot(eng):
    theta, _ = starts()
    slot, cancelled = ShiftSlot(), threading.Event()
    t, out = in_thread(eng, inner(theta, EARLY, budget_s=0.0), slot, cancelled)
    cancelled.set()
    slot.wake()
    t.join(timeout=60)
    assert not t.is_alive() and out[0].steps == CHUNK_STEPS
    with pytest.raises(ExecutorError, match="shift slot"):
        eng.run(inner(theta, EARLY), threading.Event())


def test_an_early_run_waits_for_its_shift_past_its_early_share(eng):
    # EARLY_SHARE of the steps (one chunk of two) from the estimate, then it waits; after the
    # shift it trains the rest from the moved parameters
    theta, to = starts()
    slot = ShiftSlot()
    t, out = in_thread(eng, inner(theta, EARLY), slot)
    assert t.is_alive()
    slot.shift(ShiftInner(1, to, ASSIGNMENT))
    t.join(timeout=60)
    (early,) = out
    plain = eng.run(inner(theta, 0), threading.Event())
    assert early.steps == plain.steps == STEPS and early.shifted_at == CHUNK_STEPS
    assert early.losses[:CHUNK_STEPS] == plain.losses[:CHUNK_STEPS]  # the same first chunk, from the estimate
    assert early.losses[CHUNK_STEPS:] != plain.losses[CHUNK_STEPS:]  # the second, after the shift


def test_a_shift_with_another_assignment_trains_the_rest_on_the_announced_batches(eng):
    # (a join or a departure renumbered the shards: the steps after the shift take the announced data)
    theta, to = starts()
    other = DataAssignment(worker="w", shard=1, num_shards=3, seed=9, max_steps=STEPS)
    slot = ShiftSlot()
    slot.shift(ShiftInner(1, to, other))
    early = eng.run(inner(theta, EARLY), threading.Event(), slot)
    plain = eng.run(inner(to, 0, a=other), threading.Event())
    assert early.steps == plain.steps == STEPS
    close(early.theta, plain.theta)


def test_a_shift_after_the_budget_still_gets_the_rest_of_a_round(eng):
    # the round waited for a straggler: the shift comes after the early run's budget, and the
    # run trains (1 − EARLY_SHARE) of a budget after it instead of ending with every step estimated
    theta, to = starts()
    slot = ShiftSlot()
    t, out = in_thread(eng, inner(theta, EARLY, budget_s=2.0), slot)
    t.join(timeout=2.0)  # waiting (its early share done) while its 2 s budget runs out: the shift comes late
    assert t.is_alive()
    slot.shift(ShiftInner(1, to, ASSIGNMENT))
    t.join(timeout=60)
    (early,) = out
    assert (early.shifted_at, early.steps) == (CHUNK_STEPS, STEPS)


def test_a_shift_to_a_theta_of_another_shape_is_refused_with_a_typed_error(eng):
    # the announced θ is hash-checked against its signed CID, not against the model
    theta, to = starts()
    name = next(iter(to))
    slot = ShiftSlot()
    slot.shift(ShiftInner(1, {**to, name: np.zeros((3, 3), np.float32)}, ASSIGNMENT))
    with pytest.raises(InvalidInput, match="tensors"):
        eng.run(inner(theta, EARLY), threading.Event(), slot)
    slot = ShiftSlot()
    slot.shift(ShiftInner(1, {k: v for k, v in to.items() if k != name}, ASSIGNMENT))
    with pytest.raises(InvalidInput, match="tensors"):
        eng.run(inner(theta, EARLY), threading.Event(), slot)
    assert eng.run(inner(to, 0), threading.Event()).steps == STEPS  # the engine goes on

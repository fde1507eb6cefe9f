"""A commit's update: a node holding the last checkpoint builds the next one bit for bit.

The shepherd takes the outer step exactly as its update blob carries it
(``outer.update_codec``), so the checkpoint built from the blob is the
shepherd's own bytes; anything else is refused with a typed error and the
node fetches the checkpoint instead (``RunRuntime._hold_checkpoint``; over
real libp2p in ``test_overlap_swarm.py``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_diloco_protocol import SPEC, THETA0, Round

from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import ConfigError, HashMismatch, MalformedMessage
from pcp_p2p.diloco.algorithm.checkpoint import (
    Checkpoint,
    decode_checkpoint,
    encode_checkpoint,
    lay_out_checkpoint,
    round_metrics,
)
from pcp_p2p.diloco.algorithm.outer import OuterState, nesterov_step
from pcp_p2p.diloco.algorithm.params import pack_tensors
from pcp_p2p.diloco.algorithm.update import apply_update, step_update
from pcp_p2p.diloco.protocol.commits import rebuild_checkpoint, rebuild_theta, start_checkpoint
from pcp_p2p.diloco.protocol.effects import Committed, StoreBlob
from pcp_p2p.diloco.protocol.messages import CommitRecord, RoundAnnouncement
from pcp_p2p.diloco.protocol.spec import parse_spec


def spec_with(codec: str, momentum: float):
    outer = dataclasses.replace(SPEC.outer, update_codec=codec, momentum=momentum)
    return dataclasses.replace(SPEC, outer=outer)


def two_commits(spec) -> tuple[list[CommitRecord], dict[str, bytes]]:
    """Rounds 0 and 1 committed by a real shepherd machine, with every blob it stored."""
    r = Round(spec=spec)
    rng = np.random.default_rng(0)
    records: list[CommitRecord] = []
    blobs: dict[str, bytes] = {}
    for _ in range(2):
        effects = []
        for who in r.ids:  # different Δs, so the mean is not one value per tensor
            delta = {k: rng.standard_normal(v.shape).astype(np.float32) * 0.01 for k, v in THETA0.items()}
            effects += r.shepherd.on_submission(r.submission(who, delta=delta), now=3.0)
        (rec,) = [e.record for e in effects if isinstance(e, Committed)]
        records.append(rec)
        blobs.update({e.cid: e.data for e in effects if isinstance(e, StoreBlob)})
        r.ann = [e.message for e in effects if isinstance(getattr(e, "message", None), RoundAnnouncement)][-1]
    return records, blobs


def round0_checkpoint(rec: CommitRecord) -> bytes:
    """The state round 0's step started from (a run's first commit has no checkpoint before
    it): what a worker builds out of the starting θ blob it trained round 0 from."""
    data = start_checkpoint(rec, pack_tensors(THETA0))
    assert data is not None
    return data


def test_only_the_first_commit_is_built_from_the_starting_theta() -> None:
    (rec0, rec1), _ = two_commits(SPEC)
    assert rec0.prev_theta_cid == cid_of(pack_tensors(THETA0))
    assert start_checkpoint(rec1, pack_tensors(THETA0)) is None  # later rounds have momentum


@pytest.mark.parametrize(("codec", "momentum"), [("int8", 0.9), ("fp32", 0.9), ("int8", 0.0)])
def test_the_next_checkpoint_is_built_from_the_last_and_the_update(codec: str, momentum: float) -> None:
    spec = spec_with(codec, momentum)
    (rec0, rec1), blobs = two_commits(spec)
    assert rec0.update_cid in blobs and rec1.update_cid in blobs
    built0 = rebuild_checkpoint(rec0, round0_checkpoint(rec0), blobs[rec0.update_cid], spec.outer)
    assert built0 == blobs[rec0.checkpoint_cid]
    # round 1 steps from a checkpoint with momentum in it: the second step is where v matters
    assert rebuild_checkpoint(rec1, built0, blobs[rec1.update_cid], spec.outer) == blobs[rec1.checkpoint_cid]
    # built in a reused buffer (the checkpoint before the last, as a node does): every byte rewritten
    junk = bytearray(b"\xff" * len(built0))
    assert rebuild_checkpoint(rec1, built0, blobs[rec1.update_cid], spec.outer, reuse=junk) is junk
    assert junk == blobs[rec1.checkpoint_cid]


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_the_update_is_the_outer_step_and_applying_it_is_the_shepherds_state(momentum: float) -> None:
    rng = np.random.default_rng(1)
    def tensors(scale: float) -> dict[str, np.ndarray]:
        return {"w": rng.standard_normal(1000).astype(np.float32) * scale,
                "b": rng.standard_normal((3, 7)).astype(np.float32) * scale}

    state = OuterState(tensors(1.0), tensors(0.01), 3)
    mean = tensors(0.01)
    want = nesterov_step(state, mean, lr=0.7, momentum=momentum)
    # fp32: Nesterov's step, up to float32 rounding (the momentum follows from the step taken)
    blob, exact = step_update(state, mean, "fp32", lr=0.7, momentum=momentum)
    for k in state.theta:
        np.testing.assert_allclose(exact.theta[k], want.theta[k], rtol=0, atol=1e-6)
        if momentum:
            np.testing.assert_allclose(exact.momentum[k], want.momentum[k], rtol=0, atol=1e-5)
        else:  # (no step uses it: the base's, unchanged)
            assert np.array_equal(exact.momentum[k], state.momentum[k])
    # int8: a quarter of the bytes; θ moved by the decoded step exactly, within half a step of the exact one
    blob8, quant = step_update(state, mean, "int8", lr=0.7, momentum=momentum)
    assert len(blob8) < len(blob) / 3 and quant.round == exact.round == 4
    for k in state.theta:
        step, applied = want.theta[k] - state.theta[k], quant.theta[k] - state.theta[k]
        assert not np.array_equal(quant.theta[k], exact.theta[k])  # rounded...
        assert np.max(np.abs(applied - step)) <= np.max(np.abs(step)) / 127 + 1e-6  # ...by half a step at most
    # whoever applies the blob gets the shepherd's state bit for bit
    again = apply_update(state, blob8, lr=0.7, momentum=momentum)
    for k in state.theta:
        assert np.array_equal(again.theta[k], quant.theta[k])
        assert np.array_equal(again.momentum[k], quant.momentum[k])


@pytest.fixture(scope="module")
def committed():
    spec = spec_with("int8", 0.9)
    (rec0, rec1), blobs = two_commits(spec)
    base1 = blobs[rec0.checkpoint_cid]
    return spec, rec0, rec1, blobs, base1


def test_a_tampered_update_is_refused_by_the_commits_cids(committed) -> None:
    spec, _, rec1, blobs, base1 = committed
    update = bytearray(blobs[rec1.update_cid])
    update[-1] ^= 1  # one int8 value off by one step
    with pytest.raises(HashMismatch):
        rebuild_checkpoint(rec1, base1, bytes(update), spec.outer)


def test_a_base_that_is_not_the_steps_own_is_refused(committed) -> None:
    spec, rec0, rec1, blobs, base1 = committed
    with pytest.raises(MalformedMessage, match="round"):  # round 0's base for round 1's commit
        rebuild_checkpoint(rec1, round0_checkpoint(rec0), blobs[rec1.update_cid], spec.outer)
    # the right round, other momentum: caught by the CIDs
    other, _ = encode_checkpoint(Checkpoint(rec0.run_id, 0, OuterState.initial(_theta_of(base1), round=1)))
    with pytest.raises(HashMismatch):
        rebuild_checkpoint(rec1, other, blobs[rec1.update_cid], spec.outer)


def test_theta_is_built_and_checked_before_the_momentum(committed) -> None:
    """A node trains from θ once θ is checked; the momentum and the checkpoint's CID follow. A base
    of the right round and θ with another momentum gives the commit's θ (θ' = θ + ŝ does not read
    the momentum), and only the checkpoint's CID refuses it."""
    spec, rec0, rec1, blobs, base1 = committed
    good = rebuild_theta(rec1, base1, blobs[rec1.update_cid], spec.outer)
    assert cid_of(good.theta_bytes()) == rec1.theta_cid
    assert good.finish() == blobs[rec1.checkpoint_cid]
    other, _ = encode_checkpoint(Checkpoint(rec0.run_id, 0, OuterState.initial(_theta_of(base1), round=1)))
    half = rebuild_theta(rec1, other, blobs[rec1.update_cid], spec.outer)
    assert cid_of(half.theta_bytes()) == rec1.theta_cid
    with pytest.raises(HashMismatch, match="gives its θ but not the checkpoint"):
        half.finish()


def _theta_of(ckpt: bytes):
    return decode_checkpoint(ckpt).state.theta


@pytest.mark.parametrize("bad", ["truncated", "other-tensors", "other-shape", "garbage"])
def test_a_malformed_update_is_refused_before_any_arithmetic(committed, bad: str) -> None:
    spec, _, rec1, blobs, base1 = committed
    update = {
        "truncated": blobs[rec1.update_cid][:-3],
        "other-tensors": pack_tensors({"x": np.zeros(4, np.float32)}),
        "other-shape": pack_tensors({"w": np.zeros(12, np.float32), "b": np.zeros(4, np.float32)}),
        "garbage": b"\x00" * 64,
    }[bad]
    with pytest.raises(MalformedMessage):
        rebuild_checkpoint(rec1, base1, update, spec.outer)


def test_an_unknown_update_codec_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"outer\.update_codec"):
        parse_spec('[outer]\nupdate_codec = "topk2"\n')


@pytest.mark.parametrize("with_momentum", [True, False])
def test_a_laid_out_checkpoint_is_encode_checkpoints_bytes_once_written(with_momentum: bool) -> None:
    rng = np.random.default_rng(2)
    def tensors() -> dict[str, np.ndarray]:
        return {"a": rng.standard_normal((3, 5)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float32)}

    state = OuterState(tensors(), tensors(), 4)
    metrics = round_metrics(123, 2.5, 2.25)
    want, theta_cid = encode_checkpoint(Checkpoint("run", 3, state, metrics), with_momentum=with_momentum)
    out = lay_out_checkpoint("run", 3, 4, metrics, {k: v.shape for k, v in state.theta.items()},
                             with_momentum=with_momentum)
    for k in state.theta:
        out.theta[k][...] = state.theta[k]
        if out.momentum is not None:
            out.momentum[k][...] = state.momentum[k]
    assert (out.momentum is None) == (not with_momentum)
    assert bytes(out.data) == want and out.theta_cid() == theta_cid


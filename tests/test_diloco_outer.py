"""Outer Nesterov step, tensor bundles, checkpoints, the norm bound."""

from __future__ import annotations

import numpy as np
import pytest

from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import ConfigError, MalformedMessage, ProtocolError
from pcp_p2p.diloco.algorithm.checkpoint import (
    THETA_HEAD,
    Checkpoint,
    checkpoint_theta_bytes,
    checkpoint_theta_span,
    decode_checkpoint,
    encode_checkpoint,
)
from pcp_p2p.diloco.algorithm.outer import OuterState, nesterov_step
from pcp_p2p.diloco.algorithm.params import codec_of, global_norm, pack_tensors, params_cid, unpack_tensors
from pcp_p2p.diloco.protocol.aggregate import adam_step_bound, delta_norm_bound
from pcp_p2p.diloco.protocol.spec import RunSpec

RNG = np.random.default_rng(0)
THETA = {"a": RNG.normal(size=(5, 7)).astype(np.float32), "b": RNG.normal(size=(300,)).astype(np.float32)}


def test_nesterov_matches_the_formula_over_two_steps():
    s0 = OuterState.initial(THETA)
    d1 = {k: np.full_like(v, 0.1) for k, v in THETA.items()}
    d2 = {k: np.full_like(v, -0.05) for k, v in THETA.items()}
    lr, mu = 0.7, 0.9
    s1 = nesterov_step(s0, d1, lr=lr, momentum=mu)
    s2 = nesterov_step(s1, d2, lr=lr, momentum=mu)
    v1 = 0.1
    th1 = THETA["a"] - lr * (mu * v1 + 0.1)
    v2 = mu * v1 - 0.05
    th2 = th1 - lr * (mu * v2 - 0.05)
    np.testing.assert_allclose(s1.theta["a"], th1, rtol=1e-6)
    np.testing.assert_allclose(s2.theta["a"], th2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s2.momentum["b"], v2, rtol=1e-6)
    assert (s0.round, s1.round, s2.round) == (0, 1, 2)
    np.testing.assert_array_equal(s0.theta["a"], THETA["a"])  # the old state is untouched


def test_nesterov_is_bit_for_bit_the_two_line_formula() -> None:
    """The in-place step computes exactly v = μ·m + d, θ' = θ − η·(μ·v + d) in float32 (every
    node that steps from a checkpoint must reach the same θ CID)."""
    rng = np.random.default_rng(7)
    th = {"w": rng.standard_normal(100_003).astype(np.float32)}
    state = OuterState(th, {"w": rng.standard_normal(100_003).astype(np.float32)}, 0)
    d = {"w": (rng.standard_normal(100_003) * 1e-3).astype(np.float32)}
    mu, eta = np.float32(0.9), np.float32(0.7)
    v = mu * state.momentum["w"] + d["w"]
    want = (th["w"] - eta * (mu * v + d["w"])).astype(np.float32)
    got = nesterov_step(state, d, lr=0.7, momentum=0.9)
    assert got.theta["w"].tobytes() == want.tobytes() and got.momentum["w"].tobytes() == v.tobytes()
    assert got.theta["w"].dtype == np.float32 and state.theta["w"].tobytes() == th["w"].tobytes()


def test_params_cid_is_a_function_of_values():
    assert params_cid(THETA) == params_cid({k: v.copy() for k, v in THETA.items()})
    bumped = dict(THETA, b=THETA["b"] + np.float32(1e-6))
    assert params_cid(bumped) != params_cid(THETA)
    assert unpack_tensors(pack_tensors(THETA))["a"].tobytes() == THETA["a"].tobytes()


def test_int8_codec_error_is_within_half_a_scale_step():
    codec = codec_of("int8")
    data = codec.encode(THETA)
    back = codec.decode(data)
    for k, v in THETA.items():
        bound = np.max(np.abs(v)) / 127 / 2 + 1e-6  # per-block scale <= global max / 127
        assert np.max(np.abs(back[k] - v)) <= bound
    big = {"w": RNG.normal(size=(256, 256)).astype(np.float32)}
    assert len(codec.encode(big)) < 0.26 * len(pack_tensors(big))  # 1 byte + 4/256 per value
    with pytest.raises(ConfigError):
        codec_of("zip")


def test_garbage_bundles_are_protocol_errors():
    for junk in (b"", b"PCPT\x00\x00\x00\x05hello", pack_tensors(THETA)[:-3], b"\x93\x01\x02\x03"):
        with pytest.raises(ProtocolError):
            unpack_tensors(junk)


def test_checkpoint_round_trip_and_theta_identity():
    s = nesterov_step(OuterState.initial(THETA), {k: np.ones_like(v) for k, v in THETA.items()},
                      lr=0.7, momentum=0.9)
    data, theta_cid = encode_checkpoint(Checkpoint("run", 3, s, {"val_loss": 1.5}))
    assert theta_cid == s.theta_cid == cid_of(checkpoint_theta_bytes(data))
    back = decode_checkpoint(data)
    assert (back.run_id, back.term, back.state.round, back.metrics) == ("run", 3, 1, {"val_loss": 1.5})
    for k in THETA:
        np.testing.assert_array_equal(back.state.momentum[k], s.momentum[k])
    for junk in (b"", b"\x95\xa3abc", data[:-10]):
        with pytest.raises(MalformedMessage):
            decode_checkpoint(junk)


def test_a_run_without_outer_momentum_checkpoints_theta_alone_and_continues_exactly():
    """μ = 0: the momentum is read only as 0·v, so the checkpoint leaves it out (half its bytes)."""
    ones = {k: np.ones_like(v) for k, v in THETA.items()}
    s = nesterov_step(OuterState.initial(THETA), ones, lr=0.7, momentum=0.0)
    full, theta_cid = encode_checkpoint(Checkpoint("run", 3, s, {}))
    lean, lean_cid = encode_checkpoint(Checkpoint("run", 3, s, {}), with_momentum=False)
    assert lean_cid == theta_cid and checkpoint_theta_bytes(lean) == checkpoint_theta_bytes(full)
    assert len(lean) < 0.6 * len(full)
    back = decode_checkpoint(lean).state
    assert all(not back.momentum[k].any() and back.momentum[k].shape == THETA[k].shape for k in THETA)
    # the next step from the lean checkpoint is the step from the full state, bit for bit
    halves = {k: 0.5 * v for k, v in ones.items()}
    a = nesterov_step(s, halves, lr=0.7, momentum=0.0)
    b = nesterov_step(back, halves, lr=0.7, momentum=0.0)
    assert a.theta_cid == b.theta_cid


@pytest.mark.parametrize("n", [0, 3, 70, 16_000, 70_000])  # bin8, bin16 and bin32 bundles
@pytest.mark.parametrize("with_momentum", [True, False])
def test_a_checkpoint_is_the_msgpack_array_it_is_specified_as(n: int, with_momentum: bool) -> None:
    """encode_checkpoint frames the bundles itself (one copy of the tensors): byte for byte msgpack's."""
    import msgpack

    rng = np.random.default_rng(n)
    theta = {"w": rng.standard_normal(n).astype(np.float32), "b": np.ones((2, 3), np.float32)}
    state = OuterState(theta, {k: v * 0.5 for k, v in theta.items()}, 4)
    data, theta_cid = encode_checkpoint(Checkpoint("run", 2, state, {"val_loss": 1.25}), with_momentum=with_momentum)
    meta = {"run_id": "run", "term": 2, "round": 4, "metrics": {"val_loss": 1.25}}
    want = msgpack.packb(["pcp-checkpoint", 1, meta, pack_tensors(theta),
                          pack_tensors(state.momentum if with_momentum else {})], use_bin_type=True)
    assert data == want and theta_cid == cid_of(pack_tensors(theta))


@pytest.mark.parametrize("n", [3, 70_000])  # a small and a large θ (bin header widths differ)
def test_theta_span_from_a_checkpoints_head_is_the_theta_bundle(n: int) -> None:
    """A worker reads only θ's range of the checkpoint it replicated (``runtime._theta_from_checkpoint``)."""
    state = OuterState.initial({"w": np.arange(n, dtype=np.float32), "b": np.ones(7, np.float32)})
    data, theta_cid = encode_checkpoint(Checkpoint("run", 0, state, {"val_loss": 2.0}))
    off, length = checkpoint_theta_span(data[:THETA_HEAD])
    assert data[off : off + length] == checkpoint_theta_bytes(data) and cid_of(data[off : off + length]) == theta_cid
    with pytest.raises(MalformedMessage):  # a head that claims more θ than the bytes hold
        checkpoint_theta_bytes(data[: off + length - 1])
    for junk in (b"", b"\x95\xa3abc", b"\x95\xaepcp-checkpoint\x01\x80\xa1x", b"garbage" * 9, data[:off - 1]):
        with pytest.raises(MalformedMessage):
            checkpoint_theta_span(junk)


def test_norm_bound_admits_real_adam_and_refuses_absurd():
    spec = RunSpec()
    assert 2.0 < adam_step_bound(0.9, 0.99) < 4.0
    bound = delta_norm_bound(spec, THETA, steps=10)
    n = sum(v.size for v in THETA.values())
    # ten sign-like Adam steps of size lr on every coordinate: a worst honest case
    worst_honest = 10 * spec.inner.lr * np.sqrt(n)
    assert worst_honest < bound < 1e3 * worst_honest
    assert global_norm({"x": np.array([3.0, 4.0])}) == 5.0

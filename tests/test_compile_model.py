"""The GPT model and the programs built from it, run in JAX (no IREE)."""

from __future__ import annotations

import numpy as np
import pytest

from pcp_p2p.compile.model import (
    PRESETS,
    GPTConfig,
    forward,
    init_params,
    loss_fn,
    num_params,
    param_names,
    param_shapes,
    preset,
)
from pcp_p2p.compile.programs import ProgramOptions, build_program, state_specs
from pcp_p2p.core.errors import ConfigError

jax = pytest.importorskip("jax")

# XLA compile time grows with depth; behaviour does not need the tiny preset's four layers.
MINI = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32)


@pytest.mark.parametrize(("name", "lo", "hi"), [("tiny", 0.15e6, 0.3e6), ("small", 0.8e6, 1.3e6),
                                                ("medium", 9e6, 12e6)])
def test_preset_sizes(name, lo, hi):
    assert lo <= num_params(PRESETS[name]) <= hi


def test_param_order_is_canonical_and_stable():
    cfg = PRESETS["tiny"]
    names = param_names(cfg)
    assert names[:2] == ("wte", "wpe") and names[-2:] == ("ln_f.g", "ln_f.b")
    assert names[2] == "h.0.ln_1.g"
    # h.10 after h.9, not sorted as text
    big = GPTConfig(n_layer=11)
    blocks = [n.split(".")[1] for n in param_names(big) if n.startswith("h.")]
    assert blocks == sorted(blocks, key=int)
    assert list(init_params(cfg)) == list(names)


def test_init_is_deterministic():
    a, b, c = init_params(PRESETS["tiny"], 0), init_params(PRESETS["tiny"], 0), init_params(PRESETS["tiny"], 1)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["wte"], c["wte"])
    assert all(v.dtype == np.float32 and v.shape == param_shapes(PRESETS["tiny"])[k] for k, v in a.items())


def test_config_validation():
    with pytest.raises(ConfigError):
        GPTConfig(n_embd=65, n_head=4)
    with pytest.raises(ConfigError):
        GPTConfig(n_layer=0)
    with pytest.raises(ConfigError):
        preset("huge")
    assert preset("tiny", vocab_size=99).vocab_size == 99
    cfg = PRESETS["small"]
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError):
        build_program("train", PRESETS["tiny"], ProgramOptions(seq=PRESETS["tiny"].block_size + 1))
    with pytest.raises(ConfigError):
        build_program("finetune", PRESETS["tiny"], ProgramOptions())


def test_forward_shapes_and_causality():
    cfg = MINI
    params = init_params(cfg)
    idx = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16), dtype=np.int32)
    logits = np.asarray(jax.jit(lambda p, i: forward(cfg, p, i))(params, idx))
    assert logits.shape == (2, 16, cfg.vocab_size)
    # changing a later token does not change earlier positions' logits
    idx2 = idx.copy()
    idx2[:, 10] = (idx2[:, 10] + 1) % cfg.vocab_size
    logits2 = np.asarray(jax.jit(lambda p, i: forward(cfg, p, i))(params, idx2))
    np.testing.assert_allclose(logits[:, :10], logits2[:, :10], atol=1e-6)
    assert not np.allclose(logits[:, 10:], logits2[:, 10:])
    # an untrained model is close to uniform
    targets = np.roll(idx, 1, axis=1)
    loss = float(loss_fn(cfg, params, idx, targets))
    assert abs(loss - np.log(cfg.vocab_size)) < 0.5


def _flat_state(cfg, params):
    names = param_names(cfg)
    zeros = [np.zeros_like(params[n]) for n in names]
    return [params[n] for n in names] + zeros + zeros + [np.int32(0)]


def test_train_program_learns_and_counts_steps():
    cfg = MINI
    opts = ProgramOptions(inner_steps=8, batch=2, seq=16)
    prog = build_program("train", cfg, opts)
    assert [s.name for s in prog.inputs[: len(state_specs(cfg)) - 1]] == [s.name for s in state_specs(cfg)[:-1]]
    assert [s.name for s in prog.outputs][-2:] == ["step", "losses"]
    # one fixed batch, repeated: the loss must fall
    text = np.arange(17, dtype=np.int32) % 7
    xs = np.broadcast_to(text[:-1], (8, 2, 16)).astype(np.int32)
    ys = np.broadcast_to(text[1:], (8, 2, 16)).astype(np.int32)
    out = jax.jit(prog.fn)(*_flat_state(cfg, init_params(cfg)), np.float32(1e-2), xs, ys)
    losses = np.asarray(out[-1])
    assert losses.shape == (8,) and int(out[-2]) == 8
    assert losses[-1] < losses[0] - 0.5
    for spec, value in zip(prog.outputs, out):
        assert tuple(spec.shape) == np.shape(value) and np.dtype(spec.dtype) == np.asarray(value).dtype


def test_adamw_bias_correction_clipping_and_decay():
    """Step 1 of bias-corrected Adam moves each weight by lr * sign(g); clipping scales grads."""
    from pcp_p2p.compile.programs import _adamw

    names = ("a.w", "a.b")
    params = {"a.w": np.ones(3, np.float32), "a.b": np.ones(3, np.float32)}
    grads = {"a.w": np.array([3.0, -4.0, 1e-3], np.float32), "a.b": np.array([0, 0, -1], np.float32)}
    zeros = {n: np.zeros(3, np.float32) for n in names}
    opts = ProgramOptions(weight_decay=0.5, grad_clip=1.0)
    p, m, v, step = _adamw(opts, names, params, grads, zeros, zeros, np.int32(0), np.float32(1e-2))
    assert int(step) == 1
    # |update| = 1 (bias-corrected m/sqrt(v)) plus decay 0.5 * 1 on matrices only
    np.testing.assert_allclose(np.asarray(p["a.w"]), 1 - 1e-2 * (np.sign(grads["a.w"]) + 0.5), rtol=1e-4)
    np.testing.assert_allclose(np.asarray(p["a.b"]), [1, 1, 1 + 1e-2], rtol=1e-4)
    # the global norm is sqrt(9 + 16 + 1 + tiny) ~ 5.1 > 1, so m holds (1 - beta1) * g / norm
    norm = np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values()))
    np.testing.assert_allclose(np.asarray(m["a.w"]), 0.1 * grads["a.w"] / norm, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(v["a.w"]), 0.05 * (grads["a.w"] / norm) ** 2, rtol=1e-3)


def test_sample_and_eval_programs():
    cfg = MINI
    opts = ProgramOptions(batch=2, seq=16, sample_batch=3)
    params = init_params(cfg)
    flat = [params[n] for n in param_names(cfg)]
    idx = np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 16), dtype=np.int32)
    (logits,) = jax.jit(build_program("sample", cfg, opts).fn)(*flat, idx, np.int32(5))
    full = np.asarray(forward(cfg, params, idx))
    np.testing.assert_allclose(np.asarray(logits), full[:, 4], atol=1e-5)
    (loss,) = jax.jit(build_program("eval", cfg, opts).fn)(*flat, idx[:2], idx[:2])
    np.testing.assert_allclose(float(loss), float(loss_fn(cfg, params, idx[:2], idx[:2])), rtol=1e-6)

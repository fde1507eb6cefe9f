"""A nanoGPT-style character GPT in plain JAX, readable in one file.

The model follows Karpathy's nanoGPT ``model.py``: token and position
embeddings, ``n_layer`` pre-LayerNorm blocks of causal self-attention and a
GELU MLP, a final LayerNorm, and an output head tied to the token embedding.
There is no dropout: a training step must be a pure function of its inputs, so
every node computes the same thing from the same state and batch.

Parameters are a flat dict ``name -> array`` in one fixed order
(:func:`param_shapes`): the order in which they become positional inputs of a
compiled program and named tensors in a checkpoint blob. JAX would sort a
dict's keys when flattening it, so the programs in :mod:`.programs` pass
parameters as tuples in this order instead.

Initialisation uses numpy (seeded ``default_rng``), so a node can create the
initial parameters without JAX.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pcp_p2p.core.errors import ConfigError

if TYPE_CHECKING:
    import jax

# A model's parameters as the forward pass sees them: traced or concrete JAX arrays by name.
Params = Mapping[str, "jax.Array"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model. ``block_size`` is the longest context it can attend to."""

    vocab_size: int = 65
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if type(value) is not int or value <= 0:
                raise ConfigError(f"GPTConfig.{f.name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ConfigError("n_embd must be a multiple of n_head")

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        if set(d) != names:
            raise ConfigError(f"GPTConfig fields are {sorted(names)}, got {sorted(d)}")
        return cls(**d)


# Parameter counts for the character vocabulary of tiny-shakespeare (65):
#   tiny ≈ 0.21M, small ≈ 1.0M, medium ≈ 10.7M, large ≈ 99.7M.
# ``large`` is GPT-2 small's width (768, 12 heads) two layers deeper, so that with a
# character vocabulary (whose embedding is tiny) it still reaches ~100M parameters.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=64),
    "small": GPTConfig(block_size=128, n_layer=5, n_head=4, n_embd=128),
    "medium": GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384),
    "large": GPTConfig(block_size=512, n_layer=14, n_head=12, n_embd=768),
}


def preset(name: str, vocab_size: int | None = None) -> GPTConfig:
    """A named preset, optionally with another vocabulary size."""
    try:
        cfg = PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None
    return dataclasses.replace(cfg, vocab_size=vocab_size) if vocab_size else cfg


# --- parameters ---------------------------------------------------------------


def param_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, in the canonical order."""
    C, V = cfg.n_embd, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "wte": (V, C),  # token embedding, also the output head (tied)
        "wpe": (cfg.block_size, C),  # position embedding
    }
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        shapes.update({
            p + "ln_1.g": (C,),
            p + "ln_1.b": (C,),
            p + "attn.c_attn.w": (C, 3 * C),  # q, k, v projections side by side
            p + "attn.c_attn.b": (3 * C,),
            p + "attn.c_proj.w": (C, C),
            p + "attn.c_proj.b": (C,),
            p + "ln_2.g": (C,),
            p + "ln_2.b": (C,),
            p + "mlp.c_fc.w": (C, 4 * C),
            p + "mlp.c_fc.b": (4 * C,),
            p + "mlp.c_proj.w": (4 * C, C),
            p + "mlp.c_proj.b": (C,),
        })
    shapes["ln_f.g"] = (C,)
    shapes["ln_f.b"] = (C,)
    return shapes


def param_names(cfg: GPTConfig) -> tuple[str, ...]:
    return tuple(param_shapes(cfg))


def num_params(cfg: GPTConfig) -> int:
    return sum(math.prod(s) for s in param_shapes(cfg).values())


def is_decayed(name: str) -> bool:
    """AdamW weight decay applies to matrices (weights, embeddings), not to biases or gains."""
    return name.endswith(".w") or name in ("wte", "wpe")


def init_params(cfg: GPTConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """nanoGPT's initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer)."""
    rng = np.random.default_rng(seed)
    proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    params: dict[str, np.ndarray] = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith(".g"):
            a = np.ones(shape)
        elif name.endswith(".b"):
            a = np.zeros(shape)
        else:
            std = proj_std if name.endswith("c_proj.w") else 0.02
            a = rng.standard_normal(shape) * std
        params[name] = a.astype(np.float32)
    return params


def zeros_like_params(cfg: GPTConfig) -> dict[str, np.ndarray]:
    return {n: np.zeros(s, np.float32) for n, s in param_shapes(cfg).items()}


# --- forward pass (JAX) ---------------------------------------------------------
# JAX is imported inside the functions that need it, so importing this module
# for its config and shapes costs a worker nothing.


def _layer_norm(x: jax.Array, g: jax.Array, b: jax.Array, eps: float = 1e-5) -> jax.Array:
    import jax.numpy as jnp

    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) * (1.0 / jnp.sqrt(var + eps)) * g + b


def _attention(cfg: GPTConfig, p: Params, pre: str, x: jax.Array) -> jax.Array:
    import jax
    import jax.numpy as jnp

    B, T, C = x.shape
    nh, hs = cfg.n_head, C // cfg.n_head
    qkv = x @ p[pre + "c_attn.w"] + p[pre + "c_attn.b"]  # (B, T, 3C)
    q, k, v = jnp.split(qkv, 3, axis=-1)  # each (B, T, C)
    q = q.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)  # (B, nh, T, hs)
    k = k.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)  # (B, nh, T, hs)
    v = v.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)  # (B, nh, T, hs)
    att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hs))  # (B, nh, T, T)
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))  # (T, T)
    att = jnp.where(causal, att, jnp.finfo(att.dtype).min)  # type: ignore[no-untyped-call]  # ml_dtypes.finfo is unannotated
    att = jax.nn.softmax(att, axis=-1)  # (B, nh, T, T)
    y = att @ v  # (B, nh, T, hs)
    y = y.transpose(0, 2, 1, 3).reshape(B, T, C)  # (B, T, C)
    return y @ p[pre + "c_proj.w"] + p[pre + "c_proj.b"]  # (B, T, C)


def _mlp(p: Params, pre: str, x: jax.Array) -> jax.Array:
    import jax

    h = x @ p[pre + "c_fc.w"] + p[pre + "c_fc.b"]  # (B, T, 4C)
    h = jax.nn.gelu(h, approximate=True)
    return h @ p[pre + "c_proj.w"] + p[pre + "c_proj.b"]  # (B, T, C)


def forward(cfg: GPTConfig, params: Params, idx: jax.Array) -> jax.Array:
    """Logits ``(B, T, vocab_size)`` for token ids ``idx`` of shape ``(B, T)``, ``T <= block_size``."""
    import jax.numpy as jnp

    T = idx.shape[1]
    p = params
    x = jnp.take(p["wte"], idx, axis=0) + p["wpe"][:T]  # (B, T, C)
    for i in range(cfg.n_layer):
        pre = f"h.{i}."
        x = x + _attention(cfg, p, pre + "attn.", _layer_norm(x, p[pre + "ln_1.g"], p[pre + "ln_1.b"]))
        x = x + _mlp(p, pre + "mlp.", _layer_norm(x, p[pre + "ln_2.g"], p[pre + "ln_2.b"]))
    x = _layer_norm(x, p["ln_f.g"], p["ln_f.b"])  # (B, T, C)
    return x @ p["wte"].T  # (B, T, V)


def loss_fn(cfg: GPTConfig, params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean cross-entropy of next-token targets ``y`` (B, T) given inputs ``x`` (B, T)."""
    import jax
    import jax.numpy as jnp

    logits = forward(cfg, params, x)  # (B, T, V)
    logp = jax.nn.log_softmax(logits, axis=-1)  # (B, T, V)
    # Pick each target's log-probability with a one-hot product, not take_along_axis:
    # the latter's gradient is a scatter-add that IREE 3.13 cannot compile when B = 1
    # ("iree_linalg_ext.scatter op expected indices to be equal to batch rank"). The
    # product is exact (x * 1 plus zeros) and costs B*T*vocab multiplies.
    onehot = jax.nn.one_hot(y, logits.shape[-1], dtype=logp.dtype)  # (B, T, V)
    picked = jnp.sum(logp * onehot, axis=-1)  # (B, T)
    return -jnp.mean(picked)

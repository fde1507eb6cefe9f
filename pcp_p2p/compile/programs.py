"""The three programs built from the model: ``train``, ``eval`` and ``sample``.

Each program is a pure JAX function of *flat positional* arrays, so that it
lowers to a StableHLO ``main`` whose arguments are exactly the listed
:class:`~pcp_p2p.compile.signature.TensorSpec` inputs, in order, and whose
results are the listed outputs. ``Program.inputs``/``outputs`` are that
contract; they go into the signed manifest and the executor checks calls
against them.

``train`` (one call = one round chunk of ``H`` inner steps)::

    (param/*, m/*, v/*, step, lr, xs, ys) -> (param/*, m/*, v/*, step, losses)
      param/*, m/*, v/*  float32, one per model parameter, canonical order
      step               int32 ()      AdamW steps taken so far
      lr                 float32 ()    learning rate for these H steps (a schedule needs no recompile)
      xs, ys             int32 (H, B, T) inputs and next-token targets
      losses             float32 (H,)  the loss *before* each step's update

The H steps are a ``lax.scan``, which lowers to one ``stablehlo.while``: the
artifact does not grow with H. Each step: forward, cross-entropy, gradients,
global-norm clipping, AdamW with bias correction (decoupled weight decay on
matrices only, as nanoGPT). With ``micro_batch`` M < B the loss and gradient
are accumulated over B/M passes of M sequences (an inner ``lax.scan``): the
same step, with one pass's activations alive at a time.

``eval``: ``(param/*, x, y) -> (loss,)`` with x, y int32 (B, T).

``sample``: ``(param/*, idx, length) -> (logits,)``: idx int32 (S, T) holds a
context right-padded to T, ``length`` int32 () how many of its tokens are real
(1..T); logits float32 (S, vocab) are those of position ``length - 1``, the
next-token distribution. Causal attention makes the padding invisible.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pcp_p2p.compile.model import GPTConfig, forward, is_decayed, loss_fn, param_shapes
from pcp_p2p.compile.signature import TensorSpec
from pcp_p2p.core.errors import ConfigError

if TYPE_CHECKING:
    import jax

# Named tensors inside a program: parameters, AdamW moments, gradients.
Tensors = dict[str, "jax.Array"]
# What a train step threads from one inner step to the next: params, m, v, step.
TrainCarry = tuple[Tensors, Tensors, Tensors, "jax.Array"]

PROGRAMS = ("train", "eval", "sample")


@dataclass(frozen=True)
class ProgramOptions:
    """Everything besides the model that is baked into a compiled program."""

    inner_steps: int = 10  # H: AdamW steps per train call
    batch: int = 8  # B
    seq: int = 64  # T (<= block_size)
    sample_batch: int = 1  # S: contexts per sample call
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # global-norm clip; 0 disables it
    # M: a train step's gradient is accumulated over B/M micro-batches of M sequences, so the
    # activations held at once are M sequences' (pcp_p2p.compile.memory sizes M); 0 = B (one pass).
    micro_batch: int = 0

    def __post_init__(self) -> None:
        for name in ("inner_steps", "batch", "seq", "sample_batch"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        m = self.micro_batch
        if type(m) is not int or m < 0 or (m and self.batch % m):
            raise ConfigError(f"micro_batch must be 0 or divide batch {self.batch}, got {m!r}")
        for name in ("beta1", "beta2", "eps", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{name} must be a non-negative number, got {value!r}")
        if not (self.beta1 < 1 and self.beta2 < 1):
            raise ConfigError("AdamW betas must be below 1")

    @property
    def micro_batches(self) -> int:
        """How many micro-batches a train step's batch is split into (1: no accumulation)."""
        return self.batch // self.micro_batch if self.micro_batch else 1

    def to_dict(self) -> dict[str, int | float]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProgramOptions:
        names = {f.name for f in dataclasses.fields(cls)}
        if set(d) != names:
            raise ConfigError(f"ProgramOptions fields are {sorted(names)}, got {sorted(d)}")
        return cls(**d)


@dataclass(frozen=True)
class Program:
    """A program ready to lower: a flat JAX function and its signature."""

    name: str
    config: GPTConfig
    options: ProgramOptions
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    fn: Callable[..., tuple[jax.Array, ...]]

    def input_structs(self) -> list[jax.ShapeDtypeStruct]:
        """``jax.ShapeDtypeStruct`` per input, for lowering without data."""
        import jax

        return [
            jax.ShapeDtypeStruct(s.shape, s.dtype)  # type: ignore[no-untyped-call]  # jax leaves __init__ unannotated
            for s in self.inputs
        ]


def _param_specs(cfg: GPTConfig, prefix: str) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(f"{prefix}/{n}", s, "float32") for n, s in param_shapes(cfg).items())


def state_specs(cfg: GPTConfig) -> tuple[TensorSpec, ...]:
    """The optimiser state a train call threads through: params, m, v, step."""
    return (
        *_param_specs(cfg, "param"),
        *_param_specs(cfg, "m"),
        *_param_specs(cfg, "v"),
        TensorSpec("step", (), "int32"),
    )


def build_program(name: str, cfg: GPTConfig, opts: ProgramOptions) -> Program:
    """The named program for a model config and options."""
    if opts.seq > cfg.block_size:
        raise ConfigError(f"seq {opts.seq} > block_size {cfg.block_size}")
    builders = {"train": _train, "eval": _eval, "sample": _sample}
    if name not in builders:
        raise ConfigError(f"unknown program {name!r}; known: {', '.join(PROGRAMS)}")
    return builders[name](cfg, opts)


def _adamw(opts: ProgramOptions, names: tuple[str, ...], params: Tensors, grads: Tensors,
           m: Tensors, v: Tensors, step: jax.Array, lr: jax.Array) -> tuple[Tensors, Tensors, Tensors, jax.Array]:
    """One AdamW update with global-norm clipping and bias correction."""
    import jax.numpy as jnp

    if opts.grad_clip > 0:
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(grads[n])) for n in names))
        scale = jnp.minimum(1.0, opts.grad_clip / (norm + 1e-6))
        grads = {n: grads[n] * scale for n in names}
    step = step + 1
    t = step.astype(jnp.float32)
    bc1 = 1.0 - opts.beta1**t  # bias corrections
    bc2 = 1.0 - opts.beta2**t
    new_p: Tensors = {}
    new_m: Tensors = {}
    new_v: Tensors = {}
    for n in names:
        g = grads[n]
        new_m[n] = opts.beta1 * m[n] + (1.0 - opts.beta1) * g
        new_v[n] = opts.beta2 * v[n] + (1.0 - opts.beta2) * jnp.square(g)
        update = (new_m[n] / bc1) / (jnp.sqrt(new_v[n] / bc2) + opts.eps)
        if is_decayed(n) and opts.weight_decay:
            update = update + opts.weight_decay * params[n]
        new_p[n] = params[n] - lr * update
    return new_p, new_m, new_v, step


def _loss_and_grads(cfg: GPTConfig, opts: ProgramOptions, params: Tensors, x: jax.Array,
                    y: jax.Array) -> tuple[jax.Array, Tensors]:
    """The batch's mean loss and its gradient, in ``opts.micro_batches`` passes.

    Split in K equal micro-batches, the batch's mean loss is the mean of theirs and so
    is its gradient: the same step as one pass (up to the order of float sums), while
    only one micro-batch's activations are alive at a time. K = 1 lowers exactly the
    one-pass program, so an unsized run's artifacts keep their StableHLO hash.
    """
    import jax
    import jax.numpy as jnp
    from jax import lax

    def one_pass(xb: jax.Array, yb: jax.Array) -> tuple[jax.Array, Tensors]:
        loss, grads = jax.value_and_grad(lambda p: loss_fn(cfg, p, xb, yb))(params)
        return loss, grads

    k = opts.micro_batches
    if k == 1:
        return one_pass(x, y)
    B, T = x.shape
    xm, ym = x.reshape(k, B // k, T), y.reshape(k, B // k, T)  # micro-batch i: rows i*M .. i*M+M-1

    def accumulate(acc: tuple[jax.Array, Tensors],
                   mb: tuple[jax.Array, jax.Array]) -> tuple[tuple[jax.Array, Tensors], None]:
        loss, grads = one_pass(*mb)
        return (acc[0] + loss, {n: acc[1][n] + grads[n] for n in grads}), None

    zeros = {n: jnp.zeros_like(params[n]) for n in params}
    (loss_sum, grad_sum), _ = lax.scan(accumulate, (jnp.zeros((), jnp.float32), zeros), (xm, ym))
    return loss_sum / k, {n: g / k for n, g in grad_sum.items()}


def _train(cfg: GPTConfig, opts: ProgramOptions) -> Program:
    H, B, T = opts.inner_steps, opts.batch, opts.seq
    names = tuple(param_shapes(cfg))
    n = len(names)
    inputs = (
        *state_specs(cfg)[:-1],
        TensorSpec("step", (), "int32"),
        TensorSpec("lr", (), "float32"),
        TensorSpec("xs", (H, B, T), "int32"),
        TensorSpec("ys", (H, B, T), "int32"),
    )
    outputs = (*state_specs(cfg), TensorSpec("losses", (H,), "float32"))

    def train(*args: jax.Array) -> tuple[jax.Array, ...]:
        from jax import lax

        params = dict(zip(names, args[:n]))
        m = dict(zip(names, args[n : 2 * n]))
        v = dict(zip(names, args[2 * n : 3 * n]))
        step, lr, xs, ys = args[3 * n :]

        def inner_step(carry: TrainCarry, batch: tuple[jax.Array, jax.Array]) -> tuple[TrainCarry, jax.Array]:
            params, m, v, step = carry
            x, y = batch  # (B, T) each
            loss, grads = _loss_and_grads(cfg, opts, params, x, y)
            return _adamw(opts, names, params, grads, m, v, step, lr), loss

        (params, m, v, step), losses = lax.scan(inner_step, (params, m, v, step), (xs, ys))
        return (*(params[k] for k in names), *(m[k] for k in names), *(v[k] for k in names),
                step, losses)

    return Program("train", cfg, opts, inputs, outputs, train)


def _eval(cfg: GPTConfig, opts: ProgramOptions) -> Program:
    names = tuple(param_shapes(cfg))
    B, T = opts.batch, opts.seq
    inputs = (*_param_specs(cfg, "param"), TensorSpec("x", (B, T), "int32"),
              TensorSpec("y", (B, T), "int32"))
    outputs = (TensorSpec("loss", (), "float32"),)

    def evaluate(*args: jax.Array) -> tuple[jax.Array]:
        params = dict(zip(names, args[:-2]))
        return (loss_fn(cfg, params, args[-2], args[-1]),)

    return Program("eval", cfg, opts, inputs, outputs, evaluate)


def _sample(cfg: GPTConfig, opts: ProgramOptions) -> Program:
    names = tuple(param_shapes(cfg))
    S, T = opts.sample_batch, opts.seq
    inputs = (*_param_specs(cfg, "param"), TensorSpec("idx", (S, T), "int32"),
              TensorSpec("length", (), "int32"))
    outputs = (TensorSpec("logits", (S, cfg.vocab_size), "float32"),)

    def sample(*args: jax.Array) -> tuple[jax.Array]:
        from jax import lax

        params = dict(zip(names, args[:-2]))
        idx, length = args[-2], args[-1]
        logits = forward(cfg, params, idx)  # (S, T, V)
        last = lax.clamp(0, length - 1, T - 1)
        row = lax.dynamic_slice_in_dim(logits, last, 1, axis=1)  # (S, 1, V)
        return (row[:, 0, :],)

    return Program("sample", cfg, opts, inputs, outputs, sample)

"""What a worker needs in memory to train a model, and the micro-batch that fits a node.

The batch a train step sees (``inner.batch_size`` B) is part of the run's rules:
the tokens a step weighs, the data each worker draws and what an audit replays
all follow from it. What a node's memory bounds is not B but how many of its
sequences are alive in the forward and backward pass at once, so the shepherd
sizes the *micro-batch* M (``ProgramOptions.micro_batch``): a step accumulates
its gradient over B/M passes of M sequences and takes the same AdamW step
(docs/compile.md, "Memory-aware sizing").

A worker's peak memory at micro-batch M is modelled as

    need(M) = RUNTIME_BYTES + 4·P·(CALL_COPIES + 2·kept_states + NODE_COPIES) + M·per_sample(cfg, T)

- ``RUNTIME_BYTES``: the node process and the executor child with nothing
  loaded (Python, numpy, libp2p, the IREE runtime; the child alone maps ~240 MB).
- ``CALL_COPIES`` fp32 copies of the P parameters in the executor child at a
  train call's peak: θ, m and v uploaded (with their transfer copies, which
  the child's never-trimmed heap keeps), the call's outputs beside its inputs,
  the gradient and its accumulator. Measured: 14-16 (medium), 2 spare.
- ``2·kept_states``: the m and v of every inner state the worker keeps for
  audits (``engine.KEEP_STATES``).
- ``NODE_COPIES``: θ as the node process holds it in a round (the announced θ,
  the trained θ read back, Δ and its encoding).
- ``per_sample``: the activations one sequence of T tokens keeps for the
  backward pass: per layer and token ~40·C floats (LayerNorms, q/k/v, the MLP's
  4C and its GELU) and 4·n_head·T (attention scores, softmax, mask), and per
  token ~6·V for the logits, log-softmax and one-hot of the loss.

The constants are measured, not derived: peak ``VmData`` (what
``RLIMIT_DATA`` limits; ~140 MB above the peak RSS) of the executor child over
two train calls at x86-64-v4 (``bench/memory.py`` prints measured against
modelled; docs/compile.md has the table). The model must never be below the
measured peak; it is 1.1-1.5x above it on small and medium.

This module imports nothing heavy: workers and the shepherd's planning use it.
"""

from __future__ import annotations

from pcp_p2p.compile.model import GPTConfig, num_params

MIB = 1 << 20
EXECUTOR_RUNTIME_BYTES = 320 * MIB
"""The executor child before any state is loaded (~240 MB mapped, glibc's 64 MB heap pad)."""
NODE_RUNTIME_BYTES = 256 * MIB
"""The node process besides θ: Python, libp2p, trio, numpy, blob and DHT buffers."""
RUNTIME_BYTES = EXECUTOR_RUNTIME_BYTES + NODE_RUNTIME_BYTES
CALL_COPIES = 18
"""fp32 copies of θ in the executor child at a train call's peak (medium: 14 at T = 64, 16 at T = 256; 2 spare)."""
NODE_COPIES = 6
"""fp32 copies of θ the node process holds during a round."""
ACT_FLOATS_PER_EMBD = 40
ACT_FLOATS_PER_HEAD_T = 4
ACT_FLOATS_PER_VOCAB = 6


def per_sample_bytes(cfg: GPTConfig, seq: int) -> int:
    """Activation bytes one sequence of ``seq`` tokens keeps alive through a train step."""
    per_token = (cfg.n_layer * (ACT_FLOATS_PER_EMBD * cfg.n_embd + ACT_FLOATS_PER_HEAD_T * cfg.n_head * seq)
                 + ACT_FLOATS_PER_VOCAB * cfg.vocab_size)
    return 4 * seq * per_token


def executor_bytes(cfg: GPTConfig, seq: int, micro_batch: int) -> int:
    """The executor child's part of :func:`train_memory_bytes` over a train call, with no kept
    states: what ``bench/memory.py`` checks against the child's measured peak."""
    return EXECUTOR_RUNTIME_BYTES + 4 * num_params(cfg) * CALL_COPIES + micro_batch * per_sample_bytes(cfg, seq)


def fixed_bytes(cfg: GPTConfig, kept_states: int) -> int:
    """What a worker needs whatever the micro-batch: runtime and the copies of θ."""
    return RUNTIME_BYTES + 4 * num_params(cfg) * (CALL_COPIES + 2 * kept_states + NODE_COPIES)


def train_memory_bytes(cfg: GPTConfig, seq: int, micro_batch: int, kept_states: int) -> int:
    """Modelled peak bytes of a worker training ``cfg`` at ``micro_batch`` sequences of ``seq`` per pass."""
    return fixed_bytes(cfg, kept_states) + micro_batch * per_sample_bytes(cfg, seq)


def micro_batch_choices(batch: int) -> tuple[int, ...]:
    """The micro-batches a batch of ``batch`` can be split into evenly, largest first."""
    return tuple(m for m in range(batch, 0, -1) if batch % m == 0)


def fit_micro_batch(cfg: GPTConfig, batch: int, seq: int, free_bytes: int, kept_states: int) -> int | None:
    """The largest micro-batch (a divisor of ``batch``) whose modelled need fits ``free_bytes``;
    None when not even one sequence per pass fits."""
    for m in micro_batch_choices(batch):
        if train_memory_bytes(cfg, seq, m, kept_states) <= free_bytes:
            return m
    return None


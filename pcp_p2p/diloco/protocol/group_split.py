"""The group's arithmetic: sub-shards, the token-weighted average of Δ, the names of its states.

Pure functions, shared by rank 0 (:mod:`~pcp_p2p.cluster.group`), the tests and
the benchmark, so that "one process training every sub-shard" computes exactly
what the group is meant to compute.

Why sub-shards rather than one shard read in turns: the shepherd gives the
group ONE :class:`~pcp_p2p.diloco.protocol.messages.DataAssignment` (shard ``s`` of
``N``, a seed, a step cap). Rank ``k`` of ``K`` trains shard ``s·K + k`` of
``N·K`` — the group's shard cut into K contiguous pieces — with a seed derived
from the assignment's and ``k``, so the ranks draw disjoint windows, every rank
can compute its own piece, and any node can recompute the split. The step cap
is divided in whole executor chunks, proportionally to each rank's measured
throughput, so a slower machine in the rack does not hold the round up.

Why a token-weighted average: DiLoCo's shepherd already weighs each worker's Δ
by the tokens it trained; inside the group the same rule makes K ranks that
trained t_k tokens each equivalent to one worker that trained Σ t_k. Δ_group =
Σ_k t_k·Δ_k / Σ_k t_k, summed in float64 by the allreduce.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np

from pcp_p2p.core.errors import ConfigError
from pcp_p2p.diloco.protocol.messages import FRESH_STATE, DataAssignment

GROUP_STATE_PREFIX = "grp-"
"""A group's inner state is named by the digests of its ranks' states (each rank keeps its own)."""


def rank_steps(max_steps: int, weights: Sequence[float], chunk: int) -> list[int]:
    """Steps for each rank: whole ``chunk``\\ s, proportional to ``weights``, in total at most ``max_steps``.

    Largest remainder, ties to the lower rank, so the split is a pure function of its inputs.
    A rank may get 0 (it sits the round out) when there are fewer chunks than ranks.
    """
    if chunk < 1 or not weights:
        raise ConfigError("a split needs a chunk of at least one step and at least one rank")
    w = [max(0.0, float(x)) for x in weights]
    total_w = sum(w) or float(len(w))
    w = w if sum(w) else [1.0] * len(w)
    chunks = max_steps // chunk
    exact = [chunks * x / total_w for x in w]
    base = [int(e) for e in exact]
    left = chunks - sum(base)
    order = sorted(range(len(w)), key=lambda k: (-(exact[k] - base[k]), k))
    for k in order[:left]:
        base[k] += 1
    return [b * chunk for b in base]


def sub_seed(seed: int, k: int) -> int:
    """Rank ``k``'s 63-bit data seed, derived from the group assignment's."""
    h = hashlib.sha256(f"pcp-group|{seed}|{k}".encode()).digest()
    return int.from_bytes(h[:8], "big") >> 1


def sub_assignments(assignment: DataAssignment, steps: Sequence[int]) -> list[DataAssignment]:
    """Rank ``k``'s piece of the group's assignment: shard ``s·K+k`` of ``N·K``, ``steps[k]`` steps at most."""
    k_ranks = len(steps)
    return [
        DataAssignment(
            worker=assignment.worker,
            shard=assignment.shard * k_ranks + k,
            num_shards=assignment.num_shards * k_ranks,
            seed=sub_seed(assignment.seed, k),
            max_steps=steps[k],
        )
        for k in range(k_ranks)
    ]


def flat_size(theta: Mapping[str, np.ndarray]) -> int:
    return sum(int(np.asarray(v).size) for v in theta.values())


def weighted_flat(theta: Mapping[str, np.ndarray], theta_local: Mapping[str, np.ndarray], tokens: int) -> np.ndarray:
    """``tokens · (θ − θ_local)`` flattened in float64 (sorted names), with ``tokens`` appended.

    One rank's allreduce buffer.
    """
    parts = [
        (np.asarray(theta[k], dtype=np.float64)
         - np.asarray(theta_local[k], dtype=np.float32).astype(np.float64)).ravel()
        for k in sorted(theta)
    ]
    buf = np.empty(sum(p.size for p in parts) + 1, dtype=np.float64)
    np.concatenate(parts, out=buf[:-1])
    buf[:-1] *= tokens
    buf[-1] = tokens
    return buf


def theta_from_sum(theta: Mapping[str, np.ndarray], summed: np.ndarray) -> dict[str, np.ndarray]:
    """θ − Δ_group from an allreduced :func:`weighted_flat` sum: the θ_local of one worker that did all the steps."""
    total = float(summed[-1])
    if total <= 0:
        raise ConfigError("an allreduce over ranks that trained no tokens")
    out: dict[str, np.ndarray] = {}
    i = 0
    for k in sorted(theta):
        t = np.asarray(theta[k], dtype=np.float32)
        d = summed[i : i + t.size].reshape(t.shape) / total
        out[k] = (t.astype(np.float64) - d).astype(np.float32)
        i += t.size
    return out


def combine(
    theta: Mapping[str, np.ndarray], parts: Sequence[tuple[Mapping[str, np.ndarray], int]]
) -> dict[str, np.ndarray]:
    """The group's θ_local from (θ_local_k, tokens_k) of every rank: what the allreduce computes, in one process."""
    summed = np.sum([weighted_flat(theta, local, tokens) for local, tokens in parts if tokens > 0], axis=0)
    return theta_from_sum(theta, summed)


def group_state(states: Mapping[int, str]) -> str:
    """The name of a group state from its ranks' state digests: fresh only if every rank is fresh."""
    if all(s == FRESH_STATE for s in states.values()):
        return FRESH_STATE
    text = "|".join(f"{r}:{s}" for r, s in sorted(states.items()))
    return GROUP_STATE_PREFIX + hashlib.sha256(text.encode()).hexdigest()


def mean_losses(losses: Sequence[Sequence[float]]) -> tuple[float, ...]:
    """Per-step mean over the ranks that ran that step (length: the longest rank's steps)."""
    n = max((len(x) for x in losses), default=0)
    out = []
    for i in range(n):
        vals = [x[i] for x in losses if len(x) > i]
        out.append(float(sum(vals) / len(vals)))
    return tuple(out)

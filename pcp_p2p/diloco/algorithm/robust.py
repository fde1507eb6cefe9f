"""Robust combination of the workers' pseudo-gradients (pure numpy, no I/O).

Every worker is a stranger, so the shepherd cannot take a plain token-weighted
mean: one worker that claims a huge throughput and sends a random Δ just under
the absolute norm bound takes most of the weight and wrecks θ in a few rounds
(issue #12: val loss 2.66 → 3,000 in three rounds). This module holds the three
defences that act *on the numbers* of one round; which to use and how hard is
the run spec's ``[aggregation]`` table (:class:`AggregationPolicy`, declared here
beside the rules it tunes, so the algorithm needs nothing from the protocol):

1. **Weight capping** (:func:`capped_weights`, ``max_share``). Token weights are
   water-filled so that no worker carries more than ``max_share`` of the total:
   a claim of 10¹² tokens/s buys at most that share, whatever it says. If
   ``n · max_share ≤ 1`` only equal shares meet (or come closest to) the cap,
   and every worker gets ``1/n``.
2. **Norm screening** (:func:`screen_by_norm`, ``norm_vs_median``). A Δ whose
   norm is more than ``norm_vs_median`` times the round's median norm is refused
   (a :class:`~pcp_p2p.core.errors.RejectedUpdate`); a worker that did more steps
   than the median worker gets ``√(its steps / median steps)`` times more room,
   at most ``norm_vs_median`` times more (:func:`norm_allowance`: fast hardware
   is not refused, an inflated step claim buys only its square root). The
   yardstick is the honest majority's own step size, not a bound that grows
   with ‖θ‖ (the absolute
   bound in :func:`~pcp_p2p.diloco.protocol.aggregate.delta_norm_bound` stays, as a
   sanity cap only). Breakdown point: the median is honest while fewer than
   half the submissions are hostile; with two submissions the screen can never
   fire (``a ≤ 3·(a + h)/2``), so it needs three or more.
3. **A robust rule** (:func:`combine`, ``rule``):

   ======================  =============================================  ===========================
   rule                    what it does                                   breakdown / bound
   ======================  =============================================  ===========================
   ``mean``                Σ w_k Δ_k — fastest, *not* robust:             0 (one worker moves it
                           the comparison baseline                        anywhere its norm allows)
   ``trimmed_mean``        per coordinate: sort the K values, cut         attacker weight < ``trim``:
                           ``trim_fraction`` of the *weight* from each    every coordinate stays
                           end, weighted mean of the rest                 within the honest range
   ``centered_clip``       v ← v + Σ w_k·clip_τ(Δ_k − v), ``clip_iters``  moves v by ≤ iters·w·τ per
                           times, from v = coordinate-wise weighted       hostile worker (τ = median
                           median (Karimireddy, He, Jaggi, ICML 2021)     distance to v)
   ======================  =============================================  ===========================

   The trimmed mean is *weighted and fractional*: a worker whose weight
   straddles the cut keeps the part inside, so the result is continuous in the
   weights and a 25 % trim of two equal workers is their plain mean. Because
   weights are capped first, the trim bounds a single worker exactly when
   ``max_share ≤ trim_fraction`` (or when the swarm is small enough that every
   worker gets ``1/n ≤ trim_fraction``); above that, the norm screen and the
   shepherd's loss scoring (:mod:`~pcp_p2p.diloco.protocol.shepherd`) are what bound it.

Determinism. Every function visits workers in sorted id order and adds in a
fixed order (no BLAS in the combining itself), so a replay of a round from the
same submissions gives the same bits (the committed θ's CID depends on it).
Work is done in chunks of coordinates so that peak memory stays
``O(CHUNK_ELEMENTS)`` above the inputs, whatever the model size.

Cost (docs/diloco.md, "Robust combining"): on a clean run of the tiny GPT the
trimmed mean ended +0.2 % and centered clipping −0.2 % in val loss against
the plain mean; a trimmed mean of 1 M parameters from 4 workers costs 8 ms
with equal weights and 22 ms without (sorting rows of K values, 150–190 ms).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Concatenate, ParamSpec

import numpy as np

from pcp_p2p.core.errors import ConfigError, RejectedUpdate
from pcp_p2p.diloco.algorithm.params import Params, global_norm
from pcp_p2p.wire import Message, wire_struct

AGGREGATION_RULES = ("mean", "trimmed_mean", "centered_clip")


@wire_struct
class AggregationPolicy(Message):
    """How the shepherd bounds, combines, scores and audits the workers' pseudo-gradients.

    Every worker is a stranger: no single submission may dominate a round
    (``max_share``), a norm is judged against the round's median submission
    rather than a bound that grows with θ (``norm_vs_median``), the combining
    rule is robust by default, each submission is scored on held-out data
    (``score_tolerance``), a commit whose validation loss jumps is retried
    without its suspects (``val_jump``), and a fraction of accepted submissions
    is re-executed by another worker (``audit_rate``). See ``docs/security.md``.
    """

    rule: str = "trimmed_mean"  # "mean" | "trimmed_mean" | "centered_clip"
    trim_fraction: float = 0.25  # trimmed_mean: share cut from each end, per coordinate
    clip_iters: int = 3  # centered_clip: refinement passes
    norm_vs_median: float = 3.0  # refuse ‖Δ‖ above this times the round's median norm; 0 = off
    max_share: float = 0.5  # the most token weight one worker may carry in a round
    # refuse a Δ scoring worse than θ (or the round median, if higher) by more (nats); <0 = off
    score_tolerance: float = 0.05
    val_jump: float = 0.10  # do not commit a θ whose val loss rises by more than this fraction; 0 = off
    audit_rate: float = 0.04  # share of accepted submissions re-executed by another worker (≈ its compute cost)
    # Aggregators (issue #15 item 3, pcp_p2p.diloco.protocol.partials): above ``aggregate_above`` workers, up to
    # ``aggregators`` members each combine one group's Δs and send the shepherd one partial aggregate; 0 = off.
    aggregators: int = 0
    aggregate_above: int = 16
    partial_audit_rate: float = 0.25  # share of partials another member replays (a confirmed lie bans)


P = ParamSpec("P")

CHUNK_ELEMENTS = 1 << 18
"""Upper bound on K × coordinates processed at once by the coordinate-wise rules
(a few MiB of temporaries: the sort's indices and the cumulative weights)."""
FLAT_CHUNK = 1 << 16
"""Coordinates per pass of a column kernel (:func:`_flatwise`): a few hundred KiB per column."""
COMBINE_THREADS = min(2, os.cpu_count() or 1)
"""Threads the trimmed mean's column kernel runs in (:func:`_flatwise`): a 10M model's combine
of 4 Δs is on every round's path, and the workers wait for it with their cores idle."""
COLUMNS_MAX_WORKERS = 32
"""Up to this many workers the trimmed mean ranks columns (K² elementwise passes); beyond,
it sorts rows (measured crossover near 45 on the development machine)."""


# --- weights ----------------------------------------------------------------------


def capped_weights(tokens: Sequence[float], max_share: float) -> np.ndarray:
    """Normalised weights ∝ ``tokens`` with none above ``max_share`` (water-filling).

    Workers whose proportional share would exceed the cap are pinned at it, and
    the remaining mass is shared by the others in proportion to their tokens;
    this repeats until nobody is above the cap. When ``n · max_share ≤ 1`` the
    cap cannot be met by anything but equal shares, so every worker gets ``1/n``.
    Zero or negative token counts weigh nothing (all of them: equal shares).
    """
    t = np.asarray(tokens, dtype=np.float64)
    n = t.size
    if n == 0:
        return t
    if not 0 < max_share <= 1:
        raise ConfigError(f"max_share {max_share} must be in (0, 1]")
    t = np.where(np.isfinite(t) & (t > 0), t, 0.0)
    if n * max_share <= 1 or t.sum() <= 0:
        return np.full(n, 1.0 / n)
    w = np.zeros(n)
    free = np.ones(n, dtype=bool)  # not pinned at the cap
    while True:
        mass = 1.0 - max_share * (n - free.sum())
        share = t * free
        total = share.sum()
        if total <= 0:  # only zero-token workers left unpinned: they share what remains
            w[free] = mass / free.sum()
            break
        w = np.where(free, mass * share / total, max_share)
        over = free & (w > max_share)
        if not over.any():
            break
        free &= ~over
    return w


# --- screening ------------------------------------------------------------------


def norm_allowance(factor: float, work: float, median_work: float) -> float:
    """How many times the median norm a Δ of ``work`` tokens may have: ``factor·clip(√(work/median), 1, factor)``.

    Fast hardware does more steps in the round's time, and an honest Δ grows
    at most linearly with steps (early in training, when every step pushes the
    same way), so a fixed multiple of the median would refuse honest fast
    workers. The square root lets an honest worker with up to ``factor²`` times
    the median's steps through (9x at the default 3), while a worker that
    inflates its step claim ``N``-fold buys only ``√N`` more norm, and never
    more than ``factor²`` times the median.
    """
    if median_work <= 0 or work <= median_work:
        return factor
    return factor * min(factor, math.sqrt(work / median_work))


def screen_by_norm(
    norms: Mapping[str, float], factor: float, work: Mapping[str, float] | None = None
) -> dict[str, RejectedUpdate]:
    """Workers whose ‖Δ‖ exceeds its allowance times the median of ``norms``, with why.

    ``factor == 0`` turns the screen off. ``work`` (claimed tokens or steps per
    worker) widens the allowance of workers that did more than the median (see
    :func:`norm_allowance`); without it every worker gets ``factor``. Medians
    are over workers (each counts once), so no single claim can move them.
    """
    if factor <= 0 or not norms:
        return {}
    workers = sorted(norms)
    med = float(np.median(np.array([norms[w] for w in workers], dtype=np.float64)))
    med_work = float(np.median(np.array([work[w] for w in workers], dtype=np.float64))) if work else 0.0
    out: dict[str, RejectedUpdate] = {}
    for w in workers:
        allow = norm_allowance(factor, work[w], med_work) if work else factor
        if norms[w] > allow * med:
            ratio = norms[w] / med if med > 0 else math.inf
            out[w] = RejectedUpdate(
                f"{w:.16}…: ‖Δ‖ = {norms[w]:.4g} is {ratio:.1f}x the round's median {med:.4g} "
                f"(allowed {allow:.2g}x)"
            )
    return out


# --- coordinate-wise kernels on an (n, K) block: one row per coordinate, one column per worker ---


def _sorted_with_weights(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: values ascending, and the cumulative weight below/above each value.

    Rows are coordinates and columns workers, so each sort is over K contiguous
    values (much faster than sorting down columns).
    """
    if np.all(w == w[0]):  # equal weights (the usual case): rank alone decides, no permutation needed
        xs = np.sort(x, axis=1)
        hi = np.broadcast_to(np.cumsum(w), x.shape)
        return xs, hi - w, hi
    order = np.argsort(x, axis=1, kind="stable")
    xs = np.take_along_axis(x, order, axis=1)
    ws = w[order]
    hi = np.cumsum(ws, axis=1)
    return xs, hi - ws, hi


class _Columns:
    """The trimmed mean of K flat columns, :func:`trimmed_mean_block`'s definition (float64
    masses and sums) without a sort, in buffers made once per combine: a fresh array of this
    size is a fresh mapping of memory, and its page faults cost more than the arithmetic.

    - Equal weights (every worker claimed as many tokens, or the cap evened them): the mass
      kept at each rank is one constant per rank, so the columns, sorted coordinate by
      coordinate by a bubble network of K(K−1)/2 elementwise ``minimum``/``maximum`` pairs,
      are summed with those constants.
    - Otherwise each worker's value is ranked against the others' (ties in worker order, as
      the stable sort breaks them), which gives the weight below it, hence its kept mass. The
      sums then go in worker order, not in the order of the values: within a float32 rounding
      of the sorting kernel, and as deterministic (workers come in sorted id order).
    """

    def __init__(self, k: int, w: np.ndarray, trim: float) -> None:
        self.w, self.trim = w, trim
        self.equal = bool(np.all(w == w[0]))
        hi = np.cumsum(w)
        self.kept_at = np.clip(np.minimum(hi, 1.0 - trim) - np.maximum(hi - w, trim), 0.0, None)
        self.kept_total = float(sum(self.kept_at))  # (equal weights: the same mass kept at every coordinate)
        self.sorted = [np.empty(FLAT_CHUNK, dtype=np.float32) for _ in range(k + 1 if self.equal else 0)]
        self.acc, self.mass, self.lo, self.kept, self.tmp = (np.empty(FLAT_CHUNK) for _ in range(5))
        self.below = np.empty(FLAT_CHUNK, dtype=bool)

    def __call__(self, cols: Sequence[np.ndarray]) -> np.ndarray:
        n = cols[0].size
        acc, tmp = self.acc[:n], self.tmp[:n]
        acc.fill(0.0)
        if self.equal:
            *out, spare = (b[:n] for b in self.sorted)
            for o, c in zip(out, cols):
                o[...] = c
            for i in range(len(out)):
                for j in range(len(out) - 1 - i):
                    np.minimum(out[j], out[j + 1], out=spare)
                    np.maximum(out[j], out[j + 1], out=out[j + 1])
                    out[j], spare = spare, out[j]
            for r, col in enumerate(out):
                if self.kept_at[r] > 0:
                    acc += np.multiply(col, self.kept_at[r], out=tmp)
            acc /= self.kept_total
        else:
            w, trim, lo, kept, below = self.w, self.trim, self.lo[:n], self.kept[:n], self.below[:n]
            mass = self.mass[:n]
            mass.fill(0.0)
            for i in range(len(cols)):
                lo.fill(0.0)
                for j in range(len(cols)):
                    if j != i:  # j's value is below i's: smaller, or equal and j comes first
                        (np.less_equal if j < i else np.less)(cols[j], cols[i], out=below)
                        lo += np.multiply(below, w[j], out=tmp)
                np.minimum(np.add(lo, w[i], out=kept), 1.0 - trim, out=kept)
                kept -= np.maximum(lo, trim, out=tmp)
                np.maximum(kept, 0.0, out=kept)
                mass += kept
                acc += np.multiply(kept, cols[i], out=tmp)
            acc /= mass
        return acc


def trimmed_mean_block(x: np.ndarray, w: np.ndarray, trim: float) -> np.ndarray:
    """Weighted trimmed mean of each row of ``x`` (K columns), ``w`` summing to 1.

    The mass kept of each sorted value is the part of its weight interval
    ``[lo, hi)`` inside ``[trim, 1 - trim]``; the result is the kept-mass-weighted
    mean. ``trim = 0`` is the weighted mean.
    """
    xs, lo, hi = _sorted_with_weights(x, w)
    kept = np.clip(np.minimum(hi, 1.0 - trim) - np.maximum(lo, trim), 0.0, None)
    acc = np.zeros(x.shape[0], dtype=np.float64)
    for j in range(x.shape[1]):  # a fixed order of additions: the same bits everywhere
        acc += kept[:, j] * xs[:, j]
    mean: np.ndarray = (acc / kept.sum(axis=1)).astype(np.float32)
    return mean


def median_block(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted median of each row: the midpoint of the values where the weight crosses ½."""
    xs, _, hi = _sorted_with_weights(x, w)
    k = x.shape[1]
    lower = np.minimum((hi < 0.5 - 1e-12).sum(axis=1), k - 1)
    upper = np.minimum((hi <= 0.5 + 1e-12).sum(axis=1), k - 1)
    rows = np.arange(x.shape[0])
    median: np.ndarray = (0.5 * (xs[rows, lower].astype(np.float64) + xs[rows, upper])).astype(np.float32)
    return median


def _columnwise(
    deltas: Sequence[Params], fn: Callable[Concatenate[np.ndarray, P], np.ndarray], *args: P.args, **kwargs: P.kwargs,
) -> Params:
    """Apply an (n, K) → (n,) kernel to every tensor, ``CHUNK_ELEMENTS // K`` coordinates at a time."""
    return _flatwise(deltas, lambda cols: fn(np.stack(cols, axis=1), *args, **kwargs),
                     max(1, CHUNK_ELEMENTS // len(deltas)))


Kernel = Callable[[Sequence[np.ndarray]], np.ndarray]
"""A column kernel: K columns of n coordinates in, the n combined values out."""
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max(1, COMBINE_THREADS - 1), thread_name_prefix="pcp-combine")
    return _POOL


def _flatwise(deltas: Sequence[Params], fn: Kernel | Sequence[Kernel],
              chunk: int | None = None) -> Params:
    """Apply a (K columns of n) → (n,) kernel to every tensor, ``chunk`` (``FLAT_CHUNK``) coordinates
    at a time: the columns of a chunk stay in cache across the kernel's many elementwise passes.

    ``fn`` as a sequence: one kernel per thread (each with buffers of its own), the chunks dealt
    to them in contiguous runs. Each chunk's result is the same whoever computes it, so the
    bits are too; numpy releases the GIL inside each pass, so the threads run side by side
    (the combine is on every round's path, and the shepherd's other cores idle meanwhile)."""
    step = FLAT_CHUNK if chunk is None else chunk
    kernels = list(fn) if isinstance(fn, Sequence) else [fn]
    out: Params = {}
    jobs: list[tuple[list[np.ndarray], np.ndarray, int]] = []
    for name, ref in deltas[0].items():
        flat = [np.asarray(d[name], dtype=np.float32).reshape(-1) for d in deltas]
        res = np.empty(ref.size, dtype=np.float32)
        jobs += [(flat, res, s) for s in range(0, ref.size, step)]
        out[name] = res.reshape(ref.shape)

    def run(kernel: Kernel, mine: Sequence[tuple[list[np.ndarray], np.ndarray, int]]) -> None:
        for flat, res, s in mine:
            res[s : s + step] = kernel([f[s : s + step] for f in flat])

    if len(kernels) == 1 or len(jobs) < 2 * len(kernels):
        run(kernels[0], jobs)
        return out
    share = -(-len(jobs) // len(kernels))
    others = [_pool().submit(run, k, jobs[i * share : (i + 1) * share]) for i, k in enumerate(kernels) if i]
    try:
        run(kernels[0], jobs[:share])
    finally:  # (the other threads write into ``out`` too: never return, nor raise, before they end)
        wait(others)
    for f in others:
        f.result()  # (their exception, if any)
    return out


# --- the rules ------------------------------------------------------------------------


def weighted_mean(deltas: Sequence[Params], w: np.ndarray) -> Params:
    """Σ_k w_k Δ_k in float32, accumulated in the given order (fixed order: same bits)."""
    out: Params = {k: np.zeros(v.shape, dtype=np.float32) for k, v in deltas[0].items()}
    for wk, d in zip(w, deltas):
        f = np.float32(wk)
        for k in out:
            out[k] += f * np.asarray(d[k], dtype=np.float32)
    return out


def trimmed_mean(deltas: Sequence[Params], w: np.ndarray, trim: float) -> Params:
    """Coordinate-wise weighted trimmed mean (see :func:`trimmed_mean_block`).

    Up to ``COLUMNS_MAX_WORKERS`` workers by :class:`_Columns` (a 10M model's
    combine of 4 Δs: 0.05 s with equal weights, 0.22 s without, against 1.0 s by sorting
    rows; it is on the critical path of every round, docs/diloco.md), in
    ``COMBINE_THREADS`` threads (0.048 s → 0.029 s with equal weights in two, 2026-11-29),
    beyond that by sorting rows, whose cost grows as K log K instead of K²."""
    if not 0 <= trim < 0.5:
        raise ConfigError(f"trim_fraction {trim} must be in [0, 0.5)")
    if len(deltas) <= COLUMNS_MAX_WORKERS:
        return _flatwise(deltas, [_Columns(len(deltas), w, trim) for _ in range(COMBINE_THREADS)])
    return _columnwise(deltas, trimmed_mean_block, w, trim)


def coordinate_median(deltas: Sequence[Params], w: np.ndarray) -> Params:
    """Coordinate-wise weighted median (centered clipping's default centre)."""
    return _columnwise(deltas, median_block, w)


def centered_clip(deltas: Sequence[Params], w: np.ndarray, iters: int, center: Params | None = None) -> Params:
    """Centered clipping: ``v ← v + Σ_k w_k · clip_τ(Δ_k − v)``, ``iters`` times.

    ``clip_τ(z) = z · min(1, τ/‖z‖)`` over the *whole* Δ (all tensors), with
    τ = the median over workers of ‖Δ_k − v‖, recomputed each pass: at least
    half the workers are never clipped, and any one worker moves v by at most
    ``w_k · τ`` per pass. ``center`` is the starting v (e.g. the previous
    round's result); by default the coordinate-wise weighted median, which is
    itself robust, so a hostile worker cannot choose where the search starts.
    """
    v = {k: np.array(x, dtype=np.float32) for k, x in (center or coordinate_median(deltas, w)).items()}
    for _ in range(iters):
        diffs = [{k: np.asarray(d[k], dtype=np.float32) - v[k] for k in v} for d in deltas]
        dist = np.array([global_norm(z) for z in diffs])
        tau = float(np.median(dist))
        step = {k: np.zeros_like(x) for k, x in v.items()}
        for wk, z, dk in zip(w, diffs, dist):
            scale = np.float32(wk * (min(1.0, tau / dk) if dk > 0 else 1.0))
            for k in step:
                step[k] += scale * z[k]
        for k in v:
            v[k] += step[k]
    return v


def combine(
    rule: str,
    deltas: Mapping[str, Params],
    weights: Mapping[str, float],
    policy: AggregationPolicy,
    *,
    center: Params | None = None,
) -> Params:
    """Combine workers' Δs by ``rule`` with ``weights`` capped at ``policy.max_share``.

    ``deltas`` and ``weights`` are keyed by worker id (``weights`` may be raw
    token counts: they are capped and normalised here); workers are taken in
    sorted id order so the result is bit-reproducible. ``rule`` is one of
    ``mean``, ``trimmed_mean`` (``policy.trim_fraction``) or ``centered_clip``
    (``policy.clip_iters``, starting from ``center`` or the coordinate-wise
    median). Screening is not done here (see :func:`aggregate`).
    """
    if rule not in AGGREGATION_RULES:
        raise ConfigError(f"unknown aggregation rule {rule!r}; known: {', '.join(AGGREGATION_RULES)}")
    if not deltas:
        raise ValueError("nothing to combine")
    workers = sorted(deltas)
    ds = [deltas[k] for k in workers]
    w = capped_weights([weights[k] for k in workers], policy.max_share)
    if rule == "mean":
        return weighted_mean(ds, w)
    if rule == "trimmed_mean":
        return trimmed_mean(ds, w, policy.trim_fraction)
    return centered_clip(ds, w, policy.clip_iters, center)


@dataclass(frozen=True)
class Aggregate:
    """One round's combined Δ and who counted for how much."""

    delta: Params
    weights: dict[str, float]  # capped, normalised, of the workers that were combined
    screened: dict[str, RejectedUpdate]  # refused by the norm screen, with why
    norms: dict[str, float]  # ‖Δ_k‖ of every worker offered


def aggregate(
    deltas: Mapping[str, Params], tokens: Mapping[str, float], policy: AggregationPolicy, *,
    center: Params | None = None,
) -> Aggregate:
    """The whole pipeline: norm screen → capped weights → ``policy.rule``."""
    norms = {k: global_norm(deltas[k]) for k in sorted(deltas)}
    screened = screen_by_norm(norms, policy.norm_vs_median, tokens)
    kept = [k for k in sorted(deltas) if k not in screened]
    if not kept:
        raise ValueError("every submission was screened out")
    w = capped_weights([tokens[k] for k in kept], policy.max_share)
    delta = combine(policy.rule, {k: deltas[k] for k in kept}, dict(zip(kept, w)), policy, center=center)
    return Aggregate(delta, {k: float(x) for k, x in zip(kept, w)}, screened, norms)

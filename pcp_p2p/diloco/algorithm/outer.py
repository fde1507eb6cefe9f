"""The outer optimiser: Nesterov momentum SGD on the averaged pseudo-gradient.

DiLoCo (arXiv 2311.08105) treats Δ̄ = mean_k(θ_r − θ_k) as a gradient and applies

    v ← μ·v + Δ̄
    θ ← θ − η·(μ·v + Δ̄)

with η = 0.7 and μ = 0.9. This is *Nesterov* (the look-ahead term μ·v + Δ̄), not
heavy-ball momentum (θ ← θ − η·v), and η is the outer rate, not the inner
AdamW rate — a predecessor got both wrong. The whole outer state is (θ, v,
round); it lives in every checkpoint, so whichever node is shepherd next can
continue exactly where the last commit left off.

Arithmetic is float32 per tensor with float64 never needed: one fused update
per round, no accumulation over many terms.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pcp_p2p.diloco.algorithm.params import Params, params_cid


@dataclass(frozen=True)
class OuterState:
    """θ_r, the Nesterov momentum v, and r = the number of outer steps applied."""

    theta: Params
    momentum: Params
    round: int

    @classmethod
    def initial(cls, theta: Mapping[str, np.ndarray], round: int = 0) -> OuterState:
        """θ with zero outer momentum at ``round``: a run's start, or a term whose checkpoint
        is lost resuming from the committed θ (only the momentum is lost, never a round)."""
        th = {k: np.array(v, dtype=np.float32) for k, v in theta.items()}
        return cls(theta=th, momentum={k: np.zeros_like(v) for k, v in th.items()}, round=round)

    @property
    def theta_cid(self) -> str:
        return params_cid(self.theta)


def nesterov_step(
    state: OuterState, delta_mean: Mapping[str, np.ndarray], *, lr: float, momentum: float,
    into: tuple[Params, Params | None] | None = None,
) -> OuterState:
    """The next outer state; ``state`` is left untouched (commit or discard, never half).

    ``into``: float32 arrays of θ's shapes to write the new θ and momentum into (``None``
    for the momentum: new arrays), instead of new arrays: a checkpoint laid out before the
    step (:func:`~pcp_p2p.diloco.algorithm.checkpoint.lay_out_checkpoint`) is written once."""
    mu = np.float32(momentum)
    eta = np.float32(lr)
    theta: Params = {}
    mom: Params = {}
    for name, th in state.theta.items():
        d = np.asarray(delta_mean[name], dtype=np.float32)
        # v = μ·m + d;  θ' = θ − η·(μ·v + d): the same float32 operations in the same order as
        # those two lines, bit for bit (tested), in place into two new arrays instead of six
        # temporaries (a 10M model's step runs inside the shepherd's round).
        v_out = into[1][name] if into is not None and into[1] is not None else None
        step_out = into[0][name] if into is not None else None
        v = np.multiply(mu, np.asarray(state.momentum[name], dtype=np.float32), out=v_out)
        v += d
        step = np.multiply(mu, v, out=step_out)
        step += d
        step *= eta
        theta[name] = np.subtract(np.asarray(th, dtype=np.float32), step, out=step)
        mom[name] = v
    return OuterState(theta=theta, momentum=mom, round=state.round + 1)

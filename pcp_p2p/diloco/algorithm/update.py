"""A commit's update: the outer step exactly as the shepherd applied it, as a blob.

Why it exists: every participant holds each commit's checkpoint (θ and the
outer momentum, two θ's worth), so a round's distribution moved 2θ through
every hop of the relay tree, and on a home link that fetch was most of the
round's exchange (docs/connectivity.md, run 7). A node that holds the
checkpoint the step started from needs only the update.

What the update carries is the outer **step** s = θ' − θ, not the averaged Δ:

- The shepherd computes the exact Nesterov step from the mean
  (s = −η·(μ²·v + (1+μ)·Δ̄), :func:`~pcp_p2p.diloco.algorithm.outer.nesterov_step`'s
  algebra), encodes it with ``outer.update_codec`` and applies the *decoded*
  step ŝ, as every node does: θ' = θ + ŝ, and the momentum that step implies,
  v' = μ·v + d̂ with d̂ = (−ŝ/η − μ²·v)/(1+μ), which is
  v' = μ/(1+μ)·v − ŝ/(η(1+μ)). With ŝ = s that is Nesterov's v' = μ·v + Δ̄
  (tested); with int8, the applied step is one quantisation of the exact one.
- Every node runs the same float32 operations from the same ŝ
  (:func:`apply_update`), so the θ and checkpoint it builds are the
  shepherd's bit for bit, and the commit's two CIDs check that they are.
- Why the step and not the mean: θ' = θ + ŝ does not read the momentum,
  where from a mean θ' needed v' first. So a node holds θ and goes on to the
  next round before the momentum and the checkpoint's CID
  (:func:`step_theta`, then :func:`step_momentum`; ``RunRuntime._take_commit``).
  For a 10M model θ is decoded and added in 0.027 s and hashed in 0.012 s;
  the momentum and the checkpoint's CID, 0.03 s more, leave the round's path
  (issue #15, ``bench/round.py``). The quality cost of quantising the step
  instead of the mean was measured on the tiny GPT, 10 rounds: val loss
  1.9757 against 1.9754 (docs/diloco.md).

The update is encoded with the spec's ``outer.update_codec``: ``int8`` (the
default: a quarter of θ on the wire, an eighth of a checkpoint; at most half a
step of 1/127 of each 256-value block's largest value off), or ``fp32``
(θ's size on the wire; the step as computed).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pcp_p2p.core.errors import ConfigError, MalformedMessage
from pcp_p2p.diloco.algorithm.outer import OuterState
from pcp_p2p.diloco.algorithm.params import Params, codec_of, unpack_tensors

UPDATE_CODECS = ("int8", "fp32")
"""``outer.update_codec``: how the applied step travels (the dense codecs: a step is not sparse
enough to gain, and an error-feedback codec would make θ depend on a residual)."""
_BYTES_PER_VALUE = {"int8": 1, "fp32": 4}


def update_size(params: int, codec: str) -> int:
    """About how many bytes an update of ``params`` values weighs with ``codec`` (without its
    small header and int8's per-block scales): what a fetcher plans its route by."""
    return params * _BYTES_PER_VALUE[codec]


def step_update(state: OuterState, delta_mean: Mapping[str, np.ndarray], codec: str, *, lr: float,
                momentum: float) -> tuple[bytes, OuterState]:
    """The shepherd's outer step: ``(update blob, the next state)``, the second being
    :func:`apply_update` of the first, so every node that applies the blob gets the same bits."""
    eta, mu = _rates(lr, momentum)
    step: Params = {}
    for name, v in state.momentum.items():  # s = −η·(μ²·v + (1+μ)·Δ̄), float32
        s = np.multiply(np.asarray(delta_mean[name], dtype=np.float32), np.float32(-eta * (1 + mu)))
        if mu:
            s += np.multiply(np.asarray(v, dtype=np.float32), np.float32(-eta * mu * mu))
        step[name] = s
    blob = codec_of(codec).encode(step)
    return blob, apply_update(state, blob, lr=lr, momentum=momentum)


def apply_update(base: OuterState, update: bytes, *, lr: float, momentum: float,
                 into: tuple[Params, Params | None] | None = None) -> OuterState:
    """The outer state after ``base`` took the step the update blob ``update`` carries
    (:func:`decode_step`, :func:`step_theta`, :func:`step_momentum`), written ``into`` the given
    arrays or new ones."""
    step = decode_step(base, update)
    theta = step_theta(base, step, into=into[0] if into is not None else None)
    mom = step_momentum(base, step, lr=lr, momentum=momentum, into=into[1] if into is not None else None)
    return OuterState(theta=theta, momentum=mom, round=base.round + 1)


def decode_step(base: OuterState, update: bytes) -> Params:
    """The step ŝ an update blob carries, as float32 arrays of θ's names and shapes.

    :class:`MalformedMessage` (a remote fault: the blob is the shepherd's) for
    a blob that does not decode to θ's tensors, names and shapes, before any
    arithmetic; whether what it gives is the committed state is the caller's
    check (the commit's CIDs)."""
    step = unpack_tensors(update, max_bytes=_decoded_bound(base.theta))
    if set(step) != set(base.theta) or any(step[k].shape != v.shape for k, v in base.theta.items()):
        raise MalformedMessage("a commit's update does not have θ's tensors")
    return step


def step_theta(base: OuterState, step: Params, *, into: Params | None = None) -> Params:
    """θ' = θ + ŝ (one pass): all a node needs to train the next round, before the momentum."""
    return {name: np.add(np.asarray(th, dtype=np.float32), step[name], out=into[name] if into is not None else None)
            for name, th in base.theta.items()}


def step_momentum(base: OuterState, step: Params, *, lr: float, momentum: float,
                  into: Params | None = None) -> Params:
    """v' = μ/(1+μ)·v − ŝ/(η(1+μ)) (the module's docstring), after :func:`step_theta`: it
    spends ``step`` (scaled in place). With μ = 0 no step uses the momentum, and it stays
    ``base``'s."""
    eta, mu = _rates(lr, momentum)
    if not mu:
        return dict(base.momentum)
    keep, take = np.float32(mu / (1 + mu)), np.float32(-1 / (eta * (1 + mu)))
    mom: Params = {}
    for name, v in base.momentum.items():
        new = np.multiply(np.asarray(v, dtype=np.float32), keep, out=into[name] if into is not None else None)
        new += np.multiply(step[name], take, out=step[name])
        mom[name] = new
    return mom


def _rates(lr: float, momentum: float) -> tuple[float, float]:
    if not lr > 0 or not 0 <= momentum < 1:
        raise ConfigError(f"the outer step needs lr > 0 and 0 ≤ momentum < 1, not lr={lr}, momentum={momentum}")
    return float(lr), float(momentum)


def _decoded_bound(like: Mapping[str, np.ndarray]) -> int:
    return 4 * sum(int(np.asarray(v).size) for v in like.values()) + (1 << 20)  # + the header

"""A commit's update: the averaged Δ exactly as the outer step applied it, as a blob.

Why it exists: every participant holds each commit's checkpoint (θ and the
outer momentum, two θ's worth), so a round's distribution moved 2θ through
every hop of the relay tree, and on a home link that fetch was most of the
round's exchange (docs/connectivity.md, run 7). A node that holds the
checkpoint the step started from needs only the update: the outer step
(:func:`~pcp_p2p.diloco.algorithm.outer.nesterov_step`) is a pure sequence of
float32 operations, so the node's own step gives the shepherd's checkpoint bit
for bit, and the commit's two CIDs (θ, checkpoint) check that it did.

The update is encoded with the spec's ``outer.update_codec``:

- ``int8`` (the default): a quarter of θ on the wire, an eighth of a
  checkpoint. The shepherd steps with the *decoded* int8 values, so what it
  applies and what it sends are the same numbers; the rounding (at most half
  a step of 1/127 of each 256-value block's largest value) is one more
  quantisation of a mean whose every term was already int8
  (docs/diloco.md, "The commit's update", measured).
- ``fp32``: the mean as combined, exactly; θ's size on the wire.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pcp_p2p.core.errors import MalformedMessage
from pcp_p2p.diloco.algorithm.outer import OuterState, nesterov_step
from pcp_p2p.diloco.algorithm.params import Params, codec_of, unpack_tensors

UPDATE_CODECS = ("int8", "fp32")
"""``outer.update_codec``: how the applied mean travels (the dense codecs: the mean of sparse Δs
is not sparse enough to gain, and an error-feedback codec would make the step depend on a residual)."""
_BYTES_PER_VALUE = {"int8": 1, "fp32": 4}


def update_size(params: int, codec: str) -> int:
    """About how many bytes an update of ``params`` values weighs with ``codec`` (without its
    small header and int8's per-block scales): what a fetcher plans its route by."""
    return params * _BYTES_PER_VALUE[codec]


def encode_update(delta_mean: Mapping[str, np.ndarray], codec: str) -> tuple[bytes, Params]:
    """``(update blob, the Δ the step applies)``: the second is the first decoded, so a node
    that decodes the blob applies exactly what the shepherd did."""
    data = codec_of(codec).encode(delta_mean)
    return data, unpack_tensors(data, max_bytes=_decoded_bound(delta_mean))


def apply_update(base: OuterState, update: bytes, *, lr: float, momentum: float,
                 into: tuple[Params, Params | None] | None = None) -> OuterState:
    """The outer state after ``base`` stepped by the update blob ``update`` (written ``into``
    the given arrays, see :func:`~pcp_p2p.diloco.algorithm.outer.nesterov_step`).

    :class:`MalformedMessage` (a remote fault: the blob is the shepherd's) for
    a blob that does not decode to θ's tensors, names and shapes, before any
    arithmetic; whether the result is the committed one is the caller's check
    (the commit's CIDs)."""
    delta = unpack_tensors(update, max_bytes=_decoded_bound(base.theta))
    if set(delta) != set(base.theta) or any(delta[k].shape != v.shape for k, v in base.theta.items()):
        raise MalformedMessage("a commit's update does not have θ's tensors")
    return nesterov_step(base, delta, lr=lr, momentum=momentum, into=into)


def _decoded_bound(like: Mapping[str, np.ndarray]) -> int:
    return 4 * sum(int(np.asarray(v).size) for v in like.values()) + (1 << 20)  # + the header

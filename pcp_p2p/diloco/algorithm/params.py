"""Parameter bundles as bytes: the exact fp32 form of θ and the compressed form of Δ.

The byte format is the blob layer's (:mod:`pcp_p2p.blob.tensor_codec`: a wire-encoded
header, then raw little-endian payloads; codecs fp32, fp16, int8 with one fp32
scale per block of 256). This module is the DiLoCo side of that seam:

- θ, momentum and checkpoints travel as exact fp32, so the CID of θ's bundle is
  a pure function of the values: same names, order, shapes and values give the
  same bytes on every machine (:func:`params_cid` is what "θ hash" means);
- pseudo-gradients travel int8 by default (INTELLECT-1: int8 with fp32
  accumulation costs no measurable loss, ~4x smaller than fp32), or, per run,
  ``topk2``: the largest of every 16 values, 3-bit values, error feedback
  (:mod:`~pcp_p2p.diloco.algorithm.sparse`, ~18x smaller than int8).

The :class:`Compressor` protocol is where a codec plugs in without touching the
round protocol; a codec with ``error_feedback`` makes the worker keep a
residual (:func:`~pcp_p2p.diloco.algorithm.sparse.encode_with_feedback`). Decoding raises only
:class:`~pcp_p2p.core.errors.PcpError` subclasses; the blob decoder already refuses
NaN/inf values, and the aggregator re-checks finiteness after decoding so a
codec that let them through would still not reach θ.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np

from pcp_p2p.blob.tensor_codec import decode_tensors, encode_tensor_parts
from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import ConfigError
from pcp_p2p.diloco.algorithm.sparse import SparseTopK

Params = dict[str, np.ndarray]
"""A flat, ordered ``name -> float32 array`` mapping (the model's parameter order)."""

MAX_BUNDLE_BYTES = 4 << 30
_F32 = np.dtype("<f4")


class Compressor(Protocol):
    """Turns a pseudo-gradient into bytes and back (lossy codecs allowed)."""

    name: str
    error_feedback: bool
    """Whether the worker adds what earlier payloads left out (a residual) to each Δ it sends."""

    def encode(self, params: Mapping[str, np.ndarray]) -> bytes: ...

    def decode(
        self, data: bytes, max_bytes: int = MAX_BUNDLE_BYTES, like: Mapping[str, np.ndarray] | None = None,
    ) -> Params:
        """Tensors from ``data``; ``like`` (θ) gives the layout a codec that does not send it needs."""
        ...


def _as_f32(params: Mapping[str, np.ndarray]) -> Params:
    return {k: np.ascontiguousarray(np.asarray(v, dtype=_F32)) for k, v in params.items()}


def pack_tensors(params: Mapping[str, np.ndarray], codec: str = "fp32") -> bytes:
    """Bytes for ``params`` (as float32) in ``codec``; :class:`InvalidInput` for NaN/inf."""
    return b"".join(pack_tensor_parts(params, codec))


def pack_tensor_parts(params: Mapping[str, np.ndarray], codec: str = "fp32") -> list[bytes | memoryview]:
    """:func:`pack_tensors`'s bytes as pieces to join (see :func:`~pcp_p2p.blob.tensor_codec.encode_tensor_parts`)."""
    if codec not in TENSOR_CODECS:
        raise ConfigError(f"unknown tensor codec {codec!r}; known: {', '.join(TENSOR_CODECS)}")
    return encode_tensor_parts(_as_f32(params), codec)


def unpack_tensors(data: bytes | memoryview, max_bytes: int = MAX_BUNDLE_BYTES, *, copy: bool = True) -> Params:
    """Float32 tensors from :func:`pack_tensors` bytes; a ProtocolError for anything else.
    ``copy=False``: fp32 tensors are read-only views into ``data`` (see ``decode_tensors``)."""
    return {k: np.asarray(v, dtype=_F32) for k, v in decode_tensors(data, max_bytes=max_bytes, copy=copy).items()}


class Fp32Codec:
    """Exact float32 (θ, momentum, and Δ where bandwidth does not matter)."""

    name = "fp32"
    error_feedback = False

    def encode(self, params: Mapping[str, np.ndarray]) -> bytes:
        return pack_tensors(params, "fp32")

    def decode(
        self, data: bytes, max_bytes: int = MAX_BUNDLE_BYTES, like: Mapping[str, np.ndarray] | None = None,
    ) -> Params:
        return unpack_tensors(data, max_bytes)


class Int8BlockCodec:
    """Per-block (256) symmetric int8 with a float32 scale per block."""

    name = "int8"
    error_feedback = False

    def encode(self, params: Mapping[str, np.ndarray]) -> bytes:
        return pack_tensors(params, "int8")

    def decode(
        self, data: bytes, max_bytes: int = MAX_BUNDLE_BYTES, like: Mapping[str, np.ndarray] | None = None,
    ) -> Params:
        return unpack_tensors(data, max_bytes)


TENSOR_CODECS = ("fp32", "int8")
"""The blob layer's dense codecs (:func:`pack_tensors`)."""

CODECS: dict[str, Compressor] = {
    "fp32": Fp32Codec(),
    "int8": Int8BlockCodec(),
    "topk2": SparseTopK("topk2", chunk=4096, k=256, bits=3, grouped=True),
}
"""Every Δ codec a run spec may name (``round.delta_codec``)."""


def codec_of(name: str) -> Compressor:
    """The compressor called ``name``; :class:`ConfigError` if unknown."""
    try:
        return CODECS[name]
    except KeyError:
        raise ConfigError(f"unknown tensor codec {name!r}; known: {', '.join(CODECS)}") from None


def params_cid(params: Mapping[str, np.ndarray]) -> str:
    """The CID of the exact fp32 bundle of ``params`` (what "θ hash" means everywhere)."""
    return cid_of(pack_tensors(params, "fp32"))


def global_norm(params: Mapping[str, np.ndarray]) -> float:
    """L2 norm over all tensors, in float64 so large models do not overflow."""
    total = 0.0
    for a in params.values():
        a64 = np.asarray(a, dtype=np.float64)
        total += float(np.dot(a64.reshape(-1), a64.reshape(-1)))
    return float(np.sqrt(total))


def num_params(params: Mapping[str, np.ndarray]) -> int:
    return int(sum(int(np.asarray(a).size) for a in params.values()))

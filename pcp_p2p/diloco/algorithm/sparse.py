"""Sparse low-bit pseudo-gradients: chunked top-k, 2- or 3-bit values, compact indices, error feedback.

Why. An int8 Δ costs ~1 byte per parameter per round; at H = 50 that is ~200x
fewer bytes per token than synchronous data-parallel training, and the star of
every worker's Δ into one home uplink stays the wall. The field's answer
(SparseLoCo, MuLoCo; DeMo) is to send only the largest coordinates of Δ, each
in a couple of bits, and to keep what was not sent on the worker for a later
round (*error feedback*): nothing is lost, only delayed. Over long runs the
field reports the dense trajectory's loss at a small fraction of the bytes;
what it costs over a short run here is measured by ``bench/bandwidth.py``.

Format (:class:`SparseTopK`). Each tensor is cut into chunks of ``chunk``
values (the last one shorter); from each chunk the ``k`` values of largest
magnitude are kept (a shorter last chunk keeps ``ceil(k·len/chunk)``). A kept
value travels as ``bits`` bits: one sign bit and ``bits − 1`` bits choosing one
of ``2**(bits−1)`` magnitude levels of its chunk (the levels are a 1-D
Lloyd–Max fit to the kept magnitudes, sent as float16); its position travels as
a ``log2(chunk)``-bit index, ascending within the chunk. The *grouped*
layout (``grouped=True``, format version 2) keeps instead the largest value of
each group of ``chunk/k`` consecutive values, its position a ``log2(chunk/k)``-bit
offset in its group: a free top-k spends 12 bits on a position in a chunk of
4096, one of each group of 16 spends 4, so the same bytes carry about twice the
values (measured on the tiny GPT at equal bytes, 4 rounds: val-loss ratio 1.079
grouped k = 128 against 1.090 free k = 64; ``bench/bandwidth.py``). Nothing names
the tensors: the receiver knows the model's layout (θ), and a 16-byte digest of
the layout (names, order, shapes) refuses a payload made for another one. So a
payload is::

    b"PCPS" | version u8 | bits u8 | chunk u32 | k u32 | layout digest (16 bytes)
    per tensor, per block (full chunks, then the short one):
        levels  float16[rows, 2**(bits-1)]
        indices packed, rows·k · log2(chunk) bits (grouped: log2(chunk/k)), zero-padded to a byte
                (absent when a block keeps every value)
        codes   packed, rows·k · bits bits, zero-padded to a byte

(grouped: the indices are the offsets in their groups; a short last chunk's last
group may be short, and an offset beyond it is refused.) At the default
(``topk2``: chunk 4096, k = 256 grouped, 3 bits; the name is older than its
3-bit values) that is 7 bits per kept value and ~0.47 bits per parameter with
the levels and short chunks, ~18x smaller than int8 (12,184 bytes for the tiny
GPT's 209,536 parameters). Measured on the tiny GPT (4 rounds, outer lr 4):
2-bit values gave val-loss ratio 1.0445 at 3,751x, 3-bit 1.0398 at 3,183x.

Decoding trusts nothing: it knows every size from the layout and its own
parameters before reading a byte, and refuses (typed, nothing allocated beyond
the checked sizes) a payload of another format, version or parameters, another
layout, the wrong length (:class:`~pcp_p2p.core.errors.MalformedMessage`), a dense
result larger than the caller's ``max_bytes`` or data longer than it
(:class:`~pcp_p2p.core.errors.OversizedMessage`), non-finite, negative or unsorted
levels, indices out of their chunk, repeated or out of order, and non-zero
padding bits (:class:`MalformedMessage`). The encoder is deterministic: the
same values give the same bytes, hence the same CID.

Error feedback lives on the worker, not in the codec: the worker keeps as its
residual what its payload left out (:func:`encode_with_feedback`) and starts its
next inner steps from ``θ − residual`` (:func:`local_start`), so its next Δ
(measured from θ) carries the residual once, plus new progress. The residual is
worker state like the inner AdamW moments (:mod:`~pcp_p2p.diloco.protocol.worker`
settles it on the same rule: only a commit that took the submission makes it
current). Because the start point is private, a round of an error-feedback run
cannot be replayed from public inputs: the spec refuses ``audit_rate > 0`` with
such a codec until the residual is committed and served like the inner state.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from pcp_p2p.core.errors import ConfigError, InvalidInput, MalformedMessage, OversizedMessage

if TYPE_CHECKING:
    from pcp_p2p.diloco.algorithm.params import Compressor  # tensors imports this module

MAGIC = b"PCPS"
VERSION = 1
GROUPED_VERSION = 2
"""The format's version byte names its index layout: 1 = any k of a chunk, 2 = one of each group."""
_HEADER = struct.Struct(">4sBBII16s")
_F32 = np.dtype("<f4")
_F16_MAX = 65504.0
LLOYD_ITERS = 6
"""Refinement passes of the per-chunk magnitude levels (converged well before on real Δs)."""

Params = dict[str, np.ndarray]
Layout = Mapping[str, np.ndarray] | Mapping[str, tuple[int, ...]]


def _shape(v: np.ndarray | tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(d) for d in (v if isinstance(v, tuple) else np.shape(v)))


def layout_digest(like: Layout) -> bytes:
    """16 bytes naming a model layout: tensor names, their order and shapes."""
    h = hashlib.sha256()
    for name, v in like.items():
        shape = _shape(v)
        h.update(name.encode("utf-8") + b"\0" + struct.pack(f">{len(shape) + 1}Q", len(shape), *shape))
    return h.digest()[:16]


def _pack(values: np.ndarray, width: int) -> bytes:
    """Unsigned ``values`` as a big-endian bit stream of ``width`` bits each, zero-padded to a byte."""
    shifts = np.arange(width - 1, -1, -1, dtype=np.uint32)
    bits = ((values.astype(np.uint32).reshape(-1, 1) >> shifts) & 1).astype(np.uint8)
    return np.packbits(bits.reshape(-1)).tobytes()


def _unpack(buf: bytes, count: int, width: int, what: str) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(buf, dtype=np.uint8))
    if bits[count * width :].any():
        raise MalformedMessage(f"sparse Δ: non-zero padding bits after the {what}")
    weights = (np.uint32(1) << np.arange(width - 1, -1, -1, dtype=np.uint32)).astype(np.uint32)
    values: np.ndarray = bits[: count * width].reshape(count, width).astype(np.uint32) @ weights
    return values


def _lloyd_levels(mag: np.ndarray, levels: int) -> np.ndarray:
    """Per row of ``mag`` (rows x k, float64 ≥ 0): ``levels`` ascending magnitudes minimising squared error."""
    if levels == 1:
        mean: np.ndarray = mag.mean(axis=1, keepdims=True)
        return mean
    qs = (np.arange(levels) + 0.5) / levels
    lv: np.ndarray = np.quantile(mag, qs, axis=1).T  # (rows, levels), ascending
    for _ in range(LLOYD_ITERS):
        edges = 0.5 * (lv[:, 1:] + lv[:, :-1])
        which = (mag[:, :, None] > edges[:, None, :]).sum(axis=2)  # (rows, k) level index
        for j in range(levels):
            sel = which == j
            cnt = sel.sum(axis=1)
            tot = np.where(sel, mag, 0.0).sum(axis=1)
            lv[:, j] = np.where(cnt > 0, tot / np.maximum(cnt, 1), lv[:, j])
        lv.sort(axis=1)
    return lv


class SparseTopK:
    """Chunked top-k with ``bits``-bit values and compact indices (see the module docstring).

    Lossy and meant to run with error feedback (``error_feedback = True``): the
    worker keeps what a round's payload left out and sends it later.
    """

    error_feedback = True

    def __init__(self, name: str, *, chunk: int = 4096, k: int = 64, bits: int = 2, grouped: bool = False) -> None:
        if chunk < 2 or chunk > 1 << 24 or chunk & (chunk - 1):
            raise ConfigError(f"sparse codec {name}: chunk {chunk} must be a power of two in [2, 2**24]")
        if not 1 <= k <= chunk:
            raise ConfigError(f"sparse codec {name}: k {k} must be in [1, chunk]")
        if bits not in (1, 2, 3, 4):
            raise ConfigError(f"sparse codec {name}: bits {bits} must be 1-4")
        if grouped and chunk % k:
            raise ConfigError(f"sparse codec {name}: grouped k {k} must divide chunk {chunk}")
        self.name, self.chunk, self.k, self.bits, self.grouped = name, chunk, k, bits, grouped
        self.group = chunk // k if grouped else chunk
        self.index_bits = int(math.log2(self.group))
        self.version = GROUPED_VERSION if grouped else VERSION
        self.levels = 1 << (bits - 1)

    @property
    def density(self) -> float:
        return self.k / self.chunk

    # --- layout arithmetic: every size is known before a byte is read --------------------

    def _blocks(self, n: int) -> list[tuple[int, int, int]]:
        """(rows, row length, kept per row) of a tensor of ``n`` values: full chunks, then the short one."""
        out = []
        full, rem = divmod(n, self.chunk)
        if full:
            out.append((full, self.chunk, self.k))
        if rem:
            out.append((1, rem, min(rem, max(1, -(-self.k * rem // self.chunk)))))
        return out

    def _block_sizes(self, rows: int, kk: int, length: int) -> tuple[int, int, int]:
        """Bytes of a block's levels, indices (none when every value is kept) and codes."""
        count = rows * kk
        index = 0 if kk == length else -(-count * self.index_bits // 8)
        return 2 * rows * self.levels, index, -(-count * self.bits // 8)

    def payload_size(self, like: Layout) -> int:
        """Exact bytes of a payload for a model of this layout."""
        total = _HEADER.size
        for v in like.values():
            for rows, length, kk in self._blocks(math.prod(_shape(v))):
                total += sum(self._block_sizes(rows, kk, length))
        return total

    # --- encode ----------------------------------------------------------------------------

    def encode(self, params: Mapping[str, np.ndarray]) -> bytes:
        """The payload for ``params``; :class:`InvalidInput` for NaN/inf or values beyond float16 levels."""
        parts = [_HEADER.pack(MAGIC, self.version, self.bits, self.chunk, self.k, layout_digest(params))]
        for name, arr in params.items():
            flat = np.asarray(arr, dtype=_F32).reshape(-1)
            if not np.all(np.isfinite(flat)):
                raise InvalidInput(f"{name}: NaN or inf cannot be encoded")
            start = 0
            for rows, length, kk in self._blocks(flat.size):
                block = flat[start : start + rows * length].reshape(rows, length)
                start += rows * length
                parts.extend(self._encode_block(name, block, kk))
        return b"".join(parts)

    def _encode_block(self, name: str, block: np.ndarray, kk: int) -> list[bytes]:
        rows, length = block.shape
        if kk == length:
            idx = np.broadcast_to(np.arange(length), (rows, length))
        elif self.grouped:  # the largest of each group of `group` values (the last group may be short)
            padded = np.full((rows, kk * self.group), -1.0, dtype=np.float64)
            padded[:, :length] = np.abs(block)
            local = padded.reshape(rows, kk, self.group).argmax(axis=2)
            idx = local + np.arange(kk) * self.group
        else:
            idx = np.sort(np.argpartition(-np.abs(block), kk - 1, axis=1)[:, :kk], axis=1)
        vals = np.take_along_axis(block, idx, axis=1).astype(np.float64)
        mag = np.abs(vals)
        lv = _lloyd_levels(mag, self.levels)
        if float(lv.max(initial=0.0)) > _F16_MAX:
            raise InvalidInput(f"{name}: Δ values beyond the float16 range of the sparse codec's levels")
        lv16 = np.sort(lv.astype("<f2"), axis=1)
        lv_back = lv16.astype(np.float64)
        level = np.abs(mag[:, :, None] - lv_back[:, None, :]).argmin(axis=2)  # nearest transmitted level
        codes = (np.signbit(vals).astype(np.uint32) << (self.bits - 1)) | level.astype(np.uint32)
        stored = idx - np.arange(kk) * self.group if self.grouped else idx  # grouped: offset in its group
        index = b"" if kk == length else _pack(stored, self.index_bits)
        return [lv16.tobytes(), index, _pack(codes, self.bits)]

    # --- decode ----------------------------------------------------------------------------

    def decode(self, data: bytes, max_bytes: int = 4 << 30, like: Layout | None = None) -> Params:
        """Dense float32 tensors, named and shaped as ``like``; typed errors for anything else."""
        if like is None:
            raise ConfigError(f"the {self.name} codec decodes against the model's layout: pass like=θ")
        if len(data) > max_bytes:
            raise OversizedMessage(f"sparse Δ of {len(data)} bytes, limit {max_bytes}")
        dense = 4 * sum(math.prod(_shape(v)) for v in like.values())
        if dense > max_bytes:
            raise OversizedMessage(f"sparse Δ decodes to {dense} bytes, limit {max_bytes}")
        if len(data) < _HEADER.size:
            raise MalformedMessage(f"sparse Δ: {len(data)} bytes, shorter than its header")
        magic, version, bits, chunk, k, digest = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise MalformedMessage("sparse Δ: bad magic")
        if version != self.version:
            raise MalformedMessage(f"sparse Δ: version {version}, {self.name} reads {self.version}")
        if (bits, chunk, k) != (self.bits, self.chunk, self.k):
            raise MalformedMessage(
                f"sparse Δ with bits={bits} chunk={chunk} k={k}; {self.name} is bits={self.bits} "
                f"chunk={self.chunk} k={self.k}"
            )
        if digest != layout_digest(like):
            raise MalformedMessage("sparse Δ made for another model layout (names, order or shapes)")
        expected = self.payload_size(like)
        if len(data) != expected:
            raise MalformedMessage(f"sparse Δ of {len(data)} bytes, this layout takes exactly {expected}")
        out: Params = {}
        pos = _HEADER.size
        for name, v in like.items():
            shape = _shape(v)
            flat = np.zeros(math.prod(shape), dtype=_F32)
            start = 0
            for rows, length, kk in self._blocks(flat.size):
                n_lv, n_idx, n_code = self._block_sizes(rows, kk, length)
                lv = np.frombuffer(data, dtype="<f2", count=rows * self.levels, offset=pos).reshape(rows, self.levels)
                pos += n_lv
                if kk == length:  # every value kept: positions are implied
                    idx = np.tile(np.arange(length, dtype=np.uint32), rows)
                else:
                    idx = _unpack(data[pos : pos + n_idx], rows * kk, self.index_bits, f"{name} indices")
                    if self.grouped:  # offsets within each group; a short last group bounds its own
                        idx = (idx.reshape(rows, kk) + np.arange(kk, dtype=np.uint32) * self.group).reshape(-1)
                pos += n_idx
                codes = _unpack(data[pos : pos + n_code], rows * kk, self.bits, f"{name} values")
                pos += n_code
                self._check_block(name, lv, idx.reshape(rows, kk), length)
                lv32 = lv.astype(_F32)
                idx = idx.reshape(rows, kk).astype(np.int64)
                codes = codes.reshape(rows, kk)
                mag = np.take_along_axis(lv32, (codes & (self.levels - 1)).astype(np.int64), axis=1)
                vals = np.where((codes >> (self.bits - 1)) & 1, -mag, mag)
                block = np.zeros((rows, length), dtype=_F32)
                np.put_along_axis(block, idx, vals, axis=1)
                flat[start : start + rows * length] = block.reshape(-1)
                start += rows * length
            out[name] = flat.reshape(shape)
        return out

    def _check_block(self, name: str, lv: np.ndarray, idx: np.ndarray, length: int) -> None:
        if not np.all(np.isfinite(lv)):
            raise MalformedMessage(f"sparse Δ: {name}: non-finite levels")
        if np.any(lv < 0) or np.any(np.signbit(lv)) or np.any(np.diff(lv.astype(np.float32), axis=1) < 0):
            raise MalformedMessage(f"sparse Δ: {name}: levels must be non-negative and ascending")
        if idx.size and int(idx.max()) >= length:
            raise MalformedMessage(f"sparse Δ: {name}: index {int(idx.max())} beyond its chunk of {length}")
        if idx.shape[1] > 1 and np.any(np.diff(idx.astype(np.int64), axis=1) <= 0):
            raise MalformedMessage(f"sparse Δ: {name}: indices repeated or out of order within a chunk")


def encode_with_feedback(codec: Compressor, delta: Mapping[str, np.ndarray]) -> tuple[bytes, Params | None]:
    """``(payload, new residual)`` for a worker's Δ under ``codec``.

    With a codec that wants error feedback (``codec.error_feedback``) the new
    residual is what the payload leaves out, ``Δ − decode(payload)``, exactly
    as the aggregator will decode it; other codecs get no residual (``None``).
    The residual is not added to the next Δ here: the worker starts its next
    inner steps from ``θ − residual`` (:func:`local_start`), so its next Δ,
    measured from θ, already holds it.
    """
    payload = codec.encode(delta)
    if not codec.error_feedback:
        return payload, None
    target = {k: np.asarray(v, dtype=_F32) for k, v in delta.items()}
    sent = codec.decode(payload, len(payload) + 4 * sum(v.size for v in target.values()), like=target)
    return payload, {k: target[k] - sent[k] for k in target}


def local_start(theta: Mapping[str, np.ndarray], residual: Mapping[str, np.ndarray] | None) -> Params:
    """Where a worker with error feedback starts its inner steps: ``θ − residual``.

    Why not add the residual to the next Δ instead (the textbook form)? A
    DiLoCo Δ is a displacement, not a gradient: a worker that trains again
    from the same θ, in coordinates its last payload left out, measures the
    same displacement again, and adding it to the residual counts it twice;
    the stale sum then overshoots once it is finally sent (measured: the toy
    quadratic and the tiny GPT both first improve, then diverge). Starting
    from ``θ − residual`` trains from where this worker's own pending update
    would have put it, so its next Δ = θ − θ_local holds the residual once
    and only new progress on top. A residual of another layout is ignored.
    """
    out = {k: np.array(v, dtype=_F32, copy=True) for k, v in theta.items()}
    if residual is not None and list(residual) == list(out) and all(
        np.shape(residual[k]) == out[k].shape for k in out
    ):
        for k in out:
            out[k] -= np.asarray(residual[k], dtype=_F32)
    return out

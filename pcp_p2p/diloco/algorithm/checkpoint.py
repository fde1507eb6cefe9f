"""Checkpoints: the complete outer state of a run as one content-addressed blob.

A checkpoint holds θ, the Nesterov momentum, the round count, the term that
wrote it and the round's metrics. That is *all* a node needs to act as shepherd
from the next round on (inner AdamW moments stay with the workers, as in
DiLoCo), so a failover is "fetch the latest checkpoint CID, decode, continue".

Layout: the msgpack array ``["pcp-checkpoint", 1, meta, theta, momentum]`` where
``theta`` is *exactly* the fp32 tensor bundle whose CID the commit record names
as ``theta_cid`` — a node holding a checkpoint therefore also holds θ, and can
check one against the other without re-encoding.

A run whose outer momentum μ is 0 (plain outer SGD: what the sparse ``topk2``
codec measured best with, docs/diloco.md) stores an *empty* momentum bundle,
decoded as zeros. Why: with μ = 0 the next step reads the momentum only as
0·v, so it carries nothing, yet it is half of the checkpoint, and every
participant replicates the checkpoint each round: dropping it halves the
bytes a commit costs the shepherd's uplink (issue #15's shepherd bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from pcp_p2p.blob.tensor_codec import fp32_head
from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import MalformedMessage
from pcp_p2p.diloco.algorithm.outer import OuterState
from pcp_p2p.diloco.algorithm.params import Params, pack_tensor_parts, unpack_tensors

MAGIC = "pcp-checkpoint"
VERSION = 1


@dataclass(frozen=True)
class Checkpoint:
    run_id: str
    term: int
    state: OuterState
    metrics: dict[str, float] = field(default_factory=dict)


def encode_checkpoint(ckpt: Checkpoint, *, with_momentum: bool = True) -> tuple[bytes, str]:
    """``(checkpoint bytes, θ CID)``; the θ bundle inside is byte-identical to the θ blob.

    ``with_momentum=False`` (a run with outer momentum 0) stores an empty momentum
    bundle, which :func:`decode_checkpoint` reads back as zeros."""
    # The same bytes as msgpack.packb([MAGIC, VERSION, meta, θ bundle, momentum bundle]), framed
    # here so that the tensors' bytes are copied once (a 10M model's checkpoint is 80 MB, built
    # inside the shepherd's round): the bundles' pieces go straight into the one join.
    head = _head_bytes(ckpt.run_id, ckpt.term, ckpt.state.round, ckpt.metrics)
    theta = pack_tensor_parts(ckpt.state.theta)
    momentum = pack_tensor_parts(ckpt.state.momentum if with_momentum else {})
    theta_size, theta_header = _size(theta), _bin_header(_size(theta))
    theta_at = len(head) + len(theta_header)
    data = b"".join([head, theta_header, *theta, _bin_header(_size(momentum)), *momentum])
    return data, cid_of(memoryview(data)[theta_at : theta_at + theta_size])


def _head_bytes(run_id: str, term: int, round_: int, metrics: dict[str, float]) -> bytes:
    """A checkpoint's bytes before θ's bundle: the array header, magic, version and metadata."""
    meta = {"run_id": run_id, "term": term, "round": round_, "metrics": {k: float(v) for k, v in metrics.items()}}
    return b"".join([b"\x95", *(msgpack.packb(x, use_bin_type=True) for x in (MAGIC, VERSION, meta))])


@dataclass(frozen=True)
class CheckpointLayout:
    """A checkpoint's bytes with its tensors still to be written, and those tensors as
    writable views into the bytes (``momentum`` is ``None`` when the checkpoint stores none)."""

    data: bytearray
    theta: Params
    momentum: Params | None
    theta_span: tuple[int, int]  # (offset, length) of θ's bundle: the θ blob's bytes

    def theta_cid(self) -> str:
        at, size = self.theta_span
        return cid_of(memoryview(self.data)[at : at + size])

    def theta_bytes(self) -> bytes:
        """θ's bundle, copied out (the θ blob)."""
        at, size = self.theta_span
        return bytes(memoryview(self.data)[at : at + size])


def lay_out_checkpoint(run_id: str, term: int, round_: int, metrics: dict[str, float],
                       shapes: dict[str, tuple[int, ...]], *, with_momentum: bool = True,
                       reuse: bytearray | None = None) -> CheckpointLayout:
    """The checkpoint :func:`encode_checkpoint` would write, laid out before its tensors exist.

    Why: a node that builds each commit's checkpoint from the last one and the
    commit's update (:mod:`pcp_p2p.diloco.algorithm.update`) has the outer step
    write θ and the momentum straight into it, instead of into new arrays that
    a join then copies (80 MB for a 10M model, inside the round). Once they are
    written, ``data`` is byte for byte :func:`encode_checkpoint`'s (tested).

    ``reuse``: a buffer of the same size to lay it out in (every byte is
    written), e.g. the checkpoint before the last; fresh memory costs these
    machines up to 2.5 CPU-s per GB on first touch (docs/blob.md)."""
    head = _head_bytes(run_id, term, round_, metrics)
    sizes = {k: 4 * math.prod(s) for k, s in shapes.items()}
    theta_head, mom_head = fp32_head(shapes), fp32_head(shapes if with_momentum else {})
    theta_size = len(theta_head) + sum(sizes.values())
    mom_size = len(mom_head) + (sum(sizes.values()) if with_momentum else 0)
    theta_at = len(head) + len(_bin_header(theta_size))
    size = theta_at + theta_size + len(_bin_header(mom_size)) + mom_size
    data = reuse if reuse is not None and len(reuse) == size else bytearray(size)

    def views(at: int, bundle_head: bytes, tensors: dict[str, tuple[int, ...]]) -> tuple[Params, int]:
        data[at : at + len(bundle_head)] = bundle_head
        at += len(bundle_head)
        out: Params = {}
        for k, s in tensors.items():
            out[k] = np.frombuffer(data, dtype="<f4", count=sizes[k] // 4, offset=at).reshape(s)
            at += sizes[k]
        return out, at

    data[:theta_at] = head + _bin_header(theta_size)
    theta, at = views(theta_at, theta_head, shapes)
    data[at : at + len(_bin_header(mom_size))] = _bin_header(mom_size)
    momentum, _ = views(at + len(_bin_header(mom_size)), mom_head, shapes if with_momentum else {})
    return CheckpointLayout(data, theta, momentum if with_momentum else None, (theta_at, theta_size))


def round_metrics(tokens: int, mean_loss: float, val_loss: float | None) -> dict[str, float]:
    """A commit's metrics as its checkpoint holds them. One function for the shepherd that
    writes the checkpoint and the node that rebuilds it from the commit record and the
    update (:mod:`pcp_p2p.diloco.algorithm.update`): the bytes must come out the same."""
    metrics = {"tokens": float(tokens), "mean_loss": float(mean_loss)}
    if val_loss is not None:
        metrics["val_loss"] = float(val_loss)
    return metrics


def _size(parts: list[bytes | memoryview]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


def _bin_header(size: int) -> bytes:
    """msgpack's header for a bin of ``size`` bytes (the smallest, as msgpack.packb writes it)."""
    if size < 1 << 8:
        return bytes([0xC4, size])
    if size < 1 << 16:
        return b"\xc5" + size.to_bytes(2, "big")
    return b"\xc6" + size.to_bytes(4, "big")


def checkpoint_theta_bytes(data: bytes) -> bytes:
    """The θ bundle inside checkpoint bytes (to serve θ without re-encoding): its range, found
    from the head (:func:`checkpoint_theta_span`), one copy of θ and none of the momentum.
    Only a claim, like the span: a caller checks it against θ's CID."""
    off, length = checkpoint_theta_span(data[:THETA_HEAD])
    if off + length > len(data):
        raise MalformedMessage("checkpoint θ runs past its end")
    return data[off : off + length]


THETA_HEAD = 64 * 1024
"""How many leading bytes of a checkpoint :func:`checkpoint_theta_span` reads (its metadata is small)."""

_BIN_HEADERS = {0xC4: 1, 0xC5: 2, 0xC6: 4}  # msgpack bin8/16/32: the length's width


def checkpoint_theta_span(head: bytes) -> tuple[int, int]:
    """``(offset, length)`` of the θ bundle inside a checkpoint, from its first bytes.

    Why: a worker takes θ out of the checkpoint it replicated (the bundle is
    byte-identical to the θ blob), and reading only that range instead of
    decoding the whole checkpoint skips the momentum, half of its bytes. The
    range is only a claim: the caller checks what it reads against θ's CID.
    :class:`MalformedMessage` if ``head`` does not start like a checkpoint.
    """
    _, at = _parse_head(head)
    return _bin_span(memoryview(head), at)


def _parse_head(head: bytes) -> tuple[Any, int]:
    """A checkpoint's metadata and the offset of θ's bin header, from its first bytes."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_ext_len=0, max_buffer_size=len(head) + 1)
    unpacker.feed(head)
    try:
        if unpacker.read_array_header() != 5 or unpacker.unpack() != MAGIC or unpacker.unpack() != VERSION:
            raise MalformedMessage("not a pcp checkpoint")
        meta = unpacker.unpack()
        return meta, unpacker.tell()
    except MalformedMessage:
        raise
    except Exception as exc:
        raise MalformedMessage(f"checkpoint head is not msgpack: {type(exc).__name__}") from exc


def _bin_span(view: memoryview, at: int) -> tuple[int, int]:
    """``(offset, length)`` of the msgpack bin whose header starts at ``at`` (the length is the
    header's claim: a caller holding the whole checkpoint checks it against its end)."""
    width = _BIN_HEADERS.get(view[at]) if at < len(view) else None
    if width is None or at + 1 + width > len(view):
        raise MalformedMessage("checkpoint bundle is not a msgpack bin")
    return at + 1 + width, int.from_bytes(view[at + 1 : at + 1 + width], "big")


def _split(data: bytes | bytearray) -> tuple[dict[Any, Any], memoryview, memoryview]:
    """A checkpoint's metadata, θ bundle and momentum bundle, its framing checked.

    The bundles are views into ``data``, not copies: a node that builds each
    commit's checkpoint from the last (:mod:`pcp_p2p.diloco.algorithm.update`)
    decodes 80 MB of a 10M model's checkpoint inside the round."""
    view = memoryview(data)
    meta, at = _parse_head(bytes(view[:THETA_HEAD]))
    if not isinstance(meta, dict):
        raise MalformedMessage("not a pcp checkpoint")
    theta_at, theta_len = _bin_span(view, at)
    mom_at, mom_len = _bin_span(view, theta_at + theta_len)  # (θ past the end: no bin there)
    if mom_at + mom_len != len(view):
        raise MalformedMessage("checkpoint's momentum does not end where the checkpoint does")
    return meta, view[theta_at : theta_at + theta_len], view[mom_at : mom_at + mom_len]


def decode_checkpoint(data: bytes | bytearray) -> Checkpoint:
    """A :class:`Checkpoint` from bytes; :class:`MalformedMessage` for anything else.

    An empty momentum bundle (``encode_checkpoint(..., with_momentum=False)``) is zeros.
    θ's and the momentum's tensors are read-only views into ``data`` (bytes, not a buffer
    that is reused): the outer step and everything else only read them."""
    meta, theta_b, mom_b = _split(data)
    run_id, term, round_, metrics = (meta.get(k) for k in ("run_id", "term", "round", "metrics"))
    if (
        type(run_id) is not str
        or type(term) is not int
        or type(round_) is not int
        or round_ < 0
        or not isinstance(metrics, dict)
        or not all(isinstance(k, str) and isinstance(v, float) for k, v in metrics.items())
    ):
        raise MalformedMessage("checkpoint metadata is malformed")
    # read-only views into ``data``: every use steps into new arrays or reads (no copy of 80 MB)
    theta = unpack_tensors(theta_b, copy=False)
    momentum = unpack_tensors(mom_b, copy=False) or {k: np.zeros_like(v) for k, v in theta.items()}
    if list(theta) != list(momentum) or any(theta[k].shape != momentum[k].shape for k in theta):
        raise MalformedMessage("checkpoint θ and momentum do not have the same tensors")
    return Checkpoint(run_id, term, OuterState(theta, momentum, round_), dict(metrics))

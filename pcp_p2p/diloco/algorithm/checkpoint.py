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

from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import MalformedMessage
from pcp_p2p.diloco.algorithm.outer import OuterState
from pcp_p2p.diloco.algorithm.params import pack_tensor_parts, unpack_tensors

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
    meta = {
        "run_id": ckpt.run_id,
        "term": ckpt.term,
        "round": ckpt.state.round,
        "metrics": {k: float(v) for k, v in ckpt.metrics.items()},
    }
    # The same bytes as msgpack.packb([MAGIC, VERSION, meta, θ bundle, momentum bundle]), framed
    # here so that the tensors' bytes are copied once (a 10M model's checkpoint is 80 MB, built
    # inside the shepherd's round): the bundles' pieces go straight into the one join.
    head = [b"\x95", *(msgpack.packb(x, use_bin_type=True) for x in (MAGIC, VERSION, meta))]
    theta = pack_tensor_parts(ckpt.state.theta)
    momentum = pack_tensor_parts(ckpt.state.momentum if with_momentum else {})
    theta_size, theta_header = _size(theta), _bin_header(_size(theta))
    theta_at = sum(map(len, head)) + len(theta_header)
    data = b"".join([*head, theta_header, *theta, _bin_header(_size(momentum)), *momentum])
    return data, cid_of(memoryview(data)[theta_at : theta_at + theta_size])


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
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_ext_len=0, max_buffer_size=len(head) + 1)
    unpacker.feed(head)
    try:
        if unpacker.read_array_header() != 5 or unpacker.unpack() != MAGIC or unpacker.unpack() != VERSION:
            raise MalformedMessage("not a pcp checkpoint")
        unpacker.skip()  # the metadata
        at = unpacker.tell()
    except MalformedMessage:
        raise
    except Exception as exc:
        raise MalformedMessage(f"checkpoint head is not msgpack: {type(exc).__name__}") from exc
    width = _BIN_HEADERS.get(head[at]) if at < len(head) else None
    if width is None or at + 1 + width > len(head):
        raise MalformedMessage("checkpoint θ is not a msgpack bin")
    length = int.from_bytes(head[at + 1 : at + 1 + width], "big")
    return at + 1 + width, length


def _split(data: bytes) -> tuple[dict[Any, Any], bytes, bytes]:
    """A checkpoint's metadata, θ bundle and momentum bundle, its framing checked."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_ext_len=0)
    except Exception as exc:
        raise MalformedMessage(f"checkpoint is not msgpack: {type(exc).__name__}") from exc
    if not isinstance(obj, list) or len(obj) != 5 or obj[0] != MAGIC or obj[1] != VERSION:
        raise MalformedMessage("not a pcp checkpoint")
    _, _, meta, theta, momentum = obj
    if not isinstance(meta, dict) or not isinstance(theta, bytes) or not isinstance(momentum, bytes):
        raise MalformedMessage("not a pcp checkpoint")
    return meta, theta, momentum


def decode_checkpoint(data: bytes) -> Checkpoint:
    """A :class:`Checkpoint` from bytes; :class:`MalformedMessage` for anything else.

    An empty momentum bundle (``encode_checkpoint(..., with_momentum=False)``) is zeros."""
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
    theta = unpack_tensors(theta_b)
    momentum = unpack_tensors(mom_b) or {k: np.zeros_like(v) for k, v in theta.items()}
    if list(theta) != list(momentum) or any(theta[k].shape != momentum[k].shape for k in theta):
        raise MalformedMessage("checkpoint θ and momentum do not have the same tensors")
    return Checkpoint(run_id, term, OuterState(theta, momentum, round_), dict(metrics))

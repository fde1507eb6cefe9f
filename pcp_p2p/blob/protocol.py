"""``/pcp/blob/1.0.0``: the control messages and their framing on a libp2p stream.

One stream carries one exchange: the client sends a :class:`BlobRequest`, the
server answers with a :class:`BlobReply`, and the stream closes. A
``manifest`` request is answered with the chunk manifest inline (at most
1 MiB), and for a blob of at most :data:`INLINE_MAX` bytes with the blob
itself: a small fetch (a run spec, a signed manifest, a tiny model's Δ) is then
one exchange instead of two plus a side-channel connection (measured here:
~4 ms instead of ~9). A ``data`` request for chunks ``[first, first + count)`` is answered
with a port and a fresh secret; the chunks then flow over the TCP side
channel (:mod:`pcp_p2p.blob.sidechannel`). A ``fetch`` request is both at
once, for a fetcher with one provider: the manifest, and a side channel for
chunks ``[0, min(count, chunks))`` (or the blob inline), in one exchange. The
fetcher still checks the manifest against the CID before it connects. When a client cannot reach the
side port (NAT, firewall, a relayed connection) it asks again with
``via="stream"`` and the chunks follow the reply on the same libp2p stream in
frames of at most :data:`STREAM_PIECE` bytes: 2-3x slower, but it works
wherever the libp2p connection does.

Frames are :mod:`pcp_p2p.wire.framing`'s: a 4-byte big-endian length and a
wire message, the length checked against the expected message's limit before
the body is read, every read and write under a deadline.
"""

from __future__ import annotations

from typing import TypeVar

from libp2p.custom_types import TProtocol

from pcp_p2p.blob.chunks import MANIFEST_MAX_SIZE
from pcp_p2p.wire import Message, decode, encode, framing, wire_message
from pcp_p2p.wire.framing import ByteStream

PROTOCOL_ID = TProtocol("/pcp/blob/1.0.0")
NONCE_LEN = 16
M = TypeVar("M", bound=Message)
INLINE_MAX = 256 * 1024
"""Blobs up to this size travel inline in the manifest reply (checked like any chunk)."""
STREAM_PIECE = 1024 * 1024
"""On the ``stream`` fallback a chunk travels as frames of at most this many bytes
(py-libp2p fails on single messages above ~6 MB; smaller frames also keep the
receiver reading, so yamux never times out the sender's window)."""

# Reply statuses.
OK = "ok"
NOT_FOUND = "not_found"
BAD_REQUEST = "bad_request"
BUSY = "busy"
MISMATCH = "mismatch"  # the client's manifest is not the server's
INTERNAL = "internal_error"  # serving hit a bug of the server's (pcp_p2p.core.faults): try another provider
STATUSES = (OK, NOT_FOUND, BAD_REQUEST, BUSY, MISMATCH, INTERNAL)


@wire_message("blob.request", max_size=4096)
class BlobRequest(Message):
    kind: str  # "manifest" | "data" | "fetch"
    cid: str
    nonce: bytes  # client nonce (16 bytes), salts the side-channel key
    manifest_cid: str = ""
    first: int = 0
    count: int = 0
    via: str = "side"  # "side": TCP side channel; "stream": on this libp2p stream
    wait_ms: int = 0  # a swarm fetch: wait this long (capped by the server) for a fetch of ours to start

    def __post_init__(self) -> None:
        if self.via not in ("side", "stream"):
            raise ValueError(f"unknown data path {self.via!r:.20}")
        if self.kind not in ("manifest", "data", "fetch"):
            raise ValueError(f"unknown request kind {self.kind!r:.20}")
        if len(self.nonce) != NONCE_LEN:
            raise ValueError("nonce must be 16 bytes")
        if self.wait_ms < 0:
            raise ValueError("negative wait")
        if self.first < 0 or self.count < 0:
            raise ValueError("negative chunk range")
        if self.kind == "data" and (self.count == 0 or not self.manifest_cid):
            raise ValueError("a data request names a manifest and at least one chunk")
        if self.kind == "fetch" and (self.first or not self.count or self.manifest_cid or self.via != "side"):
            raise ValueError("a fetch request asks for chunks from 0 over the side channel, naming no manifest")


@wire_message("blob.reply", max_size=MANIFEST_MAX_SIZE + 4096)
class BlobReply(Message):
    status: str
    detail: str = ""
    manifest: bytes = b""  # for "manifest" and "fetch": the wire-encoded ChunkManifest
    port: int = 0  # for "data" and "fetch": the side-channel port on the server's address
    secret: bytes = b""  # for "data" and "fetch": 32 random bytes, known only to both ends
    nonce: bytes = b""  # server nonce
    data: bytes | None = None  # for "manifest" and "fetch": the whole blob, if at most INLINE_MAX bytes

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown status {self.status!r:.20}")
        if self.data is not None and len(self.data) > INLINE_MAX:
            raise ValueError(f"inline blob of {len(self.data)} bytes > {INLINE_MAX}")
        if not 0 <= self.port <= 65535:
            raise ValueError("bad port")


async def write_frame(stream: ByteStream, msg: Message, *, timeout: float) -> None:
    """Send one message as a frame (:mod:`pcp_p2p.wire.framing`)."""
    await framing.write_frame(stream, encode(msg), timeout=timeout)


async def read_frame(stream: ByteStream, kind: type[M], *, timeout: float) -> M:
    """Read one ``kind`` message; its size limit is checked before the body is read."""
    return decode(await framing.read_frame(stream, max_size=kind.MAX_SIZE, timeout=timeout), kind)

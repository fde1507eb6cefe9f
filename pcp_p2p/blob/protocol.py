"""``/pcp/blob/1.0.0``: the control messages and their framing on a libp2p stream.

One stream carries one exchange: the client sends a :class:`BlobRequest`, the
server answers with a :class:`BlobReply`, and the stream closes. A
``manifest`` request is answered with the chunk manifest inline (at most
1 MiB). A ``data`` request for chunks ``[first, first + count)`` is answered
with a port and a fresh secret; the chunks then flow over the TCP side
channel (:mod:`pcp_p2p.blob.sidechannel`), never over the libp2p stream.

Frames are a 4-byte big-endian length and a wire message. Lengths are checked
against the expected message's limit before reading the body, and the body is
read with our own loop (py-libp2p's ``read_exactly`` gives up after 100 partial
reads, i.e. around 6 MB over yamux).
"""

from __future__ import annotations

import struct
from typing import Protocol, TypeVar

from pcp_p2p.blob.chunks import MANIFEST_MAX_SIZE
from pcp_p2p.errors import MalformedMessage, OversizedMessage, PeerGone
from pcp_p2p.wire import Message, decode, encode, wire_message

PROTOCOL_ID = "/pcp/blob/1.0.0"
NONCE_LEN = 16
_LEN = struct.Struct(">I")
M = TypeVar("M", bound=Message)

# Reply statuses.
OK = "ok"
NOT_FOUND = "not_found"
BAD_REQUEST = "bad_request"
BUSY = "busy"
MISMATCH = "mismatch"  # the client's manifest is not the server's
STATUSES = (OK, NOT_FOUND, BAD_REQUEST, BUSY, MISMATCH)


@wire_message("blob.request", max_size=4096)
class BlobRequest(Message):
    kind: str  # "manifest" | "data"
    cid: str
    nonce: bytes  # client nonce (16 bytes), salts the side-channel key
    manifest_cid: str = ""
    first: int = 0
    count: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("manifest", "data"):
            raise ValueError(f"unknown request kind {self.kind!r:.20}")
        if len(self.nonce) != NONCE_LEN:
            raise ValueError("nonce must be 16 bytes")
        if self.first < 0 or self.count < 0:
            raise ValueError("negative chunk range")
        if self.kind == "data" and (self.count == 0 or not self.manifest_cid):
            raise ValueError("a data request names a manifest and at least one chunk")


@wire_message("blob.reply", max_size=MANIFEST_MAX_SIZE + 4096)
class BlobReply(Message):
    status: str
    detail: str = ""
    manifest: bytes = b""  # for "manifest": the wire-encoded ChunkManifest
    port: int = 0  # for "data": the side-channel port on the server's address
    secret: bytes = b""  # for "data": 32 random bytes, known only to both ends
    nonce: bytes = b""  # server nonce

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown status {self.status!r:.20}")
        if not 0 <= self.port <= 65535:
            raise ValueError("bad port")


class ByteStream(Protocol):
    """The part of a libp2p ``INetStream`` the framing needs (fakes implement it)."""

    async def read(self, n: int | None = None) -> bytes: ...

    async def write(self, data: bytes) -> None: ...


async def read_exact(stream: ByteStream, n: int) -> bytes:
    parts: list[bytes] = []
    got = 0
    while got < n:
        try:
            part = await stream.read(n - got)
        except Exception as exc:  # libp2p raises several stream-closed types
            raise PeerGone(f"stream closed after {got} of {n} bytes: {exc}") from exc
        if not part:
            raise PeerGone(f"stream closed after {got} of {n} bytes")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


async def write_frame(stream: ByteStream, msg: Message) -> None:
    data = encode(msg)
    try:
        await stream.write(_LEN.pack(len(data)) + data)
    except Exception as exc:
        raise PeerGone(f"stream broke while writing: {exc}") from exc


async def read_frame(stream: ByteStream, kind: type[M]) -> M:
    """Read one length-prefixed ``kind`` message; typed errors for anything else."""
    (length,) = _LEN.unpack(await read_exact(stream, _LEN.size))
    if length > kind.MAX_SIZE:
        raise OversizedMessage(f"{kind.TAG} frame of {length} bytes > limit {kind.MAX_SIZE}")
    if length == 0:
        raise MalformedMessage("empty frame")
    return decode(await read_exact(stream, length), kind)

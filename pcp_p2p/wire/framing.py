"""Length-prefixed frames over a libp2p stream, with limits and deadlines.

A frame is a 4-byte big-endian length and that many bytes. Why not
py-libp2p's ``read_exactly``: it gives up after 100 partial reads, so any
frame above ~6.3 MB over yamux fails with a misleading "connection closed"
(see shared/notes/py-libp2p.md). :func:`read_frame` loops on ``read`` itself,
checks the declared length against the caller's limit *before* reading the
body (a peer cannot make us allocate more than the limit), and runs under a
deadline so a peer that opens a stream and never writes costs one timeout.
"""

from __future__ import annotations

import struct
from typing import Protocol

import trio

from pcp_p2p.errors import MalformedMessage, OversizedMessage, PeerGone, PeerTimeout

_LEN = struct.Struct(">I")


class ByteStream(Protocol):
    async def read(self, n: int | None = None) -> bytes: ...
    async def write(self, data: bytes) -> None: ...


async def read_exact(stream: ByteStream, n: int) -> bytes:
    """Exactly ``n`` bytes, or :class:`PeerGone` if the stream ends first."""
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = await stream.read(n - len(buf))
        except trio.Cancelled:
            raise
        except Exception as exc:  # libp2p raises StreamEOF/StreamReset/StreamError/...
            raise PeerGone(f"stream closed after {len(buf)} of {n} bytes: {type(exc).__name__}") from exc
        if not chunk:
            raise PeerGone(f"stream closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


async def read_frame(stream: ByteStream, *, max_size: int, timeout: float) -> bytes:
    """One frame of at most ``max_size`` bytes within ``timeout`` seconds."""
    with trio.move_on_after(timeout) as scope:
        (n,) = _LEN.unpack(await read_exact(stream, _LEN.size))
        if n > max_size:
            raise OversizedMessage(f"frame of {n} bytes > limit {max_size}")
        if n == 0:
            raise MalformedMessage("empty frame")
        return await read_exact(stream, n)
    assert scope.cancelled_caught
    raise PeerTimeout(f"no complete frame within {timeout:.1f} s")


async def write_frame(stream: ByteStream, data: bytes, *, timeout: float) -> None:
    with trio.move_on_after(timeout) as scope:
        try:
            await stream.write(_LEN.pack(len(data)) + data)
        except trio.Cancelled:
            raise
        except Exception as exc:
            raise PeerGone(f"stream closed while writing: {type(exc).__name__}") from exc
        return
    assert scope.cancelled_caught
    raise PeerTimeout(f"could not write a frame within {timeout:.1f} s")


async def reset_quietly(stream: object) -> None:
    """Reset a stream we are giving up on; the peer may already be gone, so never raise."""
    with trio.move_on_after(1):
        try:
            await stream.reset()  # type: ignore[attr-defined]
        except Exception:
            pass

"""Length-prefixed frames over a libp2p stream, with limits and deadlines.

A frame is a 4-byte big-endian length and that many bytes. Why not
py-libp2p's ``read_exactly``: it gives up after 100 partial reads, so any
frame above ~6.3 MB over yamux fails with a misleading "connection closed"
(see shared/notes/py-libp2p.md). :func:`read_frame` loops on ``read`` itself,
checks the declared length against the caller's limit *before* reading the
body (a peer cannot make us allocate more than the limit), and runs under a
deadline so a peer that opens a stream and never writes costs one timeout.
:func:`read_length` and :func:`read_body` are the two halves, for a caller
that budgets the declared length and paces the body (``/pcp/msg``).
"""

from __future__ import annotations

import struct
from typing import Protocol

import trio

from pcp_p2p.core.errors import MalformedMessage, OversizedMessage, PeerGone, PeerTimeout

_LEN = struct.Struct(">I")


class ByteStream(Protocol):
    async def read(self, n: int | None = None) -> bytes: ...
    async def write(self, data: bytes) -> None: ...


class ResettableStream(Protocol):
    async def reset(self) -> None: ...


async def read_exact(stream: ByteStream, n: int) -> bytes:
    """Exactly ``n`` bytes, or :class:`PeerGone` if the stream ends first."""
    return bytes(await read_body(stream, n))


async def read_length(stream: ByteStream, *, max_size: int) -> int:
    """A frame's declared length, checked against ``max_size`` before any body is read.

    Split from :func:`read_body` so a caller can budget the declared size
    (:mod:`pcp_p2p.net.budget`) and set the body's deadline from it.
    """
    n: int = _LEN.unpack(await read_exact(stream, _LEN.size))[0]
    if n > max_size:
        raise OversizedMessage(f"frame of {n} bytes > limit {max_size}")
    if n == 0:
        raise MalformedMessage("empty frame")
    return n


async def read_body(stream: ByteStream, n: int) -> bytearray:
    """Exactly ``n`` bytes as one growing buffer (no deadline: the caller's scope is it).

    The buffer grows as bytes arrive (no ``n``-byte allocation up front, and no
    copy at the end), so memory follows what the peer actually sent.
    """
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = await stream.read(n - len(buf))
        except trio.Cancelled:
            raise
        except Exception as exc:
            raise PeerGone(f"stream closed after {len(buf)} of {n} bytes: {type(exc).__name__}") from exc
        if not chunk:
            raise PeerGone(f"stream closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


async def read_frame(stream: ByteStream, *, max_size: int, timeout: float) -> bytes:
    """One frame of at most ``max_size`` bytes within ``timeout`` seconds."""
    try:
        with trio.fail_after(timeout):
            n = await read_length(stream, max_size=max_size)
            return bytes(await read_body(stream, n))
    except trio.TooSlowError:
        raise PeerTimeout(f"no complete frame within {timeout:.1f} s") from None


async def write_frame(stream: ByteStream, data: bytes, *, timeout: float) -> None:
    try:
        with trio.fail_after(timeout):
            try:
                await stream.write(_LEN.pack(len(data)) + data)
            except trio.Cancelled:
                raise
            except Exception as exc:
                raise PeerGone(f"stream closed while writing: {type(exc).__name__}") from exc
    except trio.TooSlowError:
        raise PeerTimeout(f"could not write a frame within {timeout:.1f} s") from None


async def reset_quietly(stream: ResettableStream) -> None:
    """Reset a stream we are giving up on; the peer may already be gone, so never raise."""
    with trio.move_on_after(1):
        try:
            await stream.reset()
        except Exception:
            pass

"""Chunk manifests: how a large blob is cut so each piece is checked on arrival.

A blob's CID (see :mod:`pcp_p2p.core.cid`) names, for anything larger than one
chunk, the list of its chunks' BLAKE3 digests. The chunk manifest *is* that
list (plus the CID it hashes to), so a fetcher checks the manifest against the CID before
a byte of data moves, and then each chunk against the manifest the moment it
arrives. A 1 GB checkpoint pulled from three providers is never thrown away
whole because one of them sent one bad megabyte: the bad chunk is fetched
again from another provider and only its sender is blamed. A blob of one chunk
has the raw CID of its bytes and a one-entry manifest.

The manifest is deterministic (bytes + chunk size fix it) and is itself a wire
message, so it is content-addressed too: every honest provider of a blob has
the same manifest with the same :func:`manifest_cid`.
"""

from __future__ import annotations

import os
from pathlib import Path

from pcp_p2p.core.cid import (
    CHUNK_SIZE,
    MAX_CHUNK_SIZE,
    MIN_CHUNK_SIZE,
    check_chunk_size,
    chunk_digests,
    chunked_cid,
    cid_of,
    file_chunk_digests,
    leaf_digest,
    parse_cid,
)
from pcp_p2p.core.errors import HashMismatch, MalformedMessage, OversizedMessage
from pcp_p2p.wire import Message, decode, encode, wire_message

__all__ = ["CHUNK_SIZE", "MAX_CHUNK_SIZE", "MIN_CHUNK_SIZE", "ChunkManifest", "hash_bytes",
           "hash_file", "make_manifest", "manifest_cid", "n_chunks", "parse_manifest", "read_chunk"]

MANIFEST_MAX_SIZE = 1024 * 1024  # ~30k chunks: blobs up to ~120 GB at 4 MiB
_DIGEST_LEN = 32


@wire_message("blob.manifest", max_size=MANIFEST_MAX_SIZE)
class ChunkManifest(Message):
    """Size, chunk size and per-chunk digest of one blob (see :func:`leaf_digest`)."""

    cid: str
    size: int
    chunk_size: int
    digests: tuple[bytes, ...]

    def __post_init__(self) -> None:
        # Raised as ValueError so the codec turns it into MalformedMessage.
        parse_cid(self.cid)  # MalformedMessage if it is not a CID
        if self.size < 0:
            raise ValueError("negative blob size")
        check_chunk_size(self.chunk_size)
        if len(self.digests) != n_chunks(self.size, self.chunk_size):
            raise ValueError("chunk count does not match size / chunk size")
        if any(len(d) != _DIGEST_LEN for d in self.digests):
            raise ValueError("a chunk digest is not 32 bytes")
        # The binding that makes a manifest trustworthy without its sender:
        # the chunk list must hash to the CID it claims to describe.
        if chunked_cid(self.size, self.chunk_size, self.digests) != self.cid:
            raise ValueError(f"chunk list does not hash to {self.cid}")

    @property
    def count(self) -> int:
        return len(self.digests)

    def chunk_span(self, index: int) -> tuple[int, int]:
        """``(offset, length)`` of chunk ``index``."""
        if not 0 <= index < self.count:
            raise IndexError(f"chunk {index} of {self.count}")
        offset = index * self.chunk_size
        return offset, min(self.chunk_size, self.size - offset)

    def span_of(self, chunks: range) -> tuple[int, int]:
        """``(offset, length)`` of the bytes of consecutive ``chunks`` (``(0, 0)`` for none)."""
        if not chunks:
            return 0, 0
        first = self.chunk_span(chunks[0])[0]
        last, last_len = self.chunk_span(chunks[-1])
        return first, last + last_len - first

    def chunks_covering(self, start: int, end: int) -> range:
        """Indices of the chunks that hold bytes ``[start, end)``."""
        if not 0 <= start <= end <= self.size:
            raise MalformedMessage(f"byte range [{start}, {end}) outside blob of {self.size}")
        if start == end:
            return range(0)
        return range(start // self.chunk_size, (end - 1) // self.chunk_size + 1)

    def verify_chunk(self, index: int, data: bytes | bytearray | memoryview) -> None:
        """Raise :class:`HashMismatch` unless ``data`` is chunk ``index``."""
        _, length = self.chunk_span(index)
        if len(data) != length:
            raise HashMismatch(f"{self.cid} chunk {index}: {len(data)} bytes, expected {length}")
        if leaf_digest(self.size, self.chunk_size)(data) != self.digests[index]:
            raise HashMismatch(f"{self.cid} chunk {index} does not match its hash")


def n_chunks(size: int, chunk_size: int) -> int:
    """Chunks in a blob; an empty blob has one empty chunk (so it can be fetched)."""
    return max(1, -(-size // chunk_size))


def manifest_bytes(manifest: ChunkManifest) -> bytes:
    return encode(manifest)


def manifest_cid(manifest: ChunkManifest) -> str:
    """The manifest's own content address."""
    return cid_of(encode(manifest))


def parse_manifest(
    data: bytes, *, expect_cid: str, expect_manifest_cid: str | None = None, max_size: int
) -> ChunkManifest:
    """Decode a manifest a peer sent and check it against what we asked for.

    A manifest that decodes hashes to its own ``cid`` (checked on
    construction), so one naming ``expect_cid`` is the right chunk list, whoever
    sent it. ``max_size`` is the largest blob this fetch accepts: a manifest
    declaring more is refused (:class:`OversizedMessage`) before a byte of data
    moves.
    """
    if expect_manifest_cid is not None and cid_of(data) != expect_manifest_cid:
        raise HashMismatch(f"manifest does not match {expect_manifest_cid}")
    manifest = decode(data, ChunkManifest)
    if manifest.cid != expect_cid:
        raise MalformedMessage(f"manifest is for {manifest.cid}, asked for {expect_cid}")
    if manifest.size > max_size:
        raise OversizedMessage(f"{expect_cid}: declared size {manifest.size} > limit {max_size}")
    return manifest


def make_manifest(size: int, chunk_size: int, digests: list[bytes]) -> ChunkManifest:
    """The manifest of a blob whose chunks hash to ``digests`` (its CID computed)."""
    return ChunkManifest(chunked_cid(size, chunk_size, digests), size, chunk_size, tuple(digests))


def hash_bytes(data: bytes | bytearray | memoryview, chunk_size: int = CHUNK_SIZE) -> ChunkManifest:
    """The manifest (and so the CID) of some bytes: one hashing pass."""
    return make_manifest(len(data), chunk_size, chunk_digests(data, chunk_size))


def hash_file(path: Path, chunk_size: int = CHUNK_SIZE) -> ChunkManifest:
    """The manifest of a file, one chunk in memory at a time."""
    with open(path, "rb", buffering=0) as f:
        size, digests = file_chunk_digests(f, chunk_size)
    return make_manifest(size, chunk_size, digests)


def read_chunk(fd: int, manifest: ChunkManifest, index: int) -> bytes:
    """Chunk ``index`` of an open blob file (``os.pread``: no shared offset)."""
    offset, length = manifest.chunk_span(index)
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise HashMismatch(f"{manifest.cid}: file shorter than its manifest")
    return data

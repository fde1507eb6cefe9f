"""Chunk manifests: how a large blob is cut so each piece is checked on arrival.

A blob's CID is the sha2-256 of all its bytes (see :mod:`pcp_p2p.cid`), which a
receiver can only check once it holds every byte. A 1 GB checkpoint pulled from
three providers must not be thrown away whole because one of them sent one bad
megabyte, and must not reveal *which* provider lied only at the end. So every
blob also has a chunk manifest: its size, the chunk size and the sha256 of each
chunk. A chunk is verified the moment it arrives; a bad one is fetched again
from another provider and only that provider is blamed.

The manifest is deterministic (bytes + chunk size fix it) and is itself a wire
message, so it is content-addressed too: every honest provider of a blob has
the same manifest with the same :func:`manifest_cid`. It names the blob's CID
inside it, and the fetcher still checks the whole-blob hash before anything
enters the store, so a lying manifest can waste a fetch but never plant data.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from pcp_p2p.cid import cid_from_digest, cid_of, digest_of_cid
from pcp_p2p.errors import HashMismatch, MalformedMessage, OversizedMessage
from pcp_p2p.wire import Message, decode, encode, wire_message

CHUNK_SIZE = 4 * 1024 * 1024
"""Default chunk size: large enough that per-chunk overhead (a record, a hash
call, a thread hop) is noise, small enough that a re-fetch is cheap and a
chunk in flight is bounded memory."""

MIN_CHUNK_SIZE = 64 * 1024
MAX_CHUNK_SIZE = 8 * 1024 * 1024
MANIFEST_MAX_SIZE = 1024 * 1024  # ~30k chunks: blobs up to ~120 GB at 4 MiB
_DIGEST_LEN = 32


@wire_message("blob.manifest", max_size=MANIFEST_MAX_SIZE)
class ChunkManifest(Message):
    """Size, chunk size and per-chunk sha256 of one blob."""

    cid: str
    size: int
    chunk_size: int
    digests: tuple[bytes, ...]

    def __post_init__(self) -> None:
        # Raised as ValueError so the codec turns it into MalformedMessage.
        digest_of_cid(self.cid)  # MalformedMessage if it is not a CID
        if self.size < 0:
            raise ValueError("negative blob size")
        if not MIN_CHUNK_SIZE <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise ValueError(f"chunk size {self.chunk_size} outside allowed range")
        if len(self.digests) != n_chunks(self.size, self.chunk_size):
            raise ValueError("chunk count does not match size / chunk size")
        if any(len(d) != _DIGEST_LEN for d in self.digests):
            raise ValueError("a chunk digest is not 32 bytes")

    @property
    def count(self) -> int:
        return len(self.digests)

    def chunk_span(self, index: int) -> tuple[int, int]:
        """``(offset, length)`` of chunk ``index``."""
        if not 0 <= index < self.count:
            raise IndexError(f"chunk {index} of {self.count}")
        offset = index * self.chunk_size
        return offset, min(self.chunk_size, self.size - offset)

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
        if hashlib.sha256(data).digest() != self.digests[index]:
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

    ``max_size`` is the largest blob this fetch accepts: a manifest declaring
    more is refused (:class:`OversizedMessage`) before a byte of data moves.
    """
    if expect_manifest_cid is not None and cid_of(data) != expect_manifest_cid:
        raise HashMismatch(f"manifest does not match {expect_manifest_cid}")
    manifest = decode(data, ChunkManifest)
    if manifest.cid != expect_cid:
        raise MalformedMessage(f"manifest is for {manifest.cid}, asked for {expect_cid}")
    if manifest.size > max_size:
        raise OversizedMessage(f"{expect_cid}: declared size {manifest.size} > limit {max_size}")
    return manifest


@dataclass(frozen=True, slots=True)
class Hashed:
    """A blob's manifest and its whole-content digest, computed in one read."""

    manifest: ChunkManifest
    digest: bytes


def hash_bytes(data: bytes | bytearray | memoryview, chunk_size: int = CHUNK_SIZE) -> Hashed:
    view = memoryview(data)
    whole = hashlib.sha256(view)
    digests = tuple(
        hashlib.sha256(view[i : i + chunk_size]).digest()
        for i in range(0, max(len(view), 1), chunk_size)
    )
    digest = whole.digest()
    return Hashed(ChunkManifest(cid_from_digest(digest), len(view), chunk_size, digests), digest)


def hash_file(path: Path, chunk_size: int = CHUNK_SIZE) -> Hashed:
    """Whole digest and manifest of a file, one chunk in memory at a time."""
    whole = hashlib.sha256()
    digests: list[bytes] = []
    size = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            block = f.read(chunk_size)
            if not block and digests:
                break
            whole.update(block)
            digests.append(hashlib.sha256(block).digest())
            size += len(block)
            if len(block) < chunk_size:
                break
    digest = whole.digest()
    return Hashed(ChunkManifest(cid_from_digest(digest), size, chunk_size, tuple(digests)), digest)


def read_chunk(fd: int, manifest: ChunkManifest, index: int) -> bytes:
    """Chunk ``index`` of an open blob file (``os.pread``: no shared offset)."""
    offset, length = manifest.chunk_span(index)
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise HashMismatch(f"{manifest.cid}: file shorter than its manifest")
    return data

"""Content identifiers: every large thing in PCP is named by a hash of its bytes.

A CID is a CIDv1 with a sha2-256 multihash, written in base32. There are two
kinds, and which one a blob gets follows from its size alone:

- **raw** (codec ``0x55``, ``bafkrei...``): the sha256 of the bytes, the form
  IPFS uses for raw blocks. Every blob of at most one chunk (4 MiB) is named
  this way: run specs, manifests, small artifacts, pseudo-gradients.
- **chunked** (codec ``0x301e00 + log2(chunk size)``, from multicodec's private
  range; ``0x1e`` is BLAKE3's multihash code): the sha256 of a *chunk list* —
  ``b"pcp-chunks/2"``, the size (u64 BE), the chunk size (u32 BE) and the
  BLAKE3-256 of every chunk in order. It is a one-level Merkle root, like an
  IPFS file root over its leaves.

Why a Merkle root for large blobs: a receiver checks each chunk the moment it
arrives, against a chunk list it has already checked against the CID, so a bad
chunk is pinned on the provider that sent it and nothing else needs to be
re-hashed. With the sha256 of the whole blob as its name, the receiver would
also have to hash every byte a second time, front to back, and could only
tell a lying chunk list at the very end; on the machines we measured that
second pass cost more CPU than the whole raw socket copy (``docs/blob.md``).
Putting the chunk size into the codec keeps a CID checkable with nothing but
the bytes: :func:`check_cid` knows how to cut them.

Why BLAKE3 for the leaves of a chunked blob: every byte a node fetches is
hashed once, on the receiving core, and with sha256 that single pass (1.9 GB/s
with SHA-NI on the machines we measured) took longer than the whole raw socket
copy it rides on. BLAKE3 is a 256-bit cryptographic hash like sha256 and ran at
7.5 GB/s on one core there (``docs/blob.md``). The CID itself stays a sha2-256
multihash (of the chunk list), and a blob of one chunk keeps the plain sha256
raw CID, so small content is named exactly as IPFS names it.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import BinaryIO, NamedTuple

from blake3 import blake3

from pcp_p2p.core.errors import HashMismatch, MalformedMessage

CHUNK_SIZE = 4 * 1024 * 1024
"""Default chunk size: large enough that per-chunk overhead (a record, a hash
call, a thread hop) is noise, small enough that a re-fetch is cheap and a
chunk in flight is bounded memory."""
MIN_CHUNK_SIZE = 64 * 1024
MAX_CHUNK_SIZE = 8 * 1024 * 1024

_CID_V1 = 0x01
_RAW_CODEC = 0x55
_CHUNKED_CODEC_BASE = 0x301E00  # + log2(chunk size); multicodec's private-use range
_SHA2_256 = 0x12
_DIGEST_LEN = 32
_ROOT_TAG = b"pcp-chunks/2"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _prefix(codec: int) -> bytes:
    return bytes([_CID_V1]) + _varint(codec) + bytes([_SHA2_256, _DIGEST_LEN])


_RAW_PREFIX = _prefix(_RAW_CODEC)
# prefix bytes -> chunk size, for every chunk size a chunked CID may name
_CHUNKED_PREFIXES = {
    _prefix(_CHUNKED_CODEC_BASE + k): 1 << k
    for k in range(MIN_CHUNK_SIZE.bit_length() - 1, MAX_CHUNK_SIZE.bit_length())
}


class CidInfo(NamedTuple):
    """What a CID names: a sha256 digest, and for a chunked CID the chunk size."""

    digest: bytes
    chunk_size: int | None  # None: a raw CID (sha256 of the bytes themselves)


def _encode(prefix: bytes, digest: bytes) -> str:
    if len(digest) != _DIGEST_LEN:
        raise ValueError("a sha2-256 digest has 32 bytes")
    return "b" + base64.b32encode(prefix + digest).decode("ascii").lower().rstrip("=")


def check_chunk_size(chunk_size: int) -> None:
    """ValueError unless ``chunk_size`` is a power of two in the allowed range."""
    if not (MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE) or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk size {chunk_size} is not a power of two in "
                         f"[{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]")


def cid_from_digest(digest: bytes) -> str:
    """The raw CID for a sha2-256 digest of some bytes."""
    return _encode(_RAW_PREFIX, digest)


def chunk_list_digest(size: int, chunk_size: int, digests: Sequence[bytes]) -> bytes:
    """The sha256 a chunked CID names: of the tag, size, chunk size and chunk digests
    (BLAKE3-256 each)."""
    h = hashlib.sha256(_ROOT_TAG + struct.pack(">QI", size, chunk_size))
    for d in digests:
        h.update(d)
    return h.digest()


def chunked_cid(size: int, chunk_size: int, digests: Sequence[bytes]) -> str:
    """The CID of a blob of ``size`` bytes whose chunks hash to ``digests``.

    A blob of at most one chunk gets the raw CID of its only chunk, so that the
    name of small content does not depend on a chunk size.
    """
    check_chunk_size(chunk_size)
    if size <= chunk_size:
        if len(digests) != 1:
            raise ValueError("a blob of one chunk has one digest")
        return cid_from_digest(digests[0])
    return _encode(_prefix(_CHUNKED_CODEC_BASE + chunk_size.bit_length() - 1),
                   chunk_list_digest(size, chunk_size, digests))


Digest = Callable[[bytes | bytearray | memoryview], bytes]


def _sha256(data: bytes | bytearray | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


def _blake3(data: bytes | bytearray | memoryview) -> bytes:
    return blake3(data).digest()


def leaf_digest(size: int, chunk_size: int) -> Digest:
    """How each chunk of a blob of ``size`` bytes is hashed in its chunk list:
    sha256 for the one chunk of a blob with a raw CID, BLAKE3 for a chunked one."""
    return _sha256 if size <= chunk_size else _blake3


def chunk_digests(data: bytes | bytearray | memoryview, chunk_size: int = CHUNK_SIZE) -> list[bytes]:
    """The digest of each ``chunk_size`` piece of ``data`` (one piece if empty)."""
    view = memoryview(data)
    digest = leaf_digest(len(view), chunk_size)
    return [digest(view[i : i + chunk_size]) for i in range(0, max(len(view), 1), chunk_size)]


def cid_of(data: bytes | bytearray | memoryview, chunk_size: int = CHUNK_SIZE) -> str:
    """The CID of some bytes (raw up to one chunk, chunked above)."""
    return chunked_cid(len(data), chunk_size, chunk_digests(data, chunk_size))


def file_chunk_digests(f: BinaryIO, chunk_size: int = CHUNK_SIZE) -> tuple[int, list[bytes]]:
    """Size and per-chunk digests of a file's contents, one chunk in memory at a time."""
    block, after = f.read(chunk_size), f.read(chunk_size)
    if not after:  # at most one chunk: the raw CID's sha256
        return len(block), [_sha256(block)]
    digests = [_blake3(block)]
    size = len(block)
    while after:
        digests.append(_blake3(after))
        size += len(after)
        after = f.read(chunk_size)
    return size, digests


def cid_of_file(f: BinaryIO, chunk_size: int = CHUNK_SIZE) -> str:
    """The CID of a file's contents, one chunk in memory at a time."""
    size, digests = file_chunk_digests(f, chunk_size)
    return chunked_cid(size, chunk_size, digests)


def parse_cid(cid: str) -> CidInfo:
    """Digest and chunk size a CID names; :class:`MalformedMessage` for anything else."""
    if not isinstance(cid, str) or not cid.startswith("b") or len(cid) > 128:
        raise MalformedMessage(f"not a base32 CIDv1: {cid!r:.80}")
    body = cid[1:].upper()
    try:
        raw = base64.b32decode(body + "=" * (-len(body) % 8))
    except (ValueError, TypeError) as exc:
        raise MalformedMessage(f"not a base32 CIDv1: {cid!r:.80}") from exc
    prefix, digest = raw[:-_DIGEST_LEN], raw[-_DIGEST_LEN:]
    if len(raw) <= _DIGEST_LEN:
        raise MalformedMessage(f"CID too short: {cid!r:.80}")
    if prefix == _RAW_PREFIX:
        return CidInfo(digest, None)
    if prefix in _CHUNKED_PREFIXES:
        return CidInfo(digest, _CHUNKED_PREFIXES[prefix])
    raise MalformedMessage(f"not a sha2-256 CIDv1 of a raw or chunked blob: {cid!r:.80}")


def digest_of_cid(cid: str) -> bytes:
    """The sha2-256 digest a CID names (either kind); a typed error for a non-CID."""
    return parse_cid(cid).digest


def check_cid(cid: str, data: bytes | bytearray | memoryview) -> None:
    """Raise :class:`HashMismatch` unless ``data`` is the content ``cid`` names."""
    info = parse_cid(cid)
    if info.chunk_size is None:
        ok = _sha256(data) == info.digest
    else:
        ok = len(data) > info.chunk_size and cid_of(data, info.chunk_size) == cid
    if not ok:
        raise HashMismatch(f"content does not match {cid}")

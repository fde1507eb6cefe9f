"""Content identifiers: every large thing in PCP is named by the hash of its bytes.

A CID here is a CIDv1 with the ``raw`` codec and a sha2-256 multihash, written
in base32 (``bafkrei...``), the form IPFS uses for raw blocks. Using the
standard layout means the identifier means the same thing to any tool that
speaks multihash, and leaves room for another hash function later without a
flag day: the multihash prefix says which one was used.
"""

from __future__ import annotations

import base64
import hashlib
from typing import BinaryIO

from pcp_p2p.errors import HashMismatch, MalformedMessage

_CID_V1 = 0x01
_RAW_CODEC = 0x55
_SHA2_256 = 0x12
_DIGEST_LEN = 32
_PREFIX = bytes([_CID_V1, _RAW_CODEC, _SHA2_256, _DIGEST_LEN])


def cid_from_digest(digest: bytes) -> str:
    """The CID string for a sha2-256 digest."""
    if len(digest) != _DIGEST_LEN:
        raise ValueError("a sha2-256 digest has 32 bytes")
    return "b" + base64.b32encode(_PREFIX + digest).decode("ascii").lower().rstrip("=")


def cid_of(data: bytes | bytearray | memoryview) -> str:
    """The CID of some bytes."""
    return cid_from_digest(hashlib.sha256(data).digest())


def cid_of_file(f: BinaryIO, chunk: int = 1 << 20) -> str:
    """The CID of a file's contents, read in chunks (bounded memory)."""
    h = hashlib.sha256()
    while block := f.read(chunk):
        h.update(block)
    return cid_from_digest(h.digest())


def digest_of_cid(cid: str) -> bytes:
    """The sha2-256 digest a CID names; a typed error for anything else."""
    if not isinstance(cid, str) or not cid.startswith("b") or len(cid) > 128:
        raise MalformedMessage(f"not a base32 CIDv1: {cid!r:.80}")
    body = cid[1:].upper()
    try:
        raw = base64.b32decode(body + "=" * (-len(body) % 8))
    except (ValueError, TypeError) as exc:
        raise MalformedMessage(f"not a base32 CIDv1: {cid!r:.80}") from exc
    if len(raw) != len(_PREFIX) + _DIGEST_LEN or raw[: len(_PREFIX)] != _PREFIX:
        raise MalformedMessage(f"not a raw sha2-256 CIDv1: {cid!r:.80}")
    return raw[len(_PREFIX) :]


def check_cid(cid: str, data: bytes | bytearray | memoryview) -> None:
    """Raise :class:`HashMismatch` unless ``data`` hashes to ``cid``."""
    if hashlib.sha256(data).digest() != digest_of_cid(cid):
        raise HashMismatch(f"content does not match {cid}")

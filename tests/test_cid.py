"""CIDs: raw for content of one chunk, a chunk-list root above; both checkable from bytes alone."""

from __future__ import annotations

import hashlib
import io
import os

import msgpack
import pytest
from blake3 import blake3

from pcp_p2p.blob.chunks import ChunkManifest, hash_bytes, parse_manifest
from pcp_p2p.core.cid import (
    CHUNK_SIZE,
    check_cid,
    chunk_list_digest,
    cid_from_digest,
    cid_of,
    cid_of_file,
    parse_cid,
)
from pcp_p2p.core.errors import HashMismatch, MalformedMessage

CS = 64 * 1024


def test_one_chunk_or_less_is_the_raw_sha256_cid() -> None:
    for data in (b"", b"x", os.urandom(CS)):
        cid = cid_of(data, CS)
        assert cid == cid_from_digest(hashlib.sha256(data).digest())
        assert cid.startswith("bafkrei") and parse_cid(cid).chunk_size is None
    assert cid_of(b"") == "bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyku"  # as IPFS names it


def test_more_than_one_chunk_is_named_by_its_chunk_list() -> None:
    data = os.urandom(3 * CS + 5)
    cid = cid_of(data, CS)
    info = parse_cid(cid)
    assert info.chunk_size == CS
    digests = [blake3(data[i : i + CS]).digest() for i in range(0, len(data), CS)]
    assert info.digest == chunk_list_digest(len(data), CS, digests)
    assert cid != cid_from_digest(hashlib.sha256(data).digest())
    assert cid_of(data, 2 * CS) != cid  # the chunk size is part of the name...
    check_cid(cid, data)  # ...and check_cid reads it back from the CID
    check_cid(cid_of(data, 2 * CS), data)
    assert cid_of_file(io.BytesIO(data), CS) == cid
    assert hash_bytes(data, CS).cid == cid


def test_check_cid_refuses_other_bytes() -> None:
    data = bytearray(os.urandom(2 * CS + 1))
    cid = cid_of(bytes(data), CS)
    for bad in (bytes(data[:-1]), bytes(data) + b"\0", bytes(data[: CS])):
        with pytest.raises(HashMismatch):
            check_cid(cid, bad)
    data[CS + 7] ^= 1
    with pytest.raises(HashMismatch):
        check_cid(cid, bytes(data))
    with pytest.raises(HashMismatch):
        check_cid(cid_of(b"a"), b"b")


@pytest.mark.parametrize("bad", ["", "x", "bafy", "b" + "a" * 60, "Qm" + "1" * 44, 7])
def test_non_cids_are_malformed(bad: object) -> None:
    with pytest.raises(MalformedMessage):
        parse_cid(bad)  # type: ignore[arg-type]


def test_default_chunk_size_is_four_mib() -> None:
    assert CHUNK_SIZE == 4 * 1024 * 1024
    assert parse_cid(cid_of(b"\0" * (CHUNK_SIZE + 1))).chunk_size == CHUNK_SIZE


def test_a_manifest_must_hash_to_its_cid() -> None:
    data, other = os.urandom(2 * CS + 1), os.urandom(2 * CS + 1)
    m, o = hash_bytes(data, CS), hash_bytes(other, CS)
    with pytest.raises(ValueError):
        ChunkManifest(m.cid, o.size, o.chunk_size, o.digests)
    with pytest.raises(ValueError):  # a raw CID names exactly one chunk
        ChunkManifest(cid_of(data[:10]), 10, CS, (hashlib.sha256(data[:9]).digest(),))
    forged = msgpack.packb([1, "blob.manifest", {"cid": m.cid, "size": o.size, "chunk_size": CS,
                                                 "digests": list(o.digests)}], use_bin_type=True)
    with pytest.raises(MalformedMessage, match="does not hash"):
        parse_manifest(forged, expect_cid=m.cid, max_size=1 << 30)

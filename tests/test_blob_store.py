"""Blob store: content addressing, atomicity, pins, LRU eviction, limits."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import msgpack
import pytest

from pcp_p2p.blob.chunks import hash_bytes
from pcp_p2p.blob.store import BlobStore
from pcp_p2p.core.cid import cid_from_digest, cid_of
from pcp_p2p.core.errors import BlobNotFound, HashMismatch, StoreFull

CS = 64 * 1024  # small chunks keep the tests fast


def store(tmp_path: Path, limit: int = 1 << 20) -> BlobStore:
    return BlobStore(tmp_path / "blobs", limit, chunk_size=CS)


def test_put_and_read_by_cid(tmp_path: Path) -> None:
    s = store(tmp_path)
    data = os.urandom(200_000)
    cid = s.put_bytes(data)
    assert cid == cid_of(data, CS)
    assert s.has(cid) and s.size(cid) == len(data)
    assert s.path(cid).read_bytes() == data
    assert s.read(cid, 10, 100) == data[10:110]
    m = s.manifest(cid)
    assert m.cid == cid and m.size == len(data) and m.count == 4


def test_put_with_wrong_cid_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    s = store(tmp_path)
    with pytest.raises(HashMismatch):
        s.put_bytes(b"evil", cid=cid_of(b"good"))
    assert s.cids() == []
    assert list((tmp_path / "blobs" / "tmp").iterdir()) == []


def test_put_file_copies_and_hashes(tmp_path: Path) -> None:
    s = store(tmp_path)
    src = tmp_path / "src.bin"
    data = os.urandom(3 * CS + 5)
    src.write_bytes(data)
    cid = s.put_file(src)
    assert cid == cid_of(data, CS) and s.path(cid).read_bytes() == data
    assert s.manifest(cid) == hash_bytes(data, CS)


def test_unknown_cid_is_blob_not_found(tmp_path: Path) -> None:
    s = store(tmp_path)
    with pytest.raises(BlobNotFound):
        s.path(cid_of(b"nope"))
    with pytest.raises(BlobNotFound):
        s.pin(cid_of(b"nope"))


def test_pins_survive_restart_and_partial_writes_are_cleaned(tmp_path: Path) -> None:
    s = store(tmp_path)
    a = s.put_bytes(b"a" * 1000, pin=True)
    b = s.put_bytes(b"b" * 1000)
    (tmp_path / "blobs" / "tmp" / "crash.part").write_bytes(b"half")
    s2 = store(tmp_path)
    assert s2.pinned() == {a}
    assert set(s2.cids()) == {a, b}
    assert list((tmp_path / "blobs" / "tmp").iterdir()) == []


def test_blob_without_manifest_is_dropped_at_start(tmp_path: Path) -> None:
    s = store(tmp_path)
    cid = s.put_bytes(b"x" * 10)
    (tmp_path / "blobs" / "data" / (cid + ".mf")).unlink()  # crash between the renames
    assert not store(tmp_path).has(cid)


def test_entries_with_a_manifest_that_does_not_decode_are_dropped_at_start(tmp_path: Path) -> None:
    # e.g. a large blob stored before CIDs named chunk lists: its manifest pairs a
    # raw CID with several chunks, which no longer decodes
    s = store(tmp_path)
    good = s.put_bytes(os.urandom(3 * CS))
    old = cid_from_digest(hashlib.sha256(b"old").digest())
    data = tmp_path / "blobs" / "data"
    (data / old).write_bytes(b"o" * (3 * CS))
    m = s.manifest(good)
    body = {"cid": old, "size": m.size, "chunk_size": m.chunk_size, "digests": list(m.digests)}
    (data / (old + ".mf")).write_bytes(msgpack.packb([1, "blob.manifest", body], use_bin_type=True))
    s2 = store(tmp_path)
    assert s2.has(good) and not s2.has(old)
    assert not (data / old).exists() and not (data / (old + ".mf")).exists()


def test_lru_eviction_keeps_pins_and_recent(tmp_path: Path) -> None:
    s = store(tmp_path, limit=3000)
    old = s.put_bytes(b"o" * 1000)
    pinned = s.put_bytes(b"p" * 1000, pin=True)
    recent = s.put_bytes(b"r" * 1000)
    past = time.time() - 100
    os.utime(s._data / old, (past, past))
    os.utime(s._data / recent, (past + 50, past + 50))
    s.read(recent)  # a read makes it the most recently used
    new = s.put_bytes(b"n" * 1000)
    assert not s.has(old)
    assert s.has(pinned) and s.has(recent) and s.has(new)
    assert s.used_bytes <= 3000


def test_store_full_when_pins_leave_no_room(tmp_path: Path) -> None:
    s = store(tmp_path, limit=2500)
    s.put_bytes(b"1" * 1000, pin=True)
    s.put_bytes(b"2" * 1000, pin=True)
    with pytest.raises(StoreFull):
        s.put_bytes(b"3" * 1000)
    with pytest.raises(StoreFull):
        s.put_bytes(b"4" * 5000)  # bigger than the whole store


def test_pending_blob_commits_only_when_every_chunk_was_verified(tmp_path: Path) -> None:
    s = store(tmp_path)
    data = os.urandom(100_000)
    m = hash_bytes(data, CS)
    assert m.count == 2
    with s.begin(m.cid, m) as p:
        with open(p.path, "r+b") as f:
            f.write(data)
        p.chunk_verified(0)
        with pytest.raises(HashMismatch, match="1 chunk"):
            p.commit()
    assert not s.has(m.cid)
    assert s._reserved == 0
    with s.begin(m.cid, m) as p:
        with open(p.path, "r+b") as f:
            f.write(data)
        with pytest.raises(IndexError):
            p.chunk_verified(2)
        p.chunk_verified(0)
        p.chunk_verified(1)
        path = p.commit()
    assert path.read_bytes() == data and s._reserved == 0


def test_reservations_count_against_the_limit(tmp_path: Path) -> None:
    s = store(tmp_path, limit=150_000)
    m = hash_bytes(os.urandom(100_000), CS)
    s.put_bytes(b"k" * 10, pin=True)
    with s.begin(m.cid, m):
        with pytest.raises(StoreFull):
            s.put_bytes(os.urandom(60_000))


def test_usage_reports_what_is_held_and_what_is_pinned(tmp_path: Path) -> None:
    s = BlobStore(tmp_path, 10_000)
    assert s.usage() == {"used_bytes": 0, "max_bytes": 10_000, "pinned_bytes": 0, "blobs": 0, "pinned_blobs": 0}
    a = s.put_bytes(b"a" * 1000, pin=True)
    s.put_bytes(b"b" * 300)
    assert s.usage() == {"used_bytes": 1300, "max_bytes": 10_000, "pinned_bytes": 1000, "blobs": 2, "pinned_blobs": 1}
    s.unpin(a)
    assert s.usage()["pinned_bytes"] == 0 and s.usage()["pinned_blobs"] == 0


@pytest.mark.parametrize("size", [0, 100, 4096, (4 << 20) * 2 + 123, (4 << 20) * 3])
@pytest.mark.parametrize("direct", [True, False])
def test_write_durably_writes_exactly_the_bytes(tmp_path: Path, size: int, direct: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Direct I/O from a bounce buffer (the aligned part) plus the page cache (the tail), or the
    page cache alone where O_DIRECT is missing or refused: the file holds the bytes, nothing more."""
    from pcp_p2p.blob import store as store_mod

    if not direct:
        monkeypatch.setattr(store_mod, "O_DIRECT", 0)
    data = os.urandom(size)
    path = tmp_path / "blob"
    store_mod.write_durably(path, data)
    assert path.read_bytes() == data
    s = BlobStore(tmp_path / "s", 1 << 30)
    cid = s.put_bytes(data)
    assert cid == cid_of(data) and s.read(cid) == data

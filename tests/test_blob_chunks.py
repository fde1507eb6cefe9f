"""Chunk manifests and the sans-IO fetch planner."""

from __future__ import annotations

import os

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcp_p2p.blob.chunks import hash_bytes, manifest_cid, parse_manifest
from pcp_p2p.blob.transfer import FetchPlan
from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import HashMismatch, MalformedMessage, OversizedMessage, PcpError
from pcp_p2p.wire import encode

CS = 64 * 1024


def test_manifest_lists_every_chunk() -> None:
    data = os.urandom(3 * CS + 17)
    m = hash_bytes(data, CS)
    assert m.count == 4 and m.size == len(data) and m.cid == cid_of(data, CS)
    assert m.chunk_span(3) == (3 * CS, 17)
    for i in range(4):
        off, n = m.chunk_span(i)
        m.verify_chunk(i, data[off : off + n])
    assert list(m.chunks_covering(CS - 1, CS + 1)) == [0, 1]
    assert list(m.chunks_covering(0, len(data))) == [0, 1, 2, 3]


def test_empty_blob_has_one_empty_chunk() -> None:
    m = hash_bytes(b"", CS)
    assert m.count == 1 and m.chunk_span(0) == (0, 0)
    m.verify_chunk(0, b"")


def test_bad_chunk_is_hash_mismatch() -> None:
    data = os.urandom(2 * CS)
    m = hash_bytes(data, CS)
    bad = bytearray(data[:CS])
    bad[5] ^= 1
    with pytest.raises(HashMismatch):
        m.verify_chunk(0, bad)
    with pytest.raises(HashMismatch):
        m.verify_chunk(0, data[: CS - 1])


def test_manifest_is_content_addressed_and_checked() -> None:
    m = hash_bytes(os.urandom(CS + 1), CS)
    raw = encode(m)
    assert manifest_cid(m) == cid_of(raw)
    assert parse_manifest(raw, expect_cid=m.cid, expect_manifest_cid=cid_of(raw), max_size=1 << 20) == m
    with pytest.raises(HashMismatch):
        parse_manifest(raw, expect_cid=m.cid, expect_manifest_cid=cid_of(b"x"), max_size=1 << 20)
    with pytest.raises(MalformedMessage):
        parse_manifest(raw, expect_cid=cid_of(b"other"), max_size=1 << 20)


def test_declared_size_above_limit_is_oversized() -> None:
    m = hash_bytes(os.urandom(CS + 1), CS)
    with pytest.raises(OversizedMessage):
        parse_manifest(encode(m), expect_cid=m.cid, max_size=CS)


def test_inconsistent_manifest_is_malformed() -> None:
    m = hash_bytes(os.urandom(2 * CS), CS)
    # a huge declared size with too few digests: refused at decode, nothing allocated
    body = {"cid": m.cid, "size": 10**15, "chunk_size": CS, "digests": list(m.digests)}
    raw = msgpack.packb([1, "blob.manifest", body], use_bin_type=True)
    with pytest.raises(MalformedMessage):
        parse_manifest(raw, expect_cid=m.cid, max_size=1 << 60)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_random_manifest_bytes_raise_only_pcp_errors(data: bytes) -> None:
    try:
        parse_manifest(data, expect_cid=cid_of(b"x"), max_size=1 << 30)
    except PcpError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 255))
def test_mutated_manifest_raises_only_pcp_errors(pos: int, byte: int) -> None:
    m = hash_bytes(b"y" * (CS * 2 + 3), CS)
    raw = bytearray(encode(m))
    raw[pos % len(raw)] = byte
    try:
        parse_manifest(bytes(raw), expect_cid=m.cid, max_size=1 << 30)
    except PcpError:
        pass


# --- FetchPlan -----------------------------------------------------------------


def test_one_provider_takes_everything_in_one_batch() -> None:
    plan = FetchPlan(range(10), ["a"])
    assert plan.next_batch("a") == list(range(10))
    assert plan.next_batch("a") == []
    for i in range(10):
        plan.chunk_ok("a", i)
    assert plan.complete and plan.next_batch("a") is None


def test_several_providers_share_contiguous_batches() -> None:
    plan = FetchPlan(range(12), ["a", "b", "c"])
    a, b, c = plan.next_batch("a"), plan.next_batch("b"), plan.next_batch("c")
    assert a == [0, 1] and b == [2, 3] and c == [4, 5]
    assert not set(a) & set(b)


def test_failed_provider_returns_its_chunks_and_keeps_verified_ones() -> None:
    plan = FetchPlan(range(6), ["a", "b"])
    a = plan.next_batch("a")
    assert a == [0, 1]
    plan.chunk_ok("a", 0)
    plan.provider_failed("a", "vanished")
    assert plan.next_batch("a") is None
    rest: list[int] = []
    while (batch := plan.next_batch("b")):
        rest += batch
        for i in batch:
            plan.chunk_ok("b", i)
    assert sorted(rest) == [1, 2, 3, 4, 5]  # chunk 0 is kept, not fetched again
    assert plan.complete and plan.served == {"a": 1, "b": 5}


def test_bad_chunk_bans_the_provider_and_requeues() -> None:
    plan = FetchPlan(range(4), ["a", "b"])
    batch = plan.next_batch("a")
    assert batch is not None
    plan.chunk_bad("a", batch[0])
    assert "a" in plan.banned and plan.next_batch("a") is None
    got = plan.next_batch("b")
    assert got is not None and batch[0] in got


def test_plan_fails_when_everyone_is_banned() -> None:
    plan = FetchPlan(range(2), ["a"])
    plan.next_batch("a")
    plan.provider_failed("a", "stalled")
    assert plan.failed and not plan.complete


def test_unfinished_batch_is_requeued() -> None:
    plan = FetchPlan(range(3), ["a"])
    batch = plan.next_batch("a")
    assert batch is not None
    plan.chunk_ok("a", 0)
    plan.provider_finished_batch("a", batch)
    assert plan.next_batch("a") == [1, 2]


def test_chunk_ok_from_wrong_provider_is_a_bug() -> None:
    plan = FetchPlan(range(2), ["a", "b"])
    plan.next_batch("a")
    with pytest.raises(ValueError):
        plan.chunk_ok("b", 0)

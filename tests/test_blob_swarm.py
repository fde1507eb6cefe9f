"""Swarming (pcp_p2p.blob.swarm): the relay tree, the fallback plan, and N fetchers over real libp2p.

The libp2p tests run real hosts on 127.0.0.1 in one process (as test_blob_service does):
N fetchers of one blob each ask their relay-tree ancestors, then the origin; the origin's
side-channel bytes are counted by a :class:`Traffic`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from test_blob_service import CS, DropMidChunk, StallMidChunk, info, network

from pcp_p2p.blob.service import BlobService
from pcp_p2p.blob.sidechannel import KIND_CHUNK, send_record
from pcp_p2p.blob.swarm import DIRECT_BYTES, FallbackPlan, tree_order, upstream, worth_a_tree
from pcp_p2p.core.cid import cid_of
from pcp_p2p.net.traffic import Traffic

# --- the relay tree (pure) ------------------------------------------------------------------------


@given(st.integers(1, 40), st.integers(1, 4), st.binary(min_size=1, max_size=8))
def test_every_member_climbs_to_the_root_and_no_one_has_more_than_fanout_children(
    n: int, fanout: int, salt: bytes
) -> None:
    cid = cid_of(salt)
    members = [f"peer{k}" for k in range(n)]
    order = tree_order(cid, members)
    assert tree_order(cid, reversed(members)) == order  # every member computes the same tree
    children: dict[str, int] = {}
    for m in members:
        chain = upstream(cid, members, m, fanout)
        if m == order[0]:
            assert chain == []
            continue
        assert chain[-1] == order[0] and m not in chain and len(set(chain)) == len(chain)
        children[chain[0]] = children.get(chain[0], 0) + 1
        # depth: at most ceil(log_fanout(n)) + 1 hops (a chain for fanout 1)
        assert len(chain) <= (n if fanout == 1 else 1 + next(d for d in range(n + 1) if fanout**d >= n))
    assert all(c <= fanout for c in children.values())


def test_a_late_joiner_is_a_leaf_that_changes_no_members_tree() -> None:
    cid = cid_of(b"theta")
    members = [f"peer{k}" for k in range(9)]
    before = {m: upstream(cid, members, m) for m in members}
    late = upstream(cid, members, "latecomer")
    assert late and late[-1] == tree_order(cid, members)[0]
    assert before == {m: upstream(cid, members, m) for m in members}


def test_the_fallback_plan_asks_only_the_first_standing_provider() -> None:
    plan = FallbackPlan(range(6), ["parent", "root", "origin"])
    assert plan.next_batch("root") == [] and plan.next_batch("origin") == []
    assert plan.next_batch("parent") == [0, 1, 2, 3, 4, 5]
    plan.chunk_ok("parent", 0)
    plan.chunk_ok("parent", 1)
    plan.chunk_bad("parent", 2)  # a lying relay: banned, its chunks go back
    assert plan.next_batch("parent") is None and plan.next_batch("origin") == []
    assert plan.next_batch("root") == [2, 3, 4, 5]
    plan.chunk_ok("root", 2)
    plan.provider_failed("root", "vanished")
    assert plan.next_batch("origin") == [3, 4, 5]
    for i in (3, 4, 5):
        plan.chunk_ok("origin", i)
    assert plan.complete and plan.served == {"parent": 2, "root": 1, "origin": 3}
    assert plan.next_batch("origin") is None


# --- over libp2p ------------------------------------------------------------------------------------

# The relays' socket stall limit where a test counts the origin's bytes: a relay waits for its own
# parent's chunks, and on a loaded 2-core machine 0.5 s (test_blob_service's) can pass between two of
# them; a child giving up would then climb to the origin and the count would measure the load.
STALL = 3.0


def _bad_send(sock, cipher, index, data, out):  # type: ignore[no-untyped-def]
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0xFF
    send_record(sock, cipher, KIND_CHUNK, bytes(bad))


async def _swarm_fetch(origin: BlobService, fetchers: list[BlobService], cid: str) -> dict[str, Exception]:
    """Every fetcher at once, each from its ancestors then the origin; errors by fetcher."""
    members = [f.peer_id for f in fetchers]
    by_id = {f.peer_id: f for f in fetchers}
    errors: dict[str, Exception] = {}

    async def one(f: BlobService) -> None:
        chain = [info(by_id[p]) for p in upstream(cid, members, f.peer_id, f.config.swarm_fanout)]
        try:
            await f.fetch(cid, providers=[*chain, info(origin)], ordered=True, announce=False)
        except Exception as exc:
            errors[f.peer_id] = exc

    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            for f in fetchers:
                n.start_soon(one, f)
    return errors


async def test_eight_fetchers_get_the_blob_while_the_origin_serves_about_one_copy(tmp_path: Path) -> None:
    data = os.urandom(16 * CS + 99)
    async with network(tmp_path) as net:
        origin = await net.node()
        origin.traffic = Traffic()
        cid = await origin.publish(data)
        fetchers = [await net.node(stall_timeout=STALL) for _ in range(8)]
        assert await _swarm_fetch(origin, fetchers, cid) == {}
        for f in fetchers:
            assert f.store.read(cid) == data  # (committed only once every chunk matched the manifest)
        sent = origin.traffic.bytes_out
        assert sent <= 2 * len(data), f"the origin sent {sent / len(data):.2f} copies"
        # and the members relayed the rest: someone other than the origin served chunks
        relayed = [f for f in fetchers if f.last_fetch and set(f.last_fetch.chunks_from) - {origin.peer_id}]
        assert len(relayed) >= len(fetchers) - 1
        # what status reports of it (network.swarm_*): the root names no ancestor, the others did
        assert sum(f.swarm.fetches for f in fetchers) == len(fetchers) - 1


async def test_a_small_blob_travels_inline_down_the_tree(tmp_path: Path) -> None:
    data = os.urandom(CS // 2)  # one chunk: the manifest reply carries it
    async with network(tmp_path) as net:
        origin = await net.node()
        origin.traffic = Traffic()
        cid = await origin.publish(data)
        fetchers = [await net.node(stall_timeout=STALL) for _ in range(6)]
        assert await _swarm_fetch(origin, fetchers, cid) == {}
        assert all(f.store.read(cid) == data for f in fetchers)
        # the root's fetch only, whatever the others did: manifests and control are a few hundred bytes
        assert origin.traffic.bytes_out <= 2 * len(data)


async def test_a_relay_that_tampers_is_refused_and_its_subtree_completes_from_others(tmp_path: Path) -> None:
    data = os.urandom(12 * CS)
    async with network(tmp_path) as net:
        origin = await net.node()
        cid = await origin.publish(data)
        fetchers = [await net.node() for _ in range(6)]
        members = [f.peer_id for f in fetchers]
        root = next(f for f in fetchers if f.peer_id == tree_order(cid, members)[0])
        root._send_chunk = _bad_send  # type: ignore[method-assign]  # the root relays corrupted chunks
        assert await _swarm_fetch(origin, fetchers, cid) == {}
        assert all(f.store.read(cid) == data for f in fetchers)
        children = [f for f in fetchers if upstream(cid, members, f.peer_id)[:1] == [root.peer_id]]
        assert children
        for child in children:
            report = child.last_fetch
            assert report is not None
            assert "HashMismatch" in report.failures[root.peer_id]  # the typed error, recorded
            assert root.peer_id not in report.chunks_from  # nothing it sent was kept


@pytest.mark.parametrize("fault", [DropMidChunk, StallMidChunk])
async def test_a_relay_that_vanishes_or_stalls_mid_fetch_does_not_stall_it(
    tmp_path: Path, fault: type[BlobService]
) -> None:
    data = os.urandom(12 * CS)
    async with network(tmp_path) as net:
        origin = await net.node()
        cid = await origin.publish(data)
        fetchers = [await net.node() for _ in range(5)]
        members = [f.peer_id for f in fetchers]
        root = next(f for f in fetchers if f.peer_id == tree_order(cid, members)[0])
        # half a chunk record, then the connection drops (or goes silent: the stall timeout, 0.5 s here)
        root._send_chunk = fault._send_chunk.__get__(root)  # type: ignore[method-assign]
        assert await _swarm_fetch(origin, fetchers, cid) == {}
        assert all(f.store.read(cid) == data for f in fetchers)
        children = [f for f in fetchers if upstream(cid, members, f.peer_id)[:1] == [root.peer_id]]
        assert children and all(root.peer_id in (c.last_fetch.failures if c.last_fetch else {}) for c in children)


async def test_a_member_that_never_fetches_costs_its_children_one_bounded_wait(tmp_path: Path) -> None:
    """Listed as a member (a signed record named it) but never fetching: asked by its children, it
    answers not_found after its swarm_wait (0.3 s here), and they climb to the next ancestor."""
    data = os.urandom(6 * CS)
    async with network(tmp_path) as net:
        origin = await net.node()
        cid = await origin.publish(data)
        nodes = [await net.node(swarm_wait=0.3) for _ in range(5)]
        members = [n.peer_id for n in nodes]
        idle = next(n for n in nodes if n.peer_id == tree_order(cid, members)[0])  # the root, say
        fetchers = [n for n in nodes if n is not idle]
        by_id = {n.peer_id: n for n in nodes}
        errors: dict[str, Exception] = {}

        async def one(f: BlobService) -> None:
            chain = [info(by_id[p]) for p in upstream(cid, members, f.peer_id)]
            try:
                await f.fetch(cid, providers=[*chain, info(origin)], ordered=True, announce=False)
            except Exception as exc:
                errors[f.peer_id] = exc

        start = trio.current_time()
        with trio.fail_after(10):
            async with trio.open_nursery() as n:
                for f in fetchers:
                    n.start_soon(one, f)
        assert errors == {} and all(f.store.read(cid) == data for f in fetchers)
        assert not idle.store.has(cid)
        children = [f for f in fetchers if upstream(cid, members, f.peer_id)[:1] == [idle.peer_id]]
        assert children
        for c in children:
            assert c.last_fetch is not None and "BlobNotFound" in c.last_fetch.failures[idle.peer_id]
            assert (c.swarm.fetches, c.swarm.from_origin) == (1, 1)  # past its only ancestor, to the origin
        assert idle.swarm.waits_missed >= len(children)  # what status shows at the idle parent (and deeper
        # members climbing past their own parents ask it too)
        # bounded by the 0.3 s wait, not by the request timeout (5 s here), which an unbounded wait would hit
        assert trio.current_time() - start < 4.5


def test_a_small_blob_goes_direct_and_a_large_or_widely_wanted_one_through_the_tree() -> None:
    """The tiny model's update (216 KB) for three workers: direct (three copies, 0.65 MB);
    for sixteen, or a 10 MB update for three: the tree."""
    assert not worth_a_tree(3, 216_000)
    assert worth_a_tree(16, 216_000) and worth_a_tree(3, 10_000_000)
    assert not worth_a_tree(1, DIRECT_BYTES) and worth_a_tree(1, DIRECT_BYTES + 1)

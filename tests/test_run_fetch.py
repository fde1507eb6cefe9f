"""How a run's runtime fetches blobs: a shepherd's Δs stay in memory, the rest is kept."""

from __future__ import annotations

import logging
import os
from contextlib import AsyncExitStack
from pathlib import Path

import libp2p
import pytest
import trio
from libp2p.peer.peerinfo import PeerInfo
from multiaddr import Multiaddr

from pcp_p2p.blob.routing import MemoryRouting
from pcp_p2p.blob.service import BlobConfig, BlobService
from pcp_p2p.blob.store import BlobStore
from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.run.pins import RunPins
from pcp_p2p.diloco.run.run_blobs import RunBlobs
from pcp_p2p.net.traffic import Traffic

CS = 64 * 1024
logging.getLogger("libp2p").setLevel(logging.CRITICAL)


async def _service(stack: AsyncExitStack, root: Path, routing: MemoryRouting, **cfg: object) -> BlobService:
    ident = Identity.generate()
    host = libp2p.new_host(key_pair=ident.key_pair)
    await stack.enter_async_context(host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]))
    svc = BlobService(host, BlobStore(root, 1 << 30, chunk_size=CS),
                      routing.for_peer(PeerInfo(host.get_id(), host.get_addrs())), ident,
                      BlobConfig(**cfg))  # type: ignore[arg-type]
    svc.register()
    return svc


def _runtime(blobs: BlobService, nursery: trio.Nursery, work_dir: Path) -> RunBlobs:
    """A run's blob side (no node, no run)."""
    return RunBlobs(None, blobs, work_dir, nursery)


async def test_a_shepherds_delta_is_fetched_into_memory_and_not_kept(tmp_path: Path) -> None:
    routing = MemoryRouting()
    delta, theta, big = os.urandom(5 * CS + 3), os.urandom(3 * CS), os.urandom(9 * CS)
    async with AsyncExitStack() as stack:
        worker = await _service(stack, tmp_path / "w", routing)
        shepherd = await _service(stack, tmp_path / "s", routing, max_in_memory=8 * CS)
        cids = [await worker.publish(b) for b in (delta, theta, big)]
        nursery = await stack.enter_async_context(trio.open_nursery())
        rt = _runtime(shepherd, nursery, tmp_path)
        assert await rt.fetch_bytes(cids[0], keep=False) == delta
        assert not shepherd.store.has(cids[0]) and cids[0] not in rt.pins  # not written, pinned or announced
        assert shepherd.peer_id not in routing.table[cids[0]]
        assert await rt.fetch_bytes(cids[1]) == theta  # everything else is kept and pinned
        assert shepherd.store.has(cids[1]) and cids[1] in shepherd.store.pinned() and cids[1] in rt.pins
        assert cids[1] in RunPins.load(tmp_path / "pins.json")  # the ledger is saved
        # a Δ above the in-memory limit goes through the store after all
        assert await rt.fetch_bytes(cids[2], keep=False) == big
        assert shepherd.store.has(cids[2])



async def test_a_blob_asked_for_twice_at_once_is_fetched_once(tmp_path: Path) -> None:
    """The commit's checkpoint is wanted by the replication and by θ's extraction at the same
    moment: the second waits for the first's fetch instead of pulling the bytes again."""
    routing = MemoryRouting()
    data = os.urandom(12 * CS)
    async with AsyncExitStack() as stack:
        origin = await _service(stack, tmp_path / "o", routing)
        fetcher = await _service(stack, tmp_path / "f", routing)
        cid = await origin.publish(data)
        origin.traffic = Traffic()  # the side channel's bytes out: what the fetches pulled
        nursery = await stack.enter_async_context(trio.open_nursery())
        rt = _runtime(fetcher, nursery, tmp_path)
        got: list[bytes | None] = []

        async def one(hold: bool) -> None:
            got.append(await (rt.hold(cid) if hold else rt.fetch_bytes(cid)))

        async with trio.open_nursery() as n:
            n.start_soon(one, True)
            n.start_soon(one, False)
        assert sorted(got, key=lambda b: b is not None) == [None, data]  # hold() does not read it back
        assert len(data) <= origin.traffic.bytes_out < 2 * len(data)  # the bytes crossed once
        assert cid in rt.pins and fetcher.store.has(cid)


@pytest.mark.parametrize("me_is", ["public", "relay-only"])
async def test_a_swarm_fetch_asks_no_ancestor_it_could_reach_through_a_relay_only(tmp_path: Path, me_is: str) -> None:
    """Relays never carry blobs: a relay-only member cannot serve anyone, and a cone one cannot serve
    a relay-only node (no hole punch opens between them). Whom this node asks skips those (the
    tree's positions stay everyone's), and the next ancestor or the origin serves."""
    from types import SimpleNamespace

    from pcp_p2p.blob.swarm import upstream
    from pcp_p2p.net.reachability import HOLE_PUNCHABLE, PUBLIC, RELAY_ONLY

    peers = [Identity.generate().peer_id for _ in range(12)]
    origin, cid, swarm = peers[0], "bafkreiexample", peers[1:]
    # the node deepest in this tree (never its root, which has nobody above it to skip)
    me = max(swarm, key=lambda p: len(upstream(cid, swarm, p, 2)))
    members = [p for p in swarm if p != me]
    chain = upstream(cid, swarm, me, 2)
    assert len(chain) == 3
    verdict = {p: PUBLIC for p in peers} | {chain[0]: RELAY_ONLY, chain[1]: HOLE_PUNCHABLE, me: me_is}
    records = {p: SimpleNamespace(record=SimpleNamespace(reachability=verdict[p], addrs=("/ip4/10.0.0.1/tcp/1",)))
               for p in peers}
    node = SimpleNamespace(peer_id=me, membership=SimpleNamespace(get=records.get),
                           connectivity=SimpleNamespace(reachability=me_is))
    asked: list[list[str]] = []

    async def fetch(cid: str, *, providers: list[PeerInfo] | None, **kw: object) -> None:
        asked.append([str(p.peer_id) for p in providers or []])

    blobs = SimpleNamespace(config=SimpleNamespace(swarm_fanout=2), fetch=fetch)
    io = RunBlobs(node, blobs, tmp_path)  # type: ignore[arg-type]
    io.announce_later = lambda cid: None  # type: ignore[method-assign]
    await io._fetch(cid, origin, keep=True, max_size=None, swarm=[me, *members])
    # the relay-only parent is never asked; the cone grandparent only by a node that can punch to it
    assert asked == [[*chain[1:], origin] if me_is == PUBLIC else [chain[2], origin]]


async def test_a_store_in_the_background_that_fails_is_told_to_its_waiters_and_the_run_goes_on(
        tmp_path: Path) -> None:
    """``store_later`` (a checkpoint built here, written while the machine goes on): ``holds`` while
    the write is in flight; ``stored`` says whether it landed. A full disk is logged and said so,
    where it used to raise out of the run's nursery."""
    from types import SimpleNamespace

    from pcp_p2p.core.cid import cid_of

    small, big = os.urandom(CS // 2), os.urandom(CS // 2 + 20 * CS)  # (small: one chunk, named alike by every store)
    store = BlobStore(tmp_path / "blobs", 20 * CS, chunk_size=CS)  # room for the small one only
    async with trio.open_nursery() as nursery:
        rt = RunBlobs(None, SimpleNamespace(store=store), tmp_path, nursery)  # type: ignore[arg-type]
        rt.announce_later = lambda cid: None  # type: ignore[method-assign]
        for data, fits in ((big, False), (small, True)):
            cid = cid_of(data)
            rt.store_later(cid, data)
            assert rt.holds(cid)  # at once: nobody is told it is missing while it is written
            assert await rt.stored(cid) is fits
            assert rt.holds(cid) is fits and store.has(cid) is fits

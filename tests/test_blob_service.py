"""BlobService over real libp2p hosts on 127.0.0.1 (one process), with injected faults."""

from __future__ import annotations

import logging
import os
import random
import socket
import struct
import threading
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import libp2p
import msgpack
import pytest
import trio
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.peer.peerinfo import PeerInfo
from multiaddr import Multiaddr

from pcp_p2p.blob import protocol as P
from pcp_p2p.blob.chunks import ChunkManifest
from pcp_p2p.blob.routing import DhtRouting, MemoryRouting
from pcp_p2p.blob.service import BlobConfig, BlobService
from pcp_p2p.blob.sidechannel import KIND_CHUNK, send_record
from pcp_p2p.blob.store import BlobStore
from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import (
    BlobNotFound,
    HashMismatch,
    LocalError,
    MalformedMessage,
    NoProviders,
    OversizedMessage,
    PeerError,
    ProtocolError,
)
from pcp_p2p.core.identity import Identity

CS = 64 * 1024
LOCAL = [Multiaddr("/ip4/127.0.0.1/tcp/0")]
logging.getLogger("libp2p").setLevel(logging.CRITICAL)

_release = threading.Event()  # set at teardown: frees stalled fault threads


class CorruptChunk(BlobService):
    """Sends authentic records whose content is wrong (a lying provider)."""

    def _send_chunk(self, sock, cipher, index, data, out):  # type: ignore[no-untyped-def]
        bad = bytearray(data)
        bad[len(bad) // 2] ^= 0xFF
        send_record(sock, cipher, KIND_CHUNK, bytes(bad))


class CorruptInline(BlobService):
    """Sends an honest manifest with a small blob inline whose bytes are wrong."""

    def _inline(self, cid):  # type: ignore[no-untyped-def]
        data = super()._inline(cid)
        return None if data is None else bytes(b ^ 1 for b in data)


class StallMidChunk(BlobService):
    """Sends half a record, then goes silent with the connection open."""

    def _send_chunk(self, sock, cipher, index, data, out):  # type: ignore[no-untyped-def]
        header, ct = cipher.seal(KIND_CHUNK, bytes(data))
        sock.sendall(header + ct[: len(ct) // 2])
        _release.wait(30)
        raise ConnectionResetError("released")


class DropMidChunk(BlobService):
    """Sends half a record, then drops the connection."""

    def _send_chunk(self, sock, cipher, index, data, out):  # type: ignore[no-untyped-def]
        header, ct = cipher.seal(KIND_CHUNK, bytes(data))
        sock.sendall(header + ct[: len(ct) // 2])
        sock.close()
        raise ConnectionResetError("dropped")


class Net:
    def __init__(self, stack: AsyncExitStack, tmp: Path) -> None:
        self.stack = stack
        self.tmp = tmp
        self.routing = MemoryRouting()
        self.n = 0

    async def node(self, cls: type[BlobService] = BlobService, **cfg: object) -> BlobService:
        ident = Identity.generate()
        host = libp2p.new_host(key_pair=ident.key_pair)
        await self.stack.enter_async_context(host.run(listen_addrs=LOCAL))
        info = PeerInfo(host.get_id(), host.get_addrs())
        self.n += 1
        store = BlobStore(self.tmp / f"n{self.n}", 1 << 30, chunk_size=CS)
        config = BlobConfig(**{"stall_timeout": 0.5, "request_timeout": 5.0, **cfg})  # type: ignore[arg-type]
        svc = cls(host, store, self.routing.for_peer(info), ident, config)
        svc.register()
        return svc


def info(svc: BlobService) -> PeerInfo:
    return PeerInfo(svc.host.get_id(), svc.host.get_addrs())


@asynccontextmanager
async def network(tmp: Path) -> AsyncIterator[Net]:
    _release.clear()
    try:
        async with AsyncExitStack() as stack:
            yield Net(stack, tmp)
    finally:
        _release.set()


def tmp_is_empty(svc: BlobService) -> bool:
    return list((svc.store.root / "tmp").iterdir()) == []


async def test_publish_then_fetch_whole_and_range(tmp_path: Path) -> None:
    data = os.urandom(10 * CS + 123)
    async with network(tmp_path) as net:
        a, b = await net.node(), await net.node()
        cid = await a.publish(data)
        assert cid == cid_of(data, CS)
        path = await b.fetch(cid)  # providers found through routing
        assert isinstance(path, Path) and path.read_bytes() == data
        assert b.store.has(cid)
        assert set(net.routing.table[cid]) == {a.peer_id, b.peer_id}  # b now provides it too
        c = await net.node()
        part = await c.fetch(cid, byte_range=(CS - 5, 3 * CS + 7))
        assert part == data[CS - 5 : 3 * CS + 7]
        assert not c.store.has(cid)  # a range is not stored


async def test_fetch_from_three_providers_in_parallel(tmp_path: Path) -> None:
    data = os.urandom(24 * CS)
    async with network(tmp_path) as net:
        provs = [await net.node() for _ in range(3)]
        for p in provs:
            cid = await p.publish(data)
        f = await net.node()
        path = await f.fetch(cid)
        assert path.read_bytes() == data
        report = f.last_fetch
        assert report is not None and len(report.chunks_from) == 3
        assert sum(report.chunks_from.values()) == 24


async def test_unknown_cid_is_blob_not_found(tmp_path: Path) -> None:
    async with network(tmp_path) as net:
        a, b = await net.node(), await net.node()
        with pytest.raises(BlobNotFound):
            await b.fetch(cid_of(b"never published"), providers=[info(a)])
        with pytest.raises(MalformedMessage):
            await b.fetch("not-a-cid", providers=[info(a)])


async def test_bad_chunk_is_refetched_from_another_provider(tmp_path: Path) -> None:
    data = os.urandom(8 * CS)
    async with network(tmp_path) as net:
        bad, good = await net.node(CorruptChunk), await net.node()
        cid = await bad.publish(data)
        await good.publish(data)
        f = await net.node()
        path = await f.fetch(cid, providers=[info(bad), info(good)])
        assert path.read_bytes() == data
        report = f.last_fetch
        assert report is not None
        assert "HashMismatch" in report.failures[bad.peer_id]
        assert report.chunks_from == {good.peer_id: 8}


async def test_only_a_lying_provider_means_hash_mismatch_and_nothing_stored(tmp_path: Path) -> None:
    data = os.urandom(4 * CS)
    async with network(tmp_path) as net:
        bad = await net.node(CorruptChunk)
        cid = await bad.publish(data)
        f = await net.node()
        with pytest.raises(HashMismatch):
            await f.fetch(cid, providers=[info(bad)])
        assert not f.store.has(cid) and tmp_is_empty(f)


@pytest.mark.parametrize("fault", [StallMidChunk, DropMidChunk])
async def test_provider_that_stalls_or_drops_mid_chunk_is_replaced(
    tmp_path: Path, fault: type[BlobService]
) -> None:
    data = os.urandom(8 * CS)
    async with network(tmp_path) as net:
        flaky, good = await net.node(fault), await net.node()
        cid = await flaky.publish(data)
        await good.publish(data)
        f = await net.node()
        with trio.fail_after(20):
            path = await f.fetch(cid, providers=[info(flaky), info(good)])
        assert path.read_bytes() == data
        expected = "PeerTimeout" if fault is StallMidChunk else "PeerGone"
        report = f.last_fetch
        assert report is not None and expected in report.failures[flaky.peer_id]
        g = await net.node()  # the same into memory
        with trio.fail_after(20):
            got = await g.fetch_into(cid, providers=[info(flaky), info(good)])
        assert bytes(got) == data
        report = g.last_fetch
        assert report is not None and expected in report.failures[flaky.peer_id]


async def test_declared_size_above_limit_is_oversized(tmp_path: Path) -> None:
    data = os.urandom(4 * CS)
    async with network(tmp_path) as net:
        a = await net.node()
        cid = await a.publish(data)
        small = await net.node(max_blob_size=CS)
        with pytest.raises(OversizedMessage):
            await small.fetch(cid, providers=[info(a)])
        assert tmp_is_empty(small)


async def test_malformed_request_gets_bad_request_and_server_keeps_serving(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    data = os.urandom(2 * CS)
    async with network(tmp_path) as net:
        a, b = await net.node(), await net.node()
        cid = await a.publish(data)
        await b.host.connect(info(a))
        for junk in (b"\x00\x00\x00\x05hello", struct.pack(">I", 3) + b"\x93\x01\xa3"):
            stream = await b.host.new_stream(a.host.get_id(), [P.PROTOCOL_ID])
            await stream.write(junk)
            reply = await P.read_frame(stream, P.BlobReply, timeout=5)
            assert reply.status == P.BAD_REQUEST
            await stream.close()
        # an oversized frame header is refused without reading the body
        stream = await b.host.new_stream(a.host.get_id(), [P.PROTOCOL_ID])
        await stream.write(struct.pack(">I", 1 << 30))
        assert (await P.read_frame(stream, P.BlobReply, timeout=5)).status == P.BAD_REQUEST
        await stream.close()
        assert (await b.fetch(cid, providers=[info(a)])).read_bytes() == data
    # judged by the node's one rule (pcp_p2p.core.faults.Boundary): the peer's fault, counted by kind,
    # logged once per (peer, kind), the repeats at debug; nothing counted as a bug of ours
    rejected = dict(a.boundary.rejected)
    assert sum(rejected.values()) == 3 and all(k.startswith("blob:") for k in rejected), rejected
    loud = [r for r in caplog.records if "blob rejected" in r.getMessage() and r.levelno >= logging.INFO]
    assert len(loud) == len(rejected) < 3
    assert a.boundary.faults.total == 0


async def test_peer_streaming_endless_garbage_on_the_control_stream(tmp_path: Path) -> None:
    async with network(tmp_path) as net:
        f = await net.node()
        ident = Identity.generate()
        evil = libp2p.new_host(key_pair=ident.key_pair)
        await net.stack.enter_async_context(evil.run(listen_addrs=LOCAL))
        rng = random.Random(0)

        async def spew(stream):  # type: ignore[no-untyped-def]
            try:
                await stream.read(4096)
                while True:
                    await stream.write(rng.randbytes(65536))
            except Exception:
                pass

        evil.set_stream_handler(P.PROTOCOL_ID, spew)
        with trio.fail_after(10):
            with pytest.raises(ProtocolError):
                await f.fetch(cid_of(b"anything"), providers=[PeerInfo(evil.get_id(), evil.get_addrs())])


async def test_peer_streaming_endless_garbage_on_the_side_channel(tmp_path: Path) -> None:
    """A provider whose manifest is honest but whose side socket spews random bytes."""
    data = os.urandom(4 * CS)
    async with network(tmp_path) as net:
        honest = await net.node()
        cid = await honest.publish(data)
        manifest_bytes = honest.store.manifest_bytes(cid)
        lsock = socket.create_server(("127.0.0.1", 0))
        stop = threading.Event()

        def spew_side() -> None:
            lsock.settimeout(10)
            try:
                conn, _ = lsock.accept()
                junk = os.urandom(1 << 16)
                while not stop.is_set():
                    conn.sendall(junk)
            except OSError:
                pass

        t = threading.Thread(target=spew_side, daemon=True)
        t.start()
        evil = libp2p.new_host(key_pair=Identity.generate().key_pair)
        await net.stack.enter_async_context(evil.run(listen_addrs=LOCAL))

        async def handler(stream):  # type: ignore[no-untyped-def]
            req = await P.read_frame(stream, P.BlobRequest, timeout=5)
            if req.kind == "manifest":
                await P.write_frame(stream, P.BlobReply(P.OK, manifest=manifest_bytes), timeout=5)
            else:
                await P.write_frame(stream, P.BlobReply(
                    P.OK, port=lsock.getsockname()[1], secret=b"k" * 32, nonce=b"n" * 16), timeout=5)
            await stream.close()

        evil.set_stream_handler(P.PROTOCOL_ID, handler)
        f = await net.node()
        try:
            with trio.fail_after(10):
                with pytest.raises(ProtocolError):  # garbage header: oversized or malformed
                    await f.fetch(cid, providers=[PeerInfo(evil.get_id(), evil.get_addrs())])
            assert not f.store.has(cid) and tmp_is_empty(f)
        finally:
            stop.set()
            lsock.close()


async def test_providers_through_the_kademlia_dht(tmp_path: Path) -> None:
    data = os.urandom(3 * CS)
    async with network(tmp_path) as net:
        nodes = [await net.node() for _ in range(3)]
        dhts = []
        for n in nodes:
            dht = KadDHT(n.host, DHTMode.SERVER)
            await net.stack.enter_async_context(_background(dht))
            dhts.append(dht)
        for i, n in enumerate(nodes):
            for j, m in enumerate(nodes):
                if i != j:
                    await n.host.connect(info(m))
                    await dhts[i].add_peer(m.host.get_id())
        for n, dht in zip(nodes, dhts):
            n.routing = DhtRouting(dht)
        cid = await nodes[0].publish(data)
        with trio.fail_after(20):
            found = await nodes[2].routing.find_providers(cid)
            assert nodes[0].host.get_id() in {p.peer_id for p in found}
            path = await nodes[2].fetch(cid)
        assert path.read_bytes() == data


@asynccontextmanager
async def _background(dht: KadDHT) -> AsyncIterator[None]:
    """Run a KadDHT's service loop for the duration of a block."""
    from libp2p.tools.anyio_service import background_trio_service

    async with background_trio_service(dht):
        yield


async def test_upload_slots_queue_instead_of_refusing(tmp_path: Path) -> None:
    data = os.urandom(6 * CS)
    async with network(tmp_path) as net:
        a = await net.node(max_uploads=1)
        cid = await a.publish(data)
        fetchers = [await net.node() for _ in range(3)]
        results: list[bytes] = []

        async def get(f: BlobService) -> None:
            results.append((await f.fetch(cid, providers=[info(a)])).read_bytes())

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                for f in fetchers:
                    nursery.start_soon(get, f)
        assert results == [data] * 3


class ForgedStore(BlobStore):
    """Claims to hold ``target`` but serves another blob under a manifest naming it."""

    def __init__(self, root: Path, target: str, other: str) -> None:
        super().__init__(root, 1 << 30, chunk_size=CS)
        self.target, self.other = target, other

    def has(self, cid: str) -> bool:
        return cid == self.target or super().has(cid)

    def _forged(self) -> bytes:
        # The other blob's chunk list under the target's CID: it cannot be
        # built as a ChunkManifest (which checks the binding), so pack it raw.
        m = super().manifest(self.other)
        body = {"cid": self.target, "size": m.size, "chunk_size": m.chunk_size, "digests": list(m.digests)}
        return msgpack.packb([1, "blob.manifest", body], use_bin_type=True)

    def manifest_bytes(self, cid: str) -> bytes:
        return self._forged() if cid == self.target else super().manifest_bytes(cid)

    def manifest(self, cid: str) -> ChunkManifest:  # what it would serve the other blob's chunks by
        return super().manifest(self.other if cid == self.target else cid)

    def path(self, cid: str) -> Path:
        return super().path(self.other if cid == self.target else cid)


async def test_a_forged_manifest_is_refused_before_any_data_moves(tmp_path: Path) -> None:
    data, other = os.urandom(5 * CS), os.urandom(5 * CS)
    async with network(tmp_path) as net:
        liar, good = await net.node(), await net.node()
        cid = await good.publish(data)
        forged = ForgedStore(tmp_path / "forged", cid, cid_of(other, CS))
        forged.put_bytes(other)
        liar.store = forged
        f = await net.node()
        path = await f.fetch(cid, providers=[info(liar), info(good)])
        assert path.read_bytes() == data
        report = f.last_fetch
        assert report is not None and report.manifest_source == good.peer_id
        assert "does not hash to" in report.failures[liar.peer_id]
        assert report.chunks_from == {good.peer_id: 5}  # the liar was never asked for data
        assert tmp_is_empty(f)
        f2 = await net.node()
        with pytest.raises(MalformedMessage):  # nobody else to ask: nothing is stored
            await f2.fetch(cid, providers=[info(liar)])  # (manifest and side channel in one reply)
        assert not f2.store.has(cid) and tmp_is_empty(f2)
        assert f2.last_fetch is not None and f2.last_fetch.chunks_from == {}


async def test_unreachable_side_port_falls_back_to_the_libp2p_stream(tmp_path: Path) -> None:
    data = os.urandom(9 * CS + 1)
    async with network(tmp_path) as net:
        # The side listener binds 127.0.0.2 while the fetcher dials the libp2p
        # connection's address, 127.0.0.1: the side port is out of reach (as behind NAT).
        natted = await net.node(side_host="127.0.0.2")
        cid = await natted.publish(data)
        f = await net.node()
        with trio.fail_after(30):
            path = await f.fetch(cid, providers=[info(natted)])
            assert path.read_bytes() == data
            assert natted.peer_id in f._side_unreachable
            part = await f.fetch(cid, providers=[info(natted)], byte_range=(1, 2))
        assert part == data[1:2]
        g = await net.node()
        g._side_unreachable.add(natted.peer_id)
        with trio.fail_after(30):
            assert (await g.fetch(cid, providers=[info(natted)], byte_range=(CS, 3 * CS))) == data[CS : 3 * CS]


@pytest.mark.parametrize("verdict_known", [False, True])
async def test_a_side_port_behind_a_nat_costs_at_most_the_handshake_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verdict_known: bool,
) -> None:
    """Behind a NAT the side port drops the SYN (the fetcher sees the router's address). A peer whose
    verdict says so (``side_reachable``, set by the node from member records) is fetched over the
    libp2p stream without trying; one not known to be behind a NAT costs one connect bounded by the
    handshake's deadline (when the server closes its listener anyway), not the 15 s stall timeout.
    Either cost a home's checkpoint the commit's replication wait in the network lab."""
    data = os.urandom(3 * CS + 1)
    waited: list[float | None] = []

    def dropped_syn(address: tuple[str, int], timeout: float | None = None, *args: object) -> socket.socket:
        waited.append(timeout)  # (libp2p's own connections are trio sockets: only side channels come here)
        raise TimeoutError("timed out")  # what a dropped SYN looks like, after ``timeout``

    async with network(tmp_path) as net:
        natted = await net.node(handshake_timeout=1.5)
        cid = await natted.publish(data)
        f = await net.node(handshake_timeout=1.5)
        if verdict_known:
            f.side_reachable = lambda peer_id: peer_id != natted.peer_id
        monkeypatch.setattr(socket, "create_connection", dropped_syn)
        with trio.fail_after(30):
            assert (await f.fetch(cid, providers=[info(natted)])).read_bytes() == data
        assert waited == ([] if verdict_known else [1.5])
        assert (natted.peer_id in f._side_unreachable) is not verdict_known


def test_only_a_public_peer_or_one_of_unknown_reachability_is_offered_a_side_channel() -> None:
    from types import SimpleNamespace

    from pcp_p2p.net.reachability import VERDICTS
    from pcp_p2p.node.node import Node

    records = {v: SimpleNamespace(record=SimpleNamespace(reachability=v)) for v in (*VERDICTS, "bogus")}
    node = SimpleNamespace(membership=SimpleNamespace(get=records.get))
    ok = {v for v in records if Node.side_reachable(node, v)}  # type: ignore[arg-type]
    assert ok == {"public", "unknown", "bogus"} and Node.side_reachable(node, "a stranger")  # type: ignore[arg-type]


class SwappedFile(BlobStore):
    """An honest manifest for ``target`` but the bytes of ``other`` on disk (bit rot, a liar)."""

    target = other = ""

    def path(self, cid: str) -> Path:
        return super().path(self.other if cid == self.target else cid)


async def test_stream_path_checks_every_chunk_too(tmp_path: Path) -> None:
    data, other = os.urandom(3 * CS), os.urandom(3 * CS)
    async with network(tmp_path) as net:
        liar, good = await net.node(), await net.node()
        store = SwappedFile(tmp_path / "swapped", 1 << 30, chunk_size=CS)
        store.target, store.other = store.put_bytes(data), store.put_bytes(other)
        liar.store = store
        cid = await good.publish(data)
        f = await net.node()
        f._side_unreachable.add(liar.peer_id)
        with trio.fail_after(30):
            path = await f.fetch(cid, providers=[info(liar), info(good)])
        assert path.read_bytes() == data
        assert f.last_fetch is not None and "HashMismatch" in f.last_fetch.failures[liar.peer_id]
        g = await net.node()
        g._side_unreachable.add(liar.peer_id)
        with trio.fail_after(30):
            with pytest.raises(HashMismatch):
                await g.fetch(cid, providers=[info(liar)])
        assert not g.store.has(cid) and tmp_is_empty(g)


async def test_publish_keeps_the_blob_when_announcing_fails(tmp_path: Path) -> None:
    class Down:
        async def provide(self, cid: str) -> None:
            raise PeerError("no DHT peers")

        async def find_providers(self, cid: str) -> list[PeerInfo]:
            return []

    async with network(tmp_path) as net:
        a = await net.node()
        a.routing = Down()
        with pytest.raises(PeerError) as err:
            await a.publish(b"payload")
        assert err.value.cid == cid_of(b"payload")  # type: ignore[attr-defined]
        assert a.store.has(cid_of(b"payload"))
        with pytest.raises(BlobNotFound):
            await a.announce(cid_of(b"other"))
        with pytest.raises(NoProviders):
            await a.fetch(cid_of(b"other"))


@pytest.mark.parametrize("size", [0, 1, CS, CS + 1])
async def test_edge_sizes_round_trip(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    async with network(tmp_path) as net:
        a, b = await net.node(), await net.node()
        cid = await a.publish(data)
        assert (await b.fetch(cid, providers=[info(a)])).read_bytes() == data
        c = await net.node()
        c._side_unreachable.add(a.peer_id)
        assert (await c.fetch(cid, providers=[info(a)])).read_bytes() == data
        d = await net.node()
        assert bytes(await d.fetch_into(cid, bytearray(size + 3), providers=[info(a)])) == data


async def test_fetch_into_memory_checks_every_chunk_and_stores_nothing(tmp_path: Path) -> None:
    data = os.urandom(8 * CS + 11)
    async with network(tmp_path) as net:
        bad, good = await net.node(CorruptChunk), await net.node()
        cid = await bad.publish(data)
        await good.publish(data)
        f = await net.node()
        out = bytearray(9 * CS)  # reused across fetches, larger than the blob
        got = await f.fetch_into(cid, out, providers=[info(bad), info(good)])
        assert bytes(got) == data and got.obj is out  # in place, no copy
        report = f.last_fetch
        assert report is not None and "HashMismatch" in report.failures[bad.peer_id]
        assert report.chunks_from == {good.peer_id: 9}
        assert not f.store.has(cid) and tmp_is_empty(f)
        assert cid not in net.routing.table or f.peer_id not in net.routing.table[cid]  # not announced
        # only the liar: a typed error, never a "verified" buffer
        g = await net.node()
        with pytest.raises(HashMismatch):
            await g.fetch_into(cid, out, providers=[info(bad)])
        # the stream path lands in the same buffer, copied into place
        h = await net.node()
        h._side_unreachable.add(good.peer_id)
        out[:] = bytes(len(out))
        assert bytes(await h.fetch_into(cid, out, providers=[info(good)])) == data
        # a blob the store holds is read from it
        assert bytes(await good.fetch_into(cid)) == data


async def test_fetch_into_refuses_a_small_buffer_and_an_oversized_blob(tmp_path: Path) -> None:
    data = os.urandom(3 * CS)
    async with network(tmp_path) as net:
        a = await net.node()
        cid = await a.publish(data)
        f = await net.node(max_in_memory=2 * CS)
        with pytest.raises(LocalError):
            await f.fetch_into(cid, bytearray(3 * CS - 1), providers=[info(a)])
        with pytest.raises(LocalError):
            await f.fetch_into(cid, b"\0" * (3 * CS), providers=[info(a)])  # read-only
        with pytest.raises(OversizedMessage):
            await f.fetch_into(cid, providers=[info(a)])  # would allocate above the limit
        assert bytes(await f.fetch_into(cid, bytearray(3 * CS), providers=[info(a)])) == data


async def test_a_small_blob_comes_inline_with_its_manifest_and_is_checked(tmp_path: Path) -> None:
    small, large = os.urandom(1000), os.urandom(P.INLINE_MAX + 1)
    async with network(tmp_path) as net:
        a = await net.node()
        cids = [await a.publish(small), await a.publish(large)]
        f = await net.node()
        assert (await f.fetch(cids[0], providers=[info(a)])).read_bytes() == small
        assert f.last_fetch is not None and f.last_fetch.requests == 1  # one exchange
        assert bytes(await f.fetch_into(cids[1], providers=[info(a)])) == large
        assert f.last_fetch is not None and f.last_fetch.requests == 1  # manifest + side channel at once
        # a provider whose inline bytes lie is blamed; the blob comes from another
        liar = await net.node(CorruptInline)
        await liar.publish(small)
        g = await net.node()
        got = await g.fetch_into(cids[0], providers=[info(liar), info(a)])
        assert bytes(got) == small
        report = g.last_fetch
        assert report is not None and report.manifest_source == liar.peer_id
        assert "HashMismatch" in report.failures[liar.peer_id] and report.chunks_from == {a.peer_id: 1}
        h = await net.node()
        with pytest.raises(HashMismatch):
            await h.fetch(cids[0], providers=[info(liar)])
        assert not h.store.has(cids[0]) and tmp_is_empty(h)
    with pytest.raises(ValueError):  # a reply may not carry a larger blob inline
        P.BlobReply(P.OK, data=b"x" * (P.INLINE_MAX + 1))


async def test_a_cancelled_fetch_stops_its_receive_thread_before_returning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pcp_p2p.blob import service

    running: list[bool] = []
    real = service.receive_batch

    def receive_batch(*args, **kwargs):  # type: ignore[no-untyped-def]
        running.append(True)
        try:
            return real(*args, **kwargs)
        finally:
            running.pop()

    monkeypatch.setattr(service, "receive_batch", receive_batch)
    data = os.urandom(8 * CS)
    async with network(tmp_path) as net:
        staller = await net.node(StallMidChunk)
        cid = await staller.publish(data)
        f = await net.node(stall_timeout=30.0)  # left alone, its receiver would wait 30 s
        out = bytearray(len(data))
        with trio.move_on_after(0.5) as scope:
            await f.fetch_into(cid, out, providers=[info(staller)])
        assert scope.cancelled_caught
        # nothing can write into `out` (or through a reused descriptor) any more
        assert not running
        assert not [t for t in threading.enumerate() if t.name.startswith("blob-verify")]


async def test_one_provider_sends_the_manifest_and_a_side_channel_at_once(tmp_path: Path) -> None:
    from pcp_p2p.blob.transfer import MAX_BATCH

    data = os.urandom((MAX_BATCH + 3) * CS)  # more than one batch: the rest by data requests
    async with network(tmp_path) as net:
        a = await net.node()
        cid = await a.publish(data)
        f = await net.node()
        assert (await f.fetch(cid, providers=[info(a)])).read_bytes() == data
        assert f.last_fetch is not None and f.last_fetch.requests == 2  # fetch (+ 64 chunks), data (+ 3)
        g = await net.node()
        b = await net.node()
        await b.publish(data)
        assert bytes(await g.fetch_into(cid, providers=[info(a), info(b)])) == data
        report = g.last_fetch
        assert report is not None and report.requests >= 3 and len(report.chunks_from) == 2  # manifest, then data
    nonce = b"n" * P.NONCE_LEN
    for bad in ({"first": 1, "count": 2}, {"count": 0}, {"count": 2, "manifest_cid": cid},
                {"count": 2, "via": "stream"}):
        with pytest.raises(ValueError):
            P.BlobRequest("fetch", cid, nonce, **bad)  # type: ignore[arg-type]


async def test_a_peer_that_asks_for_data_and_never_connects_holds_its_share_of_slots_only(
    tmp_path: Path,
) -> None:
    data = os.urandom(4 * CS)
    async with network(tmp_path) as net:
        a = await net.node(max_uploads=3, max_uploads_per_peer=2, request_timeout=4.0)
        cid = await a.publish(data)
        mcid = cid_of(a.store.manifest_bytes(cid))
        hog, f = await net.node(), await net.node()

        async def ask() -> str:  # a data request whose side channel is never opened
            try:
                await hog._request(info(a), P.BlobRequest("data", cid, os.urandom(P.NONCE_LEN), mcid, 0, 1))
                return "ok"
            except PeerError as exc:
                return "busy" if "busy" in str(exc) else f"error: {exc}"

        with trio.fail_after(15):
            assert [await ask(), await ask()] == ["ok", "ok"]  # two slots held, unused
            assert a._uploads.held_by(hog.peer_id) == 2
            third: list[str] = []
            async with trio.open_nursery() as nursery:

                async def ask_again() -> None:
                    third.append(await ask())

                nursery.start_soon(ask_again)
                # no event to wait on: the request is in another host's handler
                while not a._uploads._by_peer[hog.peer_id].statistics().tasks_waiting:  # noqa: ASYNC110
                    await trio.sleep(0.01)
                # the hog's third request waits on its own share, so an honest peer still gets a slot
                assert bytes(await f.fetch_into(cid, providers=[info(a)])) == data
            assert third == ["busy"]


async def test_a_fetch_hands_out_nothing_its_sink_did_not_verify(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pcp_p2p.blob.receiver import MemorySink

    data = os.urandom(3 * CS)
    async with network(tmp_path) as net:
        a = await net.node()
        cid = await a.publish(data)
        f = await net.node()
        real_put = MemorySink.put

        def forgetful_put(self, index, view, *, in_place=False):  # type: ignore[no-untyped-def]
            real_put(self, index, view, in_place=in_place)
            if index == 1:
                self.verified.discard(index)  # the plan hears "ok", the sink never kept it

        monkeypatch.setattr(MemorySink, "put", forgetful_put)
        with pytest.raises(HashMismatch):
            await f.fetch_into(cid, providers=[info(a)])

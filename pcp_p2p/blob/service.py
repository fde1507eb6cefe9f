"""The blob service: serve what the store holds, fetch what it does not.

``BlobService(host, store, routing, identity)`` plugs into any py-libp2p host:
:meth:`register` installs the ``/pcp/blob/1.0.0`` handler; :meth:`publish`
stores and announces; :meth:`fetch` finds providers, takes the manifest from
one, pulls chunks from several in parallel over authenticated side channels
(:mod:`pcp_p2p.blob.sidechannel`), verifies each chunk on arrival against the
manifest (which hashes to the CID), re-fetches bad or missing ones from the
others (:class:`~pcp_p2p.blob.transfer.FetchPlan`), and commits it to the store
only when every chunk was verified. :meth:`fetch_into` does the same into a
buffer in memory, for content that is used once and need not be stored.

Threads: the byte moving (socket I/O, AES-GCM, BLAKE3, file I/O) runs in trio
worker threads, all of which release the GIL, so the trio loop that also runs
libp2p stays responsive and receiving, decrypting and hashing overlap. The side
socket's timeout is the stall detector (no byte for ``stall_timeout`` seconds),
and ``config.pace`` the overall deadline: the chunks of a batch must arrive at
``min_rate`` on average after that grace, or the provider is given up.
"""

from __future__ import annotations

import functools
import logging
import secrets
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.peerinfo import PeerInfo

from pcp_p2p.blob import protocol as P
from pcp_p2p.blob.chunks import ChunkManifest, manifest_bytes, parse_manifest
from pcp_p2p.blob.receiver import (
    ChunkPool,
    ChunkSink,
    FileSink,
    MemorySink,
    accept_chunk,
    receive_batch,
)
from pcp_p2p.blob.routing import ContentRouting
from pcp_p2p.blob.server import BlobConfig, BlobServer, PartialBlob, SwarmCounts, UploadSlots, close_stream
from pcp_p2p.blob.sidechannel import (
    KIND_HELLO,
    RecordCipher,
    RecordReader,
    derive_key,
    hello_plaintext,
    send_record,
    transcript,
    tune,
)
from pcp_p2p.blob.store import BlobStore
from pcp_p2p.blob.swarm import FallbackPlan
from pcp_p2p.blob.transfer import MAX_BATCH, FetchPlan
from pcp_p2p.core.cid import cid_of, parse_cid
from pcp_p2p.core.errors import (
    BlobNotFound,
    HashMismatch,
    LocalError,
    MalformedMessage,
    NoProviders,
    OversizedMessage,
    PcpError,
    PeerError,
    PeerGone,
    PeerTimeout,
    ProtocolError,
)
from pcp_p2p.core.faults import Boundary
from pcp_p2p.core.identity import Identity
from pcp_p2p.core.logs import LogOnce
from pcp_p2p.net.connectivity import stream_is_relayed
from pcp_p2p.net.traffic import Traffic
from pcp_p2p.wire import framing

log = logging.getLogger(__name__)

_POOLS_KEPT = 2  # idle receive buffer pools a service keeps (16 MiB each at 4 MiB chunks)
_STOP_WAIT_S = 10.0  # a cancelled fetch waits this long at most for its receive thread


@dataclass
class FetchReport:
    """What the last fetch did (for logs, tests and benchmarks)."""

    cid: str
    manifest_source: str = ""
    chunks_from: dict[str, int] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    bad_manifest: set[str] = field(default_factory=set)
    requests: int = 0


@dataclass
class _SideOffer:
    """A side channel a ``fetch`` reply opened for the first chunks, with the manifest."""

    provider: str
    ip: str
    reply: P.BlobReply
    client_nonce: bytes
    count: int


@dataclass
class _Prepared:
    """A fetch once its manifest is in: what :meth:`BlobService._pull` works from."""

    manifest: ChunkManifest
    mcid: str  # the manifest's own CID (binds the side channel's key)
    providers: list[PeerInfo]  # the manifest's sender first
    report: FetchReport
    inline: bytes | None  # the blob itself, when it came with the manifest
    offer: _SideOffer | None = None  # a side channel that came with the manifest
    ordered: bool = False  # providers are fallbacks in order (a swarm fetch), not shared out

    def take_offer(self, provider: str, batch: list[int]) -> _SideOffer | None:
        """The offer, once, if it is for exactly this provider's ``batch``."""
        offer = self.offer
        if offer is None or offer.provider != provider or batch != list(range(offer.count)):
            return None
        self.offer = None
        return offer


class _Changed:
    """A re-armable "something changed" signal for workers waiting on the plan."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self) -> None:
        await self._event.wait()


@dataclass
class _Pull:
    """One pull of chunks into a sink, shared by its workers (one per provider)."""

    prep: _Prepared
    sink: ChunkSink
    plan: FetchPlan
    changed: _Changed = field(default_factory=_Changed)
    errors: list[PcpError] = field(default_factory=list)


class BlobService(BlobServer):
    """Serves the store (:class:`BlobServer`) and fetches into it."""

    def __init__(
        self,
        host: IHost,
        store: BlobStore,
        routing: ContentRouting,
        identity: Identity,
        config: BlobConfig | None = None,
        traffic: Traffic | None = None,
        boundary: Boundary | None = None,
    ) -> None:
        """``boundary``: the node's error boundary (what serving peers meets is judged there)."""
        self.host = host
        self.boundary = boundary if boundary is not None else Boundary(LogOnce(log))
        self.traffic = traffic  # side-channel bytes are counted here (libp2p's by the node)
        self.store = store
        self.routing = routing
        self.identity = identity
        self.config = config or BlobConfig()
        self.peer_id = identity.peer_id
        self._uploads = UploadSlots(self.config.max_uploads, self.config.max_uploads_per_peer)
        self.last_fetch: FetchReport | None = None
        # Peers whose side port we could not reach: fetched over the stream path.
        self._side_unreachable: set[str] = set()
        # Whether a peer's side port can be reached at all, before trying (the node sets it from
        # the peer's reachability verdict): behind a NAT it never can, and finding out cost a
        # connect timeout per peer, enough to miss a commit's replication wait.
        self.side_reachable: Callable[[str], bool] = lambda peer_id: True
        self._pools: list[ChunkPool] = []  # idle receive buffers, at most _POOLS_KEPT
        self._partials = {}  # blobs being fetched into the store: served chunk by chunk meanwhile
        self._partial_added = trio.Event()
        self.swarm = SwarmCounts()

    # --- public API ------------------------------------------------------------

    async def publish(self, data_or_path: bytes | Path, *, pin: bool = True) -> str:
        """Store a blob, announce it, return its CID.

        If the announcement fails the blob stays stored and a :class:`PeerError`
        carrying ``.cid`` is raised; :meth:`announce` can retry it later.
        """
        if isinstance(data_or_path, (bytes, bytearray, memoryview)):
            cid = await trio.to_thread.run_sync(lambda: self.store.put_bytes(bytes(data_or_path), pin=pin))
        else:
            cid = await trio.to_thread.run_sync(lambda: self.store.put_file(Path(data_or_path), pin=pin))
        await self.announce(cid)
        return cid

    async def announce(self, cid: str) -> None:
        """(Re-)announce a held blob. Provider records expire (24 h in py-libp2p's
        DHT), so a long-running node calls this periodically for what it serves."""
        self.store.size(cid)  # BlobNotFound if we do not hold it
        try:
            await self.routing.provide(cid)
        except PeerError as exc:
            err = PeerError(f"{cid} is stored but could not be announced: {exc}")
            err.cid = cid  # type: ignore[attr-defined]  # which blob, for a caller that retries the announce
            raise err from exc

    async def fetch(
        self,
        cid: str,
        *,
        providers: list[PeerInfo] | None = None,
        byte_range: tuple[int, int] | None = None,
        manifest_cid: str | None = None,
        pin: bool = False,
        announce: bool = True,
        max_size: int | None = None,
        ordered: bool = False,
    ) -> Path | bytes:
        """The blob's path in the store, or the bytes of ``byte_range = (start, end)``.

        A fetched whole blob is announced (this node now provides it) unless
        ``announce=False``; an announcement failure is logged, not raised.

        The manifest is checked against ``cid`` before any data moves and
        every chunk against the manifest as it arrives; a whole blob is
        committed to the store once all chunks passed, a range is returned
        and not stored. ``manifest_cid`` (when a signed record names it) pins
        the exact manifest bytes as well. ``max_size``: a manifest declaring
        more bytes is refused (:class:`OversizedMessage`) before any chunk
        moves — the caller knows how large such a blob can honestly be.

        ``ordered`` (a swarm fetch, :mod:`pcp_p2p.blob.swarm`): ``providers``
        are tried in order, each asked to wait up to ``config.swarm_wait``
        for a fetch of its own to start; the manifest comes from the first
        that answers and every chunk from the first still standing, the
        later ones only taking over from one that fails. While a whole blob
        is fetched, its verified chunks are served to others (a partial
        holding), so a relay tree forwards a blob as it arrives.
        """
        parse_cid(cid)  # MalformedMessage for a non-CID
        if self.store.has(cid):
            if byte_range is not None:
                start, end = byte_range
                return await trio.to_thread.run_sync(self.store.read, cid, start, end - start)
            if pin:
                self.store.pin(cid)
            return self.store.path(cid)
        prep = await self._prepare(cid, providers, manifest_cid, whole=byte_range is None, max_size=max_size,
                                   ordered=ordered)
        if byte_range is not None:
            return await self._fetch_range(prep, byte_range)
        partial: PartialBlob | None = None
        failed = True
        try:
            pending = await trio.to_thread.run_sync(self.store.begin, cid, prep.manifest)
            with pending, FileSink.open(pending, direct=self.config.direct_io) as sink:
                if cid not in self._partials:  # (a second fetch of the same blob serves nothing more)
                    partial = PartialBlob(prep.manifest, manifest_bytes(prep.manifest), pending.path)
                    sink.on_put = partial.chunk_ok
                    self._partials[cid] = partial
                    self._partial_added.set()
                    self._partial_added = trio.Event()
                await self._pull(prep, range(prep.manifest.count), sink)
                path = await trio.to_thread.run_sync(pending.commit)
                failed = False
            if ordered and providers and len(providers) > 1:  # (a tree's root names no ancestor)
                self.swarm.fetches += 1
                origin = providers[-1].peer_id.to_base58()  # (the caller puts the origin last)
                if origin in prep.report.chunks_from or origin == prep.report.manifest_source:
                    self.swarm.from_origin += 1
        finally:
            if partial is not None:
                partial.end(failed=failed)
                if self._partials.get(cid) is partial:
                    del self._partials[cid]
            await self._decline(prep)
        if pin:
            self.store.pin(cid)
        if announce:
            try:
                await self.announce(cid)
            except PcpError as exc:
                log.warning("blob: fetched %s but could not announce it: %s", cid, exc)
        return path

    async def fetch_into(
        self,
        cid: str,
        out: bytearray | memoryview | None = None,
        *,
        providers: list[PeerInfo] | None = None,
        manifest_cid: str | None = None,
        max_size: int | None = None,
    ) -> memoryview:
        """The whole blob, verified, in memory and not stored: ``out[:size]``.

        For content a node uses once and need not keep (the pseudo-gradients a
        shepherd averages): a fetch into the store writes every byte to disk,
        fsyncs it and reads it back, which on the machines we measured cost
        more than receiving it. Chunks are decrypted straight into their place
        in ``out`` and hashed there, so a caller that reuses one buffer per
        round touches no fresh memory. ``out`` must hold the blob's size
        (:class:`LocalError` otherwise); without it a buffer is allocated, up
        to ``config.max_in_memory`` bytes (:class:`OversizedMessage` above).
        A blob the store already holds is read from it. Until this returns,
        ``out`` may hold chunks that failed their hash; once it returns every
        byte of ``out[:size]`` was checked against the CID.
        """
        parse_cid(cid)
        if self.store.has(cid):
            size = self.store.size(cid)
            view = self._buffer_for(cid, size, out)
            await trio.to_thread.run_sync(self.store.read_into, cid, view)
            return view
        prep = await self._prepare(cid, providers, manifest_cid, whole=True, max_size=max_size)
        try:
            view = self._buffer_for(cid, prep.manifest.size, out)
            everything = range(prep.manifest.count)
            await self._pull(prep, everything, MemorySink(prep.manifest, everything, view))
        finally:
            await self._decline(prep)
        return view

    async def _decline(self, prep: _Prepared) -> None:
        """Close a side channel offered with the manifest that the fetch did not use
        (it failed first, e.g. a buffer too small or a full store): connecting and
        hanging up ends the server's wait, which otherwise holds one of its upload
        slots, and one of our peer's share of them, until its accept times out."""
        offer, prep.offer = prep.offer, None
        if offer is None:
            return
        with trio.CancelScope(shield=True), trio.move_on_after(self.config.request_timeout):
            try:
                timeout = self.config.handshake_timeout
                _close(await trio.to_thread.run_sync(_connect, offer.ip, offer.reply.port, timeout, timeout))
            except PcpError:
                pass

    def _buffer_for(self, cid: str, size: int, out: bytearray | memoryview | None) -> memoryview:
        if out is None:
            if size > self.config.max_in_memory:
                raise OversizedMessage(f"{cid} has {size} bytes > in-memory limit {self.config.max_in_memory}")
            return memoryview(bytearray(size))
        view = memoryview(out).cast("B")
        if view.readonly or len(view) < size:
            raise LocalError(f"a writable buffer of {size} bytes is needed for {cid}, got {len(view)}")
        return view[:size]

    async def _prepare(
        self, cid: str, providers: list[PeerInfo] | None, manifest_cid: str | None, *, whole: bool,
        max_size: int | None = None, ordered: bool = False,
    ) -> _Prepared:
        """Providers (from the DHT unless given) and the manifest, checked against ``cid``.

        For a ``whole`` blob from a single provider, the manifest and a side
        channel for the first batch come in one ``fetch`` exchange (one round
        trip less: ~4 ms here, a third of a 4 MB fetch).
        """
        if providers is None:
            providers = await self.routing.find_providers(cid)
        me = self.host.get_id()
        providers = [p for p in providers if p.peer_id != me]
        if not providers:
            raise NoProviders(f"nobody provides {cid}")
        report = FetchReport(cid)
        self.last_fetch = report
        # The manifest is bound to the CID (it hashes to it), so whoever sent
        # it, it is the right chunk list; only chunks can still be wrong.
        # In order (a swarm), the first that answers is the one the data comes from: the same
        # one exchange serves there too (a round trip less per hop of the relay tree).
        merged = whole and (len(providers) == 1 or ordered) and self._side_ok(providers[0].peer_id.to_base58())
        manifest, mcid, source, inline, offer = await self._get_manifest(
            cid, providers, manifest_cid, report, merged=merged, max_size=max_size, ordered=ordered)
        report.manifest_source = source
        # A provider that sent a manifest that is not this CID's holds other
        # content or lies: it gets no data requests. The one that gave the
        # manifest goes first: it is known to be alive. In order (a swarm),
        # those before it did not answer: they are passed over.
        if ordered:
            providers = providers[[p.peer_id.to_base58() for p in providers].index(source):]
        providers = [p for p in providers if p.peer_id.to_base58() not in report.bad_manifest]
        providers.sort(key=lambda p: p.peer_id.to_base58() != source)
        return _Prepared(manifest, mcid, providers, report, inline, offer, ordered)

    async def _fetch_range(self, prep: _Prepared, byte_range: tuple[int, int]) -> bytes:
        start, end = byte_range
        wanted = prep.manifest.chunks_covering(start, end)
        if end - start > self.config.max_in_memory:
            raise OversizedMessage(f"range of {end - start} bytes > limit {self.config.max_in_memory}")
        if not wanted:
            return b""
        base, length = prep.manifest.span_of(wanted)
        buf = bytearray(length)
        await self._pull(prep, wanted, MemorySink(prep.manifest, wanted, memoryview(buf)))
        return bytes(memoryview(buf)[start - base : end - base])

    # --- client side ------------------------------------------------------------

    async def _get_manifest(
        self, cid: str, providers: list[PeerInfo], want_mcid: str | None, report: FetchReport,
        *, merged: bool = False, max_size: int | None = None, ordered: bool = False,
    ) -> tuple[ChunkManifest, str, str, bytes | None, _SideOffer | None]:
        """The manifest, its CID, who sent it, the blob if it came inline, and
        (``merged``: a ``fetch`` request) the side channel that came with it."""
        errors: list[PcpError] = []
        for info in providers:
            pid = info.peer_id.to_base58()
            try:
                report.requests += 1
                nonce = secrets.token_bytes(P.NONCE_LEN)
                wait_ms = int(self.config.swarm_wait * 1000) if ordered else 0
                req = (P.BlobRequest("fetch", cid, nonce, count=MAX_BATCH, wait_ms=wait_ms) if merged
                       else P.BlobRequest("manifest", cid, nonce, wait_ms=wait_ms))
                reply, ip = await self._request(info, req)
                manifest = parse_manifest(
                    reply.manifest, expect_cid=cid, expect_manifest_cid=want_mcid,
                    max_size=self.config.max_blob_size if max_size is None
                    else min(max_size, self.config.max_blob_size),
                )
                inline = reply.data if manifest.count == 1 else None
                offer = None
                if merged and inline is None:
                    if reply.port == 0:
                        raise MalformedMessage(f"{pid} answered a fetch request without a side channel")
                    offer = _SideOffer(pid, ip, reply, nonce, min(MAX_BATCH, manifest.count))
                return manifest, cid_of(reply.manifest), pid, inline, offer
            except PcpError as exc:
                report.failures[pid] = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, ProtocolError):
                    report.bad_manifest.add(pid)
                errors.append(exc)
        raise _aggregate(cid, errors)

    async def _request(self, info: PeerInfo, req: P.BlobRequest) -> tuple[P.BlobReply, str]:
        """One control exchange; returns the reply and the server's IP address."""
        stream, reply, ip = await self._open_exchange(info, req)
        await close_stream(stream)
        return reply, ip

    async def _open_exchange(
        self, info: PeerInfo, req: P.BlobRequest
    ) -> tuple[INetStream, P.BlobReply, str]:
        """Send ``req``, read an ``ok`` reply; the stream stays open for the caller."""
        try:
            with trio.fail_after(self.config.request_timeout):
                try:
                    if info.addrs:
                        await self.host.connect(info)
                    stream = await self.host.new_stream(info.peer_id, [P.PROTOCOL_ID])
                    if stream_is_relayed(stream):  # relays carry control traffic only
                        await close_stream(stream)
                        raise PeerGone(f"only a relayed connection to {info.peer_id}: blobs never cross a relay")
                except PcpError:
                    raise
                except Exception as exc:
                    raise PeerGone(f"cannot open a blob stream to {info.peer_id}: {exc}") from exc
                try:
                    await P.write_frame(stream, req, timeout=self.config.request_timeout)
                    reply = await P.read_frame(stream, P.BlobReply, timeout=self.config.request_timeout)
                    remote = stream.get_remote_address()
                except BaseException:
                    await close_stream(stream)
                    raise
        except trio.TooSlowError as exc:
            raise PeerTimeout(f"{info.peer_id} did not answer within {self.config.request_timeout}s") from exc
        try:
            if reply.status == P.NOT_FOUND:
                raise BlobNotFound(f"{info.peer_id} does not hold {req.cid}")
            if reply.status == P.MISMATCH:
                raise HashMismatch(f"{info.peer_id} has another manifest for {req.cid}")
            if reply.status == P.BUSY:
                raise PeerError(f"{info.peer_id} is busy")
            if reply.status == P.INTERNAL:  # a bug of the server's: not its (or our) input's fault
                raise PeerError(f"{info.peer_id} failed serving {req.cid} (an internal error on its side)")
            if reply.status != P.OK:
                raise MalformedMessage(f"{info.peer_id} refused the request: {reply.detail:.200}")
            if remote is None:
                raise PeerGone("stream has no remote address")
        except BaseException:
            await close_stream(stream)
            raise
        return stream, reply, remote[0]

    async def _pull(self, prep: _Prepared, wanted: range, sink: ChunkSink) -> None:
        """Fetch ``wanted`` chunks from the providers into ``sink``."""
        providers, report = prep.providers, prep.report
        if prep.inline is not None:  # a small blob came with its manifest: check it like a chunk
            source = report.manifest_source
            try:
                await trio.to_thread.run_sync(accept_chunk, sink, 0, memoryview(prep.inline))
                report.chunks_from = {source: 1}
                return
            except HashMismatch as exc:
                report.failures[source] = f"{type(exc).__name__}: {exc}"
                providers = [p for p in providers if p.peer_id.to_base58() != source]
                if not providers:
                    raise
        by_id = {p.peer_id.to_base58(): p for p in providers}
        plan = FallbackPlan(wanted, list(by_id)) if prep.ordered else FetchPlan(wanted, list(by_id))
        pull = _Pull(prep, sink, plan)
        async with trio.open_nursery() as nursery:
            for pid, info in by_id.items():
                nursery.start_soon(self._worker, info, pid, pull)
        report.chunks_from = dict(pull.plan.served)
        if not pull.plan.complete:
            raise _aggregate(prep.manifest.cid, pull.errors)
        if not sink.complete:  # the sink's own count, not only the plan's: nothing unchecked leaves
            raise HashMismatch(f"{prep.manifest.cid}: chunks reported done but never verified")

    async def _worker(self, info: PeerInfo, pid: str, pull: _Pull) -> None:
        plan, changed, sink, report = pull.plan, pull.changed, pull.sink, pull.prep.report
        pool: ChunkPool | None = None
        try:
            while True:
                batch = plan.next_batch(pid)
                if batch is None:
                    return
                if not batch:
                    await changed.wait()
                    continue
                try:
                    if pool is None and not sink.receives_in_place:
                        pool = self._take_pool(sink.manifest.chunk_size)
                    await self._fetch_batch(info, pid, pull, batch, pool)
                    plan.provider_finished_batch(pid, batch)
                except PcpError as exc:
                    log.info("blob: provider %s failed: %s", pid, exc)
                    pull.errors.append(exc)
                    report.failures[pid] = f"{type(exc).__name__}: {exc}"
                    plan.provider_failed(pid, str(exc))
                    changed.fire()
                    return
                changed.fire()
        except BaseException:
            pool = None  # cancelled: not reused, in case its receive thread outlived the wait
            raise
        finally:
            if pool is not None:
                self._give_back_pool(pool)

    def _take_pool(self, chunk_size: int) -> ChunkPool:
        """A receive buffer pool, reused across fetches: allocating (and page-faulting)
        16 MiB of fresh buffers cost ~8 ms per fetch, 3% of a 256 MB transfer here."""
        for i, pool in enumerate(self._pools):
            if pool.chunk_size == chunk_size:
                return self._pools.pop(i)
        return ChunkPool(chunk_size)

    def _give_back_pool(self, pool: ChunkPool) -> None:
        if pool.complete and len(self._pools) < _POOLS_KEPT:
            self._pools.append(pool)

    async def _fetch_batch(
        self, info: PeerInfo, pid: str, pull: _Pull, batch: list[int], pool: ChunkPool | None
    ) -> None:
        prep, plan, changed, sink = pull.prep, pull.plan, pull.changed, pull.sink
        mcid = prep.mcid
        if not self._side_ok(pid):  # (an offer left untaken is declined by the fetch)
            await self._fetch_batch_stream(info, pid, pull, batch)
            return
        offer = prep.take_offer(pid, batch)
        manifest = sink.manifest
        cid = manifest.cid
        if offer is not None:  # the side channel came with the manifest
            reply, ip, nonce = offer.reply, offer.ip, offer.client_nonce
        else:
            nonce = secrets.token_bytes(P.NONCE_LEN)
            prep.report.requests += 1
            reply, ip = await self._request(info, P.BlobRequest("data", cid, nonce, mcid, batch[0], len(batch)))
        if len(reply.nonce) != P.NONCE_LEN:
            raise MalformedMessage("reply without a server nonce")
        info_bytes = transcript(self.peer_id, pid, cid, mcid, batch[0], len(batch))
        key = derive_key(reply.secret, nonce, reply.nonce, info_bytes)
        stall = self.config.stall_timeout
        try:
            # Connecting is bounded by the handshake's deadline, not the stall timeout: the server
            # closes its listener then, and a side port behind a NAT (the peer dialled us, and we
            # see its router's address) drops the SYN, so a 15 s connect was 15 s of a round lost.
            sock = await trio.to_thread.run_sync(_connect, ip, reply.port, self.config.handshake_timeout, stall)
        except (PeerGone, PeerTimeout) as exc:
            # Behind NAT or a firewall, or reached through a relay: the side
            # port is out of reach but the libp2p connection works. Remember
            # it and use the (slower) stream path for this peer from now on.
            log.info("blob: side channel to %s unreachable (%s); using the libp2p stream", pid, exc)
            self._side_unreachable.add(pid)
            await self._fetch_batch_stream(info, pid, pull, batch)
            return
        token = trio.lowlevel.current_trio_token()

        def ok(index: int) -> None:
            # Runs as a run_sync_soon callback: it must never raise. Trio runs
            # these in FIFO order, before the worker thread's own completion.
            if plan.in_flight.get(index) == pid:
                plan.chunk_ok(pid, index)
                changed.fire()

        def on_ok(index: int) -> None:  # called from the verifier thread; never blocks it
            token.run_sync_soon(ok, index)

        try:
            c2s = RecordCipher.for_direction(key, client_to_server=True)
            s2c = RecordCipher.for_direction(key, client_to_server=False)
            await trio.to_thread.run_sync(send_record, sock, c2s, KIND_HELLO, hello_plaintext(info_bytes))
            reader = RecordReader(sock, s2c, manifest.chunk_size, self.traffic)
            try:
                await _receive_in_thread(sock, functools.partial(
                    receive_batch, sock, reader, batch, sink, pool, on_ok=on_ok, stall=stall,
                    pace=self.config.pace))
            except HashMismatch as exc:
                index = getattr(exc, "index", None)
                if index is not None:
                    plan.chunk_bad(pid, index)
                raise
        finally:
            _close(sock)

    def _side_ok(self, pid: str) -> bool:
        """Whether to ask ``pid`` for a side channel (else the chunks come on the libp2p stream)."""
        return pid not in self._side_unreachable and self.side_reachable(pid)

    async def _fetch_batch_stream(self, info: PeerInfo, pid: str, pull: _Pull, batch: list[int]) -> None:
        """The fallback data path: chunks as frames on the (Noise-secured) libp2p stream."""
        plan, changed, sink, manifest = pull.plan, pull.changed, pull.sink, pull.sink.manifest
        pull.prep.report.requests += 1
        req = P.BlobRequest("data", manifest.cid, secrets.token_bytes(P.NONCE_LEN), pull.prep.mcid,
                            batch[0], len(batch), via="stream")
        stream, _, _ = await self._open_exchange(info, req)
        pace, start, due = self.config.pace, trio.current_time(), 0
        try:
            with trio.CancelScope() as scope:
                for index in batch:
                    _, length = manifest.chunk_span(index)
                    due += length
                    scope.deadline = pace.deadline(start, due)  # a trickling provider is given up
                    buf = bytearray()
                    while len(buf) < length:  # each frame bounded by what is still due
                        buf += await framing.read_frame(
                            stream, max_size=min(P.STREAM_PIECE, length - len(buf)),
                            timeout=self.config.stall_timeout,
                        )
                    try:
                        await trio.to_thread.run_sync(accept_chunk, sink, index, memoryview(buf))
                    except HashMismatch:
                        plan.chunk_bad(pid, index)
                        raise
                    plan.chunk_ok(pid, index)
                    changed.fire()
            if scope.cancelled_caught:
                raise PeerTimeout(f"{pid} sent below {pace.min_rate / 1024:.0f} KiB/s: given up")
        finally:
            await close_stream(stream)

async def _receive_in_thread(sock: socket.socket, receive: Callable[[], None]) -> None:
    """Run a receive pipeline in a thread; if the fetch is cancelled, stop the
    pipeline and wait for it before the cancellation goes on.

    Why wait: the pipeline writes into the caller's buffer, or into the blob's
    temp file through a descriptor. Left running after its fetch was cancelled,
    it could write into a buffer the caller already reuses for the next fetch,
    or through a descriptor number the process has since given to another file.
    Shutting the socket down ends the receive at once; the verifiers then drain.
    """
    done = threading.Event()

    def run() -> None:
        try:
            receive()
        finally:
            done.set()

    try:
        # trio-typing's stale stubs (a libp2p dependency) shadow trio's own, which has abandon_on_cancel.
        await trio.to_thread.run_sync(run, abandon_on_cancel=True)  # type: ignore[call-arg, unused-ignore]
    except trio.Cancelled:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        with trio.CancelScope(shield=True):
            if not await trio.to_thread.run_sync(done.wait, _STOP_WAIT_S):
                log.error("blob: a cancelled receive thread did not stop within %s s", _STOP_WAIT_S)
        raise


def _connect(ip: str, port: int, connect_timeout: float, timeout: float) -> socket.socket:
    try:
        sock = socket.create_connection((ip, port), timeout=connect_timeout)
    except TimeoutError as exc:
        raise PeerTimeout(f"side channel to {ip}:{port} timed out") from exc
    except OSError as exc:
        raise PeerGone(f"side channel to {ip}:{port} failed: {exc}") from exc
    tune(sock, timeout)
    return sock


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread still blocked in recv
    except OSError:
        pass
    sock.close()


def _aggregate(cid: str, errors: list[PcpError]) -> PcpError:
    """One error for a fetch that every provider failed.

    If all providers failed the same way (all said "not found", all declared
    an oversized blob, all sent bad data) that type is raised, so callers can
    tell "nobody has it" from "the network is broken"; otherwise NoProviders.
    """
    if not errors:
        return NoProviders(f"no provider could serve {cid}")
    kinds = {type(e) for e in errors}
    detail = "; ".join(f"{type(e).__name__}: {e}" for e in errors[:5])
    if len(kinds) == 1:
        kind = kinds.pop()
        try:
            err = kind(f"{cid}: every provider failed: {detail}")
        except Exception:
            err = NoProviders(f"{cid}: {detail}")
    else:
        err = NoProviders(f"{cid}: every provider failed: {detail}")
    err.__cause__ = errors[-1]
    return err

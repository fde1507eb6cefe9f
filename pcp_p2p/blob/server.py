"""The serving side of ``/pcp/blob/1.0.0``: answer requests, upload chunks.

:class:`BlobServer` is the half of :class:`~pcp_p2p.blob.service.BlobService`
that other peers talk to. A request is read and answered under the request
deadline; a data upload then runs outside it, either in a worker thread over the
TCP side channel (accept one connection, check the client's hello record, send
AES-GCM chunk records from the file, which is held open so eviction cannot pull
it away) or, on the ``stream`` fallback, as frames on the same libp2p stream.
At most ``max_uploads`` uploads run at once, at most ``max_uploads_per_peer``
of them for one peer; further data requests queue for a slot (up to half the
request deadline) before being answered ``busy`` (:class:`UploadSlots`).
A slot is never held by an idle or trickling client: the side channel's
connect and hello share one overall deadline (``handshake_timeout``) and the
chunks, on either path, must go at ``min_rate`` on average after a grace
(:class:`~pcp_p2p.net.budget.Pace`); past either deadline the upload is cut
and its slot released.

Faults are injected in tests by overriding :meth:`BlobServer._send_chunk`.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import trio
from libp2p.abc import IHost, INetStream

from pcp_p2p.blob import protocol as P
from pcp_p2p.blob.chunks import ChunkManifest
from pcp_p2p.blob.sidechannel import (
    HEADER,
    KIND_CHUNK,
    KIND_HELLO,
    TAG_LEN,
    RecordCipher,
    RecordReader,
    derive_key,
    hello_plaintext,
    send_record,
    transcript,
    tune,
)
from pcp_p2p.blob.store import BlobStore
from pcp_p2p.core.cid import cid_of, parse_cid
from pcp_p2p.core.errors import (
    BlobNotFound,
    MalformedMessage,
    PeerGone,
    PeerTimeout,
    ProtocolError,
    VerificationError,
)
from pcp_p2p.core.faults import LOCAL, Boundary
from pcp_p2p.net.budget import Pace
from pcp_p2p.net.connectivity import stream_is_relayed
from pcp_p2p.net.traffic import Traffic
from pcp_p2p.wire import framing

log = logging.getLogger("pcp_p2p.blob.service")


@dataclass(frozen=True)
class BlobConfig:
    """Limits and deadlines of the blob exchange (both the fetching and the serving end)."""

    max_blob_size: int = 16 * 1024**3  # a fetch refuses manifests declaring more
    max_in_memory: int = 256 * 1024**2  # a byte range, or fetch_into without a buffer, is held in memory
    request_timeout: float = 20.0  # one control exchange on the libp2p stream
    stall_timeout: float = 15.0  # side channel: no byte for this long = stalled; also the chunks' grace
    handshake_timeout: float = 5.0  # side channel: the client connects and its hello arrives within this
    min_rate: float = 256 * 1024  # bytes/s: chunks (either end) by stall_timeout + bytes so far / min_rate
    max_uploads: int = 4  # concurrent uploads served; more requests queue for a slot
    max_uploads_per_peer: int = 2  # of those, for one peer (its further requests wait apart)
    direct_io: bool = True  # fetched chunks go to disk with O_DIRECT where the file system allows
    swarm_fanout: int = 2  # a relay tree's children per member (pcp_p2p.blob.swarm)
    swarm_wait: float = 1.0  # the longest a request waits for a fetch of ours to start (BlobRequest.wait_ms)
    side_host: str | None = None  # where side listeners bind; None: the host's listen IP

    @property
    def pace(self) -> Pace:
        """Chunk deadlines: the whole batch at ``min_rate`` on average, after a grace."""
        return Pace(grace_s=self.stall_timeout, min_rate=self.min_rate)


class UploadSlots:
    """At most ``total`` uploads at once, and at most ``per_peer`` for one peer.

    Why per peer: a data request takes a slot before its reply, and a client
    that then never connects holds it until the side channel's accept times
    out. With only a global limit, one peer asking ``total`` times could hold
    every slot and starve everyone else. A peer's requests beyond its share
    queue on its own semaphore, not on the shared slots, so it can hold its
    share at most, while an honest peer's extra requests still just wait.
    """

    def __init__(self, total: int, per_peer: int) -> None:
        self._free = trio.Semaphore(total)
        self.total = total
        self.per_peer = per_peer
        self._by_peer: dict[str, trio.Semaphore] = {}
        self.peak = 0  # the most slots ever held at once (never above total)
        self.busy = 0  # requests answered busy: no slot within their wait
        self.released = 0  # slots given back, in all
        self._on_release = trio.Event()  # set, and replaced, whenever a slot is given back

    async def wait_idle(self, releases: int = 0) -> None:
        """Return once no slot is held and at least ``releases`` were given back in all.

        A slot is released inside the server's handler, after its upload thread
        ends: whoever must know it is free (a test, a shutdown) waits on this.
        """
        while self.held or self.released < releases:
            await self._on_release.wait()

    @property
    def held(self) -> int:
        """Slots held now, all peers."""
        return self.total - self._free.value

    def held_by(self, peer: str) -> int:
        """Slots ``peer`` holds or waits for a shared one with."""
        mine = self._by_peer.get(peer)
        return 0 if mine is None else self.per_peer - mine.value

    async def acquire(self, peer: str, timeout: float) -> _Slot | None:
        """A slot for ``peer``, or ``None`` (busy) if none is free within ``timeout``."""
        mine = self._by_peer.setdefault(peer, trio.Semaphore(self.per_peer))
        with trio.move_on_after(timeout) as scope:
            await mine.acquire()
            try:
                await self._free.acquire()
            except BaseException:
                mine.release()
                raise
        if scope.cancelled_caught:
            self._forget(peer)
            self.busy += 1
            return None
        self.peak = max(self.peak, self.held)
        return _Slot(self, peer, mine)

    def _forget(self, peer: str) -> None:
        """Drop an idle peer's semaphore (memory stays bounded by the active peers)."""
        mine = self._by_peer.get(peer)
        if mine is not None and mine.value == self.per_peer and not mine.statistics().tasks_waiting:
            del self._by_peer[peer]


class _Slot:
    def __init__(self, slots: UploadSlots, peer: str, mine: trio.Semaphore) -> None:
        self._slots, self._peer, self._mine, self._held = slots, peer, mine, True

    def release(self) -> None:
        """Give the slot back (once; later calls do nothing)."""
        if self._held:
            self._held = False
            self._slots._free.release()
            self._mine.release()
            self._slots._forget(self._peer)
            self._slots.released += 1
            done, self._slots._on_release = self._slots._on_release, trio.Event()
            done.set()


@dataclass
class _Upload:
    """What a data request leaves to do after the reply: one of the two paths,
    holding its upload slot until it ends."""

    slot: _Slot
    in_thread: Callable[[], None] | None = None
    on_stream: Callable[[INetStream], Awaitable[None]] | None = None


class PartialBlob:
    """A blob this node is fetching into its store, served to others chunk by chunk.

    Why: in a swarm (:mod:`pcp_p2p.blob.swarm`) a member relays a blob while
    it is still arriving, so the chunks flow down the relay tree in a
    pipeline. Only chunks that passed their hash are served: the fetch marks
    each with :meth:`chunk_ok` once it is written to the temp file, and an
    upload waits (:meth:`wait_chunk`, bounded by its pace) for the next one.
    :meth:`end` wakes every waiting upload when the fetch ends either way.
    The temp file is opened once, here: the commit renames it into the store
    (and an abort unlinks it), so an upload opening it by name could miss it.
    """

    def __init__(self, manifest: ChunkManifest, manifest_bytes: bytes, path: Path) -> None:
        self.manifest = manifest
        self.manifest_bytes = manifest_bytes
        self._fd: int | None = os.open(path, os.O_RDONLY)
        self._cond = threading.Condition()
        self._verified: set[int] = set()
        self.ended = False
        self.failed = False

    def chunk_ok(self, index: int) -> None:
        """Chunk ``index`` is verified and in the file (called from the verifier threads)."""
        with self._cond:
            self._verified.add(index)
            self._cond.notify_all()

    def end(self, *, failed: bool) -> None:
        with self._cond:
            self.ended, self.failed = True, failed
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._cond.notify_all()

    def open(self) -> IO[bytes] | None:
        """The temp file, for one upload (its own descriptor); ``None`` once the fetch ended."""
        with self._cond:
            return None if self._fd is None else os.fdopen(os.dup(self._fd), "rb")

    def wait_chunk(self, index: int, timeout: float) -> bool:
        """Block (a worker thread) until chunk ``index`` is here; ``False`` if it did not come
        within ``timeout``. :class:`PeerGone` if the fetch failed without it."""
        with self._cond:
            self._cond.wait_for(lambda: index in self._verified or self.ended, timeout)
            if index in self._verified:
                return True
            if self.failed:
                raise PeerGone(f"the fetch of {self.manifest.cid} failed here: chunk {index} will not come")
            return False


@dataclass
class SwarmCounts:
    """How this node's swarm fetches went, and its parent's part in others' (status
    ``network.swarm_*``). A swarmed blob should cross its origin's uplink about once; these
    say how often a fetch went past its ancestors to the origin, and how often this node was
    asked for a blob as a tree parent before its own fetch of it had started."""

    fetches: int = 0  # whole blobs fetched in tree order (ancestors first, the origin last)
    from_origin: int = 0  # of them, served (manifest or chunks) by the origin though ancestors were named
    waits_missed: int = 0  # swarm requests answered "not found": no fetch of ours started within the wait

    def as_status(self) -> dict[str, int]:
        return {"swarm_fetches": self.fetches, "swarm_fetches_from_origin": self.from_origin,
                "swarm_waits_missed": self.waits_missed}


class BlobServer:
    """Answers ``/pcp/blob/1.0.0`` requests from the store (see the module docstring)."""

    host: IHost
    store: BlobStore
    config: BlobConfig
    peer_id: str
    traffic: Traffic | None
    boundary: Boundary  # the node's error boundary (pcp_p2p.core.faults)
    _uploads: UploadSlots
    _partials: dict[str, PartialBlob]  # blobs being fetched, served as their chunks arrive
    _partial_added: trio.Event  # set, and replaced, whenever a partial holding is registered
    swarm: SwarmCounts

    def register(self) -> None:
        """Serve ``/pcp/blob/1.0.0`` on the host."""
        self.host.set_stream_handler(P.PROTOCOL_ID, self._handle)

    async def _handle(self, stream: INetStream) -> None:
        client = stream.muxed_conn.peer_id.to_base58()
        if stream_is_relayed(stream):  # relays lend bandwidth for control traffic only
            with trio.move_on_after(self.config.request_timeout):
                try:
                    await P.write_frame(stream, P.BlobReply(P.BUSY, "relayed connection: blobs go direct"),
                                        timeout=self.config.request_timeout)
                except Exception:
                    pass
            await close_stream(stream)
            return
        replied = False  # once chunks flow on the stream, no reply frame may follow
        try:
            try:
                with trio.fail_after(self.config.request_timeout):
                    req = await P.read_frame(stream, P.BlobRequest, timeout=self.config.request_timeout)
                    upload = await self._answer(stream, client, req)
                if upload is not None and upload.on_stream is not None:
                    replied = True
                    try:
                        await upload.on_stream(stream)
                    finally:
                        upload.slot.release()
                    upload = None
            except Exception as exc:  # the boundary (pcp_p2p.core.faults): counted and logged by whose fault
                if replied:
                    raise  # chunks flowed: no reply frame may follow (judged below)
                blame = self.boundary.judge(client, exc, "blob")
                # a bad request is told why; our bug gets a neutral answer; a broken stream nothing
                reply = (P.BlobReply(P.INTERNAL, "internal error") if blame == LOCAL
                         else P.BlobReply(P.BAD_REQUEST, str(exc)[:200]) if isinstance(exc, ProtocolError)
                         else None)
                if reply is not None:
                    with trio.move_on_after(self.config.request_timeout):
                        try:
                            await P.write_frame(stream, reply, timeout=self.config.request_timeout)
                        except Exception:
                            pass  # the client left: nothing more to tell it
                return
            finally:
                with trio.move_on_after(1):
                    try:
                        await stream.close()
                    except Exception:
                        pass
            if upload is not None and upload.in_thread is not None:
                try:
                    # trio-typing's stale stubs (a libp2p dependency) shadow trio's own, which has abandon_on_cancel.
                    await trio.to_thread.run_sync(  # type: ignore[call-arg, unused-ignore]
                        upload.in_thread, abandon_on_cancel=True
                    )
                finally:
                    upload.slot.release()
        except Exception as exc:  # the boundary: a bug must not take the host down, nor blame the client
            self.boundary.judge(client, exc, "blob")

    async def _answer(self, stream: INetStream, client: str, req: P.BlobRequest) -> _Upload | None:
        """Reply to ``req``; for a data request, return the upload to run.

        The upload holds one of the upload slots; ``_handle`` releases it.
        """
        partial = None
        if not self.store.has(req.cid):
            partial = self._partials.get(req.cid)
            if partial is None and req.wait_ms:
                partial = await self._await_partial(req.cid, min(req.wait_ms / 1000, self.config.swarm_wait))
            if partial is None or (partial.ended and not partial.failed and self.store.has(req.cid)):
                partial = None  # (a fetch that just committed: served from the store)
                if not self.store.has(req.cid):
                    if req.wait_ms:
                        self.swarm.waits_missed += 1
                    await P.write_frame(stream, P.BlobReply(P.NOT_FOUND), timeout=self.config.request_timeout)
                    return None
        mf_bytes = partial.manifest_bytes if partial is not None else self.store.manifest_bytes(req.cid)
        if req.kind in ("manifest", "fetch"):
            inline = self._inline(req.cid) if partial is None else None  # a partial one goes by chunks
            if req.kind == "manifest" or inline is not None:
                reply = P.BlobReply(P.OK, manifest=mf_bytes, data=inline)
                await P.write_frame(stream, reply, timeout=self.config.request_timeout)
                return None
        manifest = partial.manifest if partial is not None else self.store.manifest(req.cid)
        if req.kind == "fetch":  # the manifest, and a side channel for its first chunks
            mcid, first, count = cid_of(mf_bytes), 0, min(req.count, manifest.count)
        else:
            mcid, first, count = req.manifest_cid, req.first, req.count
            if cid_of(mf_bytes) != mcid:
                await P.write_frame(stream, P.BlobReply(P.MISMATCH), timeout=self.config.request_timeout)
                return None
            if first + count > manifest.count:
                raise MalformedMessage(f"chunks [{first}, {first + count}) of {manifest.count}")
        # Queue for an upload slot rather than refuse at once: a burst of
        # fetchers (fan-out) then drains in turn instead of failing over.
        slot = await self._uploads.acquire(client, self.config.request_timeout / 2)
        if slot is None:
            await P.write_frame(stream, P.BlobReply(P.BUSY), timeout=self.config.request_timeout)
            return None
        opened = partial.open() if partial is not None else None
        try:
            # Held open: eviction cannot pull it away. Opening is one quick local syscall (ASYNC230).
            # (A partial blob whose fetch ended meanwhile is in the store now, or gone.)
            file = opened if opened is not None else open(self.store.path(req.cid), "rb")  # noqa: ASYNC230
            partial = partial if opened is not None else None
        except (FileNotFoundError, BlobNotFound):  # evicted since the check above
            slot.release()
            await P.write_frame(stream, P.BlobReply(P.NOT_FOUND), timeout=self.config.request_timeout)
            return None
        if req.via == "stream":
            try:
                await P.write_frame(stream, P.BlobReply(P.OK), timeout=self.config.request_timeout)
            except BaseException:
                file.close()
                slot.release()
                raise

            async def on_stream(s: INetStream) -> None:
                try:
                    await self._stream_upload(s, file, manifest, first, count, partial)
                finally:
                    file.close()

            return _Upload(slot, on_stream=on_stream)
        try:
            listener = socket.create_server((self._side_host(), 0), backlog=1)
        except BaseException:
            file.close()
            slot.release()
            raise
        secret, nonce = secrets.token_bytes(32), secrets.token_bytes(P.NONCE_LEN)
        info = transcript(client, self.peer_id, req.cid, mcid, first, count)
        key = derive_key(secret, req.nonce, nonce, info)
        try:
            await P.write_frame(
                stream,
                P.BlobReply(P.OK, port=listener.getsockname()[1], secret=secret, nonce=nonce,
                            manifest=mf_bytes if req.kind == "fetch" else b""),
                timeout=self.config.request_timeout,
            )
        except BaseException:
            listener.close()
            file.close()
            slot.release()
            raise

        def upload() -> None:
            try:
                self._upload(listener, file, key, info, manifest, first, count, partial)
            finally:
                listener.close()
                file.close()

        return _Upload(slot, in_thread=upload)

    async def _stream_upload(
        self, stream: INetStream, file: IO[bytes], manifest: ChunkManifest, first: int, count: int,
        partial: PartialBlob | None = None,
    ) -> None:
        fd = file.fileno()
        pace, start, due = self.config.pace, trio.current_time(), 0
        with trio.CancelScope() as scope:
            for i in range(first, first + count):
                offset, length = manifest.chunk_span(i)
                due += length
                scope.deadline = pace.deadline(start, due)  # a client reading slowly is cut here
                if partial is not None:  # still arriving here: wait for it (by the same deadline)
                    left = scope.deadline - trio.current_time()
                    if not await trio.to_thread.run_sync(partial.wait_chunk, i, max(0.0, left)):
                        raise PeerTimeout(f"chunk {i} of {manifest.cid} did not arrive here in time")
                data = await trio.to_thread.run_sync(os.pread, fd, length, offset)
                if len(data) != length:
                    raise PeerGone("blob file shorter than its manifest")
                for j in range(0, length, P.STREAM_PIECE):
                    await framing.write_frame(
                        stream, data[j : j + P.STREAM_PIECE], timeout=self.config.stall_timeout
                    )
        if scope.cancelled_caught:
            raise PeerTimeout(f"stream upload below {pace.min_rate / 1024:.0f} KiB/s: cut at its deadline")

    def _upload(
        self,
        listener: socket.socket,
        file: IO[bytes],
        key: bytes,
        info: bytes,
        manifest: ChunkManifest,
        first: int,
        count: int,
        partial: PartialBlob | None = None,
    ) -> None:
        """Runs in a worker thread: accept the client, check its hello, send the chunks.

        The upload slot is held for exactly this long, so every wait here has
        an overall deadline: connecting and the hello together within
        ``handshake_timeout``, then the chunks paced by ``config.pace`` (the
        client must read them at ``min_rate`` on average). An idle or
        trickling client is cut at the deadline and the slot goes back.
        From a ``partial`` blob (still being fetched here) each chunk is sent
        once it is verified here, waited for under the same deadline.
        """
        clock = time.monotonic
        handshake_due = clock() + self.config.handshake_timeout
        listener.settimeout(self.config.handshake_timeout)
        try:
            sock, _ = listener.accept()
        except TimeoutError as exc:
            raise PeerTimeout("client never connected to the side channel") from exc
        listener.close()
        try:
            tune(sock, self.config.stall_timeout)
            c2s = RecordCipher.for_direction(key, client_to_server=True)
            s2c = RecordCipher.for_direction(key, client_to_server=False)
            hello = RecordReader(sock, c2s, len(hello_plaintext(info))).read(KIND_HELLO, deadline=handshake_due)
            if hello != hello_plaintext(info):
                raise VerificationError("side-channel hello does not match the transfer")
            fd = file.fileno()
            # Store files never change once in place, so the chunks are sealed
            # straight from a read-only mapping of the page cache: one copy
            # (pread into a buffer) less per byte. The size is checked first,
            # since touching a mapping past the end of a file is SIGBUS.
            if os.fstat(fd).st_size != manifest.size:
                raise PeerGone("blob file does not have its manifest's size")
            out = bytearray(manifest.chunk_size + TAG_LEN)
            pace, start, due = self.config.pace, clock(), 0
            # A partial blob's file is still being written (with O_DIRECT): read each chunk with
            # pread once it is verified, rather than through a mapping.
            with _map(fd, manifest.size) if partial is None else nullcontext(None) as mapped:
                for i in range(first, first + count):
                    offset, length = manifest.chunk_span(i)
                    due += HEADER.size + length + TAG_LEN
                    left = pace.remaining(start, due, clock())
                    if left <= 0:
                        raise PeerTimeout(f"client reads below {pace.min_rate / 1024:.0f} KiB/s: cut")
                    if mapped is None:
                        assert partial is not None
                        if not partial.wait_chunk(i, left):
                            raise PeerTimeout(f"chunk {i} of {manifest.cid} did not arrive here in time")
                        data = memoryview(os.pread(fd, length, offset))
                        if len(data) != length:
                            raise PeerGone("partial blob file shorter than its manifest")
                        left = pace.remaining(start, due, clock())
                        if left <= 0:
                            raise PeerTimeout(f"client reads below {pace.min_rate / 1024:.0f} KiB/s: cut")
                    else:
                        data = mapped[offset : offset + length]
                    sock.settimeout(left)  # a record is sent within the socket's timeout, as a whole
                    self._send_chunk(sock, s2c, i, data, out)
                    if self.traffic is not None:
                        self.traffic.sent(HEADER.size + length + TAG_LEN)
            sock.shutdown(socket.SHUT_WR)
            # Wait (a stall timeout at most) for the client to close so its last bytes are not cut by a reset.
            sock.settimeout(self.config.stall_timeout)
            sock.recv(1)
        except OSError as exc:
            raise PeerGone(f"side channel broke: {exc}") from exc
        finally:
            sock.close()

    async def _await_partial(self, cid: str, timeout: float) -> PartialBlob | None:
        """The partial holding of ``cid`` once a fetch of ours starts, within ``timeout``.

        A swarm member asks its relay-tree parent at about the moment the
        parent learns of the blob itself: a short wait here saves it a hop up
        the tree. No slot is held meanwhile; the wait is capped by the config.
        """
        partial = None
        with trio.move_on_after(timeout):
            while (partial := self._partials.get(cid)) is None and not self.store.has(cid):
                await self._partial_added.wait()
        return partial

    def _inline(self, cid: str) -> bytes | None:
        """The blob itself if it is small enough to ride in the manifest reply
        (tests override this to inject faults)."""
        try:  # only a blob of one chunk (a raw CID): it is then checked as that chunk
            if parse_cid(cid).chunk_size is not None or self.store.size(cid) > P.INLINE_MAX:
                return None
            return self.store.read(cid)
        except (BlobNotFound, OSError):  # evicted meanwhile: the client fetches it the long way
            return None

    def _send_chunk(
        self, sock: socket.socket, cipher: RecordCipher, index: int, data: memoryview, out: bytearray
    ) -> None:
        """Send one chunk record (tests override this to inject faults)."""
        send_record(sock, cipher, KIND_CHUNK, data, out)

    def _side_host(self) -> str:
        if self.config.side_host is not None:
            return self.config.side_host
        for addr in self.host.get_transport_addrs():  # listen addresses (get_addrs: what is advertised)
            try:
                ip: str = addr.value_for_protocol("ip4")  # multiaddr is untyped
                return ip
            except Exception:
                continue
        return "0.0.0.0"



@contextmanager
def _map(fd: int, size: int) -> Iterator[memoryview]:
    """A read-only view of a whole file (an empty view for an empty file)."""
    if size == 0:
        yield memoryview(b"")
        return
    mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    view = memoryview(mm)
    try:
        yield view
    finally:
        view.release()
        try:
            mm.close()
        except BufferError:  # a chunk's slice is still referenced (by the traceback of a
            pass  # send that timed out): the mapping goes when that does


async def close_stream(stream: INetStream) -> None:
    with trio.move_on_after(1):
        try:
            await stream.close()
        except Exception:
            pass

"""The receiving end of a side-channel batch: receive, decrypt, verify, keep.

Why threads and reused buffers: on this 2-core class of machine every byte of a
fetch costs a kernel copy in, an AES-GCM open and a BLAKE3 for its chunk, and,
for a fetch into the store, a write into the page cache. All of those release
the GIL, so they run in plain threads, in a pipeline:

    receiver thread    recv_into + decrypt_into the chunk's place
          │ queue (bounded: at most a few chunks wait, so memory is bounded)
    verifier threads   hash the chunk against the manifest, then hand it to
    (two)              the sink (a store file: pwrite and start its writeback)

Where a chunk is decrypted to depends on the :class:`ChunkSink`:

- :class:`MemorySink` (a fetch into memory): straight into its place in the
  caller's buffer, so a byte is touched by the kernel's copy, the cipher and
  the hash, and nothing else. A chunk that fails its hash is overwritten when
  it is fetched again; the buffer is handed out only once every chunk passed.
- :class:`FileSink` (a fetch into the store): into one of a few pooled chunk
  buffers (:class:`ChunkPool`), written to the blob's temp file only after it
  passed its hash, so no unverified byte ever lands in the store's files. The
  write is direct I/O (``O_DIRECT``) where the file system allows it: on these
  VMs a buffered write into fresh page-cache pages cost anywhere from 0.1 to
  2.5 CPU-seconds per GB (the host backs each new page on first touch), a
  direct write from a reused, page-aligned buffer ~0.05 and never more, and
  the fsync before the commit then has nothing left to flush.

Buffers are allocated once and reused, because fresh memory on these VMs
costs page faults worth ~2 GB/s, i.e. more than a BLAKE3 pass.

The manifest was checked against the CID before the batch started (see
:mod:`pcp_p2p.core.cid`), so the chunk hashes are the only hashing a fetch does.
Nothing here touches trio: the caller passes callbacks.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pcp_p2p.blob.chunks import ChunkManifest
from pcp_p2p.blob.sidechannel import KIND_CHUNK, RecordReader
from pcp_p2p.blob.store import DIRECT_ALIGN, O_DIRECT, PendingBlob, start_writeback
from pcp_p2p.core.errors import HashMismatch, LocalError, PcpError
from pcp_p2p.net.budget import Pace

VERIFIERS = 2


class ChunkPool:
    """A few chunk-sized buffers, reused for every batch of one provider.

    Anonymous mappings, so each starts on a page boundary, as direct I/O needs.
    """

    def __init__(self, chunk_size: int, n: int = 4) -> None:
        self.chunk_size = chunk_size
        self._n = n
        self._free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        for _ in range(n):
            self._free.put(mmap.mmap(-1, chunk_size))

    @property
    def complete(self) -> bool:
        """Every buffer is back (the pool may be reused by another fetch)."""
        return self._free.qsize() == self._n

    def get(self, timeout: float) -> mmap.mmap:
        try:
            return self._free.get(timeout=timeout)
        except queue.Empty:
            raise PcpError("receive pipeline stuck: no free chunk buffer") from None

    def put(self, buf: mmap.mmap) -> None:
        self._free.put(buf)


class ChunkSink:
    """Where the verified chunks of one fetch go.

    :meth:`slot` says where chunk ``index`` may be received in place (``None``:
    into a pooled buffer); :meth:`put` takes a chunk that matched its hash.
    ``put`` runs in verifier threads, for different chunks at once.
    """

    manifest: ChunkManifest
    receives_in_place = False  # True: every chunk has a slot (no buffer pool needed)

    def slot(self, index: int) -> memoryview | None:
        return None

    def put(self, index: int, view: memoryview, *, in_place: bool = False) -> None:
        """Keep verified chunk ``index``; ``in_place``: ``view`` is its :meth:`slot`."""
        raise NotImplementedError

    @property
    def complete(self) -> bool:
        """Every chunk this sink was given passed its hash."""
        raise NotImplementedError


class FileSink(ChunkSink):
    """Chunks into the temp file of a :class:`PendingBlob`, which learns each one.

    Open it with :meth:`open`. Aligned data goes through a direct-I/O
    descriptor when the file system takes one (a tail shorter than
    :data:`DIRECT_ALIGN`, or a chunk in an unaligned buffer, is written
    through the page cache); if a direct write is refused, the sink falls
    back to the page cache for good.
    """

    def __init__(self, pending: PendingBlob, fd: int, direct_fd: int | None = None) -> None:
        self.manifest = pending.manifest
        self.pending = pending
        self.fd = fd
        self.direct_fd = direct_fd
        self.on_put: Callable[[int], None] | None = None  # told of each chunk once it is in the file

    @classmethod
    @contextmanager
    def open(cls, pending: PendingBlob, *, direct: bool = True) -> Iterator[FileSink]:
        fd = os.open(pending.path, os.O_RDWR)
        direct_fd = None
        if direct and O_DIRECT:
            try:
                direct_fd = os.open(pending.path, os.O_RDWR | O_DIRECT)
            except OSError:  # tmpfs and some others refuse O_DIRECT
                direct_fd = None
        try:
            yield cls(pending, fd, direct_fd)
        finally:
            os.close(fd)
            if direct_fd is not None:
                os.close(direct_fd)

    def put(self, index: int, view: memoryview, *, in_place: bool = False) -> None:
        offset = self.manifest.chunk_span(index)[0]
        direct_fd = self.direct_fd
        if direct_fd is not None and offset % DIRECT_ALIGN == 0 and _aligned(view):
            n = len(view) - len(view) % DIRECT_ALIGN
            try:
                _pwrite_all(direct_fd, view[:n], offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct_fd = None  # (closed by open()'s exit)
                n = 0
            view, offset = view[n:], offset + n
        if len(view):
            _pwrite_all(self.fd, view, offset)
            start_writeback(self.fd, offset, len(view))
        self.pending.chunk_verified(index)
        if self.on_put is not None:
            self.on_put(index)

    @property
    def complete(self) -> bool:
        return self.pending.complete


def _aligned(view: memoryview) -> bool:
    """Whether a (writable) buffer starts on a :data:`DIRECT_ALIGN` boundary."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view)) % DIRECT_ALIGN == 0
    except (TypeError, ValueError):  # read-only or empty: take the page cache
        return False


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


class MemorySink(ChunkSink):
    """Chunks ``wanted`` of a blob into ``out``, chunk ``wanted[0]`` at offset 0."""

    receives_in_place = True

    def __init__(self, manifest: ChunkManifest, wanted: range, out: memoryview) -> None:
        self.manifest = manifest
        self.wanted = wanted
        self.base, need = manifest.span_of(wanted)
        if len(out) < need:
            raise LocalError(f"buffer of {len(out)} bytes for {need} bytes of {manifest.cid}")
        self.out = out
        self.verified: set[int] = set()

    def slot(self, index: int) -> memoryview:
        offset, length = self.manifest.chunk_span(index)
        return self.out[offset - self.base : offset - self.base + length]

    def put(self, index: int, view: memoryview, *, in_place: bool = False) -> None:
        if not in_place:  # received elsewhere (the stream path): copy it in
            self.slot(index)[:] = view
        self.verified.add(index)  # atomic under the GIL

    @property
    def complete(self) -> bool:
        """Every wanted chunk is in ``out`` and matched its hash."""
        return len(self.verified) == len(self.wanted)


def accept_chunk(sink: ChunkSink, index: int, view: memoryview, *, in_place: bool = False) -> None:
    """Verify one received chunk against the manifest, then give it to ``sink``.

    A mismatch raises :class:`HashMismatch` with ``.index`` and keeps nothing.
    """
    try:
        sink.manifest.verify_chunk(index, view)
    except HashMismatch as exc:
        exc.index = index
        raise
    sink.put(index, view, in_place=in_place)


def receive_batch(
    sock: socket.socket,
    reader: RecordReader,
    batch: list[int],
    sink: ChunkSink,
    pool: ChunkPool | None,
    *,
    on_ok: Callable[[int], None],
    stall: float,
    pace: Pace | None = None,
) -> None:
    """Receive ``batch`` from ``sock`` into ``sink`` (blocking; run in a worker thread).

    Each chunk is verified against the sink's manifest before the sink keeps
    it and it is reported with ``on_ok(index)``. ``pool`` supplies buffers for
    a sink that has no slot for a chunk. With ``pace``, chunk ``k`` must have
    arrived by ``pace.deadline(start, bytes of chunks 0..k)``: a provider that
    trickles is given up for another (:class:`PeerTimeout`). Raises the first
    error of either stage (:class:`HashMismatch` has ``.index``).
    """
    work: queue.Queue[tuple[int, memoryview, mmap.mmap | None] | None] = queue.Queue(maxsize=VERIFIERS)
    failure: list[BaseException] = []

    def give_back(buf: mmap.mmap | None) -> None:
        if buf is not None and pool is not None:
            pool.put(buf)

    def verifier() -> None:
        try:
            while (item := work.get()) is not None:
                index, view, buf = item
                try:
                    accept_chunk(sink, index, view, in_place=buf is None)
                finally:
                    give_back(buf)
                on_ok(index)
        except BaseException as exc:
            failure.append(exc)
            try:  # unblock the receiver, which may be waiting to put
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            while True:  # drain so the receiver never blocks on a full queue
                item = work.get()
                if item is None:
                    return
                give_back(item[2])

    threads = [threading.Thread(target=verifier, name=f"blob-verify-{k}", daemon=True)
               for k in range(VERIFIERS)]
    for t in threads:
        t.start()
    start, due = time.monotonic(), 0
    try:
        for index in batch:
            if failure:
                break
            due += sink.manifest.chunk_span(index)[1]
            deadline = None if pace is None else pace.deadline(start, due)
            place = sink.slot(index)
            buf = None
            if place is None:
                if pool is None:
                    raise LocalError("a sink without slots needs a buffer pool")
                buf = pool.get(timeout=stall * 2)
                place = memoryview(buf)
            try:
                n = reader.read_into(KIND_CHUNK, place, deadline)
            except BaseException:
                give_back(buf)
                raise
            work.put((index, place[:n], buf))
    except BaseException as exc:
        if not failure:
            failure.append(exc)
    finally:
        for _ in threads:
            work.put(None)
        for t in threads:
            t.join()
    if failure:
        raise failure[0]

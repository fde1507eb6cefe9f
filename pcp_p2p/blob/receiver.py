"""The receiving end of a side-channel batch: receive, decrypt, verify, write.

Why threads and reused buffers: on this 2-core class of machine every byte of a
fetch costs a kernel copy in, an AES-GCM open, a sha256 for its chunk and a
write into the page cache. All of those release the GIL, so they run in plain
threads, in a pipeline:

    receiver thread    recv_into + decrypt_into a pooled chunk buffer
          │ queue (bounded: the pool has a few buffers, so memory is bounded)
    verifier threads   sha256 of the chunk against the manifest, pwrite,
    (two)              start its writeback, report

Two verifiers because hashing and writing a chunk costs ~3x receiving and
decrypting it: with one, the verifier was the pipeline's bottleneck.

The manifest was checked against the CID before the batch started (see
:mod:`pcp_p2p.cid`), so the chunk hashes are the only hashing a fetch does.

Buffers are allocated once per provider and reused, because fresh 4 MiB
allocations on this VM cost page faults worth ~2 GB/s, i.e. as much as a
sha256 pass. Nothing here touches trio: the caller passes callbacks.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
from collections.abc import Callable

from pcp_p2p.blob.chunks import ChunkManifest
from pcp_p2p.blob.sidechannel import KIND_CHUNK, RecordReader
from pcp_p2p.blob.store import PendingBlob, start_writeback
from pcp_p2p.errors import HashMismatch, PcpError

VERIFIERS = 2


class ChunkPool:
    """A few chunk-sized buffers, reused for every batch of one provider."""

    def __init__(self, chunk_size: int, n: int = 4) -> None:
        self.chunk_size = chunk_size
        self._n = n
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        for _ in range(n):
            self._free.put(bytearray(chunk_size))

    @property
    def complete(self) -> bool:
        """Every buffer is back (the pool may be reused by another fetch)."""
        return self._free.qsize() == self._n

    def get(self, timeout: float) -> bytearray:
        try:
            return self._free.get(timeout=timeout)
        except queue.Empty:
            raise PcpError("receive pipeline stuck: no free chunk buffer") from None

    def put(self, buf: bytearray) -> None:
        self._free.put(buf)


def accept_chunk(
    manifest: ChunkManifest,
    index: int,
    view: memoryview,
    *,
    fd: int,
    chunks: dict[int, bytes] | None,
    pending: PendingBlob | None,
) -> None:
    """Verify one received chunk, then keep it (``chunks``) or write it (``fd``,
    the file of ``pending``, which learns the chunk is verified).

    A mismatch raises :class:`HashMismatch` with ``.index`` and writes nothing.
    """
    try:
        manifest.verify_chunk(index, view)
    except HashMismatch as exc:
        exc.index = index  # type: ignore[attr-defined]
        raise
    if chunks is not None:
        chunks[index] = bytes(view)
        return
    offset = manifest.chunk_span(index)[0]
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    start_writeback(fd, offset, len(view))
    if pending is not None:
        pending.chunk_verified(index)


def receive_batch(
    sock: socket.socket,
    reader: RecordReader,
    manifest: ChunkManifest,
    batch: list[int],
    pool: ChunkPool,
    *,
    fd: int,
    chunks: dict[int, bytes] | None,
    pending: PendingBlob | None,
    on_ok: Callable[[int], None],
    stall: float,
) -> None:
    """Receive ``batch`` from ``sock`` (blocking; run in a worker thread).

    Each chunk is verified against ``manifest`` before it is written to ``fd``
    (or kept in ``chunks``) and reported with ``on_ok(index)``. Raises the
    first error of either stage (:class:`HashMismatch` has ``.index``).
    """
    work: queue.Queue[tuple[int, bytearray, int] | None] = queue.Queue(maxsize=VERIFIERS)
    failure: list[BaseException] = []

    def verifier() -> None:
        try:
            while (item := work.get()) is not None:
                index, buf, n = item
                try:
                    accept_chunk(manifest, index, memoryview(buf)[:n], fd=fd, chunks=chunks, pending=pending)
                finally:
                    pool.put(buf)
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
                pool.put(item[1])

    threads = [threading.Thread(target=verifier, name=f"blob-verify-{k}", daemon=True)
               for k in range(VERIFIERS)]
    for t in threads:
        t.start()
    try:
        for index in batch:
            if failure:
                break
            buf = pool.get(timeout=stall * 2)
            try:
                n = reader.read_into(KIND_CHUNK, buf)
            except BaseException:
                pool.put(buf)
                raise
            work.put((index, buf, n))
    except BaseException as exc:
        if not failure:
            failure.append(exc)
    finally:
        for t in threads:
            work.put(None)
        for t in threads:
            t.join()
    if failure:
        raise failure[0]

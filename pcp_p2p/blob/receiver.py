"""The receiving end of a side-channel batch: receive, decrypt, verify, write, hash.

Why threads and reused buffers: on this 2-core class of machine every byte of a
fetch costs a kernel copy in, an AES-GCM open, a sha256 for its chunk, a write
into the page cache and a sha256 for the whole blob. All of those release the
GIL, so they run in plain threads, in a pipeline:

    receiver thread   recv_into + decrypt_into a pooled chunk buffer
          │ queue (bounded: the pool has a few buffers, so memory is bounded)
    verifier thread   sha256 of the chunk against the manifest, pwrite, report
          │ in-order chunks are handed over (a copy), others re-read later
    WholeHasher       sha256 of the blob front to back, one thread per fetch

Buffers are allocated once per provider and reused, because fresh 4 MiB
allocations on this VM cost page faults worth ~2 GB/s, i.e. as much as a
sha256 pass. Nothing here touches trio: the caller passes callbacks.
"""

from __future__ import annotations

import hashlib
import os
import queue
import socket
import threading
from collections.abc import Callable

from pcp_p2p.blob.chunks import ChunkManifest
from pcp_p2p.blob.sidechannel import KIND_CHUNK, RecordReader
from pcp_p2p.errors import HashMismatch, PcpError


class ChunkPool:
    """A few chunk-sized buffers, reused for every batch of one provider."""

    def __init__(self, chunk_size: int, n: int = 3) -> None:
        self.chunk_size = chunk_size
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        for _ in range(n):
            self._free.put(bytearray(chunk_size))

    def get(self, timeout: float) -> bytearray:
        try:
            return self._free.get(timeout=timeout)
        except queue.Empty:
            raise PcpError("receive pipeline stuck: no free chunk buffer") from None

    def put(self, buf: bytearray) -> None:
        self._free.put(buf)


class WholeHasher:
    """sha256 of a whole blob, fed front to back while chunks arrive in any order.

    The verifier hands over the bytes of the chunk the hasher needs next (the
    usual case with one provider, or the head of the blob with several); a
    chunk that arrives early is only marked written and read back from the
    file when its turn comes, so memory stays bounded.
    """

    def __init__(self, manifest: ChunkManifest, fd: int) -> None:
        self.manifest = manifest
        self.fd = fd
        self._h = hashlib.sha256()
        self._cv = threading.Condition()
        self._written: set[int] = set()
        self._handed: dict[int, bytes] = {}
        self._cursor = 0
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="blob-whole-hash", daemon=True)
        self._thread.start()

    def wants(self, index: int) -> bool:
        return index == self._cursor

    def written(self, index: int, data: bytes | None) -> None:
        with self._cv:
            self._written.add(index)
            if data is not None and index == self._cursor:
                self._handed[index] = data
            self._cv.notify()

    def _run(self) -> None:
        try:
            while self._cursor < self.manifest.count:
                with self._cv:
                    while self._cursor not in self._written and not self._closed:
                        self._cv.wait()
                    if self._closed:
                        return
                    data = self._handed.pop(self._cursor, None)
                if data is None:
                    offset, length = self.manifest.chunk_span(self._cursor)
                    data = os.pread(self.fd, length, offset)
                self._h.update(data)
                with self._cv:
                    self._cursor += 1
        except BaseException as exc:  # reported by digest()
            self._error = exc

    def digest(self) -> bytes:
        """Wait for the last chunk and return the whole blob's sha256."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._cursor < self.manifest.count:
            raise PcpError("whole-blob hash closed before the last chunk")
        return self._h.digest()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._handed.clear()
            self._cv.notify()


def accept_chunk(
    manifest: ChunkManifest,
    index: int,
    view: memoryview,
    *,
    fd: int,
    chunks: dict[int, bytes] | None,
    hasher: WholeHasher | None,
) -> None:
    """Verify one received chunk, then keep it (``chunks``) or write it (``fd``).

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
    if hasher is not None:
        hasher.written(index, bytes(view) if hasher.wants(index) else None)


def receive_batch(
    sock: socket.socket,
    reader: RecordReader,
    manifest: ChunkManifest,
    batch: list[int],
    pool: ChunkPool,
    *,
    fd: int,
    chunks: dict[int, bytes] | None,
    hasher: WholeHasher | None,
    on_ok: Callable[[int], None],
    stall: float,
) -> None:
    """Receive ``batch`` from ``sock`` (blocking; run in a worker thread).

    Each chunk is verified against ``manifest`` before it is written to ``fd``
    (or kept in ``chunks``) and reported with ``on_ok(index)``. Raises the
    first error of either stage (:class:`HashMismatch` has ``.index``).
    """
    work: queue.Queue[tuple[int, bytearray, int] | None] = queue.Queue(maxsize=2)
    failure: list[BaseException] = []

    def verifier() -> None:
        try:
            while (item := work.get()) is not None:
                index, buf, n = item
                try:
                    accept_chunk(manifest, index, memoryview(buf)[:n], fd=fd, chunks=chunks, hasher=hasher)
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

    t = threading.Thread(target=verifier, name="blob-verify", daemon=True)
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
        work.put(None)
        t.join()
    if failure:
        raise failure[0]

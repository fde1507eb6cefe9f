"""The on-disk blob store: content-addressed, size-limited, pinnable, crash-safe.

Layout under ``<data-dir>/blobs``::

    data/<cid>        the blob's bytes (never modified once renamed into place)
    data/<cid>.mf     its chunk manifest (wire-encoded), written before the blob
    tmp/              partial writes and in-progress fetches
    pins              one pinned CID per line, rewritten atomically

Why these rules:

- **Nothing enters unless it hashes to its CID.** :meth:`put_bytes` and
  :meth:`put_file` compute the manifest (so the CID) over the very bytes
  written; :class:`PendingBlob.commit` requires every chunk of a manifest that
  hashes to the CID to have been verified as it was written.
- **Atomic writes.** A blob is written to ``tmp/``, fsynced, renamed into
  ``data/`` and the directory fsynced, so a crash leaves either the whole blob or
  nothing; ``tmp/`` is emptied at start.
- **Pins.** Content a node still needs (the current checkpoint, the artifact it
  runs, what it publishes) is pinned and never evicted; pins are a file so they
  survive restarts.
- **LRU eviction.** Unpinned blobs are evicted least-recently-used first to make
  room; recency is the file's mtime, bumped on every read, so it also survives
  restarts. If pinned content leaves no room, :class:`StoreFull`.
- **Reservations.** A fetch reserves its declared size before the first byte
  arrives, so concurrent fetches cannot together overrun the limit.

All methods are quick metadata work or plain file I/O; callers on a trio loop
run the large ones (put of a big file, hashing) in a worker thread.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path

from pcp_p2p.blob.chunks import CHUNK_SIZE, ChunkManifest, hash_bytes, make_manifest
from pcp_p2p.core.cid import check_chunk_size, leaf_digest, parse_cid
from pcp_p2p.core.errors import BlobNotFound, HashMismatch, LocalError, ProtocolError, StoreFull
from pcp_p2p.wire import decode, encode

_MF_SUFFIX = ".mf"


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + length)`` to disk now.

    Why: a fetch ends with an fsync before the blob is renamed into place. If
    every chunk's writeback starts as soon as it is written, the disk works
    while later chunks arrive, and that final fsync waits only for the tail
    (measured here for 256 MB: 0.01–0.05 s instead of 0.07–0.13 s). It only
    starts I/O (``SYNC_FILE_RANGE_WRITE``), never waits and guarantees
    nothing; durability still comes from the fsync. A no-op off Linux.
    """
    if _sync_file_range is not None and length:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


O_DIRECT = getattr(os, "O_DIRECT", 0)
DIRECT_ALIGN = 4096  # O_DIRECT: buffer address, file offset and length (any block size up to a page)
_BOUNCE = 4 << 20  # bytes per direct write: a multiple of DIRECT_ALIGN


def write_durably(path: Path, data: bytes | bytearray | memoryview) -> None:
    """Write ``data`` as the whole of a new file at ``path`` and fsync it.

    Why not ``open(...).write``: on these VMs writing into *fresh* page-cache
    pages costs up to ~2.5 CPU-s per GB (the host backs each page on first touch;
    ``docs/blob.md``, "Fresh memory is the trap"), and the shepherd stores θ and
    the checkpoint (120 MB for a 10M model) inside every round. Direct I/O from
    one reused, page-aligned buffer skips the page cache (~0.04 CPU-s per GB
    here); a file system that refuses ``O_DIRECT`` (tmpfs) gets the plain write.
    """
    view = memoryview(data).cast("B")
    whole = len(view) - len(view) % DIRECT_ALIGN
    done = 0
    if O_DIRECT and whole >= _BOUNCE:
        done = _write_direct(path, view[:whole])
    with open(path, "r+b" if done else "wb") as f:  # the rest (all of it without direct I/O) cached
        f.seek(done)
        f.write(view[done:])
        f.flush()
        os.fsync(f.fileno())


def _write_direct(path: Path, view: memoryview) -> int:
    """Write ``view`` (a multiple of :data:`DIRECT_ALIGN` bytes) at the start of a new file with ``O_DIRECT``:
    how many bytes were written (0 if the file system refuses direct I/O; the caller writes the rest)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o644)
    except OSError:  # tmpfs and some others refuse O_DIRECT
        return 0
    done = 0
    try:
        with mmap.mmap(-1, _BOUNCE) as buf:  # page-aligned, as O_DIRECT needs
            while done < len(view):
                n = min(_BOUNCE, len(view) - done)
                buf[:n] = view[done : done + n]
                try:
                    wrote = os.pwrite(fd, memoryview(buf)[:n], done)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    return done  # direct writes refused after all: the page cache takes the rest
                if wrote != n:
                    raise OSError(errno.ENOSPC, f"short write into {path.name}")
                done += n
    finally:
        os.close(fd)
    return done


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PendingBlob:
    """A blob being written into the store (by a fetch); commit or abort it.

    The writer fills :attr:`path` (e.g. with ``os.pwrite`` at chunk offsets)
    and calls :meth:`chunk_verified` for each chunk it checked against the
    manifest before writing it; :meth:`commit` refuses until all are.
    """

    def __init__(self, store: BlobStore, cid: str, manifest: ChunkManifest, path: Path) -> None:
        self.store = store
        self.cid = cid
        self.manifest = manifest
        self.path = path
        self._done = False
        self._verified: set[int] = set()

    def chunk_verified(self, index: int) -> None:
        """Chunk ``index`` matched its manifest digest and is in the file.

        Called from the verifier thread; a set add is atomic under the GIL.
        """
        self.manifest.chunk_span(index)  # IndexError for a chunk it does not have
        self._verified.add(index)

    @property
    def complete(self) -> bool:
        """Every chunk of the manifest was verified and written."""
        return len(self._verified) == self.manifest.count

    def commit(self) -> Path:
        """Move the finished blob into place once every chunk was verified."""
        if self._done:
            raise LocalError("pending blob already committed or aborted")
        try:
            if not self.complete:
                missing = self.manifest.count - len(self._verified)
                raise HashMismatch(f"{self.cid}: {missing} chunk(s) never verified")
            if self.path.stat().st_size != self.manifest.size:
                raise HashMismatch(f"fetched file has the wrong size for {self.cid}")
            return self.store._install(self.path, self.cid, self.manifest)
        finally:
            self._finish()

    def abort(self) -> None:
        if not self._done:
            self._finish()

    def _finish(self) -> None:
        self._done = True
        self.path.unlink(missing_ok=True)
        self.store._release(self.manifest.size)

    def __enter__(self) -> PendingBlob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


class BlobStore:
    """Blobs on disk under ``root``, keyed by CID, at most ``max_bytes`` in all."""

    def __init__(self, root: Path, max_bytes: int, *, chunk_size: int = CHUNK_SIZE) -> None:
        self.root = Path(root)
        check_chunk_size(chunk_size)
        self.max_bytes = max_bytes
        self.chunk_size = chunk_size
        self._data = self.root / "data"
        self._tmp = self.root / "tmp"
        self._pins_file = self.root / "pins"
        self._lock = threading.RLock()
        self._reserved = 0
        self._seq = 0
        self._data.mkdir(parents=True, exist_ok=True)
        self._tmp.mkdir(parents=True, exist_ok=True)
        for stale in self._tmp.iterdir():  # a crash mid-write leaves these
            stale.unlink(missing_ok=True)
        self._sizes: dict[str, int] = {}
        for entry in self._data.iterdir():
            if entry.suffix == _MF_SUFFIX:
                continue
            mf = self._data / (entry.name + _MF_SUFFIX)
            if not mf.exists():
                entry.unlink(missing_ok=True)  # blob without manifest: half-installed
                continue
            if not self._manifest_ok(entry, mf):
                entry.unlink(missing_ok=True)
                continue
            self._sizes[entry.name] = entry.stat().st_size
        for mf in self._data.glob("*" + _MF_SUFFIX):
            if mf.name[: -len(_MF_SUFFIX)] not in self._sizes:
                mf.unlink(missing_ok=True)
        self._pins: set[str] = set()
        if self._pins_file.exists():
            self._pins = {ln for ln in self._pins_file.read_text().split() if ln}

    @staticmethod
    def _manifest_ok(blob: Path, mf: Path) -> bool:
        """Whether a held blob's manifest decodes (so hashes to its CID) and names it.

        A store written before large blobs were named by their chunk list holds
        them under the sha256 of all their bytes; their manifests no longer
        decode, and such entries are dropped at start rather than served.
        """
        try:
            manifest = decode(mf.read_bytes(), ChunkManifest)
        except (ProtocolError, OSError):
            return False
        return manifest.cid == blob.name and manifest.size == blob.stat().st_size

    # --- queries ------------------------------------------------------------------

    def has(self, cid: str) -> bool:
        return cid in self._sizes

    def size(self, cid: str) -> int:
        try:
            return self._sizes[cid]
        except KeyError:
            raise BlobNotFound(cid) from None

    def path(self, cid: str) -> Path:
        """The blob's file (read-only by convention); bumps its LRU recency."""
        self.size(cid)
        p = self._data / cid
        try:
            os.utime(p)
        except FileNotFoundError:
            raise BlobNotFound(cid) from None
        return p

    def read(self, cid: str, offset: int = 0, length: int | None = None) -> bytes:
        size = self.size(cid)
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise LocalError(f"range [{offset}, {offset + length}) outside blob of {size}")
        with open(self.path(cid), "rb") as f:
            f.seek(offset)
            return f.read(length)

    def read_into(self, cid: str, out: memoryview) -> None:
        """The whole blob into ``out``, which must have exactly its size."""
        size = self.size(cid)
        if len(out) != size:
            raise LocalError(f"buffer of {len(out)} bytes for a blob of {size}")
        with open(self.path(cid), "rb", buffering=0) as f:
            got = 0
            while got < size:
                n = f.readinto(out[got:])
                if not n:
                    raise BlobNotFound(f"{cid}: file shorter than its size")
                got += n

    def manifest(self, cid: str) -> ChunkManifest:
        self.size(cid)
        return decode((self._data / (cid + _MF_SUFFIX)).read_bytes(), ChunkManifest)

    def manifest_bytes(self, cid: str) -> bytes:
        self.size(cid)
        return (self._data / (cid + _MF_SUFFIX)).read_bytes()

    def cids(self) -> list[str]:
        return sorted(self._sizes)

    @property
    def used_bytes(self) -> int:
        return sum(self._sizes.values())

    def usage(self) -> dict[str, int]:
        """What the store holds, for a node's status: bytes used and allowed,
        bytes pinned (never evicted), blobs held and pinned."""
        with self._lock:
            pinned = [c for c in self._pins if c in self._sizes]
            return {"used_bytes": self.used_bytes, "max_bytes": self.max_bytes,
                    "pinned_bytes": sum(self._sizes[c] for c in pinned),
                    "blobs": len(self._sizes), "pinned_blobs": len(pinned)}

    # --- pins -----------------------------------------------------------------------

    def pin(self, cid: str) -> None:
        """Keep ``cid`` until unpinned (it must be held)."""
        self.size(cid)
        with self._lock:
            if cid not in self._pins:
                self._pins.add(cid)
                self._save_pins()

    def unpin(self, cid: str) -> None:
        with self._lock:
            if cid in self._pins:
                self._pins.discard(cid)
                self._save_pins()

    def pinned(self) -> frozenset[str]:
        return frozenset(self._pins)

    def _save_pins(self) -> None:
        tmp = self._tmp / "pins.tmp"
        with open(tmp, "w") as f:
            f.write("".join(c + "\n" for c in sorted(self._pins)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._pins_file)
        _fsync_dir(self.root)

    # --- writes -----------------------------------------------------------------

    def put_bytes(self, data: bytes | bytearray, *, cid: str | None = None, pin: bool = False) -> str:
        """Store ``data``; if ``cid`` is given the bytes must hash to it."""
        manifest = hash_bytes(data, self._chunking(cid))
        self._check_expected(manifest, cid)
        with self._reservation(len(data)):
            tmp = self._tmp_path()
            try:
                write_durably(tmp, data)
                self._install(tmp, manifest.cid, manifest)
            finally:
                tmp.unlink(missing_ok=True)
        if pin:
            self.pin(manifest.cid)
        return manifest.cid

    def put_file(self, src: Path, *, cid: str | None = None, pin: bool = False) -> str:
        """Copy the file at ``src`` into the store, hashing what is copied."""
        size = Path(src).stat().st_size
        chunk_size = self._chunking(cid)
        digest = leaf_digest(size, chunk_size)  # a size change is caught below
        with self._reservation(size):
            tmp = self._tmp_path()
            try:
                digests: list[bytes] = []
                with open(src, "rb") as fin, open(tmp, "wb") as fout:
                    while True:
                        block = fin.read(chunk_size)
                        if not block and digests:
                            break
                        digests.append(digest(block))
                        fout.write(block)
                        if len(block) < chunk_size:
                            break
                    fout.flush()
                    os.fsync(fout.fileno())
                written = tmp.stat().st_size
                manifest = make_manifest(written, chunk_size, digests)
                self._check_expected(manifest, cid)
                if written != size:
                    raise HashMismatch(f"{src} changed size while it was being stored")
                self._install(tmp, manifest.cid, manifest)
            finally:
                tmp.unlink(missing_ok=True)
        if pin:
            self.pin(manifest.cid)
        return manifest.cid

    def begin(self, cid: str, manifest: ChunkManifest) -> PendingBlob:
        """Reserve room for a blob about to be fetched and give its temp file.

        Raises :class:`StoreFull` if pinned content leaves no room for it.
        """
        if manifest.cid != cid:
            raise HashMismatch(f"manifest is for {manifest.cid}, not {cid}")
        with self._lock:
            self._make_room(manifest.size)
            self._reserved += manifest.size
        tmp = self._tmp_path()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            # Allocate up front: the fetch then writes into blocks the file
            # system already has (measured ~2x faster than a sparse file here)
            # and a full disk shows up now, not half-way through a transfer.
            if manifest.size:
                os.posix_fallocate(fd, 0, manifest.size)
        except OSError as exc:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            self._release(manifest.size)
            raise StoreFull(f"cannot allocate {manifest.size} bytes: {exc}") from exc
        os.close(fd)
        return PendingBlob(self, cid, manifest, tmp)

    def delete(self, cid: str) -> None:
        """Remove a blob (and its pin)."""
        with self._lock:
            self.unpin(cid)
            self._remove(cid)

    # --- internals ----------------------------------------------------------------

    def _chunking(self, cid: str | None) -> int:
        """The chunk size to cut content by: the expected CID's, else the store's."""
        return (parse_cid(cid).chunk_size if cid is not None else None) or self.chunk_size

    def _check_expected(self, manifest: ChunkManifest, cid: str | None) -> None:
        if cid is not None and manifest.cid != cid:
            raise HashMismatch(f"content does not match {cid}")

    def _tmp_path(self) -> Path:
        with self._lock:
            self._seq += 1
            return self._tmp / f"{os.getpid()}-{self._seq}.part"

    def _reservation(self, size: int) -> _Reservation:
        return _Reservation(self, size)

    def _release(self, size: int) -> None:
        with self._lock:
            self._reserved -= size

    def _make_room(self, size: int) -> None:
        """Evict unpinned blobs, oldest use first, until ``size`` more bytes fit."""
        if size > self.max_bytes:
            raise StoreFull(f"blob of {size} bytes exceeds the store limit {self.max_bytes}")
        need = self.used_bytes + self._reserved + size - self.max_bytes
        if need <= 0:
            return
        victims = sorted(
            (c for c in self._sizes if c not in self._pins),
            key=lambda c: self._mtime(c),
        )
        freeable = sum(self._sizes[c] for c in victims)
        if freeable < need:
            raise StoreFull(
                f"need {need} more bytes; only {freeable} are unpinned "
                f"(limit {self.max_bytes}, pinned {self.used_bytes - freeable})"
            )
        for c in victims:
            if need <= 0:
                break
            need -= self._sizes[c]
            self._remove(c)

    def _mtime(self, cid: str) -> float:
        try:
            return (self._data / cid).stat().st_mtime
        except FileNotFoundError:
            return 0.0

    def _remove(self, cid: str) -> None:
        self._sizes.pop(cid, None)
        (self._data / cid).unlink(missing_ok=True)
        (self._data / (cid + _MF_SUFFIX)).unlink(missing_ok=True)

    def _install(self, tmp: Path, cid: str, manifest: ChunkManifest) -> Path:
        """Rename a verified temp file into place (manifest first, then blob)."""
        dest = self._data / cid
        with self._lock:
            if cid in self._sizes:  # already held: identical bytes by construction
                return dest
            mf_tmp = self._tmp_path()
            with open(mf_tmp, "wb") as f:
                f.write(encode(manifest))
                f.flush()
                os.fsync(f.fileno())
            os.replace(mf_tmp, self._data / (cid + _MF_SUFFIX))
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, dest)
            _fsync_dir(self._data)
            self._sizes[cid] = manifest.size
        return dest


class _Reservation:
    def __init__(self, store: BlobStore, size: int) -> None:
        self.store = store
        self.size = size

    def __enter__(self) -> None:
        with self.store._lock:
            self.store._make_room(self.size)
            self.store._reserved += self.size

    def __exit__(self, *exc: object) -> None:
        self.store._release(self.size)

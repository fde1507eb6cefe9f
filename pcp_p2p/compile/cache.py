"""An on-disk cache of compiled artifacts, so an unchanged program is never recompiled.

The key is the hash of what determines a compile's output bytes: the
StableHLO hash, the target name, the compiler version and the exact flag
list. Each entry is ``<root>/<key[:2]>/<key>.vmfb`` with a ``.cid`` sidecar
holding the artifact's CID; a read re-hashes the bytes against the sidecar,
so a damaged entry is a miss (and is removed), never a wrong artifact.
A ``<key>.failed`` file records that a compile with *optional* flags (a
target's data tiling) failed, so the fallback is used without retrying it.
Writes go to a temporary file in the same directory, are fsynced and then
renamed over the final name, so a crash leaves either the old state or the
new, and two processes filling the same entry race harmlessly.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import msgpack

from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import ConfigError

CACHE_DIR = "compile-cache"


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see all of it or none of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def cache_key(stablehlo_hash: str, target: str, compiler_version: str,
              flags: tuple[str, ...]) -> str:
    """Hex sha256 of the canonical encoding of what decides the artifact's bytes."""
    blob = msgpack.packb(["pcp-compile-cache-v1", stablehlo_hash, target, compiler_version,
                          list(flags)], use_bin_type=True)
    return hashlib.sha256(blob).hexdigest()


class ArtifactCache:
    """Compiled vmfbs by :func:`cache_key`, and the StableHLO text they are compiled
    from by :func:`~pcp_p2p.compile.pipeline.lowering_key` (both are bytes checked by CID)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @classmethod
    def in_data_dir(cls, data_dir: Path) -> ArtifactCache:
        return cls(Path(data_dir) / CACHE_DIR)

    def _paths(self, key: str) -> tuple[Path, Path]:
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise ConfigError(f"not a cache key: {key!r:.80}")
        d = self.root / key[:2]
        return d / f"{key}.vmfb", d / f"{key}.cid"

    def get(self, key: str) -> bytes | None:
        """The cached artifact for ``key``, or None (missing or damaged)."""
        vmfb, cid = self._paths(key)
        try:
            data = vmfb.read_bytes()
            expected = cid.read_text().strip()
        except OSError:
            return None
        if cid_of(data) != expected:
            self.discard(key)
            return None
        return data

    def put(self, key: str, data: bytes) -> str:
        """Store ``data`` under ``key``; its CID."""
        vmfb, cid_path = self._paths(key)
        cid = cid_of(data)
        atomic_write(vmfb, data)
        atomic_write(cid_path, cid.encode())  # last: an entry without it is a miss
        return cid

    def _failure_path(self, key: str) -> Path:
        vmfb, _ = self._paths(key)
        return vmfb.with_suffix(".failed")

    def put_failure(self, key: str, reason: str) -> None:
        """Remember that ``key``'s compile fails (deterministic for the same key), with why."""
        atomic_write(self._failure_path(key), reason.encode()[-4000:])

    def failed(self, key: str) -> bool:
        """Whether a compile for ``key`` is known to fail (see :meth:`put_failure`)."""
        return self._failure_path(key).is_file()

    def discard(self, key: str) -> None:
        for p in self._paths(key):
            try:
                p.unlink()
            except OSError:
                pass

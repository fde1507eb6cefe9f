"""Content-addressed blob exchange: store, chunk manifests, transfer, tensor payloads.

Public names, re-exported one by one (see ``docs/blob.md``):

- :class:`BlobStore` — on-disk store under ``<data-dir>/blobs``.
- :class:`BlobService`, :class:`BlobConfig` — ``/pcp/blob/1.0.0`` on a libp2p host.
- :class:`ContentRouting`, :class:`DhtRouting`, :class:`MemoryRouting` — who holds a CID.
- :func:`encode_tensors`, :func:`decode_tensors` — named float tensors as bytes.

Imports are lazy so ``import pcp_p2p.blob.tensors`` does not pull in libp2p.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pcp_p2p.blob.chunks import ChunkManifest
    from pcp_p2p.blob.routing import ContentRouting, DhtRouting, MemoryRouting
    from pcp_p2p.blob.service import BlobConfig, BlobService, FetchReport
    from pcp_p2p.blob.store import BlobStore
    from pcp_p2p.blob.tensors import decode_tensors, encode_tensors

_WHERE = {
    "ChunkManifest": "pcp_p2p.blob.chunks",
    "ContentRouting": "pcp_p2p.blob.routing",
    "DhtRouting": "pcp_p2p.blob.routing",
    "MemoryRouting": "pcp_p2p.blob.routing",
    "BlobConfig": "pcp_p2p.blob.service",
    "BlobService": "pcp_p2p.blob.service",
    "FetchReport": "pcp_p2p.blob.service",
    "BlobStore": "pcp_p2p.blob.store",
    "decode_tensors": "pcp_p2p.blob.tensors",
    "encode_tensors": "pcp_p2p.blob.tensors",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(name)

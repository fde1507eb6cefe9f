"""Content-addressed blob exchange: store, chunk manifests, transfer, tensor payloads.

Public names, re-exported one by one (see ``docs/blob.md``):

- :class:`BlobStore` — on-disk store under ``<data-dir>/blobs``.
- :class:`BlobService`, :class:`BlobConfig` — ``/pcp/blob/1.0.0`` on a libp2p host.
- :class:`ContentRouting`, :class:`DhtRouting`, :class:`MemoryRouting` — who holds a CID.
- :func:`encode_tensors`, :func:`decode_tensors` — named float tensors as bytes.

Imports are lazy so ``import pcp_p2p.blob.tensor_codec`` does not pull in libp2p.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # ``X as X``: the explicit re-export form, so type checkers see these names as this package's API.
    from pcp_p2p.blob.chunks import ChunkManifest as ChunkManifest
    from pcp_p2p.blob.routing import ContentRouting as ContentRouting
    from pcp_p2p.blob.routing import DhtRouting as DhtRouting
    from pcp_p2p.blob.routing import MemoryRouting as MemoryRouting
    from pcp_p2p.blob.server import BlobConfig as BlobConfig
    from pcp_p2p.blob.service import BlobService as BlobService
    from pcp_p2p.blob.service import FetchReport as FetchReport
    from pcp_p2p.blob.store import BlobStore as BlobStore
    from pcp_p2p.blob.tensor_codec import decode_tensors as decode_tensors
    from pcp_p2p.blob.tensor_codec import encode_tensors as encode_tensors

_WHERE = {
    "ChunkManifest": "pcp_p2p.blob.chunks",
    "ContentRouting": "pcp_p2p.blob.routing",
    "DhtRouting": "pcp_p2p.blob.routing",
    "MemoryRouting": "pcp_p2p.blob.routing",
    "BlobConfig": "pcp_p2p.blob.server",
    "BlobService": "pcp_p2p.blob.service",
    "FetchReport": "pcp_p2p.blob.service",
    "BlobStore": "pcp_p2p.blob.store",
    "decode_tensors": "pcp_p2p.blob.tensor_codec",
    "encode_tensors": "pcp_p2p.blob.tensor_codec",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(name)

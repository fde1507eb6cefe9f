"""A standalone blob provider process, for integration tests and benchmarks.

    python -m pcp_p2p.blob.peerproc --data-dir D --size N --seed S [--fault F]

Starts a libp2p host on 127.0.0.1, stores a deterministic blob of ``N`` bytes
(numpy PCG64 stream ``S``, so every provider started with the same seed holds
the same blob), serves it on ``/pcp/blob/1.0.0`` and prints one JSON line
``{"peer_id", "addrs", "cid", "manifest_cid"}``. It exits when its stdin
closes, so a parent that dies never leaves it behind.

``--fault midchunk`` makes it send half of its second chunk record, print
``MIDCHUNK`` and hang: the parent then kills it at a known point of a transfer
(no sleeps, no guessing).
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import threading
from pathlib import Path

import libp2p
import numpy as np
import trio
from libp2p.peer.peerinfo import PeerInfo
from multiaddr import Multiaddr

from pcp_p2p.blob.chunks import manifest_cid
from pcp_p2p.blob.routing import MemoryRouting
from pcp_p2p.blob.server import BlobConfig
from pcp_p2p.blob.service import BlobService
from pcp_p2p.blob.sidechannel import KIND_CHUNK, RecordCipher
from pcp_p2p.blob.store import BlobStore
from pcp_p2p.core.identity import Identity


def blob_bytes(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(size)


class MidChunkFault(BlobService):
    """Sends half of its second chunk, says so on stdout, then hangs."""

    sent = 0
    hang = threading.Event()

    def _send_chunk(
        self, sock: socket.socket, cipher: RecordCipher, index: int, data: memoryview, out: bytearray
    ) -> None:
        MidChunkFault.sent += 1
        if MidChunkFault.sent < 2:
            return super()._send_chunk(sock, cipher, index, data, out)
        header, ct = cipher.seal(KIND_CHUNK, bytes(data))
        sock.sendall(header + ct[: len(ct) // 2])
        print("MIDCHUNK", flush=True)
        self.hang.wait()


async def amain(args: argparse.Namespace) -> None:
    ident = Identity.generate()
    host = libp2p.new_host(key_pair=ident.key_pair)
    async with host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        info = PeerInfo(host.get_id(), host.get_addrs())
        store = BlobStore(Path(args.data_dir) / "blobs", max(args.size * 2, 1 << 20))
        cls = MidChunkFault if args.fault == "midchunk" else BlobService
        svc = cls(host, store, MemoryRouting().for_peer(info), ident,
                  BlobConfig(max_uploads=args.max_uploads))
        svc.register()
        data = blob_bytes(args.size, args.seed)
        cid = await svc.publish(data)
        del data
        print(json.dumps({
            "peer_id": ident.peer_id,
            "addrs": [str(a) for a in host.get_addrs()],
            "cid": cid,
            "manifest_cid": manifest_cid(store.manifest(cid)),
        }), flush=True)
        # Serve until stdin closes (the parent ended or dropped us).
        # trio-typing's stale stubs (a libp2p dependency) shadow trio's own, which has abandon_on_cancel.
        await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)  # type: ignore[call-arg, unused-ignore]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fault", choices=["none", "midchunk"], default="none")
    parser.add_argument("--max-uploads", type=int, default=4)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("libp2p").setLevel(logging.ERROR)
    trio.run(amain, args)


if __name__ == "__main__":
    main()

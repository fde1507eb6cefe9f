"""A 50 MB blob from three provider processes, one SIGKILLed mid-chunk, arrives intact."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import libp2p
import pytest
import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from multiaddr import Multiaddr

from pcp_p2p.blob.peerproc import blob_bytes
from pcp_p2p.blob.routing import MemoryRouting
from pcp_p2p.blob.service import BlobConfig, BlobService
from pcp_p2p.blob.store import BlobStore
from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.identity import Identity

ROOT = Path(__file__).resolve().parent.parent
SIZE = 50 * 1024 * 1024
SEED = 7
logging.getLogger("libp2p").setLevel(logging.CRITICAL)


class Providers:
    """Provider child processes, each in its own process group, all killed at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, data_dir: Path, fault: str = "none") -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pcp_p2p.blob.peerproc", "--data-dir", str(data_dir),
             "--size", str(SIZE), "--seed", str(SEED), "--fault", fault],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    @staticmethod
    def ready(proc: subprocess.Popen[str]) -> dict:
        """The provider's JSON line (peer id, addresses, CID), once it serves."""
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line, "provider exited before it was ready"
        return json.loads(line)  # type: ignore[no-any-return]

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait(timeout=10)


@pytest.fixture
def providers() -> Iterator[Providers]:
    ps = Providers()
    try:
        yield ps
    finally:
        ps.kill_all()


@pytest.mark.timeout(120)
async def test_fifty_mb_from_three_providers_survives_a_sigkill(tmp_path: Path, providers: Providers) -> None:
    # The victim goes first in the list so it is certain to be handed chunks.
    victim = providers.start(tmp_path / "p0", "midchunk")
    others = [providers.start(tmp_path / f"p{k}") for k in (1, 2)]  # all start at once
    metas = [await trio.to_thread.run_sync(providers.ready, p) for p in (victim, *others)]
    vmeta = metas[0]
    cid = metas[0]["cid"]
    assert all(m["cid"] == cid for m in metas)
    infos = [PeerInfo(ID.from_base58(m["peer_id"]), [Multiaddr(a) for a in m["addrs"]]) for m in metas]

    async def kill_victim_mid_chunk() -> None:
        line = await trio.to_thread.run_sync(victim.stdout.readline)  # type: ignore[union-attr]
        assert line.strip() == "MIDCHUNK"
        os.killpg(victim.pid, signal.SIGKILL)

    ident = Identity.generate()
    host = libp2p.new_host(key_pair=ident.key_pair)
    async with host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        me = PeerInfo(host.get_id(), host.get_addrs())
        svc = BlobService(host, BlobStore(tmp_path / "fetcher", 1 << 30), MemoryRouting().for_peer(me),
                          ident, BlobConfig(stall_timeout=20.0))
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(kill_victim_mid_chunk)
                path = await svc.fetch(cid, providers=infos)
    assert victim.wait(timeout=10) == -signal.SIGKILL
    report = svc.last_fetch
    assert report is not None
    victim_id = vmeta["peer_id"]
    assert victim_id in report.failures and "PeerGone" in report.failures[victim_id]
    assert report.chunks_from.get(victim_id, 0) >= 1  # its verified chunk was kept
    assert sum(report.chunks_from.values()) == 13  # 50 MB / 4 MiB chunks, none fetched twice
    data = await trio.to_thread.run_sync(path.read_bytes)
    assert cid_of(data) == cid and data == blob_bytes(SIZE, SEED)

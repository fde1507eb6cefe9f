"""Blob transfer throughput against raw TCP, and fan-out, on loopback.

    .venv/bin/python bench/transfer.py [--size-mb 256] [--fanout-mb 50] [--nodes 8] [--repeat 7]

1. raw: a child process sends the blob's bytes over a plain TCP socket
   (``sendall`` of 1 MiB slices; the parent ``recv_into`` a buffer reused
   across runs). No encryption, no hashing: the ceiling of the machine.
2. pcp: a provider process (``python -m pcp_p2p.blob.peerproc``) serves the same
   size of blob; this process fetches it by CID with BlobService over libp2p +
   the AES-256-GCM side channel, with every check on (Noise-authenticated
   control stream, the chunk manifest against the CID, every chunk's BLAKE3
   against the manifest), into memory like the raw copy:
   ``fetch_into(cid, buf)`` with a buffer reused across runs. Timed from the
   call to the verified bytes. This is the headline.
3. pcp into the store: the same fetch with ``fetch()``, which also writes every
   chunk into the store and commits it atomically (fsync, rename). Compared
   with the raw copy and with raw-to-file (the raw copy, then 4 MiB pwrites
   into a preallocated file and an fsync).
4. fan-out: one provider holds a 50 MB blob; 8 nodes (libp2p hosts in this
   process, each with its own store) fetch it at once. Total time for all 8
   versus one fetch alone.

Prints one JSON line: headline = raw_time / pcp_time (a throughput ratio).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

import libp2p
import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from multiaddr import Multiaddr

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pcp_p2p.blob.routing import MemoryRouting  # noqa: E402
from pcp_p2p.blob.service import BlobService  # noqa: E402
from pcp_p2p.blob.store import BlobStore  # noqa: E402
from pcp_p2p.core.identity import Identity  # noqa: E402

MiB = 1024 * 1024
_TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def raw_child(port: int, size: int) -> None:
    data = os.urandom(size)
    view = memoryview(data)
    with socket.create_connection(("127.0.0.1", port)) as s:
        while s.recv(1):  # one "go" byte per run; EOF ends
            for i in range(0, size, MiB):
                s.sendall(view[i : i + MiB])


class RawPeer:
    """A child process that sends ``size`` random bytes over plain TCP per "go" byte."""

    def __init__(self, size: int) -> None:
        self.size = size
        lsock = socket.create_server(("127.0.0.1", 0))
        self.child = subprocess.Popen(
            [sys.executable, __file__, "--raw-child", str(lsock.getsockname()[1]), str(size)],
            start_new_session=True,
        )
        try:
            lsock.settimeout(60)
            self.conn, _ = lsock.accept()
        finally:
            lsock.close()
        self.conn.settimeout(60)
        self.buf = bytearray(size)

    def run_once(self, to_file: Path | None = None) -> tuple[float, float]:
        """(seconds, CPU seconds of both processes) for one copy into memory; with
        ``to_file`` the bytes also land in a file (fallocate, 4 MiB pwrites, fsync):
        the floor for any fetch into a store."""
        view = memoryview(self.buf)
        fd = None
        if to_file is not None:
            fd = os.open(to_file, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
            os.posix_fallocate(fd, 0, self.size)
        c0 = time.process_time() + proc_cpu(self.child.pid)
        t0 = time.perf_counter()
        self.conn.sendall(b"g")
        got = 0
        while got < self.size:
            k = self.conn.recv_into(view[got:], self.size - got)
            if k == 0:
                raise RuntimeError("raw child closed early")
            got += k
        if fd is not None:
            for i in range(0, self.size, 4 * MiB):
                os.pwrite(fd, view[i : i + 4 * MiB], i)
            os.fsync(fd)
        dt = time.perf_counter() - t0
        cpu = time.process_time() + proc_cpu(self.child.pid) - c0
        if fd is not None and to_file is not None:
            os.close(fd)
            to_file.unlink()
        return dt, cpu

    def stop(self) -> None:
        self.conn.close()
        try:
            self.child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.child.pid, 9)
            self.child.wait()


STREAM_PROTO = "/pcp/bench/stream/1.0.0"


async def stream_child(size: int) -> None:
    """Serve ``size`` bytes on a plain libp2p stream (the data path we did not choose)."""
    host = libp2p.new_host(key_pair=Identity.generate().key_pair)
    data = os.urandom(size)

    async def handler(stream) -> None:  # type: ignore[no-untyped-def]
        await stream.read(1)
        for i in range(0, size, MiB):
            await stream.write(data[i : i + MiB])
        await stream.close()

    host.set_stream_handler(STREAM_PROTO, handler)
    async with host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        print(json.dumps({"peer_id": host.get_id().to_base58(),
                          "addrs": [str(a) for a in host.get_addrs()]}), flush=True)
        await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)


async def stream_run(size: int) -> float:
    """Seconds to read ``size`` bytes over one Noise + Yamux libp2p stream."""
    # Blocking here is harmless (ASYNC220): the loop has nothing else to run until the child's first line
    # arrives, and nothing is timed yet.
    child = subprocess.Popen([sys.executable, __file__, "--stream-child", str(size)],  # noqa: ASYNC220
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        meta = json.loads(child.stdout.readline())  # type: ignore[union-attr]
        host = libp2p.new_host(key_pair=Identity.generate().key_pair)
        async with host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            info = PeerInfo(ID.from_base58(meta["peer_id"]), [Multiaddr(a) for a in meta["addrs"]])
            await host.connect(info)
            stream = await host.new_stream(info.peer_id, [STREAM_PROTO])
            t0 = time.perf_counter()
            await stream.write(b"g")
            got = 0
            while got < size:
                part = await stream.read(MiB)
                if not part:
                    raise RuntimeError("stream ended early")
                got += len(part)
            return time.perf_counter() - t0
    finally:
        os.killpg(child.pid, 9)
        child.wait()


class Provider:
    """A peerproc child serving one deterministic blob."""

    def __init__(self, size: int, seed: int, workdir: Path, slots: int = 4) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pcp_p2p.blob.peerproc", "--data-dir", str(workdir),
             "--size", str(size), "--seed", str(seed), "--max-uploads", str(slots)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, start_new_session=True, text=True,
        )
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError("provider died before it was ready")
        meta = json.loads(line)
        self.cid: str = meta["cid"]
        self.info = PeerInfo(ID.from_base58(meta["peer_id"]), [Multiaddr(a) for a in meta["addrs"]])

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
            self.proc.wait()


async def interleaved(raw: RawPeer, provider: Provider, workdir: Path, repeat: int) -> dict[str, list[float]]:
    """Alternate raw copies and PCP fetches so both see the same machine load."""
    ident = Identity.generate()
    host = libp2p.new_host(key_pair=ident.key_pair)
    out: dict[str, list[float]] = {
        k: [] for k in ("raw", "raw_cpu", "raw_file", "pcp", "pcp_cpu", "store", "store_cpu")}
    buf = bytearray(raw.size)
    async with host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        info = PeerInfo(host.get_id(), host.get_addrs())
        store = BlobStore(workdir / "fetcher", 1 << 40)
        svc = BlobService(host, store, MemoryRouting().for_peer(info), ident)
        await svc.fetch(provider.cid, providers=[provider.info])  # warm-up: dial, page cache
        store.delete(provider.cid)
        await svc.fetch_into(provider.cid, buf, providers=[provider.info])
        for _ in range(repeat):
            t, c = await trio.to_thread.run_sync(raw.run_once)
            out["raw"].append(t)
            out["raw_cpu"].append(c)
            for key, fetch in (("pcp", lambda: svc.fetch_into(provider.cid, buf, providers=[provider.info])),
                               ("store", lambda: svc.fetch(provider.cid, providers=[provider.info]))):
                c0 = time.process_time() + proc_cpu(provider.proc.pid)
                t0 = time.perf_counter()
                await fetch()
                out[key].append(time.perf_counter() - t0)
                out[key + "_cpu"].append(time.process_time() + proc_cpu(provider.proc.pid) - c0)
            store.delete(provider.cid)
            t, _ = await trio.to_thread.run_sync(raw.run_once, workdir / "raw.bin")
            out["raw_file"].append(t)
    return out


async def fanout(provider: Provider, workdir: Path, nodes: int) -> tuple[float, float]:
    async with AsyncExitStack() as stack:
        svcs = []
        for k in range(nodes):
            ident = Identity.generate()
            host = libp2p.new_host(key_pair=ident.key_pair)
            await stack.enter_async_context(host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]))
            info = PeerInfo(host.get_id(), host.get_addrs())
            svcs.append(BlobService(host, BlobStore(workdir / f"fan{k}", 1 << 40),
                                    MemoryRouting().for_peer(info), ident))
        # single transfer (after a warm-up that opens the connection)
        for _ in range(2):
            t0 = time.perf_counter()
            await svcs[0].fetch(provider.cid, providers=[provider.info])
            single = time.perf_counter() - t0
            svcs[0].store.delete(provider.cid)
        for s in svcs[1:]:  # connect every node first: time the transfer, not the dial
            await s.host.connect(provider.info)
        t0 = time.perf_counter()
        async with trio.open_nursery() as n:
            for s in svcs:
                n.start_soon(lambda s=s: s.fetch(provider.cid, providers=[provider.info]))
        total = time.perf_counter() - t0
        for s in svcs:
            assert s.store.has(provider.cid)
    return single, total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--fanout-mb", type=int, default=50)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--stream-mb", type=int, default=64, help="size for the plain libp2p stream figure")
    ap.add_argument("--raw-child", nargs=2, type=int, help=argparse.SUPPRESS)
    ap.add_argument("--stream-child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.raw_child:
        raw_child(*args.raw_child)
        return
    if args.stream_child:
        logging.getLogger("libp2p").setLevel(logging.ERROR)
        trio.run(stream_child, args.stream_child)
        return
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("libp2p").setLevel(logging.ERROR)
    size = args.size_mb * MiB
    workdir = Path(tempfile.mkdtemp(prefix="pcp-bench-transfer-"))
    providers: list[Provider] = []
    try:
        raw_peer = RawPeer(size)
        try:
            big = Provider(size, 1, workdir / "p1")
            providers.append(big)
            m = trio.run(interleaved, raw_peer, big, workdir, args.repeat)
        finally:
            raw_peer.stop()
        big.stop()
        small = Provider(args.fanout_mb * MiB, 2, workdir / "p2")
        providers.append(small)
        single, total = trio.run(fanout, small, workdir, args.nodes)
        small.stop()
        stream_s = trio.run(stream_run, args.stream_mb * MiB)
    finally:
        for p in providers:
            p.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in m.items()}
    print(json.dumps({
        "headline": round(med["raw"] / med["pcp"], 3),
        "target": 0.8,  # issue #20 item 6
        "better": "higher",
        "unit": "ratio",
        "metric": f"pcp blob fetch into memory (fetch_into) / raw TCP copy into memory, throughput, "
                  f"{args.size_mb} MB, loopback, 2 processes",
        "size_mb": args.size_mb,
        "raw_mb_s": round(size / med["raw"] / 1e6, 1),
        "pcp_mb_s": round(size / med["pcp"] / 1e6, 1),
        "raw_s": [round(t, 3) for t in m["raw"]],
        "pcp_s": [round(t, 3) for t in m["pcp"]],
        "raw_cpu_s": round(med["raw_cpu"], 3),
        "pcp_cpu_s": round(med["pcp_cpu"], 3),
        "cpu_ratio": round(med["raw_cpu"] / med["pcp_cpu"], 3),
        "store_vs_raw": round(med["raw"] / med["store"], 3),
        "store_mb_s": round(size / med["store"] / 1e6, 1),
        "store_s": [round(t, 3) for t in m["store"]],
        "store_cpu_s": round(med["store_cpu"], 3),
        "raw_to_file_mb_s": round(size / med["raw_file"] / 1e6, 1),
        "store_vs_raw_to_file": round(med["raw_file"] / med["store"], 3),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "libp2p_stream_mb_s": round(args.stream_mb * MiB / stream_s / 1e6, 1),
        "fanout_nodes": args.nodes,
        "fanout_mb": args.fanout_mb,
        "fanout_single_s": round(single, 3),
        "fanout_total_s": round(total, 3),
        "fanout_vs_single": round(total / single, 2),
        "checks": "noise-authenticated control, AES-256-GCM records (HKDF key bound to both peer ids), "
                  "manifest vs CID, BLAKE3 of every chunk vs manifest; store: fsync before commit",
    }))


if __name__ == "__main__":
    main()

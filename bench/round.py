"""The end of a round: from the last worker's Δ leaving to every worker holding the next θ.

Run: ``.venv/bin/python bench/round.py`` (about a minute on 2 CPU cores).

Issue #15's figure: a 10M-parameter model (40 MB of fp32 θ), 4 worker
processes on 127.0.0.1, goal ≤ 0.3 s. For reference, a peer system's
all-reduce of the same 40 MB among 4 peers took 1.29 s (fp32) on this machine.

What runs: a shepherd process and ``WORKERS`` worker processes, each its own
libp2p host with the real :class:`~pcp_p2p.blob.service.BlobService` (side
channels, AES-GCM, BLAKE3 per chunk, manifests checked against CIDs, the
store). The driver (this process) plays the messages of the round flow
(``docs/diloco.md``) over pipes, which cost well under a millisecond each:

1. every worker encodes its Δ (int8, the default codec) and stores it; the
   clock starts when the last one has (its Submission would leave now);
2. the shepherd fetches the Δs into memory (``fetch_into``, as
   ``run_blobs`` does), decodes and averages them, takes the outer Nesterov
   step, encodes the checkpoint (θ and momentum, 80 MB) and stores it;
3. every worker fetches the checkpoint before it accepts the commit, then
   holds θ (see the arms for who fetches when);
4. the clock stops when the last worker holds θ: checked against its CID,
   in memory, where the runtime hands it to the worker machine (it is
   stored in the background); in the ``direct`` arm, fetched into the store.

Arms, in the same run, alternating round by round so both see the same load:

- ``swarm`` (today's flow): the commit goes to every worker at once, and
  each fetches the checkpoint from its tree ancestors, the shepherd last
  (:mod:`pcp_p2p.blob.swarm`), and takes θ out of it (byte-identical; its
  CID checked);
- ``direct`` (the flow before swarming, the baseline): the commit is held
  until one of ``REPLICAS`` = 2 replicas holds the checkpoint, then every
  other worker fetches it from the shepherd, then θ from the shepherd.

Also reported: the shepherd's side-channel bytes out per round over θ's size
(``shepherd_out_per_theta``), per arm.

Knobs: ``PCP_BENCH_ROUND_PARAMS`` (10_000_000), ``PCP_BENCH_ROUND_WORKERS``
(4), ``PCP_BENCH_ROUND_ROUNDS`` (3 per arm).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PARAMS = int(os.environ.get("PCP_BENCH_ROUND_PARAMS", "10000000"))
WORKERS = int(os.environ.get("PCP_BENCH_ROUND_WORKERS", "4"))
ROUNDS = int(os.environ.get("PCP_BENCH_ROUND_ROUNDS", "3"))
REPLICAS = 2
TARGET_S = 0.3
TENSORS = 4  # θ as this many equal tensors


# --- a process: one libp2p host and blob service, driven over stdin/stdout ---------------------


async def serve(data_dir: Path) -> None:
    import libp2p
    import trio
    from libp2p.peer.peerinfo import PeerInfo
    from multiaddr import Multiaddr

    from pcp_p2p.blob.routing import MemoryRouting
    from pcp_p2p.blob.service import BlobService
    from pcp_p2p.blob.store import BlobStore
    from pcp_p2p.core.identity import Identity
    from pcp_p2p.net.traffic import Traffic

    ident = Identity.generate()
    host = libp2p.new_host(key_pair=ident.key_pair)
    async with host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        info = PeerInfo(host.get_id(), host.get_addrs())
        store = BlobStore(data_dir / "blobs", 2 << 30)
        svc = BlobService(host, store, MemoryRouting().for_peer(info), ident, traffic=Traffic())
        svc.register()
        node = BenchNode(svc)
        print(json.dumps({"peer": ident.peer_id, "addrs": [str(a) for a in host.get_addrs()]}), flush=True)
        while line := await trio.to_thread.run_sync(sys.stdin.readline):
            cmd = json.loads(line)
            print(json.dumps(await getattr(node, cmd.pop("op"))(**cmd)), flush=True)


class BenchNode:
    """One bench process's part of the round flow: each method answers one driver command."""

    def __init__(self, svc: Any) -> None:
        from pcp_p2p.diloco.algorithm.outer import OuterState

        self.svc = svc
        self.peers: dict[str, Any] = {}
        self.state: OuterState | None = None
        self.bufs: list[bytearray] = []
        self.size = PARAMS // TENSORS

    async def peers_are(self, peers: dict[str, list[str]]) -> dict[str, Any]:
        from libp2p.peer.id import ID
        from libp2p.peer.peerinfo import PeerInfo
        from multiaddr import Multiaddr

        me = self.svc.peer_id
        self.peers = {p: PeerInfo(ID.from_base58(p), [Multiaddr(a) for a in addrs])
                      for p, addrs in peers.items() if p != me}
        for p in self.peers.values():
            await self.svc.host.connect(p)
        return {"ok": True}

    async def init(self) -> dict[str, Any]:
        """The shepherd's θ_0 and zero momentum."""
        import numpy as np

        from pcp_p2p.diloco.algorithm.outer import OuterState

        rng = np.random.default_rng(0)
        self.state = OuterState.initial({f"w{k}": rng.standard_normal(self.size, dtype=np.float32)
                                         for k in range(TENSORS)})
        return {"ok": True}

    async def delta(self, seed: int) -> dict[str, Any]:
        """A worker's Δ, int8-encoded and stored (its submission would name it now)."""
        import numpy as np
        import trio

        from pcp_p2p.blob.tensor_codec import encode_tensors

        def make() -> str:
            rng = np.random.default_rng(seed)
            d = {f"w{k}": rng.standard_normal(self.size, dtype=np.float32) * 1e-3 for k in range(TENSORS)}
            cid: str = self.svc.store.put_bytes(encode_tensors(d, codec="int8"))
            return cid

        return {"cid": await trio.to_thread.run_sync(make), "t": time.monotonic()}

    async def aggregate(self, subs: list[tuple[str, str]]) -> dict[str, Any]:
        """The shepherd: fetch the Δs into memory, average, outer Nesterov step, checkpoint and θ stored."""
        import trio

        from pcp_p2p.blob.tensor_codec import decode_tensors
        from pcp_p2p.diloco.algorithm.checkpoint import Checkpoint, checkpoint_theta_bytes, encode_checkpoint
        from pcp_p2p.diloco.algorithm.outer import nesterov_step

        state = self.state
        assert state is not None
        while len(self.bufs) < len(subs):
            self.bufs.append(bytearray(PARAMS + (1 << 20)))
        views: list[memoryview] = []

        async def one(k: int, cid: str, peer: str) -> None:
            views.append(await self.svc.fetch_into(cid, self.bufs[k], providers=[self.peers[peer]]))

        async with trio.open_nursery() as n:
            for k, (cid, peer) in enumerate(subs):
                n.start_soon(one, k, cid, peer)

        def outer() -> tuple[str, str, int]:
            decoded = [decode_tensors(bytes(v), max_bytes=8 * PARAMS) for v in views]
            mean = {name: sum(d[name] for d in decoded) / len(decoded) for name in state.theta}
            self.state = new = nesterov_step(state, mean, lr=0.7, momentum=0.9)  # the shepherd's step
            ckpt, theta_cid = encode_checkpoint(Checkpoint("bench", 0, new))
            theta = checkpoint_theta_bytes(ckpt)  # as the shepherd takes θ's bytes
            # the shepherd's StoreBlob of θ and of the checkpoint: two stores side by side, as the
            # runtime's store_later runs them; the commit leaves once both are done
            with ThreadPoolExecutor(2) as pool:
                stored_theta = pool.submit(self.svc.store.put_bytes, theta)
                ckpt_cid = self.svc.store.put_bytes(ckpt)
                stored_theta.result()
            return ckpt_cid, theta_cid, len(theta)

        ckpt_cid, theta_cid, theta_bytes = await trio.to_thread.run_sync(outer)
        return {"ckpt": ckpt_cid, "theta": theta_cid, "theta_bytes": theta_bytes, "t": time.monotonic()}

    async def fetch(self, ckpt: str, providers: list[str], ordered: bool, theta: str, theta_from_ckpt: bool,
                    shepherd: str = "") -> dict[str, Any]:
        """A worker: the checkpoint, then θ (out of the checkpoint, or fetched from the shepherd)."""
        import trio

        from pcp_p2p.core.cid import cid_of
        from pcp_p2p.diloco.algorithm.checkpoint import THETA_HEAD, checkpoint_theta_span

        store = self.svc.store
        await self.svc.fetch(ckpt, providers=[self.peers[p] for p in providers], ordered=ordered, announce=False)
        if not theta_from_ckpt:
            await self.svc.fetch(theta, providers=[self.peers[shepherd]], announce=False)
            return {"t": time.monotonic()}

        def extract() -> bytes:  # as the runtime does: only θ's range of the checkpoint
            off, length = checkpoint_theta_span(store.read(ckpt, 0, min(THETA_HEAD, store.size(ckpt))))
            data = store.read(ckpt, off, length)
            if cid_of(data) != theta:
                raise SystemExit("θ in the checkpoint does not match its CID")
            return data

        data = await trio.to_thread.run_sync(extract)
        done = time.monotonic()  # θ is held (and checked): the runtime stores it in the background
        await trio.to_thread.run_sync(store.put_bytes, data)
        return {"t": done}

    async def traffic(self) -> dict[str, int]:
        snapshot: dict[str, int] = self.svc.traffic.snapshot()
        return snapshot


# --- the driver -----------------------------------------------------------------------------------


class Proc:
    def __init__(self, root: Path, name: str) -> None:
        (root / name).mkdir(parents=True)
        self.log = open(root / f"{name}.log", "wb")
        self.p = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(root / name)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
        hello = self.read()
        self.peer: str = hello["peer"]
        self.addrs: list[str] = hello["addrs"]

    def send(self, **cmd: Any) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def read(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            self.log.flush()
            tail = Path(self.log.name).read_text(errors="replace")[-12000:]
            raise RuntimeError(f"a bench process died; its log ends:\n{tail}")
        out: dict[str, Any] = json.loads(line)
        return out

    def ask(self, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        return self.read()

    def close(self) -> None:
        if self.p.stdin is not None:
            self.p.stdin.close()
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.log.close()


def one_round(arm: str, seed: int, shepherd: Proc, workers: list[Proc]) -> dict[str, Any]:
    from pcp_p2p.blob.swarm import tree_order, upstream

    for k, w in enumerate(workers):
        w.send(op="delta", seed=seed * 1000 + k)
    subs = [(w.read()["cid"], w.peer) for w in workers]
    before = shepherd.ask(op="traffic")["bytes_out"]
    t0 = time.monotonic()  # the last Δ is stored: its submission leaves now
    agg = shepherd.ask(op="aggregate", subs=subs)
    ckpt, theta = agg["ckpt"], agg["theta"]
    members = [w.peer for w in workers]
    by_peer = {w.peer: w for w in workers}
    if arm == "swarm":  # the commit goes to every worker at once; each fetches through the tree
        for w in [by_peer[p] for p in tree_order(ckpt, members)]:
            w.send(op="fetch", ckpt=ckpt, providers=[*upstream(ckpt, members, w.peer), shepherd.peer],
                   ordered=True, theta=theta, theta_from_ckpt=True)
        done = [w.read()["t"] for w in workers]
    else:
        replicas = workers[:REPLICAS]

        def fetch(w: Proc) -> None:
            w.send(op="fetch", ckpt=ckpt, providers=[shepherd.peer], ordered=False, theta=theta,
                   theta_from_ckpt=False, shepherd=shepherd.peer)
        for r in replicas:
            fetch(r)
        done = [replicas[0].read()["t"]]  # one ack releases the commit
        rest = [w for w in workers if w not in replicas]
        for w in rest:
            fetch(w)
        done += [w.read()["t"] for w in [*replicas[1:], *rest]]
    after = shepherd.ask(op="traffic")["bytes_out"]
    return {"s": max(done) - t0, "aggregate_s": agg["t"] - t0,
            "shepherd_out_per_theta": (after - before) / agg["theta_bytes"]}


def main() -> None:
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    results: dict[str, list[dict[str, Any]]] = {"swarm": [], "direct": []}
    with tempfile.TemporaryDirectory(prefix="pcp-bench-round-") as tmp:
        root = Path(tmp)
        procs: list[Proc] = []
        try:
            shepherd = Proc(root, "shepherd")
            procs.append(shepherd)
            workers = [Proc(root, f"w{k}") for k in range(WORKERS)]
            procs += workers
            everyone = {p.peer: p.addrs for p in procs}
            for p in procs:
                p.ask(op="peers_are", peers=everyone)
            shepherd.ask(op="init")
            one_round("direct", 0, shepherd, workers)  # warm-up: connections, buffers, page cache
            for r in range(ROUNDS):
                for arm in ("swarm", "direct") if r % 2 == 0 else ("direct", "swarm"):
                    results[arm].append(one_round(arm, 1 + 2 * r + (arm == "swarm"), shepherd, workers))
        finally:
            for p in procs:
                p.close()

    def med(arm: str, key: str) -> float:
        return round(statistics.median(x[key] for x in results[arm]), 3)

    print(json.dumps({
        "headline": med("swarm", "s"),
        "target": TARGET_S,
        "better": "lower",
        "unit": "s from the last Δ stored to every worker holding the next θ (median)",
        "baseline_direct_s": med("direct", "s"),
        "speedup_vs_direct": round(med("direct", "s") / med("swarm", "s"), 2),
        "reference_allreduce_fp32_s": 1.29,
        "aggregate_s": med("swarm", "aggregate_s"),
        "shepherd_out_per_theta_swarm": med("swarm", "shepherd_out_per_theta"),
        "shepherd_out_per_theta_direct": med("direct", "shepherd_out_per_theta"),
        "rounds_s_swarm": [round(x["s"], 3) for x in results["swarm"]],
        "rounds_s_direct": [round(x["s"], 3) for x in results["direct"]],
        "params": PARAMS,
        "workers": WORKERS,
        "rounds_per_arm": ROUNDS,
    }))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--serve", help="(internal) run one bench process with this data dir")
    args = parser.parse_args()
    if args.serve:
        import trio

        logging.basicConfig(level=logging.WARNING)
        logging.getLogger("libp2p").setLevel(logging.CRITICAL)
        trio.run(serve, Path(args.serve))
    else:
        main()

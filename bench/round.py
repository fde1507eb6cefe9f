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

1. every worker encodes its Δ (int8, the default codec) and stores it. The
   shepherd takes each Δ as it arrives: fetched into memory (``fetch_into``,
   as ``run_blobs`` does) and decoded (``RoundAggregator.check_delta``). The
   others' came first, as from workers of different speeds: the clock starts
   when the last one is stored (its Submission would leave now), and the
   shepherd takes that one. ``update_together_s``: every Δ leaves at once, the
   clock starts before the shepherd has taken any;
2. the shepherd combines them by the default spec's rule (norm screen, capped
   weights, the trimmed mean: ``robust.aggregate``; equal weights here),
   takes the outer Nesterov step, encodes the checkpoint (θ and momentum,
   80 MB) and stores it, as ``Shepherd._commit`` does;
3. every worker holds the checkpoint before it accepts the commit, then
   holds θ (in the ``update`` arm: θ built and checked first, the commit
   accepted, the rest of the checkpoint after; see the arms for who fetches
   when);
4. the clock stops when the last worker holds θ: checked against its CID,
   in memory, where the runtime hands it to the worker machine (it is
   stored in the background); in the ``direct`` arm, fetched into the store.

Also reported: the shepherd's phases (``shepherd_combine_s``, ``_step_s``,
``_store_s``) and the slowest worker's (``worker_fetch_s``: the update through
the tree; ``worker_build_s``: θ built and checked, and copied out).

Arms, in the same run, alternating round by round so all see the same load:

- ``update`` (today's flow): the shepherd takes the outer step as its int8
  update blob carries it (``outer.update_codec``: the quantized step,
  :func:`~pcp_p2p.diloco.algorithm.update.step_update`) and stores the update
  beside θ and the checkpoint; the commit leaves once the update is stored
  (the runtime's stores run in the background: a fetch of a blob the origin
  is still storing waits for it), and goes to every worker at once, and
  each, holding the last checkpoint, fetches the update (an eighth of a
  checkpoint) from its tree ancestors, the shepherd last, builds θ of the
  checkpoint itself (:func:`~pcp_p2p.diloco.protocol.commits.rebuild_theta`:
  θ's CID checked) and holds θ (copied out); the momentum, the checkpoint's
  CID and its write come after that, as ``RunRuntime._take_commit`` hands the
  commit to the worker machine once θ is checked and acks after the write.
  As ``RunRuntime`` does, a worker keeps the checkpoint it built in memory
  and builds the next from it, in the buffer of the one before. This arm
  runs two rounds in a row: the first builds from a checkpoint fetched the
  round before, read from the store (``update_cold_s``), the second is the
  steady state (the headline);
- ``swarm`` (the flow before the update, the baseline; the shepherd steps
  from the mean, ``nesterov_step``, and the commit leaves once θ and the
  checkpoint are stored, in this arm and the next): the commit goes to
  every worker at once, and each fetches the checkpoint from its tree
  ancestors, the shepherd last (:mod:`pcp_p2p.blob.swarm`), and takes θ out
  of it (byte-identical; its CID checked);
- ``direct`` (the flow before swarming): the commit is held
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
LR, MOMENTUM = 0.7, 0.9  # the outer step's (DiLoCo's)
TARGET_S = 0.3
TENSORS = 4  # θ as this many equal tensors
STEPS = 50  # the inner steps each Δ claims (what its norm bound allows)


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
        self.held: list[dict[str, Any]] = []  # the shepherd's: the round's Δs taken so far, decoded
        self.size = PARAMS // TENSORS
        self.last_ckpt = ""  # a worker's: the checkpoint it holds from the round before
        self.built: tuple[str, bytearray] | None = None  # the last checkpoint it built, in memory
        self.spare: bytearray | None = None  # the buffer of the one before
        self.pool = ThreadPoolExecutor(2)  # the shepherd's stores in the background
        self.storing: list[Any] = []

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

    async def accept(self, subs: list[tuple[str, str]]) -> dict[str, Any]:
        """The shepherd takes submissions' Δs as they arrive: fetched into memory and checked
        as the shepherd checks them (``RoundAggregator.check_delta``: decoded, names, shapes,
        finite, the norm bound), held for the combine."""
        import trio

        from pcp_p2p.diloco.protocol.aggregate import RoundAggregator
        from pcp_p2p.diloco.protocol.messages import Submission
        from pcp_p2p.diloco.protocol.spec import parse_spec

        assert self.state is not None
        spec = parse_spec("")  # the defaults: int8 Δs, the trimmed mean
        checker = RoundAggregator(spec, None, self.state.theta)  # type: ignore[arg-type]  # (no header checks)
        while len(self.bufs) < len(self.held) + len(subs):
            self.bufs.append(bytearray(PARAMS + (1 << 20)))

        async def one(buf: bytearray, cid: str, peer: str) -> None:
            view = await self.svc.fetch_into(cid, buf, providers=[self.peers[peer]])
            sub = Submission(run_id="bench", term=0, round=0, attempt=0, worker=peer, base_theta_cid="",
                             codec="int8", delta_cid=cid, delta_inline=None, steps=STEPS,
                             tokens=STEPS * spec.tokens_per_step, losses=())
            self.held.append(await trio.to_thread.run_sync(lambda: checker.check_delta(sub, bytes(view))))

        async with trio.open_nursery() as n:
            for k, (cid, peer) in enumerate(subs):
                n.start_soon(one, self.bufs[len(self.held) + k], cid, peer)
        return {"t": time.monotonic()}

    async def aggregate(self, update: bool) -> dict[str, Any]:
        """The shepherd, once the round's Δs are held: the default spec's combine (norm screen,
        capped weights, trimmed mean: ``robust.aggregate``), the outer Nesterov step, checkpoint
        and θ stored (with ``update``: the step applies the int8 update, stored beside them)."""
        import trio

        from pcp_p2p.core.cid import cid_of
        from pcp_p2p.diloco.algorithm.checkpoint import (
            Checkpoint,
            checkpoint_theta_bytes,
            encode_checkpoint,
            round_metrics,
        )
        from pcp_p2p.diloco.algorithm.outer import nesterov_step
        from pcp_p2p.diloco.algorithm.robust import AggregationPolicy, aggregate
        from pcp_p2p.diloco.algorithm.update import step_update

        for f in self.storing:  # the last round's stores in the background: ended
            f.result()
        state = self.state
        assert state is not None
        held, self.held = self.held, []
        phases: dict[str, float] = {}

        def outer() -> tuple[str, str, str, int]:
            t = time.monotonic()
            # equal steps, so equal weights: the workers are alike here
            mean = aggregate({f"w{k}": d for k, d in enumerate(held)}, {f"w{k}": 1.0 for k in range(len(held))},
                             AggregationPolicy()).delta
            phases["combine"], t = time.monotonic() - t, time.monotonic()
            # as the shepherd's commit (``Shepherd._commit``): the step (with ``update``: the one its
            # int8 update blob carries, :func:`step_update`), the checkpoint encoded, θ's bytes taken
            if update:
                blob, new = step_update(state, mean, "int8", lr=LR, momentum=MOMENTUM)
            else:  # (the baselines: the step from the mean, as before the update)
                blob, new = b"", nesterov_step(state, mean, lr=LR, momentum=MOMENTUM)
            ckpt, theta_cid = encode_checkpoint(Checkpoint("bench", 0, new, round_metrics(0, 0.0, None)))
            theta = checkpoint_theta_bytes(ckpt)
            self.state = new
            ckpt_cid, update_cid = cid_of(ckpt), cid_of(blob) if update else ""  # (the commit names them)
            phases["step"], t = time.monotonic() - t, time.monotonic()
            # the shepherd's StoreBlobs (θ, the checkpoint, the update): side by side, as the
            # runtime's store_later runs them; the commit leaves once the blob the workers fetch
            # first is stored (the update; the baselines: the checkpoint), the others go on
            self.storing = [self.pool.submit(self.svc.store.put_bytes, b) for b in (theta, ckpt)]
            if update:
                self.svc.store.put_bytes(blob, cid=update_cid)
            else:
                for f in self.storing:
                    f.result()
            phases["store"] = time.monotonic() - t
            return ckpt_cid, theta_cid, update_cid, len(theta)

        prev_theta = state.theta_cid
        ckpt_cid, theta_cid, update_cid, theta_bytes = await trio.to_thread.run_sync(outer)
        return {"ckpt": ckpt_cid, "theta": theta_cid, "update": update_cid, "prev_theta": prev_theta,
                "round": state.round, "theta_bytes": theta_bytes, "t": time.monotonic(), "phases": phases}

    async def rebuild(self, record: dict[str, Any], providers: list[str]) -> dict[str, Any]:
        """A worker, as ``RunRuntime._rebuild_checkpoint``: the update through the tree, θ of the
        checkpoint built from the last one (in memory if this worker built it, in the buffer of
        the one before) and checked, and copied out: θ is held, and the commit goes to the worker
        machine; then the momentum and the checkpoint's CID, and the checkpoint is stored (the
        ack waits for that, the worker machine does not)."""
        import trio

        from pcp_p2p.diloco.protocol.commits import rebuild_theta
        from pcp_p2p.diloco.protocol.messages import CommitRecord
        from pcp_p2p.diloco.protocol.spec import OuterOptimizer

        store, rec = self.svc.store, CommitRecord(**record)
        t0 = time.monotonic()
        await self.svc.fetch(rec.update_cid, providers=[self.peers[p] for p in providers], ordered=True,
                             announce=False)
        fetched = time.monotonic()
        outer = OuterOptimizer(lr=LR, momentum=MOMENTUM, update_codec="int8")
        cached = self.built[1] if self.built is not None and self.built[0] == self.last_ckpt else None

        def build() -> Any:
            base = cached if cached is not None else store.read(self.last_ckpt)
            half = rebuild_theta(rec, base, store.read(rec.update_cid), outer, reuse=self.spare)
            half.theta_bytes()  # θ for the worker machine: a copy (the buffer is reused)
            return half

        half = await trio.to_thread.run_sync(build)
        done = time.monotonic()  # θ is built and checked, and held, in memory
        ckpt = await trio.to_thread.run_sync(half.finish)  # the rest, then stored, before the ack
        await trio.to_thread.run_sync(store.put_bytes, ckpt)  # (RunRuntime._take_commit): the next command waits
        # the last one built (the base, or one older when built from the store) is the next one's buffer
        self.spare = self.built[1] if self.built is not None else None
        self.built, self.last_ckpt = (rec.checkpoint_cid, ckpt), rec.checkpoint_cid
        return {"t": done, "fetch_s": fetched - t0, "build_s": done - fetched}

    async def fetch(self, ckpt: str, providers: list[str], ordered: bool, theta: str, theta_from_ckpt: bool,
                    shepherd: str = "") -> dict[str, Any]:
        """A worker: the checkpoint, then θ (out of the checkpoint, or fetched from the shepherd)."""
        import trio

        from pcp_p2p.core.cid import cid_of
        from pcp_p2p.diloco.algorithm.checkpoint import THETA_HEAD, checkpoint_theta_span

        store = self.svc.store
        await self.svc.fetch(ckpt, providers=[self.peers[p] for p in providers], ordered=ordered, announce=False)
        self.last_ckpt = ckpt
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


def one_round(arm: str, seed: int, shepherd: Proc, workers: list[Proc], together: bool = False) -> dict[str, Any]:
    from pcp_p2p.blob.swarm import tree_order, upstream

    phases: dict[str, float] = {}
    for k, w in enumerate(workers):
        w.send(op="delta", seed=seed * 1000 + k)
    subs = [(w.read()["cid"], w.peer) for w in workers]
    before = shepherd.ask(op="traffic")["bytes_out"]
    # "together": every Δ leaves at once (the clock starts before the shepherd takes any);
    # otherwise the others' came first, as they do from workers of different speeds, and the
    # shepherd took them as they came (the clock starts when the last one leaves)
    early = [] if together else subs[:-1]
    if early:
        shepherd.ask(op="accept", subs=early)
    t0 = time.monotonic()  # the last Δ is stored: its submission leaves now
    shepherd.ask(op="accept", subs=subs[len(early):])
    agg = shepherd.ask(op="aggregate", update=arm == "update")
    ckpt, theta = agg["ckpt"], agg["theta"]
    members = [w.peer for w in workers]
    by_peer = {w.peer: w for w in workers}
    if arm == "update":  # the commit goes to every worker at once; each fetches the update through the tree
        record = {"run_id": "bench", "term": 0, "round": agg["round"], "attempt": 0,
                  "prev_theta_cid": agg["prev_theta"], "theta_cid": theta, "checkpoint_cid": ckpt,
                  "participants": members, "tokens": 0, "mean_loss": 0.0, "val_loss": None,
                  "shepherd": shepherd.peer, "update_cid": agg["update"]}
        for w in [by_peer[p] for p in tree_order(agg["update"], members)]:
            w.send(op="rebuild", record=record, providers=[*upstream(agg["update"], members, w.peer), shepherd.peer])
        answers = [w.read() for w in workers]
        done = [a["t"] for a in answers]
        phases = {"worker_fetch_s": max(a["fetch_s"] for a in answers),
                  "worker_build_s": max(a["build_s"] for a in answers)}
    elif arm == "swarm":  # the commit goes to every worker at once; each fetches through the tree
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
    return {"s": max(done) - t0, "aggregate_s": agg["t"] - t0, **{f"{k}_s": v for k, v in agg["phases"].items()},
            **phases,
            "shepherd_out_per_theta": (after - before) / agg["theta_bytes"]}


def main() -> None:
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    arms = ("update", "swarm", "direct")
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ("update_cold", "update_together", *arms)}
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
            seed = 1
            for r in range(ROUNDS):
                for arm in arms[r % 3:] + arms[:r % 3]:  # each arm first in turn
                    if arm == "update":  # the first from a fetched checkpoint (read from the store), then
                        # the steady state: from the checkpoint each worker built, in memory
                        results["update_cold"].append(one_round(arm, seed, shepherd, workers))
                        seed += 1
                    results[arm].append(one_round(arm, seed, shepherd, workers))
                    seed += 1
                    if arm == "update":  # and with every Δ leaving at once
                        results["update_together"].append(one_round(arm, seed, shepherd, workers, together=True))
                        seed += 1
        finally:
            for p in procs:
                p.close()

    def med(arm: str, key: str) -> float:
        return round(statistics.median(x[key] for x in results[arm]), 3)

    print(json.dumps({
        "headline": med("update", "s"),
        "target": TARGET_S,
        "better": "lower",
        "unit": "s from the last Δ stored to every worker holding the next θ (median)",
        "baseline_swarm_s": med("swarm", "s"),
        "baseline_direct_s": med("direct", "s"),
        "speedup_vs_swarm": round(med("swarm", "s") / med("update", "s"), 2),
        "reference_allreduce_fp32_s": 1.29,
        "update_cold_s": med("update_cold", "s"),
        "update_together_s": med("update_together", "s"),
        "aggregate_s_update": med("update", "aggregate_s"),
        "aggregate_s_swarm": med("swarm", "aggregate_s"),
        **{f"shepherd_{phase}_s": med("update", f"{phase}_s") for phase in ("combine", "step", "store")},
        "worker_fetch_s": med("update", "worker_fetch_s"),  # the slowest worker's, per round
        "worker_build_s": med("update", "worker_build_s"),
        **{f"shepherd_out_per_theta_{arm}": med(arm, "shepherd_out_per_theta") for arm in arms},
        **{f"rounds_s_{arm}": [round(x["s"], 3) for x in results[arm]] for arm in results},
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

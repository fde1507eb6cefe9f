"""An in-memory DiLoCo swarm on trio, with seeded fault injection.

This is the round protocol's test bench: the real :class:`Shepherd` and
:class:`Worker` state machines, the real wire codec (every message is encoded
and decoded on its way), real Ed25519 signatures and CIDs — but an in-memory
network and blob store instead of libp2p, and a cheap numpy objective instead
of the IREE executor, so a ten-round swarm with faults runs in well under a
second of wall time on trio's ``MockClock``.

Faults, all drawn from one ``random.Random(seed)`` so a failing seed replays:

- the network drops, duplicates and delays messages (:class:`Faults`);
- a worker can be killed at any phase of a chosen round (:class:`WorkerPlan`
  ``kill_at=(round, phase)``, phase one of :data:`KILL_PHASES`);
- a worker can join late (``join_at``) and have a different speed;
- a worker can be Byzantine (``attack``, one of :data:`ATTACKS`): it runs the
  honest protocol but lies about its Δ or its work (see :meth:`World._attack`).

The inner loop is AdamW on a per-shard quadratic ``½·Σ a⊙(θ − θ*_k)²`` with
gradient noise seeded by the data assignment: each shard pulls towards its own
optimum, so averaging matters, and the validation loss (distance to the global
optimum θ*) falls only if the protocol really combines the workers. The
shepherd's held-out ``score`` is the same loss on a fixed quarter of the
coordinates (a small held-out batch stands in for the validation set).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from pcp_p2p.cid import cid_of
from pcp_p2p.diloco.aggregate import delta_norm_bound
from pcp_p2p.diloco.effects import (
    CancelInner,
    Committed,
    Discarded,
    Effect,
    FetchBlob,
    Finished,
    LookupCommit,
    Rejected,
    RunInner,
    Send,
    StoreBlob,
)
from pcp_p2p.diloco.messages import CommitRecord, Join, RoundAnnouncement, Submission
from pcp_p2p.diloco.outer import OuterState
from pcp_p2p.diloco.shepherd import Phase, Shepherd
from pcp_p2p.diloco.spec import RunSpec, sign_spec, run_id_of
from pcp_p2p.diloco.tensors import Params, global_norm
from pcp_p2p.diloco.worker import InnerResult, Worker
from pcp_p2p.errors import BlobNotFound, PcpError, ProtocolError
from pcp_p2p.node.identity import Identity
from pcp_p2p.wire import Message, decode, encode

SIM_ARTIFACT = b"stands in for a compiled .vmfb"
KILL_PHASES = ("announced", "fetching", "training", "submitted", "committed")
ATTACKS = ("random", "sign_flip", "scale10", "lazy", "stale")
"""Byzantine workers: a random Δ just under the absolute norm bound; the honest Δ
sign-flipped; the honest Δ times 10; one real step claimed as ``max_steps``;
the Δ of its first round re-sent each round (and the first submission itself
replayed verbatim, which the header check refuses as stale)."""


@dataclass(frozen=True)
class Faults:
    drop: float = 0.0
    duplicate: float = 0.0
    delay: tuple[float, float] = (0.0, 0.0)
    fetch_delay: float = 0.05


@dataclass(frozen=True)
class WorkerPlan:
    tokens_per_s: float = 1000.0
    join_at: float = 0.0
    kill_at: tuple[int, str] | None = None
    attack: str | None = None  # one of ATTACKS


@dataclass(frozen=True)
class SimConfig:
    spec: RunSpec
    workers: tuple[WorkerPlan, ...]
    faults: Faults = Faults()
    seed: int = 0
    shape: tuple[int, int] = (16, 8)
    time_limit: float = 10_000.0
    scoring: bool = True  # give the shepherd the held-out score
    spread: float = 0.5  # how far the shards' optima lie from the global one (non-IID-ness)
    floor: float = 0.0  # irreducible loss added to val loss and score (a language model's entropy)


@dataclass
class SimResult:
    commits: list[CommitRecord]
    discarded: list[tuple[int, int]]
    rejected: list[tuple[str, str | None, PcpError]]  # (node, peer, error)
    final_theta_cid: str | None
    worker_theta_cids: dict[str, str | None]
    alive: set[str]
    killed: set[str]
    val_losses: list[float]
    finished: bool
    end_time: float
    initial_val_loss: float


# --- the cheap objective ------------------------------------------------------


@dataclass(frozen=True)
class Quadratic:
    """``½·mean(a⊙(θ − θ*_k)²)`` with shard optima spread around the global θ*."""

    curvature: Params
    optimum: Params
    spread: Params
    held_out: Params  # 0/1 masks: the coordinates the held-out score looks at
    floor: float = 0.0  # added to every loss, like a language model's irreducible entropy

    @classmethod
    def make(cls, rng: np.random.Generator, shape: tuple[int, int], spread: float = 0.5, floor: float = 0.0) -> Quadratic:
        names = {"w": shape, "b": (shape[1],)}
        return cls(
            curvature={k: rng.uniform(0.5, 2.0, s).astype(np.float32) for k, s in names.items()},
            optimum={k: rng.normal(0, 1, s).astype(np.float32) for k, s in names.items()},
            spread={k: rng.normal(0, spread, s).astype(np.float32) for k, s in names.items()},
            held_out={k: (rng.random(s) < 0.25).astype(np.float32) for k, s in names.items()},
            floor=floor,
        )

    def initial(self) -> Params:
        return {k: np.zeros_like(v) for k, v in self.optimum.items()}

    def shard_optimum(self, shard: int, num_shards: int) -> Params:
        # shard offsets sum to zero over the shards, so the mean optimum is θ*
        phase = 2 * math.pi * shard / max(1, num_shards)
        c = math.cos(phase) if num_shards > 1 else 0.0
        return {k: v + c * self.spread[k] for k, v in self.optimum.items()}

    def loss(self, theta: Params, target: Params | None = None) -> float:
        target = self.optimum if target is None else target
        tot = sum(float(np.sum(self.curvature[k] * (theta[k] - target[k]) ** 2)) for k in theta)
        n = sum(v.size for v in theta.values())
        return self.floor + 0.5 * tot / n

    def score(self, theta: Params) -> float:
        """The loss on the held-out coordinates only: cheaper and noisier than :meth:`loss`."""
        tot = sum(float(np.sum(self.held_out[k] * self.curvature[k] * (theta[k] - self.optimum[k]) ** 2)) for k in theta)
        n = sum(float(m.sum()) for m in self.held_out.values())
        return self.floor + 0.5 * tot / max(1.0, n)

    def inner(self, run: RunInner, steps: int, spec: RunSpec) -> InnerResult:
        """``steps`` AdamW steps from ``run.theta`` on the assigned shard (moments kept)."""
        i = spec.inner
        a = run.assignment
        rng = np.random.default_rng(a.seed)
        target = self.shard_optimum(a.shard, a.num_shards)
        theta = {k: v.astype(np.float32).copy() for k, v in run.theta.items()}
        state = run.inner_state or {
            "m": {k: np.zeros_like(v) for k, v in theta.items()},
            "v": {k: np.zeros_like(v) for k, v in theta.items()},
            "t": 0,
        }
        m, v, t = state["m"], state["v"], state["t"]
        losses = []
        for _ in range(steps):
            t += 1
            losses.append(self.loss(theta, target))
            for k in theta:
                g = self.curvature[k] * (theta[k] - target[k]) + rng.normal(0, 0.1, theta[k].shape)
                m[k] = i.beta1 * m[k] + (1 - i.beta1) * g
                v[k] = i.beta2 * v[k] + (1 - i.beta2) * g * g
                mh = m[k] / (1 - i.beta1**t)
                vh = v[k] / (1 - i.beta2**t)
                theta[k] = (theta[k] - i.lr * (mh / (np.sqrt(vh) + 1e-8) + i.weight_decay * theta[k])).astype(
                    np.float32
                )
        return InnerResult(run.round, run.attempt, theta, steps, tuple(losses), {"m": m, "v": v, "t": t})


# --- the in-memory world ----------------------------------------------------


class InMemoryNetwork:
    """Delivers encoded messages between inboxes, dropping/duplicating/delaying them."""

    def __init__(self, nursery: trio.Nursery, rng: random.Random, faults: Faults) -> None:
        self.nursery = nursery
        self.rng = rng
        self.faults = faults
        self.inboxes: dict[str, trio.MemorySendChannel[tuple[Any, ...]]] = {}
        self.sent = 0
        self.dropped = 0

    def send(self, dst: str, msg: Message) -> None:
        data = encode(msg)
        self.sent += 1
        f = self.faults
        if self.rng.random() < f.drop:
            self.dropped += 1
            return
        copies = 2 if self.rng.random() < f.duplicate else 1
        for _ in range(copies):
            self.nursery.start_soon(self._deliver, dst, data, self.rng.uniform(*f.delay))

    async def _deliver(self, dst: str, data: bytes, delay: float) -> None:
        await trio.sleep(delay)
        inbox = self.inboxes.get(dst)
        if inbox is not None:
            inbox.send_nowait(("msg", data))


class World:
    """One simulated run: a shepherd, workers, a network, a blob store, a commit board."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.problem = Quadratic.make(np.random.default_rng(cfg.seed), cfg.shape, cfg.spread, cfg.floor)
        self.blobs: dict[str, bytes] = {}
        self.board: CommitRecord | None = None  # stands in for the DHT's latest-commit record
        self.rejected: list[tuple[str, str | None, PcpError]] = []
        self.discarded: list[tuple[int, int]] = []
        self.workers: dict[str, Worker] = {}
        self.first_delta: dict[str, Params] = {}  # the "stale" attackers' first Δ
        self.killed: set[str] = set()
        self.kill_scopes: dict[str, trio.CancelScope] = {}
        self.done = trio.Event()
        self.finished_cid: str | None = None
        self.target = cfg.spec.targets[0]
        owner = self._identity()
        self.signed_spec = sign_spec(cfg.spec, owner)
        self.run_id = run_id_of(self.signed_spec)
        self.shepherd = Shepherd(
            spec=cfg.spec,
            run_id=self.run_id,
            identity=owner,
            term=0,
            state=OuterState.initial(self.problem.initial()),
            artifacts={self.target: cid_of(SIM_ARTIFACT)},
            evaluate=self.problem.loss,
            score=self.problem.score if cfg.scoring else None,
        )
        # the artifact is an ordinary blob too (its bytes are irrelevant to the sim)
        self.blobs[self.shepherd.artifacts[self.target]] = SIM_ARTIFACT

    def _identity(self) -> Identity:
        return Identity(self.rng.randbytes(32))

    # --- effects -------------------------------------------------------------

    def _run_effects(self, node: str, effects: list[Effect], nursery: trio.Nursery, net: InMemoryNetwork) -> None:
        for eff in effects:
            if isinstance(eff, Send):
                net.send(eff.to, eff.message)
                plan = self.plans.get(node)
                if plan is not None and plan.attack == "stale" and isinstance(eff.message, Submission):
                    if len(self.workers[node].submitted) > 1:
                        net.send(eff.to, self.workers[node].submitted[0])  # a verbatim replay too
            elif isinstance(eff, StoreBlob):
                self.blobs[eff.cid] = eff.data
            elif isinstance(eff, FetchBlob):
                nursery.start_soon(self._fetch, node, eff.cid, net)
            elif isinstance(eff, LookupCommit):
                nursery.start_soon(self._lookup, node, net)
            elif isinstance(eff, RunInner):
                nursery.start_soon(self._inner, node, eff, net)
            elif isinstance(eff, Rejected):
                self.rejected.append((node, eff.peer, eff.error))
            elif isinstance(eff, Committed):
                self.board = eff.record
            elif isinstance(eff, Discarded):
                self.discarded.append((eff.round, eff.attempt))
            elif isinstance(eff, Finished):
                self.finished_cid = eff.theta_cid
            elif isinstance(eff, CancelInner):
                pass  # results of superseded runs are ignored by the worker's tags

    async def _fetch(self, node: str, cid: str, net: InMemoryNetwork) -> None:
        await trio.sleep(self.cfg.faults.fetch_delay)
        inbox = net.inboxes.get(node)
        if inbox is None:
            return
        data = self.blobs.get(cid)
        if data is None:
            inbox.send_nowait(("blob_failed", cid, BlobNotFound(cid)))
        else:
            inbox.send_nowait(("blob", cid, data))

    async def _lookup(self, node: str, net: InMemoryNetwork) -> None:
        await trio.sleep(self.cfg.faults.fetch_delay)
        inbox = net.inboxes.get(node)
        if inbox is not None and self.board is not None:
            inbox.send_nowait(("commit", self.board))

    async def _inner(self, node: str, run: RunInner, net: InMemoryNetwork) -> None:
        plan = self.plans[node]
        spec = self.cfg.spec
        by_time = int(plan.tokens_per_s * run.time_budget_s // spec.tokens_per_step)
        steps = max(1, min(run.assignment.max_steps, by_time))
        await trio.sleep(steps * spec.tokens_per_step / plan.tokens_per_s)
        result = self.problem.inner(run, steps, spec)
        if plan.attack is not None:
            result = self._attack(node, plan.attack, run, result)
        inbox = net.inboxes.get(node)
        if inbox is not None:
            inbox.send_nowait(("inner", result))

    def _attack(self, node: str, attack: str, run: RunInner, honest: InnerResult) -> InnerResult:
        """What a Byzantine worker hands its (honest) worker machine in place of its training result."""
        spec = self.cfg.spec
        theta = {k: np.asarray(v, dtype=np.float32) for k, v in run.theta.items()}
        delta = {k: theta[k] - honest.theta[k] for k in theta}
        steps = honest.steps
        if attack == "random":
            rng = np.random.default_rng(run.assignment.seed)
            noise = {k: rng.normal(0, 1, v.shape).astype(np.float32) for k, v in theta.items()}
            scale = 0.9 * delta_norm_bound(spec, theta, steps) / global_norm(noise)
            delta = {k: np.float32(scale) * v for k, v in noise.items()}
        elif attack == "sign_flip":
            delta = {k: -v for k, v in delta.items()}
        elif attack == "scale10":
            delta = {k: 10 * v for k, v in delta.items()}
        elif attack == "lazy":
            one = self.problem.inner(run, 1, spec)
            delta = {k: theta[k] - one.theta[k] for k in theta}
            steps = run.assignment.max_steps
        elif attack == "stale":
            delta = self.first_delta.setdefault(node, delta)
        else:
            raise ValueError(f"unknown attack {attack!r}; known: {ATTACKS}")
        new_theta = {k: theta[k] - delta[k] for k in theta}
        losses = honest.losses[:steps] + (honest.losses[-1],) * max(0, steps - len(honest.losses))
        return InnerResult(honest.round, honest.attempt, new_theta, steps, losses, honest.inner_state)

    # --- nodes -----------------------------------------------------------------

    async def shepherd_node(self, net: InMemoryNetwork) -> None:
        send, recv = trio.open_memory_channel[tuple[Any, ...]](math.inf)
        sh = self.shepherd
        net.inboxes[sh.peer_id] = send
        async with trio.open_nursery() as nursery:
            while True:
                wake = sh.next_wakeup
                item = None
                with trio.move_on_at(wake if wake is not None else math.inf):
                    item = await recv.receive()
                now = trio.current_time()
                if item is None:
                    effects = sh.tick(now)
                elif item[0] == "msg":
                    try:
                        msg = decode(item[1], Join, Submission)
                    except ProtocolError as exc:
                        effects = [Rejected(None, exc)]
                    else:
                        effects = sh.receive(msg, now)
                elif item[0] == "blob":
                    effects = sh.on_blob(item[1], item[2], now)
                else:
                    effects = sh.on_blob_failed(item[1], item[2], now)
                self._run_effects(sh.peer_id, effects, nursery, net)
                if sh.phase is Phase.FINISHED:
                    self._check_done()

    async def worker_node(self, w: Worker, plan: WorkerPlan, net: InMemoryNetwork) -> None:
        await trio.sleep(plan.join_at)
        send, recv = trio.open_memory_channel[tuple[Any, ...]](math.inf)
        net.inboxes[w.peer_id] = send
        self.workers[w.peer_id] = w
        with trio.CancelScope() as scope:
            self.kill_scopes[w.peer_id] = scope
            async with trio.open_nursery() as nursery:
                self._run_effects(w.peer_id, w.start(trio.current_time()), nursery, net)
                while True:
                    item = None
                    with trio.move_on_at(w.next_wakeup):
                        item = await recv.receive()
                    now = trio.current_time()
                    if item is None:
                        effects = w.tick(now)
                    elif item[0] == "msg":
                        try:
                            msg = decode(item[1], RoundAnnouncement, CommitRecord)
                        except ProtocolError as exc:
                            effects = [Rejected(None, exc)]
                        else:
                            if self._kill_point(w, plan, "announced", msg):
                                return
                            effects = w.receive(msg, now)
                    elif item[0] == "blob":
                        effects = w.on_blob(item[1], item[2], now)
                    elif item[0] == "blob_failed":
                        effects = w.on_blob_failed(item[1], item[2], now)
                    elif item[0] == "commit":
                        effects = w.on_commit(item[1], now)
                    else:
                        effects = w.on_inner_done(item[1], now)
                    self._run_effects(w.peer_id, effects, nursery, net)
                    if self._kill_point(w, plan, w.phase.value, None):
                        return
                    got_commit = item is not None and (
                        item[0] == "commit" or (item[0] == "msg" and isinstance(msg, CommitRecord))
                    )
                    if got_commit and self._kill_point(w, plan, "committed", None):
                        return
                    self._check_done()

    def _kill_point(self, w: Worker, plan: WorkerPlan, phase: str, msg: Message | None) -> bool:
        if plan.kill_at is None or w.peer_id in self.killed:
            return False
        kill_round, kill_phase = plan.kill_at
        if kill_phase != phase:
            return False
        if phase == "announced":
            hit = isinstance(msg, RoundAnnouncement) and msg.round == kill_round
        elif phase == "idle":
            return False
        elif phase == "committed":
            hit = w.last_commit is not None and w.last_commit.round == kill_round
        else:
            hit = w.current is not None and w.current.round == kill_round
        if hit:
            self.killed.add(w.peer_id)
            self.net.inboxes.pop(w.peer_id, None)
            self.kill_scopes[w.peer_id].cancel()
        return hit

    def _check_done(self) -> None:
        if self.shepherd.phase is not Phase.FINISHED:
            return
        final = self.shepherd.theta_cid
        for pid, w in self.workers.items():
            if pid not in self.killed and w.theta_cid != final:
                return
        self.done.set()

    async def run(self) -> SimResult:
        cfg = self.cfg
        self.plans: dict[str, WorkerPlan] = {}
        machines = []
        for plan in cfg.workers:
            w = Worker(
                spec=cfg.spec,
                run_id=self.run_id,
                identity=self._identity(),
                shepherds={0: self.shepherd.peer_id},
                target=self.target,
                tokens_per_s=plan.tokens_per_s,
            )
            self.plans[w.peer_id] = plan
            machines.append((w, plan))
        initial_val = self.problem.loss(self.shepherd.state.theta)
        finished = False
        async with trio.open_nursery() as nursery:
            self.net = InMemoryNetwork(nursery, self.rng, cfg.faults)
            nursery.start_soon(self.shepherd_node, self.net)
            for w, plan in machines:
                nursery.start_soon(self.worker_node, w, plan, self.net)
            with trio.move_on_after(cfg.time_limit):
                await self.done.wait()
                finished = True
            nursery.cancel_scope.cancel()
        alive = {pid for pid in self.workers if pid not in self.killed}
        return SimResult(
            commits=list(self.shepherd.commits),
            discarded=list(self.discarded),
            rejected=list(self.rejected),
            final_theta_cid=self.finished_cid,
            worker_theta_cids={pid: self.workers[pid].theta_cid for pid in alive},
            alive=alive,
            killed=set(self.killed),
            val_losses=[c.val_loss for c in self.shepherd.commits if c.val_loss is not None],
            finished=finished,
            end_time=trio.current_time(),
            initial_val_loss=initial_val,
        )


async def simulate(cfg: SimConfig) -> SimResult:
    """Run one simulated swarm to completion (or ``cfg.time_limit``) on the current clock."""
    return await World(cfg).run()


def simulate_sync(cfg: SimConfig) -> SimResult:
    """:func:`simulate` under a fresh ``MockClock`` (autojump): milliseconds of wall time."""
    from trio.testing import MockClock

    return trio.run(simulate, cfg, clock=MockClock(autojump_threshold=0))

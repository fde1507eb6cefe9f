"""An in-memory swarm where every node is candidate, worker and (when elected) shepherd.

Built on :mod:`pcp_p2p.diloco.sim` (the same numpy objective, the same real
state machines, codec, signatures and CIDs) with the election on top: each node
runs an :class:`~pcp_p2p.diloco.election.Election`, a
:class:`~pcp_p2p.diloco.worker.Worker`, and a
:class:`~pcp_p2p.diloco.shepherd.Shepherd` while it holds a term. Time is trio's
clock (``MockClock`` in tests), so lease expiries, claim timeouts and round
deadlines all run in milliseconds of wall time.

What stands in for the network and the DHT:

- messages go through an in-memory network with seeded drop/delay, and only
  between nodes on the same side of a partition;
- the DHT's ``commit`` and ``lease`` records are boards of everything published,
  each entry tagged with the partition side it was published on: a lookup sees
  what was published on its side (or anywhere, once healed) and picks the best
  (commits by fork choice, leases by term);
- blobs are one content-addressed store reachable from everywhere (a dead
  shepherd's checkpoint is held by the workers that fetched it, in the real
  network);
- membership: a node sees a peer while it is alive and reachable, and for
  ``membership_lag_s`` after it stops being so (a membership record's TTL).

Faults on the shepherd (:class:`ShepherdFault`): at round ``round`` and point
``at`` — ``announce`` (dies instead of announcing), ``collect`` (at the first
submission), ``aggregate`` (on the input that would commit, nothing of the
commit survives), ``commit_unheard`` (the commit is on its disk, no one heard)
— the node is killed, or hung for ``hang_s`` (``action="hang"``) after which it
resumes as a *zombie*: its shepherd acts on the passed deadline before it
learns anything, which is what fencing must stop. :class:`Partition` splits
the nodes into two sides for a while.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from pcp_p2p.cid import cid_of
from pcp_p2p.diloco.checkpoint import checkpoint_theta_bytes
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
from pcp_p2p.diloco.election import (
    BecomeShepherd,
    Candidate,
    Election,
    ElectionConfig,
    FollowShepherd,
    Lease,
    LookupLease,
    PublishLease,
    StepDown,
    commit_key,
)
from pcp_p2p.diloco.messages import CommitRecord, Join, RoundAnnouncement, Submission
from pcp_p2p.diloco.outer import OuterState
from pcp_p2p.diloco.shepherd import Shepherd
from pcp_p2p.diloco.sim import SIM_ARTIFACT, Quadratic
from pcp_p2p.diloco.spec import RunSpec, run_id_of, sign_spec
from pcp_p2p.diloco.worker import Worker
from pcp_p2p.errors import BlobNotFound, PcpError, ProtocolError
from pcp_p2p.node.identity import Identity
from pcp_p2p.wire import Message, decode, encode

FAULT_POINTS = ("announce", "collect", "aggregate", "commit_unheard")


@dataclass(frozen=True)
class ShepherdFault:
    round: int
    at: str  # one of FAULT_POINTS
    action: str = "kill"  # "kill" | "hang"
    hang_s: float = 0.0


@dataclass(frozen=True)
class Partition:
    at: float
    heal_at: float
    side: frozenset[int]  # node indices on side A; the rest are side B


@dataclass(frozen=True)
class ElectionSimConfig:
    spec: RunSpec
    nodes: int = 5
    election: ElectionConfig = ElectionConfig(
        lease_s=10.0, renew_every_s=3.0, grace_s=1.0, min_uptime_s=0.0, rotate_every=0,
        claim_timeout_s=10.0, settle_s=1.0,
    )
    faults: tuple[ShepherdFault, ...] = ()
    partition: Partition | None = None
    drop: float = 0.0
    delay: tuple[float, float] = (0.0, 0.2)
    membership_lag_s: float = 5.0
    tokens_per_s: float = 64.0
    seed: int = 0
    shape: tuple[int, int] = (8, 4)
    time_limit: float = 5_000.0


@dataclass
class ElectionSimResult:
    finished: bool
    final: CommitRecord | None
    chain: list[CommitRecord]  # the winning θ history, round 0 .. last
    published: list[CommitRecord]  # every commit that reached the DHT board
    rejected: list[tuple[str, str | None, PcpError]]
    alive: set[str]
    theta_cids: dict[str, str | None]  # live node -> θ its worker holds
    terms: dict[str, int | None]  # live node -> its election's current term
    history: list[dict[str, Any]]  # shepherd_history of the node that saw the most terms
    val_losses: list[float]
    initial_val_loss: float
    names: list[str]  # peer ids in node-index order
    end_time: float


@dataclass
class SimNode:
    index: int
    identity: Identity
    election: Election
    worker: Worker
    started_at: float = 0.0
    shepherd: Shepherd | None = None
    alive: bool = True
    hung_until: float | None = None
    zombie_pending: bool = False
    scope: trio.CancelScope | None = None
    inbox: trio.MemorySendChannel[tuple[Any, ...]] | None = None

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id


@dataclass
class _Board:
    entries: list[tuple[int | None, Any]] = field(default_factory=list)  # (side at publish, value)


class ElectionWorld:
    def __init__(self, cfg: ElectionSimConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.problem = Quadratic.make(np.random.default_rng(cfg.seed), cfg.shape)
        owner = Identity(self.rng.randbytes(32))
        self.run_id = run_id_of(sign_spec(cfg.spec, owner))
        self.target = cfg.spec.targets[0]
        self.artifact_cid = cid_of(SIM_ARTIFACT)
        self.blobs: dict[str, bytes] = {self.artifact_cid: SIM_ARTIFACT}
        self.commits = _Board()
        self.leases = _Board()
        self.rejected: list[tuple[str, str | None, PcpError]] = []
        self.pending_faults = list(cfg.faults)
        self.side_of: dict[str, int] | None = None
        self.invisible_since: dict[tuple[str, str], float] = {}
        self.done = trio.Event()
        self.at_done: tuple[dict[str, str | None], dict[str, int | None]] = ({}, {})
        self.nodes: list[SimNode] = []
        for i in range(cfg.nodes):
            ident = Identity(self.rng.randbytes(32))
            self.nodes.append(
                SimNode(
                    i, ident, Election(self.run_id, ident, cfg.election),
                    Worker(spec=cfg.spec, run_id=self.run_id, identity=ident, shepherds={},
                           target=self.target, tokens_per_s=cfg.tokens_per_s),
                )
            )
        self.by_id = {n.peer_id: n for n in self.nodes}

    # --- reachability, membership -------------------------------------------------

    def side(self, peer: str) -> int | None:
        return None if self.side_of is None else self.side_of[peer]

    def reachable(self, a: str, b: str) -> bool:
        return self.side_of is None or self.side_of[a] == self.side_of[b]

    def view_of(self, node: SimNode, now: float) -> list[Candidate]:
        out = []
        for other in self.nodes:
            key = (node.peer_id, other.peer_id)
            visible = other.alive and self.reachable(node.peer_id, other.peer_id)
            if visible:
                self.invisible_since.pop(key, None)
            else:
                since = self.invisible_since.setdefault(key, now)
                if now - since >= self.cfg.membership_lag_s:
                    continue
            out.append(Candidate(other.peer_id, uptime_s=now - other.started_at))
        return out

    # --- network ------------------------------------------------------------------

    def send(self, src: str, dst: str, msg: Message, nursery: trio.Nursery) -> None:
        if not self.reachable(src, dst) or self.rng.random() < self.cfg.drop:
            return
        nursery.start_soon(self._deliver, dst, ("msg", encode(msg)), self.rng.uniform(*self.cfg.delay))

    async def _deliver(self, dst: str, item: tuple[Any, ...], delay: float) -> None:
        await trio.sleep(delay)
        node = self.by_id[dst]
        if node.alive or node.hung_until is not None:
            if node.inbox is not None:
                node.inbox.send_nowait(item)

    def best_commit(self, peer: str) -> CommitRecord | None:
        seen = [rec for side, rec in self.commits.entries if side is None or self.side_of is None or side == self.side(peer)]
        return max(seen, key=commit_key, default=None)

    def best_lease(self, peer: str, now: float) -> Lease | None:
        seen = [
            le for side, le in self.leases.entries
            if (side is None or self.side_of is None or side == self.side(peer)) and le.expiry > now
        ]
        return max(seen, key=lambda le: (le.term, le.issued), default=None)

    # --- effects --------------------------------------------------------------------

    def carry_out(self, node: SimNode, effects: list[Any], nursery: trio.Nursery) -> None:
        now = trio.current_time()
        todo = list(effects)
        while todo:
            eff = todo.pop(0)
            if isinstance(eff, Send):
                self.send(node.peer_id, eff.to, eff.message, nursery)
            elif isinstance(eff, StoreBlob):
                self.blobs[eff.cid] = eff.data
            elif isinstance(eff, FetchBlob):
                nursery.start_soon(self._fetch, node, eff.cid)
            elif isinstance(eff, LookupCommit):
                nursery.start_soon(self._lookup_commit, node)
            elif isinstance(eff, LookupLease):
                nursery.start_soon(self._lookup_lease, node)
            elif isinstance(eff, RunInner):
                nursery.start_soon(self._inner, node, eff)
            elif isinstance(eff, Rejected):
                self.rejected.append((node.peer_id, eff.peer, eff.error))
            elif isinstance(eff, Committed):
                self.commits.entries.append((self.side(node.peer_id), eff.record))
                todo[:0] = node.election.on_commit(eff.record, now)
            elif isinstance(eff, PublishLease):
                self.leases.entries.append((self.side(node.peer_id), eff.lease))
                for other in self.nodes:
                    if other is not node:
                        self.send(node.peer_id, other.peer_id, eff.lease, nursery)
            elif isinstance(eff, BecomeShepherd):
                node.shepherd = self._make_shepherd(node, eff)
            elif isinstance(eff, FollowShepherd):
                todo[:0] = node.worker.set_shepherd(eff.term, eff.peer, now, base=eff.base)
            elif isinstance(eff, StepDown):
                if node.shepherd is not None and node.shepherd.term == eff.term:
                    node.shepherd = None
            elif isinstance(eff, (Discarded, Finished, CancelInner)):
                pass

    def _make_shepherd(self, node: SimNode, eff: BecomeShepherd) -> Shepherd:
        kw: dict[str, Any] = dict(
            spec=self.cfg.spec, run_id=self.run_id, identity=node.identity, term=eff.term,
            artifacts={self.target: self.artifact_cid}, evaluate=self.problem.loss, end_round=eff.end_round,
        )
        if eff.checkpoint_cid is None:
            return Shepherd(state=OuterState.initial(self.problem.initial()), **kw)
        ckpt = self.blobs[eff.checkpoint_cid]
        assert cid_of(checkpoint_theta_bytes(ckpt))  # the checkpoint holds θ itself
        return Shepherd.from_checkpoint(checkpoint=ckpt, **kw)

    async def _fetch(self, node: SimNode, cid: str) -> None:
        await trio.sleep(0.05)
        data = self.blobs.get(cid)
        if node.inbox is not None:
            node.inbox.send_nowait(("blob", cid, data) if data is not None else ("blob_failed", cid, BlobNotFound(cid)))

    async def _lookup_commit(self, node: SimNode) -> None:
        await trio.sleep(0.05)
        rec = self.best_commit(node.peer_id)
        if rec is not None and node.inbox is not None:
            node.inbox.send_nowait(("commit", rec))
        await trio.sleep(0.05)  # the lease lookup (started alongside) has answered too
        if node.inbox is not None:
            node.inbox.send_nowait(("lookups_done",))

    async def _lookup_lease(self, node: SimNode) -> None:
        await trio.sleep(0.05)
        lease = self.best_lease(node.peer_id, trio.current_time())
        if lease is not None and node.inbox is not None:
            node.inbox.send_nowait(("msg", encode(lease)))

    async def _inner(self, node: SimNode, run: RunInner) -> None:
        spec = self.cfg.spec
        by_time = int(self.cfg.tokens_per_s * run.time_budget_s // spec.tokens_per_step)
        steps = max(1, min(run.assignment.max_steps, by_time))
        await trio.sleep(steps * spec.tokens_per_step / self.cfg.tokens_per_s)
        result = self.problem.inner(run, steps, spec)
        if node.inbox is not None:
            node.inbox.send_nowait(("inner", result))

    # --- faults -------------------------------------------------------------------

    def _fault_for(self, node: SimNode, effects: list[Any]) -> ShepherdFault | None:
        """The next planned fault, if this node's shepherd just reached its point."""
        sh = node.shepherd
        if sh is None or not self.pending_faults:
            return None
        f = self.pending_faults[0]
        committed = any(isinstance(e, Committed) and e.record.round == f.round for e in effects)
        if f.at == "announce":
            hit = any(
                isinstance(e, Send) and isinstance(e.message, RoundAnnouncement) and e.message.round == f.round
                for e in effects
            )
        elif f.at == "collect":
            agg = sh.round_agg
            hit = agg is not None and sh.state.round == f.round and len(agg.accepted) >= 1 and not committed
        else:
            hit = committed
        if hit:
            self.pending_faults.pop(0)
            return f
        return None

    def _strike(self, node: SimNode, f: ShepherdFault, effects: list[Effect], nursery: trio.Nursery) -> None:
        if f.at == "commit_unheard":  # the commit reached this node's disk, nothing more
            self.carry_out(node, [e for e in effects if isinstance(e, StoreBlob)], nursery)
        elif f.at == "announce":  # everything before the announcement happened (a commit, say)
            first = next(i for i, e in enumerate(effects)
                         if isinstance(e, Send) and isinstance(e.message, RoundAnnouncement))
            self.carry_out(node, effects[:first], nursery)
        if f.action == "kill":
            node.alive = False
            node.inbox = None
            assert node.scope is not None
            node.scope.cancel()
        else:
            node.alive = False
            node.hung_until = trio.current_time() + f.hang_s
            node.zombie_pending = True

    # --- node loop --------------------------------------------------------------------

    async def node_loop(self, node: SimNode) -> None:
        send, recv = trio.open_memory_channel[tuple[Any, ...]](math.inf)
        node.inbox = send
        with trio.CancelScope() as scope:
            node.scope = scope
            async with trio.open_nursery() as nursery:
                now = trio.current_time()
                node.started_at = now
                self.carry_out(node, node.election.start(now), nursery)
                self.carry_out(node, node.worker.start(now), nursery)
                while True:
                    if node.hung_until is not None:
                        await trio.sleep_until(node.hung_until)
                        node.hung_until = None
                        node.alive = True
                        if node.zombie_pending and node.shepherd is not None:
                            # it wakes inside its shepherd's code: acts on the passed deadline first
                            node.zombie_pending = False
                            self.carry_out(node, node.shepherd.tick(trio.current_time()), nursery)
                    wakes = [node.election.next_wakeup, node.worker.next_wakeup, now + 1.0]
                    if node.shepherd is not None:
                        wakes.append(node.shepherd.next_wakeup)
                    # A wakeup already past did nothing when last ticked (Worker.next_wakeup
                    # stays in the past while it trains): waiting on it would spin and, under
                    # an autojump MockClock, freeze time.
                    item = None
                    with trio.move_on_at(min(w if w > now else now + 0.5 for w in wakes if w is not None)):
                        item = await recv.receive()
                    now = trio.current_time()
                    struck = self._carry_out_or_strike(node, self._handle(node, item, now), nursery)
                    if struck == "kill":
                        return
                    if struck is not None:
                        continue
                    self.carry_out(node, node.election.on_members(self.view_of(node, now), now), nursery)
                    self.carry_out(node, node.worker.tick(now), nursery)
                    if node.shepherd is not None:
                        struck = self._carry_out_or_strike(node, node.shepherd.tick(now), nursery)
                        if struck == "kill":
                            return
                        if struck is not None:
                            continue
                    self._check_done()

    def _carry_out_or_strike(self, node: SimNode, effects: list[Any], nursery: trio.Nursery) -> str | None:
        """Carry out ``effects`` unless a scheduled fault strikes them; the fault's action if so."""
        f = self._fault_for(node, effects)
        if f is None:
            self.carry_out(node, effects, nursery)
            return None
        self._strike(node, f, effects, nursery)
        return f.action

    def _handle(self, node: SimNode, item: tuple[Any, ...] | None, now: float) -> list[Any]:
        if item is None:
            return []
        kind = item[0]
        if kind == "msg":
            try:
                msg = decode(item[1], Join, Submission, RoundAnnouncement, CommitRecord, Lease)
            except ProtocolError as exc:
                return [Rejected(None, exc)]
            if isinstance(msg, Lease):
                return node.election.on_lease(msg, now)
            if isinstance(msg, (Join, Submission)):
                return node.shepherd.receive(msg, now) if node.shepherd is not None else []
            if isinstance(msg, CommitRecord):
                return [*node.election.on_commit(msg, now), *node.worker.on_commit(msg, now)]
            return node.worker.on_announcement(msg, now)
        if kind == "commit":
            return [*node.election.on_commit(item[1], now), *node.worker.on_commit(item[1], now)]
        if kind == "blob":
            out = node.worker.on_blob(item[1], item[2], now)
            if node.shepherd is not None and item[1] in node.shepherd.pending:
                out += node.shepherd.on_blob(item[1], item[2], now)
            return out
        if kind == "lookups_done":
            return node.election.on_lookups_done(now)
        if kind == "blob_failed":
            return node.worker.on_blob_failed(item[1], item[2], now)
        return node.worker.on_inner_done(item[1], now)

    def _check_done(self) -> None:
        final = max((rec for _, rec in self.commits.entries), key=commit_key, default=None)
        if final is None or final.round + 1 < self.cfg.spec.round.rounds:
            return
        live = [n for n in self.nodes if n.alive]
        if all(n.worker.theta_cid == final.theta_cid for n in live) and len(
            {n.election.current_term for n in live}
        ) == 1 and not self.done.is_set():
            # snapshot now: the swarm keeps running until the nursery is cancelled
            # (a rotation after the last round may start another term meanwhile)
            self.at_done = (
                {n.peer_id: n.worker.theta_cid for n in live},
                {n.peer_id: n.election.current_term for n in live},
            )
            self.done.set()

    async def _partition(self, p: Partition) -> None:
        await trio.sleep_until(p.at)
        self.side_of = {n.peer_id: (0 if n.index in p.side else 1) for n in self.nodes}
        await trio.sleep_until(p.heal_at)
        self.side_of = None

    async def run(self) -> ElectionSimResult:
        cfg = self.cfg
        initial_val = self.problem.loss(self.problem.initial())
        finished = False
        async with trio.open_nursery() as nursery:
            for node in self.nodes:
                nursery.start_soon(self.node_loop, node)
            if cfg.partition is not None:
                nursery.start_soon(self._partition, cfg.partition)
            with trio.move_on_after(cfg.time_limit):
                await self.done.wait()
                finished = True
            nursery.cancel_scope.cancel()
        published = [rec for _, rec in self.commits.entries]
        final = max(published, key=commit_key, default=None)
        chain = _chain(final, published)
        live = [n for n in self.nodes if n.alive]
        hist = max((n.election.history for n in live), key=len, default=[])
        return ElectionSimResult(
            finished=finished,
            final=final,
            chain=chain,
            published=published,
            rejected=list(self.rejected),
            alive={n.peer_id for n in live},
            theta_cids=self.at_done[0] if finished else {n.peer_id: n.worker.theta_cid for n in live},
            terms=self.at_done[1] if finished else {n.peer_id: n.election.current_term for n in live},
            history=[t.as_dict() for t in hist],
            val_losses=[c.val_loss for c in chain if c.val_loss is not None],
            initial_val_loss=initial_val,
            names=[n.peer_id for n in self.nodes],
            end_time=trio.current_time(),
        )


def _chain(final: CommitRecord | None, published: list[CommitRecord]) -> list[CommitRecord]:
    """Walk back from the winning commit by ``prev_theta_cid`` (preferring higher terms)."""
    if final is None:
        return []
    by_theta: dict[str, list[CommitRecord]] = {}
    for rec in published:
        by_theta.setdefault(rec.theta_cid, []).append(rec)
    chain = [final]
    while chain[-1].round > 0:
        prev = [r for r in by_theta.get(chain[-1].prev_theta_cid, []) if r.round == chain[-1].round - 1]
        if not prev:
            break
        chain.append(max(prev, key=commit_key))
    return chain[::-1]


async def simulate_election(cfg: ElectionSimConfig) -> ElectionSimResult:
    return await ElectionWorld(cfg).run()

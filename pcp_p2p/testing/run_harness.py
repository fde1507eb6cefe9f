"""N run machines in one process on trio's clock: the combining rules under faults, in milliseconds.

Each simulated node runs the real :class:`~pcp_p2p.diloco.run.run_machine.RunMachine`
(and through it the real election, worker and shepherd, real Ed25519
signatures, CIDs and the wire codec) behind a pump that does in memory what
:class:`~pcp_p2p.diloco.run.runtime.RunRuntime` does on a node: it posts the same
typed inputs (:mod:`pcp_p2p.diloco.run.run_effects`) to an inbox and carries out
the same effects, over :mod:`pcp_p2p.testing.memnet`'s network, DHT and blob
stores. Nothing here decides anything the machine decides: a harness that bent
a rule would test itself.

What differs from a node, on purpose:

- the inner loop is :class:`~pcp_p2p.testing.quadratic.Quadratic`'s AdamW on a
  per-shard quadratic, taking ``steps · tokens_per_step / tokens_per_s`` of
  virtual time; a term's set-up (compiling) takes ``compile_s``;
- a message is acknowledged the way the runtime's ``deliver`` acknowledges it:
  a commit from its shepherd only once the receiver holds the checkpoint;
- membership is exact after ``membership_lag_s`` (a dead node stays listed that
  long, as a SWIM suspicion would keep it);
- a killed node loses its machine and its in-flight work, keeps its "disk" (blob
  store, last lease) and restarts with a fresh machine when its :class:`Kill`
  says so, which exercises catch-up after a restart.

Use :func:`run_swarm_sync` (a fresh ``MockClock``) or ``await RunSwarm(cfg).run()``.
"""

from __future__ import annotations

import math
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import trio

from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import BlobNotFound, HeldBack, PcpError
from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.algorithm.outer import OuterState
from pcp_p2p.diloco.protocol.effects import Discarded, Finished, Rejected, RunInner, Send, StoreBlob
from pcp_p2p.diloco.protocol.election import ElectionConfig, Lease, PublishLease, commit_key, start_candidates
from pcp_p2p.diloco.protocol.messages import CommitRecord, RoundAnnouncement, Submission
from pcp_p2p.diloco.protocol.shepherd import Shepherd
from pcp_p2p.diloco.protocol.spec import RunSpec, run_id_of, sign_spec
from pcp_p2p.diloco.protocol.worker import InnerResult, WorkerPhase
from pcp_p2p.diloco.run.reputation import ReputationLedger
from pcp_p2p.diloco.run.run_effects import (
    BlobFailed,
    BlobIn,
    CancelSetUp,
    CommitLookedUp,
    Event,
    Fetch,
    InnerDone,
    LeaseLookedUp,
    LookUpCommit,
    LookUpLease,
    MembersSeen,
    MessageIn,
    PublishCommit,
    ReplicateCheckpoint,
    ReplicateCommit,
    Replicated,
    RunEnded,
    SaveLease,
    SetUpEnded,
    SetUpShepherd,
    ShepherdBuilt,
)
from pcp_p2p.diloco.run.run_machine import Member, RunMachine
from pcp_p2p.testing.memnet import FaultPlan, Kill, MemBlobs, MemDht, MemNetwork
from pcp_p2p.testing.quadratic import SIM_ARTIFACT, Quadratic
from pcp_p2p.wire import Message

SWARM_ELECTION = ElectionConfig(
    lease_s=10.0, renew_every_s=3.0, grace_s=1.0, min_uptime_s=0.0, rotate_every=0,
    claim_timeout_s=10.0, settle_s=1.0,
)
"""A simulated swarm's election unless its config says otherwise."""


@dataclass(frozen=True)
class SwarmConfig:
    spec: RunSpec
    nodes: int = 5
    election: ElectionConfig = SWARM_ELECTION
    plan: FaultPlan = field(default_factory=FaultPlan)
    membership_lag_s: float = 3.0
    tokens_per_s: float = 64.0
    compile_s: float = 2.0
    shape: tuple[int, int] = (8, 4)
    time_limit: float = 3_000.0


@dataclass
class SwarmResult:
    finished: bool
    final: CommitRecord | None
    chain: list[CommitRecord]  # the winning θ history, round 0 .. last
    published: list[CommitRecord]
    theta_cids: dict[str, str | None]  # live node -> the θ its worker holds
    ended: dict[str, str]  # live node -> how its run ended ("finished", "stopped"), if it did
    killed: list[tuple[str, str]]  # (node, phase) in order
    restarts: int
    rejected: list[tuple[str, str | None, PcpError]]
    val_losses: list[float]
    initial_val_loss: float
    end_time: float


@dataclass
class MemNode:
    index: int
    identity: Identity
    ledger_dir: Path
    machine: RunMachine | None = None
    alive: bool = False
    started_at: float = 0.0
    inbox: trio.MemorySendChannel[Event] | None = None
    scope: trio.CancelScope | None = None
    setup_scope: trio.CancelScope | None = None
    nursery: trio.Nursery | None = None
    lease: Lease | None = None  # its "disk": the last lease it accepted
    ended: str | None = None
    hung_until: float | None = None  # hung (alive, deaf and mute) until then; then a zombie
    # θ CID -> set once the commit naming it is taken (in the machine, or refused): what waits for it
    taking: dict[str, trio.Event] = field(default_factory=dict)
    deferred: list[Any] | None = None  # the effects a hang interrupted: carried out when it wakes

    def __post_init__(self) -> None:
        self.peer_id = self.identity.peer_id  # once: ``Identity.peer_id`` derives it from the key on every read

    @property
    def up(self) -> bool:
        """Running and answering (neither dead nor hung)."""
        return self.alive and self.hung_until is None

    def boot(self, inbox: trio.MemorySendChannel[Event], now: float) -> None:
        """(Re)start: alive from ``now`` with a fresh inbox, neither ended nor hung.

        A method, not assignments in the node's loop, because a fault task sets ``hung_until``
        while the loop awaits: narrowed there to ``None``, its wake-up branch read as dead code.
        """
        self.inbox, self.alive, self.started_at, self.ended, self.hung_until = inbox, True, now, None, None

    def post(self, ev: Event) -> None:
        if self.alive and self.inbox is not None:  # a hung node finds it when it wakes
            self.inbox.send_nowait(ev)


class RunSwarm:
    """One run on ``cfg.nodes`` simulated nodes, each every role at once."""

    def __init__(self, cfg: SwarmConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.plan.seed)
        self.problem = Quadratic.make(np.random.default_rng(cfg.plan.seed), cfg.shape)
        owner = Identity(self.rng.randbytes(32))
        self.owner = owner.peer_id
        self.run_id = run_id_of(sign_spec(cfg.spec, owner))
        self.target = cfg.spec.targets[0]
        self.artifact_cid = cid_of(SIM_ARTIFACT)
        self.net = MemNetwork(cfg.plan, self.rng)
        self.dht = MemDht(self.net)
        self.blobs = MemBlobs(self.net)
        self.kills = list(cfg.plan.kills)
        self.killed: list[tuple[str, str]] = []
        self.restarts = 0
        self.rejected: list[tuple[str, str | None, PcpError]] = []
        self.discarded: list[tuple[int, int]] = []
        self.finished_cid: str | None = None  # what the shepherd's Finished named
        self.done = trio.Event()
        # the nodes' reputation ledgers (saved on every commit): in memory where the OS offers it
        shm = Path("/dev/shm")
        self._tmp = tempfile.TemporaryDirectory(prefix="pcp-swarm-", dir=shm if shm.is_dir() else None)
        self.nodes = [MemNode(i, Identity(self.rng.randbytes(32)), Path(self._tmp.name) / str(i))
                      for i in range(cfg.nodes)]
        self.by_id = {n.peer_id: n for n in self.nodes}
        self.world: trio.Nursery | None = None
        self._invisible_since: dict[tuple[str, str], float] = {}

    # --- what a scenario may vary per node (override) ---------------------------------------

    def start_at(self, node: MemNode) -> float:
        """When ``node`` first starts (virtual seconds)."""
        return 0.0

    def target_of(self, node: MemNode) -> str | None:
        """The target ``node`` trains for (``None``: it trains nothing, only leads or follows)."""
        return self.target

    def can_compile(self, node: MemNode) -> bool:
        """Whether ``node`` is a candidate to lead (what its member record says)."""
        return True

    def tokens_per_s(self, node: MemNode) -> float:
        return self.cfg.tokens_per_s

    def inner_result(self, node: MemNode, run: RunInner, honest: InnerResult) -> InnerResult:
        """What ``node``'s executor hands its worker (a Byzantine scenario lies here)."""
        return honest

    def extra_sends(self, node: MemNode, send: Send) -> list[Message]:
        """Messages ``node`` sends along with ``send`` (a replaying scenario adds them here)."""
        return []

    def shepherd_kwargs(self, node: MemNode) -> dict[str, Any]:
        """Extra keyword arguments of the shepherd ``node`` builds (``score``, ...)."""
        return {}

    # --- nodes ---------------------------------------------------------------------------

    def _machine(self, node: MemNode, now: float) -> RunMachine:
        node.ledger_dir.mkdir(parents=True, exist_ok=True)
        m = RunMachine.for_spec(
            self.cfg.spec, run_id=self.run_id, owner=self.owner, identity=node.identity,
            ledger=ReputationLedger(node.ledger_dir / "reputation.json", self.run_id),
            target=self.target_of(node), tokens_per_s=self.tokens_per_s(node), started_at=now,
            config=self.cfg.election,
        )
        if node.lease is not None:
            m.restore(node.lease)
        return m

    async def node_loop(self, node: MemNode) -> None:
        send, recv = trio.open_memory_channel[Event](math.inf)
        now = trio.current_time()
        node.boot(send, now)
        self.blobs.alive.add(node.peer_id)
        self.blobs.put(node.peer_id, self.artifact_cid, SIM_ARTIFACT)  # every node built the artifact
        m = node.machine = self._machine(node, now)
        with trio.CancelScope() as scope:
            node.scope = scope
            async with trio.open_nursery() as nursery:
                node.nursery = nursery
                if self._carry_out(node, m.start(now), None) == "kill":
                    return
                nursery.start_soon(self._members_loop, node)
                while not m.finished:
                    if node.hung_until is not None:
                        await trio.sleep_until(node.hung_until)
                        node.hung_until = None
                        self.blobs.alive.add(node.peer_id)
                        # it wakes inside its machines: finishes what it was doing and acts on
                        # the passed deadlines before it hears anything (what fencing must stop)
                        deferred, node.deferred = node.deferred or [], None
                        if self._carry_out(node, deferred + m.tick(trio.current_time()), None) == "kill":
                            return
                        continue
                    wake = m.next_wakeup
                    now = trio.current_time()
                    # a wakeup already past (a worker training) must not spin: look again in 0.5 s
                    at = math.inf if wake is None else max(wake, now + 0.5) if wake <= now else wake
                    ev: Event | None = None
                    with trio.move_on_at(at):
                        ev = await recv.receive()
                    now = trio.current_time()
                    if self._carry_out(node, m.handle(ev, now) if ev is not None else m.tick(now), ev) == "kill":
                        return
                    self._check_done()
                nursery.cancel_scope.cancel()  # the run is over here; the node stays up (its blobs)

    async def _members_loop(self, node: MemNode) -> None:
        while True:
            if node.up:
                node.post(MembersSeen(self.view_of(node, trio.current_time())))
            await trio.sleep(1.0)

    def view_of(self, node: MemNode, now: float) -> list[Member]:
        """The members ``node`` sees: each peer up and reachable, and for ``membership_lag_s``
        after it stops being so (a member record's suspicion and lifetime)."""
        out = []
        for other in self.nodes:
            key = (node.peer_id, other.peer_id)
            if other.up and self.net.reachable(node.peer_id, other.peer_id):
                self._invisible_since.pop(key, None)
            elif now - self._invisible_since.setdefault(key, now) >= self.cfg.membership_lag_s:
                continue
            out.append(Member(other.peer_id, other.started_at, self.can_compile(other)))
        return out

    # --- the pump ------------------------------------------------------------------------

    def _carry_out(self, node: MemNode, effects: list[Any], ev: Event | None) -> str | None:
        """Carry ``effects`` out, unless a planned fault strikes this node here: then only those
        before its cut, and the fault's action (``"kill"``, ``"hang"``)."""
        cut, fault = self.fault(node, effects, ev)
        if fault is not None and fault.hang_s:  # paused mid-input: the rest waits for the wake
            self._carry_out_now(node, effects[:cut])
            node.deferred = effects[cut:]
        else:
            self._carry_out_now(node, effects if fault is None else effects[:cut])
        if fault is None:
            return None
        self.killed.append((node.peer_id, fault.phase))
        if fault.hang_s:
            node.hung_until = trio.current_time() + fault.hang_s
            self.blobs.alive.discard(node.peer_id)
            return "hang"
        self.kill(node, fault.restart_after)
        return "kill"

    def _carry_out_now(self, node: MemNode, effects: list[Any]) -> None:
        n = node.nursery
        assert n is not None and self.world is not None
        me = node.peer_id
        delay = self.cfg.plan.fetch_delay
        for e in effects:
            if isinstance(e, Send):
                self.send(me, e.to, e.message)
                for extra in self.extra_sends(node, e):
                    self.send(me, e.to, extra)
            elif isinstance(e, StoreBlob):
                self.blobs.put(me, e.cid, e.data)
            elif isinstance(e, Fetch):
                n.start_soon(self._fetch, node, e, delay)
            elif isinstance(e, RunInner):
                n.start_soon(self._inner, node, e)
            elif isinstance(e, LookUpCommit):
                n.start_soon(self._later, node, delay, lambda f=e.for_election: CommitLookedUp(
                    self.dht.best_commit(me), f))
            elif isinstance(e, LookUpLease):
                n.start_soon(self._later, node, delay, lambda: LeaseLookedUp(
                    self.dht.best_lease(me, trio.current_time())))
            elif isinstance(e, PublishLease):
                if e.store:
                    self.dht.put_lease(me, e.lease)
                for peer in node.machine.run_members():  # type: ignore[union-attr]
                    self.send(me, peer, e.lease)
            elif isinstance(e, PublishCommit):
                self.dht.put_commit(me, e.record)
            elif isinstance(e, ReplicateCommit):
                n.start_soon(self._replicate, node, e)
            elif isinstance(e, ReplicateCheckpoint):
                self.blobs.fetch(me, e.cid)
            elif isinstance(e, SetUpShepherd):
                n.start_soon(self._set_up, node, e)
            elif isinstance(e, CancelSetUp):
                if node.setup_scope is not None:
                    node.setup_scope.cancel()
            elif isinstance(e, SaveLease):
                node.lease = e.lease
            elif isinstance(e, RunEnded):
                node.ended = e.phase
            elif isinstance(e, Rejected):
                self.rejected.append((me, e.peer, e.error))
            elif isinstance(e, Discarded):
                self.discarded.append((e.round, e.attempt))
            elif isinstance(e, Finished):
                self.finished_cid = e.theta_cid
            # Leads, ReleasePins, CommitAccepted, CancelInner (a superseded result is ignored by
            # the worker), Audit, LookUpOwnerRecord, Stopped: nothing to do in memory

    def send(self, src: str, dst: str, msg: Message) -> None:
        assert self.world is not None
        for delay in self.net.copies(src, dst):
            self.world.start_soon(self._deliver_after, src, dst, MemNetwork.wire(msg), delay)

    async def _deliver_after(self, src: str, dst: str, msg: Message, delay: float) -> None:
        await trio.sleep(delay)
        await self.deliver(src, dst, msg)

    async def deliver(self, sender: str, dst: str, msg: Message) -> bool:
        """What the runtime's ``deliver`` does before the messenger acks; True: acknowledged."""
        node = self.by_id[dst]
        if not node.alive or node.machine is None or not self.net.reachable(sender, dst):
            return False
        if node.hung_until is not None:
            node.post(MessageIn(sender, msg))  # read when it wakes; nobody acks meanwhile
            return False
        if isinstance(msg, CommitRecord) and msg.checkpoint_cid and sender == msg.shepherd:
            try:
                node.machine.vouch_commit(msg)
            except HeldBack:
                node.post(MessageIn(sender, msg))  # the election keeps it; no ack
                return False
            except PcpError:
                return False
            taking = node.taking.setdefault(msg.theta_cid, trio.Event())
            try:
                await trio.sleep(self.cfg.plan.fetch_delay)
                if not node.alive or self.blobs.fetch(dst, msg.checkpoint_cid) is None:
                    return False  # the checkpoint could not be fetched: neither acked nor accepted
                node.post(MessageIn(sender, msg))
                return True
            finally:
                if node.taking.get(msg.theta_cid) is taking:
                    del node.taking[msg.theta_cid]
                taking.set()
        if isinstance(msg, RoundAnnouncement) and (before := node.taking.get(msg.theta_cid)) is not None:
            await before.wait()  # (as the runtime: held while the commit it starts from is taken)
        node.post(MessageIn(sender, msg))  # (dropped by a node killed meanwhile)
        return True

    async def _later(self, node: MemNode, delay: float, make: Any) -> None:
        await trio.sleep(delay)
        node.post(make())

    async def _fetch(self, node: MemNode, e: Fetch, delay: float) -> None:
        await trio.sleep(delay)
        data = self.blobs.fetch(node.peer_id, e.cid, keep=e.who != "shepherd")
        node.post(BlobIn(e.who, e.cid, data) if data is not None else BlobFailed(e.who, e.cid, BlobNotFound(e.cid)))

    async def _inner(self, node: MemNode, run: RunInner) -> None:
        spec, speed = self.cfg.spec, self.tokens_per_s(node)
        by_time = int(speed * run.time_budget_s // spec.tokens_per_step)
        steps = max(1, min(run.assignment.max_steps, by_time))
        await trio.sleep(steps * spec.tokens_per_step / speed)
        node.post(InnerDone(self.inner_result(node, run, self.problem.inner(run, steps, spec))))

    async def _replicate(self, node: MemNode, e: ReplicateCommit) -> None:
        acked: list[str] = []
        done = trio.Event()
        then = dict(e.then)

        async def ask(peer: str) -> None:
            follow = then.get(peer)
            for delay in self.net.copies(node.peer_id, peer)[:1]:
                await trio.sleep(delay)
                if await self.deliver(node.peer_id, peer, MemNetwork.wire(e.commit)):
                    acked.append(peer)
                    done.set()
                if follow is not None:  # right behind it: the runtime's receiver holds it until then
                    await self.deliver(node.peer_id, peer, MemNetwork.wire(follow))
                    follow = None
            if follow is not None:  # (the commit was lost: it travels on its own)
                self.send(node.peer_id, peer, follow)

        async with trio.open_nursery() as n:  # (as the runtime: the other sends go on)
            for peer in e.targets:
                n.start_soon(ask, peer)
            with trio.move_on_after(e.timeout_s):
                await done.wait()
            node.post(Replicated(e.commit, list(acked)))

    async def _set_up(self, node: MemNode, e: SetUpShepherd) -> None:
        become, m = e.become, node.machine
        assert m is not None
        with trio.CancelScope() as scope:
            node.setup_scope = scope
            await trio.sleep(self.cfg.compile_s)
            kw: dict[str, Any] = dict(
                spec=self.cfg.spec, run_id=self.run_id, identity=node.identity, term=become.term,
                artifacts={self.target: self.artifact_cid}, evaluate=self.problem.loss,
                end_round=become.end_round, admit=m.admission.why_not, **self.shepherd_kwargs(node),
            )
            if become.checkpoint_cid is None:
                node.post(ShepherdBuilt(Shepherd(state=OuterState.initial(self.problem.initial()), **kw)))
            else:  # as the runtime's set-up: the first of the lease's starting states a live node holds
                for point in start_candidates(become, m.election.lease, m.election.best_commit):
                    blob = self.blobs.fetch(node.peer_id, point.cid)
                    if blob is not None:
                        node.post(ShepherdBuilt(Shepherd.from_start(point, blob, **kw)))
                        break
                else:
                    m.setup_failed("none of the states the lease's term can start from is held by a live node")
        if node.setup_scope is scope:
            node.setup_scope = None
        node.post(SetUpEnded(become.term))

    # --- faults --------------------------------------------------------------------------

    def fault(self, node: MemNode, effects: list[Any], ev: Event | None) -> tuple[int, Kill | None]:
        """The planned fault that strikes ``node`` on ``effects`` (from ``ev``), if any, and how many
        of the effects happen first (a :class:`Kill` strikes after all of them)."""
        for k in list(self.kills):
            if (k.node is None or k.node == node.index) and self.phase_hits(node, k, effects, ev):
                self.kills.remove(k)
                return len(effects), k
        return len(effects), None

    def phase_hits(self, node: MemNode, k: Kill, effects: list[Any], ev: Event | None) -> bool:
        """Whether ``node``, having just produced ``effects`` from ``ev``, is at ``k.phase``."""
        m = node.machine
        assert m is not None
        r = k.round
        if k.phase == "settling":
            return any(isinstance(e, LookUpLease) for e in effects)
        if k.phase == "claimed":
            return any(isinstance(e, PublishLease) and not e.renewal for e in effects)
        if k.phase == "compiling":
            return any(isinstance(e, SetUpShepherd) for e in effects)
        if k.phase == "announced":  # (after a commit, the announcement follows it: ReplicateCommit.then)
            sent = [e.message for e in effects if isinstance(e, Send)]
            sent += [msg for e in effects if isinstance(e, ReplicateCommit) for _, msg in e.then]
            return any(isinstance(msg, RoundAnnouncement) and msg.round >= r for msg in sent)
        if k.phase == "collecting":
            sh = m.shepherd
            return (isinstance(ev, MessageIn) and isinstance(ev.message, Submission) and sh is not None
                    and sh.round_agg is not None and sh.state.round >= r and len(sh.round_agg.accepted) >= 1)
        if k.phase == "replicating":
            return any(isinstance(e, ReplicateCommit) and e.commit.round >= r for e in effects)
        if k.phase == "committed":
            return any(isinstance(e, PublishCommit) and e.record.round >= r for e in effects)
        w = m.worker
        if k.phase == "fetching":
            return (w is not None and w.phase is WorkerPhase.FETCHING and w.current is not None
                    and w.current.round >= r)
        if k.phase == "training":
            return any(isinstance(e, RunInner) and e.round >= r for e in effects)
        if k.phase == "submitted":
            return any(isinstance(e, Send) and isinstance(e.message, Submission) and e.message.round >= r
                       for e in effects)
        return False

    def kill(self, node: MemNode, restart_after: float | None) -> None:
        assert node.scope is not None and self.world is not None
        node.alive, node.setup_scope = False, None
        self.blobs.alive.discard(node.peer_id)
        node.scope.cancel()
        if restart_after is not None:
            self.world.start_soon(self._restart, node, restart_after)

    async def _start_node(self, node: MemNode) -> None:
        await trio.sleep(self.start_at(node))
        await self.node_loop(node)

    async def _restart(self, node: MemNode, after: float) -> None:
        await trio.sleep(after)
        self.restarts += 1
        await self.node_loop(node)

    async def _partition(self) -> None:
        p = self.cfg.plan.partition
        assert p is not None
        await trio.sleep_until(p.at)
        self.net.side_of = {n.peer_id: (0 if n.index in p.side else 1) for n in self.nodes}
        await trio.sleep_until(p.heal_at)
        self.net.side_of = None

    # --- the outcome ---------------------------------------------------------------------

    def final(self) -> CommitRecord | None:
        return max(self.dht.published(), key=commit_key, default=None)

    def _check_done(self) -> None:
        final = self.final()
        if final is None or final.round + 1 < self.cfg.spec.round.rounds:
            return  # (a planned kill whose phase never came is the test's to notice: ``killed``)
        live = [n for n in self.nodes if n.alive]
        if live and all(n.ended == "finished" for n in live):
            self.done.set()

    async def run(self) -> SwarmResult:
        cfg = self.cfg
        finished = False
        try:
            async with trio.open_nursery() as world:
                self.world = world
                for node in self.nodes:
                    world.start_soon(self._start_node, node)
                if cfg.plan.partition is not None:
                    world.start_soon(self._partition)
                with trio.move_on_after(cfg.time_limit):
                    await self.done.wait()
                    finished = True
                world.cancel_scope.cancel()
        finally:
            self._tmp.cleanup()
        published = self.dht.published()
        final = self.final()
        chain = chain_of(final, published)
        live = [n for n in self.nodes if n.alive]
        return SwarmResult(
            finished=finished, final=final, chain=chain, published=published,
            theta_cids={n.peer_id: (n.machine.worker.theta_cid if n.machine and n.machine.worker else None)
                        for n in live},
            ended={n.peer_id: n.ended for n in live if n.ended is not None},
            killed=list(self.killed), restarts=self.restarts, rejected=list(self.rejected),
            val_losses=[c.val_loss for c in chain if c.val_loss is not None],
            initial_val_loss=self.problem.loss(self.problem.initial()), end_time=trio.current_time(),
        )


def chain_of(final: CommitRecord | None, published: list[CommitRecord]) -> list[CommitRecord]:
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


async def run_swarm(cfg: SwarmConfig) -> SwarmResult:
    return await RunSwarm(cfg).run()


def run_swarm_sync(cfg: SwarmConfig) -> SwarmResult:
    """:func:`run_swarm` under a fresh autojump ``MockClock``: virtual time, milliseconds of wall time."""
    from trio.testing import MockClock

    return trio.run(run_swarm, cfg, clock=MockClock(autojump_threshold=0))


"""The planetary simulator: thousands of real run machines on home links, with churn, in virtual time.

Every simulated node runs the real :class:`~pcp_p2p.diloco.run.run_machine.RunMachine`
(and through it the real election, worker and shepherd: real Ed25519 signatures,
CIDs, the wire codec, the robust aggregation). What is simulated is the world
around the machines, and each stand-in is chosen so that 10,000 nodes fit in one
process on two cores; every choice is listed here, because a simulator that
bends a rule tests itself:

- **Time** is a plain virtual clock and a heap of timed events (no trio: ten
  thousand tasks and a cancel scope per message cost more than the machines).
  A node's machine is fed one input at a time with ``now``, and its
  ``next_wakeup`` is kept as one timer in the heap (replaced, never scanned).
- **Links** (:class:`LinkModel`): each node draws a downlink, an uplink and a
  one-way access latency from a distribution of home broadband links. A message
  waits for its sender's uplink (one FIFO queue per node: a shepherd sending a
  1,000-worker announcement a thousand times pays for every byte), crosses both
  access latencies, and is read at the receiver's downlink speed. Every message
  goes through the wire codec (encoded once per message object; the receivers
  share the decoded copy, which is immutable).
- **Compute** (``speed_*``): tokens per second drawn log-normally (consumer GPUs
  and CPUs differ by an order of magnitude), so fast nodes do more inner steps
  in the round's time budget, as the worker's ``RunInner`` asks.
- **Inner training** (:func:`surrogate_inner`): the closed form of gradient descent
  on the worker's shard of :class:`~pcp_p2p.testing.quadratic.Quadratic` with a
  little noise, ``θ* + (θ − θ*)·exp(−k·a·steps)``: one numpy expression whatever
  the step count, on a 36-parameter θ. It takes ``steps · tokens_per_step /
  tokens_per_s`` virtual seconds. Validation loss still falls only if the
  protocol really combines the shards. An early run (``round.overlap``) trains
  from its start until its ``ShiftInner`` arrives, is moved by the shift there
  (at that step, not at a chunk boundary; it waits for it past
  ``EARLY_SHARE`` of its steps) and trains the rest of its steps.
- **Membership** (the one model that is not the node's): a real node's view lists
  every member of its run and is posted to the machine every second; at 10,000
  nodes that is 10⁸ entries posted per second and 10⁴ views of 10⁴ members in
  memory. Here the run's shepherd-capable members (``pool``: the members whose
  record says ``can_compile``, drawn from the fastest uplinks) are the only
  candidates, and a node's view is the pool's live members, posted only when it
  changes, after a lag drawn per node (``view_lag_s``: SWIM's spread and
  suspicion; a dead member stays listed that long). A node that leads (from its
  ``Leads(True)``) sees the whole run, refreshed at most every
  ``holder_view_every_s`` when it changed, since the shepherd is the one node
  whose effects fan out to the run (leases, relayed departures). Because views
  are not re-posted every second the election's ``min_uptime_s`` is 0 here.
- **DHT**: the run's best commit (fork choice) and live leases, answered after
  ``dht_delay_s``.
- **Blobs**: each node's store survives its death (its disk); a fetch is served by
  the hinted node if it holds the blob and is up, else by any live holder, at
  that holder's uplink speed. Old rounds' blobs are released on ``ReleasePins``.
- **Churn**: departures form a Poisson process whose rate gives ``churn`` × N
  departures over the run's expected length; a departure is a graceful leave (a
  signed ``Leave``, share ``graceful``) or a kill at whatever phase the node is
  in. A departed node comes back after an exponential downtime (so joins are a
  Poisson process too) with its disk (blobs, last lease) and a fresh machine,
  which exercises catch-up. ``shepherd_kills`` more kills strike whoever leads,
  spread over the run, to measure failover.
- **Verification** of a signature is done once per message object (all
  receivers of one broadcast share the decoded object, so identical bytes):
  :func:`verification_cache`. **Signing** is done once per distinct content and
  key: Ed25519 is deterministic, so a worker's ``Join``, the same each time it
  joins again, is the same signed message, and the simulator reuses it (with its
  wire encoding and its verification). Every distinct message is really signed,
  and really verified once.
- **Disk**: the reputation ledger is the real one, kept in memory
  (:class:`MemoryLedger`; the simulator never reads a ledger back), and the
  cyclic garbage collector runs at larger thresholds while the planet runs
  (``GC_THRESHOLD``).

:func:`simulate` runs one configuration and returns :class:`PlanetResult`
(rounds committed and attempted, goodput, round time, shepherd bytes per round,
election convergence, memory per node); ``bench/sim.py`` and ``pcp sim`` print it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import heapq
import math
import os
import random
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pcp_p2p.core import identity as identity_mod
from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import BlobNotFound, HeldBack, PcpError
from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.algorithm.outer import OuterState
from pcp_p2p.diloco.algorithm.params import unpack_tensors
from pcp_p2p.diloco.protocol import aggregate, commits, departures, election, messages, shepherd, worker
from pcp_p2p.diloco.protocol.departures import make_leave
from pcp_p2p.diloco.protocol.effects import (
    EARLY,
    EARLY_SHARE,
    CancelInner,
    Rejected,
    RunInner,
    Send,
    ShiftInner,
    StoreBlob,
)
from pcp_p2p.diloco.protocol.election import ElectionConfig, Lease, PublishLease, commit_key, start_candidates
from pcp_p2p.diloco.protocol.messages import CommitRecord, RoundAnnouncement
from pcp_p2p.diloco.protocol.shepherd import Shepherd
from pcp_p2p.diloco.protocol.spec import RunSpec, parse_spec, run_id_of, sign_spec
from pcp_p2p.diloco.protocol.worker import InnerResult
from pcp_p2p.diloco.run.reputation import ReputationLedger
from pcp_p2p.diloco.run.run_effects import (
    BlobFailed,
    BlobIn,
    CancelSetUp,
    CommitLookedUp,
    Event,
    Fetch,
    InnerDone,
    Leads,
    LeaseLookedUp,
    LookUpCommit,
    LookUpLease,
    MembersSeen,
    MessageIn,
    PublishCommit,
    ReleasePins,
    ReplicateCheckpoint,
    ReplicateCommit,
    Replicated,
    RunEnded,
    SaveLease,
    SetUpEnded,
    SetUpShepherd,
    ShepherdBuilt,
)
from pcp_p2p.diloco.run.run_machine import REPLICATE_TIMEOUT_S, Member, RunMachine
from pcp_p2p.testing.quadratic import SIM_ARTIFACT, Quadratic
from pcp_p2p.wire import Message, decode, encode

# --- the world's distributions ------------------------------------------------------------


@dataclass(frozen=True)
class LinkModel:
    """Home broadband links, per node.

    Downlink: log-normal, median ``down_median_mbps`` (90 Mbit/s: the order of
    the 2024 global median of fixed broadband speed tests), ``down_sigma`` 0.9
    (a tenth of the nodes below ~30 Mbit/s, a tenth above ~300), clipped to
    [2, 1000]. Uplink: the same for the ``symmetric`` share (fibre), else the
    downlink times U(0.05, 0.3) (cable and DSL). One-way access latency:
    log-normal, median 15 ms, sigma 0.7, clipped to [2, 250] ms; a message's
    delay is the sum of both ends' (plus its time on the wire).
    """

    down_median_mbps: float = 90.0
    down_sigma: float = 0.9
    symmetric: float = 0.35
    latency_median_ms: float = 15.0
    latency_sigma: float = 0.7

    def draw(self, rng: random.Random) -> tuple[float, float, float]:
        """``(down bytes/s, up bytes/s, one-way latency s)``."""
        down = min(1000.0, max(2.0, self.down_median_mbps * math.exp(rng.gauss(0, self.down_sigma))))
        up = down if rng.random() < self.symmetric else down * rng.uniform(0.05, 0.3)
        lat = min(250.0, max(2.0, self.latency_median_ms * math.exp(rng.gauss(0, self.latency_sigma))))
        return down * 125_000, max(0.5, up) * 125_000, lat / 1000


def planet_spec(rounds: int = 50, min_quorum: int = 2, overlap: bool = False) -> RunSpec:
    """The run every simulated node takes part in: minute-long rounds, 60 s leases, no audits.

    Leases are longer than the spec's default (6 s, renewed every 2 s: sized for a
    LAN swarm) because at 10,000 members every renewal is 10,000 messages from the
    shepherd's home uplink. Audits are off: the simulator does not replay rounds.
    """
    return parse_spec(f"""
[inner]
lr = 0.02
batch_size = 4
seq_len = 8
[round]
time_budget_s = 60.0
deadline_s = 90.0
max_inner_steps = 100
rounds = {rounds}
min_quorum = {min_quorum}
overlap = {"true" if overlap else "false"}
[election]
lease_s = 60.0
renew_every_s = 20.0
grace_s = 2.0
min_uptime_s = 0.0
rotate_every = 10
claim_timeout_s = 30.0
[aggregation]
audit_rate = 0.0
val_jump = 0.0
""")


@dataclass(frozen=True)
class PlanetConfig:
    nodes: int
    rounds: int = 50
    churn: float = 0.3  # departures over the run, as a share of ``nodes``
    graceful: float = 0.1  # share of departures that announce themselves (the rest: kills)
    down_mean_s: float = 300.0  # a departed node returns after an exponential downtime of this mean
    shepherd_kills: int = 1  # extra kills of whoever leads, spread over the run
    pool: int = 16  # shepherd-capable members (can_compile), from the fastest uplinks
    view_lag_s: tuple[float, float] = (0.5, 5.0)  # per node: how late it sees the pool change
    holder_view_every_s: float = 10.0
    dht_delay_s: float = 0.5
    compile_s: float = 5.0
    speed_median: float = 64.0  # tokens/s
    speed_sigma: float = 0.6
    links: LinkModel = LinkModel()
    seed: int = 0
    min_quorum: int = 2
    time_limit: float | None = None  # virtual seconds; default: rounds x 4 deadlines
    overlap: bool = False  # round.overlap: workers train the next round while their Δ travels
    spec: RunSpec | None = None

    def run_spec(self) -> RunSpec:
        return self.spec if self.spec is not None else planet_spec(self.rounds, self.min_quorum, self.overlap)


@dataclass
class PlanetResult:
    nodes: int
    rounds: int
    finished: bool
    rounds_committed: int  # distinct rounds on the winning chain
    rounds_attempted: int  # distinct (term, round, attempt) announced
    goodput: float  # rounds committed / attempts
    round_time_s: float  # mean virtual seconds per committed round
    shepherd_bytes_per_round: float  # sent by leading nodes (messages and blobs served), per committed round
    elections: int  # terms that some node followed
    election_convergence_s: list[float]  # per new term: from the vacancy (the start, the leader's death) or
    # the first node following it (a rotation) to 95% of live nodes following its holder
    departures: int  # graceful leaves and kills (incl. shepherd kills)
    kills: int
    returns: int
    leader_departures: int  # departures (kills included) of a node that led or was setting its term up
    terms: int  # terms that committed a round on the winning chain
    seated_mean: float  # workers per commit (participants)
    val_loss_first: float | None
    val_loss_last: float | None
    virtual_s: float
    wall_s: float
    events: int
    rss_per_node_kib: float
    deliveries: int
    rejected: dict[str, int] = field(default_factory=dict)
    early_runs: int = 0  # early runs (round.overlap) that were adopted and shifted
    checkpoints_rebuilt: int = 0  # commits' checkpoints built from the last one and the update
    checkpoints_fetched: int = 0  # ... and fetched whole (no base held, or the build did not match)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# --- the surrogate inner loop --------------------------------------------------------------

INNER_RATE = 0.02  # per step and unit curvature: 100 steps bring a shard ~e^-2·a of the way


def surrogate_inner(problem: Quadratic, run: RunInner, steps: int, noise: np.random.Generator) -> InnerResult:
    """``steps`` of gradient descent on the assigned shard's quadratic, in closed form.

    ``θ_k = θ*_k + (θ − θ*_k)·exp(−INNER_RATE·a·steps) + ε`` (ε ~ N(0, 0.01)): what
    plain gradient descent of step ``INNER_RATE`` converges like, one numpy
    expression per tensor. The losses reported are the shard's before and after.
    """
    a = run.assignment
    target = problem.shard_optimum(a.shard, a.num_shards)
    theta = {}
    for k, v in run.theta.items():
        decay = np.exp(-INNER_RATE * problem.curvature[k] * steps)
        theta[k] = (target[k] + (v - target[k]) * decay + noise.normal(0, 0.01, v.shape)).astype(np.float32)
    losses = (problem.loss(run.theta, target), problem.loss(theta, target))
    return InnerResult(run.round, run.attempt, theta, steps, losses, None)


# --- verification, once per message object --------------------------------------------------

_VERIFY_USERS = (aggregate, commits, departures, election, shepherd, worker)


@dataclass(frozen=True)
class KeptIdentity(Identity):
    """An :class:`~pcp_p2p.core.identity.Identity` that derives its key and peer id once.

    The real one derives both on every read through 64-entry caches, which ten
    thousand identities in one process thrash (a third of the run's time went to
    base58 and key parsing). Signing is unchanged: the same key signs the same bytes.
    """

    _key: Ed25519PrivateKey = field(init=False, repr=False, compare=False)
    _peer: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "_key", Ed25519PrivateKey.from_private_bytes(self.seed))
        object.__setattr__(self, "_peer", super().peer_id)

    @property
    def private_key(self) -> Ed25519PrivateKey:
        return self._key

    @property
    def peer_id(self) -> str:
        return self._peer


@contextlib.contextmanager
def verification_cache() -> Iterator[None]:
    """``messages.verify`` remembered per message object while the simulator runs (and θ decoded once).

    Every receiver of a broadcast gets the same decoded (immutable) object, so a
    signature over identical bytes is checked once, not once per receiver: at
    10,000 nodes that is the difference between one Ed25519 verification and
    ten thousand per lease renewal. Failures are never cached. The modules that
    imported ``verify`` get the cached one and their own back afterwards. Peer
    ids' public keys are kept (the real cache holds 4,096), and a θ blob, one
    bytes object that every worker fetches, is decoded once into read-only arrays.
    ``messages.sign`` is remembered per (content, identity) the same way (see
    ``sign_once``): a seatless worker's ``Join`` is signed once, not every deadline.
    """
    real = messages.verify
    ok: dict[int, tuple[Message, str]] = {}
    keys: dict[str, Ed25519PublicKey] = {}
    real_key_of = identity_mod.public_key_of

    def key_of(peer_id: str) -> Ed25519PublicKey:  # the real one's 4,096-entry cache thrashes at 10,000 peers
        key = keys.get(peer_id)
        if key is None:
            key = keys[peer_id] = real_key_of(peer_id)
        return key

    def cached(msg: Message, signer: str) -> None:
        hit = ok.get(id(msg))
        if hit is not None and hit[0] is msg and hit[1] == signer:
            return
        real(msg, signer)
        if len(ok) > 200_000:
            ok.clear()
        ok[id(msg)] = (msg, signer)

    real_sign = messages.sign
    signed: dict[tuple[Message, Identity], Message] = {}

    def sign_once(msg: Any, identity: Identity) -> Any:
        # Ed25519 is deterministic (RFC 8032): the same key over the same content gives the
        # same signed message, so a worker's Join, identical each time it joins again, is
        # signed once and the signed object reused (and with it the wire's and the
        # verification's entries for that object). Messages with unhashable fields
        # (a submission's dicts) and anything new are signed for real.
        try:
            key = (msg, identity)
            hit = signed.get(key)
        except TypeError:
            return real_sign(msg, identity)
        if hit is None:
            hit = real_sign(msg, identity)
            if len(signed) > 100_000:
                signed.clear()
            signed[key] = hit
        return hit

    saved = [(m, m.verify) for m in _VERIFY_USERS if getattr(m, "verify", None) is real]
    for m, _ in saved:
        m.verify = cached  # type: ignore[attr-defined]  # patching the name each module imported
    saved_sign = [(m, m.sign) for m in _VERIFY_USERS if getattr(m, "sign", None) is real_sign]
    for m, _ in saved_sign:
        m.sign = sign_once  # type: ignore[attr-defined]  # patching the name each module imported
    identity_mod.public_key_of = key_of  # type: ignore[assignment]  # a plain function for an lru_cache wrapper
    real_unpack = unpack_tensors  # what worker imported
    unpacked: dict[int, tuple[bytes | memoryview, dict[str, np.ndarray]]] = {}

    def unpack(data: bytes | memoryview, *a: Any, **kw: Any) -> dict[str, np.ndarray]:
        # θ: the same blob object reaches every worker; decoded once, shared read-only
        hit = unpacked.get(id(data))
        if hit is not None and hit[0] is data:
            return dict(hit[1])
        out = real_unpack(data, *a, **kw)
        for v in out.values():
            v.flags.writeable = False  # a worker that wrote into a shared θ would raise, not corrupt
        if len(unpacked) > 10_000:
            unpacked.clear()
        unpacked[id(data)] = (data, out)
        return dict(out)

    worker.unpack_tensors = unpack  # type: ignore[attr-defined]
    try:
        yield
    finally:
        identity_mod.public_key_of = real_key_of
        worker.unpack_tensors = real_unpack  # type: ignore[attr-defined]
        for m, f in saved:
            m.verify = f  # type: ignore[attr-defined]  # the name each module imported, restored
        for m, f in saved_sign:
            m.sign = f  # type: ignore[attr-defined]


class MemoryLedger(ReputationLedger):
    """The real reputation ledger, kept in memory: ``save`` writes nothing.

    A node writes its ledger to disk (JSON of up to 4,096 peers) at most every
    5 s while strikes come in, and a full roster strikes every seatless worker's
    ``Join`` again each deadline: at 10,000 nodes the shepherd's JSON writes were
    a large share of the run. The simulator never reads a ledger back (a restarted
    node's machine starts a fresh one), so the writes only cost; the ledger's
    credits, strikes and bans, which the machines consult, are kept as the real one.
    """

    def save(self, now: float) -> None:
        self._dirty = False
        self._saved_at = now


# --- nodes ---------------------------------------------------------------------------------


class PNode:
    """One simulated node: its links and speed, its disk, and (while up) its machine."""

    __slots__ = (
        "alive",
        "blobs",
        "checkpoints",
        "down",
        "early",
        "ended",
        "epoch",
        "identity",
        "index",
        "lat",
        "leading",
        "lease",
        "machine",
        "member",
        "peer_id",
        "pins",
        "pool",
        "setup_epoch",
        "setup_term",
        "speed",
        "started_at",
        "taking",
        "term_seen",
        "up",
        "up_free",
        "view_due",
        "view_seen",
        "wake",
    )

    def __init__(self, index: int, identity: Identity, link: tuple[float, float, float], speed: float) -> None:
        self.index = index
        self.identity = identity
        self.peer_id = identity.peer_id
        self.down, self.up, self.lat = link
        self.speed = speed
        self.pool = False
        self.machine: RunMachine | None = None
        self.alive = False
        self.epoch = 0  # bumped on every death: events of an earlier life are dropped
        self.started_at = 0.0
        self.lease: Lease | None = None  # on disk: the last lease accepted
        self.blobs: dict[str, bytes] = {cid_of(SIM_ARTIFACT): SIM_ARTIFACT}  # on disk
        self.checkpoints: dict[str, str] = {}  # θ CID -> the held checkpoint of the commit that named it
        self.pins: deque[str] = deque()  # the round blobs held, oldest first
        self.up_free = 0.0  # when its uplink is free again
        self.wake: float | None = None  # the machine's timer in the heap
        self.view_due = False  # a view refresh is scheduled
        self.leading = False
        self.view_seen: tuple[int, bool] | None = None  # (version, whole run?) of the view last posted
        self.setup_epoch = 0  # bumped to cancel a set-up in progress
        self.setup_term: int | None = None  # the term being set up
        self.member: Member | None = None
        self.term_seen: int | None = None
        self.ended: str | None = None
        self.early: tuple[RunInner, int, float, float] | None = None  # (run, steps, started, compute done)
        # θ CID -> the deliveries waiting while the commit naming it is taken (the runtime's ``deliver``)
        self.taking: dict[str, list[Callable[[], None]]] = {}


KEEP_BLOBS = 8  # round blobs (θ, checkpoints) a node keeps; older ones are released


class Planet:
    """The world: nodes, links, DHT, blobs, membership, churn; and the event heap that drives them."""

    def __init__(self, cfg: PlanetConfig) -> None:
        self.cfg = cfg
        self.spec = cfg.run_spec()
        self.rng = random.Random(cfg.seed)
        self.noise = np.random.default_rng(cfg.seed)
        self.problem = Quadratic.make(np.random.default_rng(cfg.seed), (8, 4))
        owner = Identity(self.rng.randbytes(32))
        self.owner = owner.peer_id
        self.run_id = run_id_of(sign_spec(self.spec, owner))
        self.target = self.spec.targets[0]
        self.artifact_cid = cid_of(SIM_ARTIFACT)
        self.election_cfg = ElectionConfig(
            lease_s=self.spec.election.lease_s, renew_every_s=self.spec.election.renew_every_s,
            grace_s=self.spec.election.grace_s, min_uptime_s=0.0, rotate_every=self.spec.election.rotate_every,
            claim_timeout_s=self.spec.election.claim_timeout_s, settle_s=3.0,
        )
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.events = 0
        self.deliveries = 0
        self.early_runs = 0  # early runs shifted (round.overlap)
        self.rebuilt = self.ckpt_fetched = 0  # commits' checkpoints built from the update / fetched
        # nodes
        self.nodes: list[PNode] = []
        for i in range(cfg.nodes):
            link = cfg.links.draw(self.rng)
            speed = cfg.speed_median * math.exp(self.rng.gauss(0, cfg.speed_sigma))
            self.nodes.append(PNode(i, KeptIdentity(self.rng.randbytes(32)), link, speed))
        for n in sorted(self.nodes, key=lambda n: -n.up)[: cfg.pool]:
            n.pool = True
        self.by_id = {n.peer_id: n for n in self.nodes}
        shm = Path("/dev/shm")
        self._tmp = tempfile.TemporaryDirectory(prefix="pcp-planet-", dir=shm if shm.is_dir() else None)
        self.ledger_dir = Path(self._tmp.name)
        # membership
        self.live: dict[str, Member] = {}
        self.live_version = 0
        self._live_list: tuple[int, list[Member]] = (-1, [])
        self.pool_live: dict[str, Member] = {}
        self.pool_version = 0
        self._pool_list: tuple[int, list[Member]] = (-1, [])
        # DHT
        self.best_commit: CommitRecord | None = None
        self.published: list[CommitRecord] = []
        self.leases: dict[str, Lease] = {}  # holder -> its latest lease
        # blobs
        self.holders: dict[str, set[int]] = {}
        # the wire: message object -> (size, decoded copy)
        self._wire: dict[int, tuple[Message, int, Message]] = {}
        # measurements
        self.attempts: set[tuple[int, int, int]] = set()
        self.shepherd_bytes = 0
        self.departures = 0
        self.leader_departures = 0
        self.kills = 0
        self.returns = 0
        self.rejected: dict[str, int] = {}
        self.term_followers: dict[int, int] = {}
        self.vacancy_at: float | None = 0.0  # the run starts vacant; a leader's death makes it so
        self.term_since: dict[int, float] = {}  # new terms not yet followed by 95% of live nodes
        self.convergence: list[float] = []
        self.finished = False
        self.end_time: float | None = None

    # --- the event heap ---------------------------------------------------------------------

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def run(self, limit: float) -> None:
        heap = self._heap
        pop = heapq.heappop
        events = self.events
        try:
            while heap and not self.finished:
                t, _, fn, args = pop(heap)
                if t > limit:
                    break
                self.now = t
                events += 1
                fn(*args)
        finally:
            self.events = events

    # --- membership ---------------------------------------------------------------------------

    def _live_members(self) -> list[Member]:
        if self._live_list[0] != self.live_version:
            self._live_list = (self.live_version, list(self.live.values()))
        return self._live_list[1]

    def _pool_members(self) -> list[Member]:
        if self._pool_list[0] != self.pool_version:
            self._pool_list = (self.pool_version, list(self.pool_live.values()))
        return self._pool_list[1]

    def _member_changed(self, node: PNode, up: bool) -> None:
        if up:
            node.member = Member(node.peer_id, node.started_at, node.pool)
            self.live[node.peer_id] = node.member
        else:
            self.live.pop(node.peer_id, None)
        self.live_version += 1
        if not node.pool:
            return
        if up:
            assert node.member is not None
            self.pool_live[node.peer_id] = node.member
        else:
            self.pool_live.pop(node.peer_id, None)
        self.pool_version += 1
        lo, hi = self.cfg.view_lag_s
        for n in self.nodes:  # each sees the change after its own lag (one refresh pending at most)
            if n.alive and not n.view_due:
                n.view_due = True
                self.at(self.now + self.rng.uniform(lo, hi), self._refresh_view, n, n.epoch)

    def _refresh_view(self, node: PNode, epoch: int) -> None:
        node.view_due = False
        if node.epoch != epoch or not node.alive:
            return
        self._post_view(node)

    def _post_view(self, node: PNode) -> None:
        version = (self.live_version if node.leading else self.pool_version, node.leading)
        if version == node.view_seen:
            return
        node.view_seen = version
        self.handle(node, MembersSeen(self._live_members() if node.leading else self._pool_members()))

    def _holder_view(self, node: PNode, epoch: int) -> None:
        if node.epoch != epoch or not node.alive or not node.leading:
            return
        self._post_view(node)
        self.at(self.now + self.cfg.holder_view_every_s, self._holder_view, node, epoch)

    # --- a node's life ------------------------------------------------------------------------

    def start(self, node: PNode) -> None:
        node.alive, node.started_at, node.ended, node.leading = True, self.now, None, False
        node.view_seen, node.view_due, node.wake, node.term_seen = None, False, None, None
        node.setup_term = None
        # the real ledger, in memory (see MemoryLedger: the simulator never reads one back)
        ledger = MemoryLedger(self.ledger_dir / f"{node.index}.json", self.run_id)
        m = node.machine = RunMachine.for_spec(
            self.spec, run_id=self.run_id, owner=self.owner, identity=node.identity, ledger=ledger,
            target=self.target, tokens_per_s=node.speed, started_at=self.now, config=self.election_cfg,
        )
        if node.lease is not None:
            m.restore(node.lease)
        self._member_changed(node, True)
        self.carry_out(node, m.start(self.now))
        if node.alive:
            self._post_view(node)

    def stop(self, node: PNode, graceful: bool) -> None:
        """The node goes away: a graceful one tells whom its machine says first."""
        m = node.machine
        if not node.alive or m is None:
            return
        if graceful:
            m.members = self._live_members() if node.leading else self._pool_members()
            targets = m.departure_targets()
            if targets:
                leave = make_leave(self.run_id, node.identity, self.now)
                for peer in targets:
                    self.send(node, peer, leave)
        else:
            self.kills += 1
        if m.shepherd is not None or m.becoming:
            self.vacancy_at = self.now  # the next term's convergence counts from here
            self.leader_departures += 1
        node.alive, node.machine, node.leading = False, None, False
        node.epoch += 1
        node.early = None
        node.taking = {}
        node.up_free = self.now
        self._member_changed(node, False)

    # --- the pump ------------------------------------------------------------------------------

    def handle(self, node: PNode, ev: Event) -> None:
        m = node.machine
        if m is None or not node.alive:
            return
        self.carry_out(node, m.handle(ev, self.now))

    def _tick(self, node: PNode, epoch: int, at: float) -> None:
        if node.epoch != epoch or node.wake != at:
            return  # superseded
        node.wake = None
        m = node.machine
        if m is not None and node.alive:
            self.carry_out(node, m.tick(self.now))

    def _arm(self, node: PNode) -> None:
        m = node.machine
        if m is None or not node.alive or m.finished:
            return
        wake = m.next_wakeup
        if wake is None:
            return
        # a wakeup already past (a worker training) must not spin: look again in 0.5 s
        at = max(wake, self.now + 0.5) if wake <= self.now else wake
        if node.wake is not None and node.wake <= at and node.wake > self.now:
            return  # an earlier timer is armed; it re-arms after firing
        node.wake = at
        self.at(at, self._tick, node, node.epoch, at)

    def carry_out(self, node: PNode, effects: list[Any]) -> None:
        m = node.machine
        assert m is not None
        if not effects:  # most inputs (a renewal, a relayed departure) have none
            if node.alive:
                self._follow(node)
                self._arm(node)
            return
        if any(type(e) is Leads and e.leading for e in effects):
            # a node that leads sees the whole run before its lease fans out (see the module doc)
            node.leading = True
            extra = m.on_members(self._live_members(), self.now)
            node.view_seen = (self.live_version, True)
            effects = effects + extra
            self.at(self.now + self.cfg.holder_view_every_s, self._holder_view, node, node.epoch)
        me = node.peer_id
        for e in effects:
            if not node.alive:
                return
            if isinstance(e, Send):
                if e.to == me:
                    self.at(self.now, self.handle, node, MessageIn(me, e.message))
                else:
                    if isinstance(e.message, RoundAnnouncement):
                        a = e.message
                        self.attempts.add((a.term, a.round, a.attempt))
                    self.send(node, e.to, e.message)
            elif isinstance(e, StoreBlob):
                self.store(node, e.cid, e.data)
            elif isinstance(e, Fetch):
                self.fetch(node, e.cid, e.hint, functools.partial(BlobIn, e.who, e.cid),
                           functools.partial(_blob_not_found, e.who, e.cid))
            elif isinstance(e, RunInner):
                steps = max(1, min(e.assignment.max_steps,
                                   int(node.speed * e.time_budget_s // self.spec.tokens_per_step)))
                done = self.now + steps * self.spec.tokens_per_step / node.speed
                if e.attempt == EARLY:
                    node.early = (e, steps, self.now, done)  # its result waits for its shift
                else:
                    self.at(done, self._inner_done, node, node.epoch, e, steps)
            elif isinstance(e, ShiftInner):
                self._shift(node, e)
            elif isinstance(e, CancelInner):
                if e.attempt == EARLY and node.early is not None and node.early[0].round == e.round:
                    node.early = None
            elif isinstance(e, LookUpCommit):
                self.at(self.now + self.cfg.dht_delay_s, self._answer, node, node.epoch,
                        "commit", e.for_election)
            elif isinstance(e, LookUpLease):
                self.at(self.now + self.cfg.dht_delay_s, self._answer, node, node.epoch, "lease", False)
            elif isinstance(e, PublishLease):
                if e.store:
                    self.leases[e.lease.holder] = e.lease
                for peer in m.run_members():
                    self.send(node, peer, e.lease)
            elif isinstance(e, PublishCommit):
                self.publish_commit(e.record)
            elif isinstance(e, ReplicateCommit):
                self.replicate(node, e)
            elif isinstance(e, ReplicateCheckpoint):
                self.hold_checkpoint(node, e.record, None, None)
            elif isinstance(e, SetUpShepherd):
                node.setup_epoch += 1  # (one set-up at a time, as the runtime's)
                node.setup_term = e.become.term
                self.at(self.now + self.cfg.compile_s, self._set_up, node, node.epoch, node.setup_epoch, e)
            elif isinstance(e, CancelSetUp):
                if node.setup_term is not None:  # cancelled: its end is posted now, as a cancelled task's
                    node.setup_epoch += 1
                    self.at(self.now, self.handle, node, SetUpEnded(node.setup_term))
                    node.setup_term = None
            elif isinstance(e, Leads):
                if not e.leading:
                    node.leading = False
            elif isinstance(e, SaveLease):
                node.lease = e.lease
            elif isinstance(e, ReleasePins):
                self.release(node)
            elif isinstance(e, RunEnded):
                node.ended = e.phase
                self._check_done()
            elif isinstance(e, Rejected):
                key = type(e.error).__name__
                self.rejected[key] = self.rejected.get(key, 0) + 1
            # Discarded, Finished, CommitAccepted, CancelInner of an announced run (a superseded
            # result is ignored by the worker), Audit, LookUpOwnerRecord, Stopped: nothing to do in this world
        if node.alive:
            self._follow(node)
            self._arm(node)

    def _follow(self, node: PNode) -> None:
        """Election convergence: how many live nodes follow each term's holder."""
        m = node.machine
        assert m is not None
        term = m.election.current_term if m.election.holder is not None else None
        if term == node.term_seen:
            return
        if node.term_seen is not None:
            self.term_followers[node.term_seen] = self.term_followers.get(node.term_seen, 0) - 1
        node.term_seen = term
        if term is None:
            return
        if term not in self.term_followers:  # a new term: from the vacancy, or (a rotation) from now
            self.term_since[term] = self.vacancy_at if self.vacancy_at is not None else self.now
            self.vacancy_at = None
        count = self.term_followers[term] = self.term_followers.get(term, 0) + 1
        since = self.term_since.get(term)
        if since is not None and count >= 0.95 * len(self.live):
            self.convergence.append(self.now - since)
            del self.term_since[term]

    # --- the world's services --------------------------------------------------------------------

    def wire(self, msg: Message) -> tuple[int, Message]:
        hit = self._wire.get(id(msg))
        if hit is not None and hit[0] is msg:
            return hit[1], hit[2]
        data = encode(msg)
        out = decode(data, type(msg))
        if len(self._wire) > 50_000:
            self._wire.clear()
        self._wire[id(msg)] = (msg, len(data), out)
        return len(data), out

    def _transfer(self, src: PNode, dst: PNode, size: int) -> float:
        """When ``size`` bytes sent now from ``src`` are read by ``dst`` (the uplink queues)."""
        start = max(self.now, src.up_free)
        src.up_free = start + size / src.up
        if src.leading:
            self.shepherd_bytes += size
        return src.up_free + src.lat + dst.lat + size / dst.down

    def send(self, src: PNode, to: str, msg: Message, ack: Callable[[], None] | None = None) -> None:
        dst = self.by_id.get(to)
        if dst is None:
            return
        size, out = self.wire(msg)
        self.at(self._transfer(src, dst, size), self._deliver, src.peer_id, dst, out, ack)

    def _deliver(self, sender: str, dst: PNode, msg: Message, ack: Callable[[], None] | None) -> None:
        """What the runtime's ``deliver`` does before the messenger acks."""
        m = dst.machine
        if not dst.alive or m is None:
            return
        self.deliveries += 1
        if isinstance(msg, CommitRecord) and msg.checkpoint_cid and sender == msg.shepherd:
            try:
                m.vouch_commit(msg)
            except HeldBack:
                self.handle(dst, MessageIn(sender, msg))  # the election keeps it; no ack
                return
            except PcpError:
                return
            if msg.checkpoint_cid not in dst.blobs:
                # acknowledged only once the checkpoint is held here
                epoch, waiting = dst.epoch, dst.taking.setdefault(msg.theta_cid, [])

                def taken() -> None:  # in the machine, or given up: the announcement behind it goes on
                    if dst.epoch == epoch and dst.taking.get(msg.theta_cid) is waiting:
                        del dst.taking[msg.theta_cid]
                        for go in waiting:
                            go()

                def vouched(data: bytes) -> None:
                    self._vouched(dst, epoch, sender, msg, ack)
                    taken()

                self.hold_checkpoint(dst, msg, sender, vouched)
                self.at(self.now + REPLICATE_TIMEOUT_S, taken)
                return
        if isinstance(msg, RoundAnnouncement) and msg.theta_cid in dst.taking:
            # (as the runtime: held while the commit it starts from is taken)
            dst.taking[msg.theta_cid].append(lambda: self._deliver(sender, dst, msg, ack))
            return
        # (``on_message`` is what ``handle(MessageIn(...))`` dispatches to: called directly,
        # a lease renewal's ten thousand deliveries build no event object each)
        self.carry_out(dst, m.on_message(sender, msg, self.now))
        if ack is not None:
            ack()

    def hold_checkpoint(self, node: PNode, rec: CommitRecord, hint: str | None,
                        done: Callable[[bytes], Any] | None) -> None:
        """The runtime's ``_hold_checkpoint``: ``rec``'s checkpoint built from the one its step started
        from and its update (:func:`~pcp_p2p.diloco.protocol.commits.rebuild_checkpoint`, run for
        real) when this node holds that one, else fetched whole; then ``done(bytes)``."""
        def held(data: bytes) -> Any:
            node.checkpoints[rec.theta_cid] = rec.checkpoint_cid
            while len(node.checkpoints) > 2:
                del node.checkpoints[next(iter(node.checkpoints))]
            return done(data) if done is not None else None

        data = node.blobs.get(rec.checkpoint_cid)
        if data is not None:  # (the shepherd's own, stored by its StoreBlob)
            held(data)
            return
        base = node.checkpoints.get(rec.prev_theta_cid)
        start = None  # (the run's first commit: from the starting θ, as the runtime)
        if base is None and rec.prev_theta_cid in node.blobs:
            start = commits.start_checkpoint(rec, node.blobs[rec.prev_theta_cid])
        if rec.update_cid and ((base is not None and base in node.blobs) or start is not None):
            def build(update: bytes) -> Any:
                # (the base may have been released while the update came: then fetched whole, as a
                # runtime whose base is gone from its store)
                src = node.blobs.get(base) if base is not None else start
                try:
                    if src is None:
                        raise BlobNotFound(f"the checkpoint {base} was released")
                    built = bytes(commits.rebuild_checkpoint(rec, src, update, self.spec.outer))
                except PcpError:
                    self.ckpt_fetched += 1
                    self.fetch(node, rec.checkpoint_cid, hint, held, None)
                    return None
                self.rebuilt += 1
                self.store(node, rec.checkpoint_cid, built)
                return held(built)

            self.fetch(node, rec.update_cid, hint, build, None)
            return
        self.ckpt_fetched += 1
        self.fetch(node, rec.checkpoint_cid, hint, held, None)

    def _vouched(self, dst: PNode, epoch: int, sender: str, msg: Message, ack: Callable[[], None] | None) -> None:
        if dst.epoch != epoch or not dst.alive:
            return
        self.handle(dst, MessageIn(sender, msg))
        if ack is not None:
            ack()

    def store(self, node: PNode, cid: str, data: bytes) -> None:
        if cid not in node.blobs:
            node.blobs[cid] = data
            node.pins.append(cid)
            self.holders.setdefault(cid, set()).add(node.index)

    def release(self, node: PNode) -> None:
        while len(node.pins) > KEEP_BLOBS:
            cid = node.pins.popleft()
            node.blobs.pop(cid, None)
            held = self.holders.get(cid)
            if held is not None:
                held.discard(node.index)
                if not held:
                    del self.holders[cid]

    def fetch(self, node: PNode, cid: str, hint: str | None, ok: Callable[[bytes], Any] | None,
              failed: Callable[[], Any] | None) -> None:
        """Fetch ``cid`` for ``node``: ``ok(data)`` builds the input to post (or is called), ``failed()`` too."""
        epoch = node.epoch
        data = node.blobs.get(cid)
        if data is not None:
            self.at(self.now + 0.001, self._fetched, node, epoch, cid, data, ok, failed, False)
            return
        src = self.by_id.get(hint) if hint is not None else None
        if src is None or not src.alive or cid not in src.blobs:
            src = None
            for i in self.holders.get(cid, ()):
                cand = self.nodes[i]
                if cand.alive:
                    src = cand
                    break
        if src is None:
            self.at(self.now + self.cfg.dht_delay_s, self._fetched, node, epoch, cid, None, ok, failed, False)
            return
        data = src.blobs[cid]
        t = self._transfer(src, node, len(data)) + min(src.lat, node.lat) * 2  # the request's way there
        self.at(t, self._fetched, node, epoch, cid, data, ok, failed, True)

    def _fetched(self, node: PNode, epoch: int, cid: str, data: bytes | None, ok: Any, failed: Any,
                 keep: bool) -> None:
        if node.epoch != epoch or not node.alive:
            return
        if data is None:
            if failed is not None:
                self.handle(node, failed())
            return
        if keep:
            self.store(node, cid, data)
        if ok is not None:
            ev = ok(data)
            if ev is not None:
                self.handle(node, ev)

    def _answer(self, node: PNode, epoch: int, kind: str, for_election: bool) -> None:
        if node.epoch != epoch or not node.alive:
            return
        if kind == "commit":
            self.handle(node, CommitLookedUp(self.best_commit, for_election))
        else:
            live = [le for le in self.leases.values() if le.expiry > self.now]
            self.handle(node, LeaseLookedUp(max(live, key=lambda le: (le.term, le.issued), default=None)))

    def publish_commit(self, rec: CommitRecord) -> None:
        self.published.append(rec)
        if self.best_commit is None or commit_key(rec) > commit_key(self.best_commit):
            self.best_commit = rec

    def replicate(self, node: PNode, e: ReplicateCommit) -> None:
        acked: list[str] = []
        done = [False]
        epoch = node.epoch
        then = dict(e.then)

        def follow(peer: str) -> None:
            msg = then.pop(peer, None)
            if msg is not None:
                if isinstance(msg, RoundAnnouncement):
                    self.attempts.add((msg.term, msg.round, msg.attempt))
                self.send(node, peer, msg)

        def finish() -> None:
            if not done[0]:
                done[0] = True
                if node.epoch == epoch:
                    self.handle(node, Replicated(e.commit, list(acked)))

        def ack_from(peer: str) -> Callable[[], None]:
            def ack() -> None:
                acked.append(peer)
                finish()
            return ack

        for peer in e.targets:
            self.send(node, peer, e.commit, ack_from(peer))
            follow(peer)  # right behind it (the receiver holds it until the commit is taken)
        self.at(self.now + e.timeout_s, finish)

    def _inner_done(self, node: PNode, epoch: int, run: RunInner, steps: int) -> None:
        if node.epoch != epoch or not node.alive:
            return
        self.handle(node, InnerDone(surrogate_inner(self.problem, run, steps, self.noise)))

    def _shift(self, node: PNode, e: ShiftInner) -> None:
        """The early run learns its real start: the steps done so far are kept, moved by the shift."""
        if node.early is None or node.early[0].round != e.round:
            return
        run, steps, started, done = node.early
        node.early = None
        self.early_runs += 1
        step_s = self.spec.tokens_per_step / node.speed
        before = min(int(EARLY_SHARE * steps), int((self.now - started) / step_s))
        done = max(done, self.now + (steps - before) * step_s)  # (it waited for the shift past its share)
        mid = surrogate_inner(self.problem, run, before, self.noise).theta if before else run.theta
        shifted = {k: (mid[k] + (e.to[k] - run.theta[k])).astype(np.float32) for k in mid}
        rest = replace(run, theta=shifted, assignment=e.assignment)
        end = surrogate_inner(self.problem, rest, steps - before, self.noise) if steps > before else None
        result = InnerResult(run.round, run.attempt, end.theta if end else shifted, steps,
                             end.losses if end else (), None, shifted_at=before)
        self.at(done, self._inner_result, node, node.epoch, result)

    def _inner_result(self, node: PNode, epoch: int, result: InnerResult) -> None:
        if node.epoch == epoch and node.alive:
            self.handle(node, InnerDone(result))

    def _set_up(self, node: PNode, epoch: int, setup: int, e: SetUpShepherd) -> None:
        m = node.machine
        if node.epoch != epoch or not node.alive or m is None or node.setup_epoch != setup:
            return
        node.setup_term = None
        become = e.become
        kw: dict[str, Any] = dict(
            spec=self.spec, run_id=self.run_id, identity=node.identity, term=become.term,
            artifacts={self.target: self.artifact_cid}, evaluate=self.problem.loss,
            end_round=become.end_round, admit=m.admission.why_not,
        )
        built: Shepherd | None = None
        if become.checkpoint_cid is None:
            built = Shepherd(state=OuterState.initial(self.problem.initial()), **kw)
        else:  # as the runtime's set-up: the first of the lease's starting states a live node holds
            for point in start_candidates(become, m.election.lease, m.election.best_commit):
                blob = self._any_copy(point.cid)
                if blob is not None:
                    built = Shepherd.from_start(point, blob, **kw)
                    break
            else:
                m.setup_failed("none of the states the lease's term can start from is held by a live node")
        if built is not None:
            self.handle(node, ShepherdBuilt(built))
        if node.alive and node.epoch == epoch:
            self.handle(node, SetUpEnded(become.term))

    def _any_copy(self, cid: str) -> bytes | None:
        """A blob a set-up fetches (within its compile time): its own or any live holder's."""
        for i in self.holders.get(cid, ()):
            n = self.nodes[i]
            if n.alive:
                return n.blobs[cid]
        return None

    # --- churn ----------------------------------------------------------------------------------------

    def expected_run_s(self) -> float:
        r = self.spec.round
        return self.cfg.rounds * (r.deadline_s + 5.0)

    def _departure(self) -> None:
        cfg = self.cfg
        live = [n for n in self._live_sample()]
        if live:
            node = self.rng.choice(live)
            self.departures += 1
            self.stop(node, graceful=self.rng.random() < cfg.graceful)
            self.at(self.now + self.rng.expovariate(1 / cfg.down_mean_s), self._return, node)
        self._schedule_departure()

    def _live_sample(self) -> list[PNode]:
        # a few draws are enough to find a live node; no scan of 10,000
        for _ in range(20):
            n = self.nodes[self.rng.randrange(len(self.nodes))]
            if n.alive:
                return [n]
        return [n for n in self.nodes if n.alive]

    def _schedule_departure(self) -> None:
        rate = self.cfg.churn * self.cfg.nodes / self.expected_run_s()
        if rate > 0:
            self.at(self.now + self.rng.expovariate(rate), self._departure)

    def _return(self, node: PNode) -> None:
        if node.alive or self.finished:
            return
        self.returns += 1
        self.start(node)

    def _kill_shepherd(self) -> None:
        for n in self.nodes:
            if n.alive and n.machine is not None and n.machine.shepherd is not None:
                self.departures += 1
                self.stop(n, graceful=False)
                self.at(self.now + self.rng.expovariate(1 / self.cfg.down_mean_s), self._return, n)
                return

    # --- the outcome ------------------------------------------------------------------------------------

    def _check_done(self) -> None:
        best = self.best_commit
        if best is None or best.round + 1 < self.spec.round.rounds:
            return
        if self.end_time is None:
            self.end_time = self.now
        self.finished = True  # the last round is committed; stragglers catching up do not matter


def _blob_not_found(who: str, cid: str) -> BlobFailed:
    """What a node hears when no holder of ``cid`` answered its fetch."""
    return BlobFailed(who, cid, BlobNotFound(cid))


def _rss_kib() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def chain_of(final: CommitRecord | None, published: list[CommitRecord]) -> list[CommitRecord]:
    """The winning θ history (see :func:`pcp_p2p.testing.run_harness.chain_of`)."""
    from pcp_p2p.testing.run_harness import chain_of as walk

    return walk(final, published)


GC_THRESHOLD = (50_000, 50, 100)


@contextlib.contextmanager
def _few_collections() -> Iterator[None]:
    """Python's cyclic collector, tuned for a heap of ten thousand machines (put back after).

    With the default thresholds (700 allocations) the collector ran a thousand
    times in 400 virtual seconds at 3,000 nodes and took 15% of the CPU, most of
    it walking the machines' long-lived state over and over; it ran 9 times at
    ``GC_THRESHOLD``. Nothing here depends on when garbage cycles are freed.
    """
    saved = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*saved)


def simulate(cfg: PlanetConfig) -> PlanetResult:
    """Run one planet to the run's end (or ``cfg.time_limit``); the figures."""
    rss0 = _rss_kib()
    t0 = time.perf_counter()
    with verification_cache(), _few_collections():
        p = Planet(cfg)
        spec = p.spec
        for n in p.nodes:  # everyone starts within the first few seconds
            p.at(p.rng.uniform(0, 5.0), p.start, n)
        p._schedule_departure()
        run_s = p.expected_run_s()
        for k in range(cfg.shepherd_kills):
            p.at(run_s * (k + 1) / (cfg.shepherd_kills + 1), p._kill_shepherd)
        limit = cfg.time_limit if cfg.time_limit is not None else cfg.rounds * 4 * spec.round.deadline_s
        try:
            p.run(limit)
        finally:
            p._tmp.cleanup()
        rss = _rss_kib()
    wall = time.perf_counter() - t0
    chain = chain_of(p.best_commit, p.published)
    committed = len({c.round for c in chain})
    attempted = max(1, len(p.attempts))
    end = p.end_time if p.end_time is not None else p.now
    first_commit = chain[0] if chain else None
    vals = [c.val_loss for c in chain if c.val_loss is not None]
    return PlanetResult(
        nodes=cfg.nodes, rounds=spec.round.rounds, finished=p.finished, rounds_committed=committed,
        rounds_attempted=len(p.attempts), goodput=round(committed / attempted, 4),
        round_time_s=round(end / committed, 2) if committed else math.inf,
        shepherd_bytes_per_round=round(p.shepherd_bytes / committed) if committed else math.inf,
        election_convergence_s=[round(x, 2) for x in p.convergence], elections=len(p.term_followers),
        departures=p.departures, kills=p.kills, returns=p.returns, leader_departures=p.leader_departures,
        terms=len({c.term for c in chain}),
        seated_mean=round(sum(len(c.participants) for c in chain) / len(chain), 1) if chain else 0.0,
        val_loss_first=p.problem.loss(p.problem.initial()) if first_commit else None,
        val_loss_last=vals[-1] if vals else None, virtual_s=round(end, 1), wall_s=round(wall, 2),
        events=p.events, rss_per_node_kib=round((rss - rss0) / cfg.nodes, 1), deliveries=p.deliveries,
        rejected=dict(sorted(p.rejected.items())), early_runs=p.early_runs,
        checkpoints_rebuilt=p.rebuilt, checkpoints_fetched=p.ckpt_fetched,
    )

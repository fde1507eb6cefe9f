"""An in-memory world for run machines: a network, a DHT, per-node blob stores, and a seeded fault plan.

What stands in for what (in :mod:`pcp_p2p.testing.run_harness`, the MockClock
harness that drives real :class:`~pcp_p2p.diloco.run.run_machine.RunMachine`\\ s):

- **network** (:class:`MemNetwork`): every message is encoded and decoded by the
  wire codec on its way, and delivered after a delay drawn from the plan; the plan
  may drop or duplicate it, and a partition delivers only within a side;
- **DHT** (:class:`MemDht`): the ``commit`` and ``lease`` records as boards of
  everything published, each entry tagged with the partition side it was
  published on; a lookup sees its side (or everything once healed) and picks the
  best (commits by fork choice, leases by term then issue time);
- **blobs** (:class:`MemBlobs`): one store per node. A fetch succeeds from any
  live node on the same side that holds the blob, so a killed shepherd takes
  every blob nobody fetched from it along: exactly what "hold a commit until
  another node holds its checkpoint" is for.

:class:`FaultPlan` is seeded (``random.Random(seed)``): a failing seed replays.
Kills are named by phase (:data:`KILL_PHASES`) so that a test can walk through
every phase of a round and of an election.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from pcp_p2p.diloco.protocol.election import Lease, commit_key
from pcp_p2p.diloco.protocol.messages import CommitRecord
from pcp_p2p.wire import Message, decode, encode

KILL_PHASES = (
    # an election
    "settling",  # started, lookups asked, nothing claimed yet
    "claimed",  # published a lease claiming a term (not a renewal)
    "compiling",  # setting its term up (the shepherd's set-up, before it exists)
    # a round, on the shepherd
    "announced",  # sent a round announcement
    "collecting",  # accepted a submission of the round
    "replicating",  # holds a commit back until another node holds its checkpoint
    "committed",  # published a commit
    # a round, on a worker
    "fetching",  # fetching θ or the artifact of an announced round
    "training",  # running the inner loop
    "submitted",  # sent its submission
)
"""Where :class:`Kill` may strike (see :meth:`pcp_p2p.testing.run_harness.MemNode.phase_hits`)."""


@dataclass(frozen=True)
class Kill:
    """Kill a node the first time it reaches ``phase`` (at round ``round`` or later, for the
    round phases); it restarts ``restart_after`` virtual seconds later (``None``: never), with
    what it had on disk (its blobs, its last lease) and a fresh machine."""

    phase: str
    round: int = 0
    restart_after: float | None = 5.0
    node: int | None = None  # only this node (index); None: the first to reach the phase
    hang_s: float = 0.0  # instead of dying, hang this long and resume as it was (a zombie)


@dataclass(frozen=True)
class Partition:
    at: float
    heal_at: float
    side: frozenset[int]  # node indices on side A; the rest are side B


@dataclass(frozen=True)
class FaultPlan:
    seed: int = 0
    drop: float = 0.0
    duplicate: float = 0.0
    delay: tuple[float, float] = (0.01, 0.1)
    fetch_delay: float = 0.05
    kills: tuple[Kill, ...] = ()
    partition: Partition | None = None

    def __post_init__(self) -> None:
        for k in self.kills:
            if k.phase not in KILL_PHASES:
                raise ValueError(f"unknown kill phase {k.phase!r}; known: {KILL_PHASES}")


@dataclass
class MemNetwork:
    """Who is reachable from whom, and the seeded dice for each message."""

    plan: FaultPlan
    rng: random.Random
    side_of: dict[str, int] | None = None
    sent: int = 0
    dropped: int = 0

    def reachable(self, a: str, b: str) -> bool:
        return self.side_of is None or self.side_of.get(a) == self.side_of.get(b)

    def side(self, peer: str) -> int | None:
        return None if self.side_of is None else self.side_of.get(peer)

    def copies(self, src: str, dst: str) -> list[float]:
        """The delays of the copies of one message from ``src`` to ``dst`` (none: lost)."""
        self.sent += 1
        if not self.reachable(src, dst) or self.rng.random() < self.plan.drop:
            self.dropped += 1
            return []
        n = 2 if self.rng.random() < self.plan.duplicate else 1
        return [self.rng.uniform(*self.plan.delay) for _ in range(n)]

    @staticmethod
    def wire(msg: Message) -> Message:
        """The message as the receiver sees it: through the codec both ways."""
        return decode(encode(msg), type(msg))


@dataclass
class MemDht:
    """The run's ``commit`` and ``lease`` records, as published on each side of a partition."""

    net: MemNetwork
    commits: list[tuple[int | None, CommitRecord]] = field(default_factory=list)
    leases: list[tuple[int | None, Lease]] = field(default_factory=list)

    def put_commit(self, peer: str, rec: CommitRecord) -> None:
        self.commits.append((self.net.side(peer), rec))

    def put_lease(self, peer: str, lease: Lease) -> None:
        self.leases.append((self.net.side(peer), lease))

    def _seen(self, entries: list[tuple[int | None, Any]], peer: str) -> list[Any]:
        side = self.net.side(peer)
        return [v for s, v in entries if s is None or side is None or s == side]

    def best_commit(self, peer: str) -> CommitRecord | None:
        return max(self._seen(self.commits, peer), key=commit_key, default=None)

    def best_lease(self, peer: str, now: float) -> Lease | None:
        live = [le for le in self._seen(self.leases, peer) if le.expiry > now]
        return max(live, key=lambda le: (le.term, le.issued), default=None)

    def published(self) -> list[CommitRecord]:
        return [rec for _, rec in self.commits]


@dataclass
class MemBlobs:
    """One blob store per node; a fetch finds any live holder on the fetcher's side."""

    net: MemNetwork
    stores: dict[str, dict[str, bytes]] = field(default_factory=dict)
    alive: set[str] = field(default_factory=set)

    def put(self, peer: str, cid: str, data: bytes) -> None:
        self.stores.setdefault(peer, {})[cid] = data

    def has(self, peer: str, cid: str) -> bool:
        return cid in self.stores.get(peer, {})

    def fetch(self, peer: str, cid: str, keep: bool = True) -> bytes | None:
        own = self.stores.get(peer, {})
        if cid in own:
            return own[cid]
        for holder, store in self.stores.items():
            if holder != peer and holder in self.alive and cid in store and self.net.reachable(peer, holder):
                if keep:
                    self.put(peer, cid, store[cid])
                return store[cid]
        return None

"""An in-memory swarm where every node is candidate, worker and (when elected) shepherd.

A thin user of :mod:`pcp_p2p.testing.run_harness`: every node runs the real
:class:`~pcp_p2p.diloco.run.run_machine.RunMachine` (so the same combining rules as
a node on the network: commits vouched for by the election, held until another
node holds their checkpoint, no term after the last round), over the harness's
in-memory network, DHT boards and per-node blob stores, on trio's clock
(``MockClock`` in tests). This module only names the scenarios of the election
tests and reads the outcome.

Faults on the shepherd (:class:`ShepherdFault`): at round ``round`` and point
``at`` — ``announce`` (dies instead of announcing), ``collect`` (at the first
submission), ``aggregate`` (on the input that would commit, nothing of the
commit survives), ``commit_unheard`` (the commit is on its disk, no one heard)
— the node is killed, or hung for ``hang_s`` (``action="hang"``) after which it
resumes as a *zombie*: it carries out what it was doing and acts on the passed
deadlines before it learns anything, which is what fencing must stop.
:class:`Partition` splits the nodes into two sides for a while.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pcp_p2p.core.errors import PcpError
from pcp_p2p.diloco.protocol.effects import Send, StoreBlob
from pcp_p2p.diloco.protocol.election import ElectionConfig
from pcp_p2p.diloco.protocol.messages import CommitRecord, RoundAnnouncement
from pcp_p2p.diloco.protocol.spec import RunSpec
from pcp_p2p.diloco.run.run_effects import Event, PublishCommit, ReplicateCommit
from pcp_p2p.testing.memnet import FaultPlan, Kill, Partition
from pcp_p2p.testing.run_harness import MemNode, RunSwarm, SwarmConfig, chain_of

__all__ = ["FAULT_POINTS", "ElectionSimConfig", "ElectionSimResult", "Partition", "ShepherdFault",
           "simulate_election"]

FAULT_POINTS = ("announce", "collect", "aggregate", "commit_unheard")


@dataclass(frozen=True)
class ShepherdFault:
    round: int
    at: str  # one of FAULT_POINTS
    action: str = "kill"  # "kill" | "hang"
    hang_s: float = 0.0


SIM_ELECTION = ElectionConfig(
    lease_s=10.0, renew_every_s=3.0, grace_s=1.0, min_uptime_s=0.0, rotate_every=0,
    claim_timeout_s=10.0, settle_s=1.0,
)


@dataclass(frozen=True)
class ElectionSimConfig:
    spec: RunSpec
    nodes: int = 5
    election: ElectionConfig = SIM_ELECTION
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


class ElectionWorld(RunSwarm):
    """The harness, with the shepherd faults of :class:`ElectionSimConfig` as its fault plan."""

    def __init__(self, cfg: ElectionSimConfig) -> None:
        super().__init__(SwarmConfig(
            spec=cfg.spec, nodes=cfg.nodes, election=cfg.election,
            plan=FaultPlan(seed=cfg.seed, drop=cfg.drop, delay=cfg.delay, partition=cfg.partition),
            membership_lag_s=cfg.membership_lag_s, tokens_per_s=cfg.tokens_per_s, compile_s=0.0,
            shape=cfg.shape, time_limit=cfg.time_limit,
        ))
        self.pending_faults = list(cfg.faults)

    def fault(self, node: MemNode, effects: list[Any], ev: Event | None) -> tuple[int, Kill | None]:
        sh = node.machine.shepherd if node.machine is not None else None
        if sh is None or not self.pending_faults:
            return len(effects), None
        f = self.pending_faults[0]
        commit = next((i for i, e in enumerate(effects)
                       if (isinstance(e, ReplicateCommit) and e.commit.round == f.round)
                       or (isinstance(e, PublishCommit) and e.record.round == f.round)), None)
        cut: int | None = None
        if f.at == "announce":  # everything before the announcement happened (a commit, say)
            cut = next((i for i, e in enumerate(effects) if isinstance(e, Send)
                        and isinstance(e.message, RoundAnnouncement) and e.message.round == f.round), None)
        elif f.at == "collect":
            agg = sh.round_agg
            if agg is not None and sh.state.round == f.round and len(agg.accepted) >= 1 and commit is None:
                cut = len(effects)
        elif commit is not None:
            # aggregate: nothing of the commit survives; commit_unheard: it reached this node's disk
            cut = 0 if f.at == "aggregate" else next(
                (i for i, e in enumerate(effects) if not isinstance(e, StoreBlob)), len(effects))
        if cut is None:
            return len(effects), None
        self.pending_faults.pop(0)
        return cut, Kill(f"shepherd:{f.at}", restart_after=None, hang_s=f.hang_s if f.action == "hang" else 0.0)

    async def simulate(self) -> ElectionSimResult:
        r = await self.run()
        live = [n for n in self.nodes if n.alive and n.machine is not None]
        hist = max((n.machine.election.history for n in live if n.machine), key=len, default=[])
        return ElectionSimResult(
            finished=r.finished, final=r.final, chain=chain_of(r.final, r.published), published=r.published,
            rejected=r.rejected, alive={n.peer_id for n in live}, theta_cids=r.theta_cids,
            terms={n.peer_id: n.machine.election.current_term for n in live if n.machine},
            history=[t.as_dict() for t in hist], val_losses=r.val_losses, initial_val_loss=r.initial_val_loss,
            names=[n.peer_id for n in self.nodes], end_time=r.end_time,
        )


async def simulate_election(cfg: ElectionSimConfig) -> ElectionSimResult:
    return await ElectionWorld(cfg).simulate()

"""An in-memory DiLoCo swarm on trio, with seeded fault injection: one shepherd, many workers.

The round protocol's test bench, and a thin user of :mod:`pcp_p2p.testing.run_harness`:
every node runs the production :class:`~pcp_p2p.diloco.run.run_machine.RunMachine`
(its election, worker and shepherd, real Ed25519 signatures, CIDs and the wire
codec) over the harness's in-memory network, DHT and blob stores, with
:class:`~pcp_p2p.testing.quadratic.Quadratic` for the inner loop, so a ten-round
swarm with faults runs in about a second of wall time on trio's ``MockClock``.
Node 0 is the shepherd: the only member that can compile, so the only candidate;
it trains nothing. The workers are the :class:`WorkerPlan`\\ s.

Faults, all drawn from one ``random.Random(seed)`` so a failing seed replays:

- the network drops, duplicates and delays messages (:class:`Faults`);
- a worker can be killed at any phase of a chosen round (:class:`WorkerPlan`
  ``kill_at=(round, phase)``, phase one of :data:`KILL_PHASES`);
- a worker can join late (``join_at``) and have a different speed;
- a worker can be Byzantine (``attack``, one of :data:`ATTACKS`): it runs the
  honest protocol but lies about its Δ or its work (see :meth:`World.inner_result`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from pcp_p2p.core.errors import PcpError
from pcp_p2p.diloco.algorithm.params import Params, global_norm
from pcp_p2p.diloco.protocol.aggregate import delta_norm_bound
from pcp_p2p.diloco.protocol.effects import RunInner, Send
from pcp_p2p.diloco.protocol.messages import CommitRecord, RoundAnnouncement, Submission
from pcp_p2p.diloco.protocol.spec import RunSpec
from pcp_p2p.diloco.protocol.worker import InnerResult
from pcp_p2p.diloco.run.run_effects import CommitLookedUp, Event, MessageIn
from pcp_p2p.testing.memnet import FaultPlan, Kill
from pcp_p2p.testing.quadratic import SIM_ARTIFACT, Quadratic
from pcp_p2p.testing.run_harness import MemNode, RunSwarm, SwarmConfig
from pcp_p2p.wire import Message

__all__ = [
    "ATTACKS",
    "KILL_PHASES",
    "SIM_ARTIFACT",
    "Faults",
    "Quadratic",
    "SimConfig",
    "SimResult",
    "WorkerPlan",
    "World",
    "simulate",
    "simulate_sync",
]

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
    byzantine: set[str]  # the workers with an attack


class World(RunSwarm):
    """One simulated run: node 0 leads, the others work as their plans say."""

    def __init__(self, cfg: SimConfig) -> None:
        f = cfg.faults
        super().__init__(SwarmConfig(
            spec=cfg.spec, nodes=1 + len(cfg.workers), compile_s=0.0, shape=cfg.shape, time_limit=cfg.time_limit,
            plan=FaultPlan(seed=cfg.seed, drop=f.drop, duplicate=f.duplicate, delay=f.delay, fetch_delay=f.fetch_delay),
        ))
        self.sim = cfg
        self.problem = Quadratic.make(np.random.default_rng(cfg.seed), cfg.shape, cfg.spread, cfg.floor)
        self.plans = {n.peer_id: plan for n, plan in zip(self.nodes[1:], cfg.workers)}
        self.first_delta: dict[str, Params] = {}  # the "stale" attackers' first Δ

    # --- the scenario --------------------------------------------------------------------

    def start_at(self, node: MemNode) -> float:
        return 0.0 if node.index == 0 else self.plans[node.peer_id].join_at

    def target_of(self, node: MemNode) -> str | None:
        return None if node.index == 0 else self.target

    def can_compile(self, node: MemNode) -> bool:
        return node.index == 0

    def tokens_per_s(self, node: MemNode) -> float:
        return 1000.0 if node.index == 0 else self.plans[node.peer_id].tokens_per_s

    def shepherd_kwargs(self, node: MemNode) -> dict[str, Any]:
        return {"score": self.problem.score} if self.sim.scoring else {}

    def extra_sends(self, node: MemNode, send: Send) -> list[Message]:
        plan = self.plans.get(node.peer_id)
        w = node.machine.worker if node.machine is not None else None
        if plan is not None and plan.attack == "stale" and isinstance(send.message, Submission) \
                and w is not None and len(w.submitted) > 1:
            return [w.submitted[0]]  # a verbatim replay too
        return []

    def fault(self, node: MemNode, effects: list[Any], ev: Event | None) -> tuple[int, Kill | None]:
        plan = self.plans.get(node.peer_id)
        if plan is None or plan.kill_at is None or any(p == node.peer_id for p, _ in self.killed):
            return len(effects), None
        kill_round, phase = plan.kill_at
        w = node.machine.worker if node.machine is not None else None
        if phase == "announced":  # dies on the announcement, before doing anything with it
            hit, cut = (isinstance(ev, MessageIn) and isinstance(ev.message, RoundAnnouncement)
                        and ev.message.round == kill_round), 0
        elif phase == "committed":
            got_commit = isinstance(ev, CommitLookedUp) or (isinstance(ev, MessageIn)
                                                            and isinstance(ev.message, CommitRecord))
            hit, cut = got_commit and w is not None and w.last_commit is not None \
                and w.last_commit.round == kill_round, len(effects)
        else:
            hit, cut = (w is not None and w.phase.value == phase and w.current is not None
                        and w.current.round == kill_round), len(effects)
        return (cut, Kill(phase, kill_round, restart_after=None)) if hit else (len(effects), None)

    def inner_result(self, node: MemNode, run: RunInner, honest: InnerResult) -> InnerResult:
        """What a Byzantine worker hands its (honest) worker machine in place of its training result."""
        attack = self.plans[node.peer_id].attack
        if attack is None:
            return honest
        spec = self.sim.spec
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
            delta = self.first_delta.setdefault(node.peer_id, delta)
        else:
            raise ValueError(f"unknown attack {attack!r}; known: {ATTACKS}")
        new_theta = {k: theta[k] - delta[k] for k in theta}
        losses = honest.losses[:steps] + (honest.losses[-1],) * max(0, steps - len(honest.losses))
        return InnerResult(honest.round, honest.attempt, new_theta, steps, losses, honest.inner_state)

    # --- the outcome -----------------------------------------------------------------------

    async def simulate(self) -> SimResult:
        r = await self.run()
        sh = self.nodes[0].machine.shepherd if self.nodes[0].machine is not None else None
        commits = list(sh.commits) if sh is not None else []
        killed = {p for p, _ in self.killed}
        alive = {n.peer_id for n in self.nodes[1:] if n.alive}
        return SimResult(
            commits=commits, discarded=list(self.discarded), rejected=r.rejected, final_theta_cid=self.finished_cid,
            worker_theta_cids={p: t for p, t in r.theta_cids.items() if p in alive}, alive=alive, killed=killed,
            val_losses=[c.val_loss for c in commits if c.val_loss is not None], finished=r.finished,
            end_time=r.end_time, initial_val_loss=self.problem.loss(self.problem.initial()),
            byzantine={pid for pid, plan in self.plans.items() if plan.attack is not None},
        )


async def simulate(cfg: SimConfig) -> SimResult:
    """Run one simulated swarm to completion (or ``cfg.time_limit``) on the current clock."""
    return await World(cfg).simulate()


def simulate_sync(cfg: SimConfig) -> SimResult:
    """:func:`simulate` under a fresh ``MockClock`` (autojump): milliseconds of wall time."""
    from trio.testing import MockClock

    return trio.run(simulate, cfg, clock=MockClock(autojump_threshold=0))

"""Five run machines over the in-memory network, through a kill at every phase of a round and an election.

The machines are the real :class:`~pcp_p2p.diloco.run.run_machine.RunMachine` (real election,
worker and shepherd, signatures, CIDs and codec); the pump is
:mod:`pcp_p2p.testing.run_harness` on trio's ``MockClock``. Each kill strikes the first
node to reach its phase, which restarts a few virtual seconds later from what it kept
on disk; the run must still commit every round exactly once on one chain, and every
live node must end on the final θ.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import pytest
import trio
from trio.testing import MockClock

from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.protocol.election import PublishLease
from pcp_p2p.diloco.protocol.messages import CommitRecord, RoundAnnouncement
from pcp_p2p.diloco.protocol.spec import parse_spec
from pcp_p2p.diloco.run.reputation import ReputationLedger
from pcp_p2p.diloco.run.run_effects import ReplicateCommit, SetUpShepherd
from pcp_p2p.diloco.run.run_machine import Member, RunMachine
from pcp_p2p.testing.memnet import KILL_PHASES, FaultPlan, Kill, Partition
from pcp_p2p.testing.quadratic import settled_loss
from pcp_p2p.testing.run_harness import MemNode, RunSwarm, SwarmConfig, SwarmResult, run_swarm_sync
from pcp_p2p.wire import Message

ROUNDS = 12
SPEC = parse_spec(
    f"""
[inner]
lr = 0.02
batch_size = 4
seq_len = 8
[round]
time_budget_s = 10.0
deadline_s = 20.0
max_inner_steps = 20
rounds = {ROUNDS}
min_quorum = 2
[aggregation]
score_tolerance = 0.25
val_jump = 0.0
"""
)
# One kill per phase, in the order a run meets them: the election's three first (the
# first node to start, the first claimant, the first to compile), then one per round.
KILLS = (
    Kill("settling"), Kill("claimed"), Kill("compiling"),
    *(Kill(phase, round=r) for r, phase in enumerate(KILL_PHASES[3:], start=1)),
)


def check(r: SwarmResult) -> None:
    assert r.finished, f"not finished: chain {[(c.term, c.round) for c in r.chain]}, killed {r.killed}"
    assert r.final is not None and r.final.round == ROUNDS - 1
    assert [c.round for c in r.chain] == list(range(ROUNDS))  # every round once, on one chain
    for a, b in zip(r.chain, r.chain[1:]):
        assert b.prev_theta_cid == a.theta_cid and b.term >= a.term
    assert set(r.theta_cids.values()) == {r.final.theta_cid}  # every live node on the final θ
    assert set(r.ended.values()) == {"finished"}
    # training made progress across the kills
    assert settled_loss(r.val_losses) < 0.5 * r.initial_val_loss, r.val_losses


def test_a_kill_at_every_phase_of_a_round_and_an_election() -> None:
    assert {k.phase for k in KILLS} == set(KILL_PHASES)
    r = run_swarm_sync(SwarmConfig(spec=SPEC, nodes=5, plan=FaultPlan(seed=1, kills=KILLS)))
    check(r)
    # each struck once (a worker fetching round r+1 may come before round r's commit is published:
    # the announcement travels right behind the commit, ReplicateCommit.then)
    assert sorted(phase for _, phase in r.killed) == sorted(k.phase for k in KILLS)
    assert r.restarts == len(KILLS)  # and each killed node came back and caught up
    terms = {c.term for c in r.chain}
    assert len(terms) >= 3  # the shepherd kills forced failovers


def test_lossy_network_without_kills_commits_every_round() -> None:
    plan = FaultPlan(seed=2, drop=0.05, duplicate=0.05, delay=(0.01, 0.3))
    check(run_swarm_sync(SwarmConfig(spec=SPEC, nodes=5, plan=plan)))


def test_a_kill_that_never_restarts_leaves_four_nodes_that_finish() -> None:
    plan = FaultPlan(seed=3, kills=(Kill("replicating", round=2, restart_after=None),))
    r = run_swarm_sync(dataclasses.replace(SwarmConfig(spec=SPEC), plan=plan))
    check(r)
    assert len(r.theta_cids) == 4 and r.restarts == 0


def test_each_workers_announcement_rides_behind_its_commit_and_reaches_its_machine_after_it() -> None:
    """A commit's next announcement goes to each other worker right behind the commit
    (``ReplicateCommit.then``), not behind the first ack and the shepherd's next step; the
    receiver holds it while it takes the commit, so it never reaches a worker's machine before
    the commit it builds on, and it reaches it once."""

    class Recording(RunSwarm):
        def __init__(self, cfg: SwarmConfig) -> None:
            super().__init__(cfg)
            self.replications: list[ReplicateCommit] = []
            self.arrived: list[tuple[str, str, int]] = []  # (node, message kind, round), as posted

        def _carry_out_now(self, node: MemNode, effects: list[Any]) -> None:
            self.replications += [e for e in effects if isinstance(e, ReplicateCommit)]
            super()._carry_out_now(node, effects)

        async def deliver(self, sender: str, dst: str, msg: Message) -> bool:
            taken = await super().deliver(sender, dst, msg)  # (returns once posted to the machine)
            if taken and isinstance(msg, (CommitRecord, RoundAnnouncement)):
                self.arrived.append((dst, type(msg).__name__, msg.round))
            return taken

    async def go() -> tuple[Recording, SwarmResult]:
        swarm = Recording(SwarmConfig(spec=SPEC, nodes=4))
        return swarm, await swarm.run()

    swarm, r = trio.run(go, clock=MockClock(autojump_threshold=0))
    check(r)
    assert swarm.replications and all(e.then for e in swarm.replications[:-1])  # (the last: none follows)
    for e in swarm.replications:
        assert e.update and cid_of(e.update) == e.commit.update_cid  # (small: it rides with the commit)
        assert {peer for peer, _ in e.then} <= set(e.targets)
        assert all(isinstance(m, RoundAnnouncement) and m.round == e.commit.round + 1 for _, m in e.then)
    shepherds = {e.commit.shepherd for e in swarm.replications}  # (its own messages: the batch's order)
    for node in {d for d, _, _ in swarm.arrived} - shepherds:
        seen = [(kind, rnd) for d, kind, rnd in swarm.arrived if d == node]
        announced = [rnd for kind, rnd in seen if kind == "RoundAnnouncement"]
        assert len(announced) == len(set(announced))  # once each
        for rnd in announced:
            if rnd:
                assert ("CommitRecord", rnd - 1) in seen[: seen.index(("RoundAnnouncement", rnd))]


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_many_seeds_kills_loss_rotation_and_a_partition(seed: int) -> None:
    """Seven machines, 15% loss, 10% duplicates, up to 1 s delays, four kills at random phases
    (some never restart), rotation or not, and sometimes a partition that heals mid-run."""
    rng = random.Random(seed)
    kills = sorted((Kill(rng.choice(KILL_PHASES), round=rng.randrange(0, 10),
                         restart_after=rng.choice([3.0, 20.0, 60.0, None])) for _ in range(4)), key=lambda k: k.round)
    base = SwarmConfig(spec=SPEC)
    partition = Partition(40.0, 90.0, frozenset({0, 1})) if rng.random() < 0.3 else None
    plan = FaultPlan(seed=seed, drop=0.15, duplicate=0.1, delay=(0.01, 1.0), kills=tuple(kills), partition=partition)
    check(run_swarm_sync(dataclasses.replace(
        base, nodes=7, plan=plan, election=dataclasses.replace(base.election, rotate_every=rng.choice([0, 3])))))


def lone_machine(tmp_path, owner: Identity | None = None) -> RunMachine:  # type: ignore[no-untyped-def]
    """One machine, alone in its run, that has claimed term 0 and is setting it up."""
    me, owner = Identity.generate(), owner or Identity.generate()
    m = RunMachine.for_spec(SPEC, run_id="run", owner=owner.peer_id, identity=me,
                            ledger=ReputationLedger(tmp_path / "ledger.json", "run"), target="cpu",
                            tokens_per_s=64.0, started_at=0.0, config=SwarmConfig(spec=SPEC).election)
    m.start(0.0)
    m.on_lease_lookup(None, 0.1)
    out = m.on_commit_lookup(None, True, 0.1) + m.on_members([Member(me.peer_id, 0.0)], 1.5)
    assert [e.become.term for e in out if isinstance(e, SetUpShepherd)] == [0] and m.becoming
    return m


def renewals(effects: list) -> list:
    return [e for e in effects if isinstance(e, PublishLease) and e.renewal]


def test_a_term_whose_set_up_failed_is_given_up_and_not_renewed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pcp_p2p.diloco.run.run_effects import Leads

    compiling, failed = lone_machine(tmp_path / "a"), lone_machine(tmp_path / "b")
    failed.setup_failed("the lease's checkpoint is held by no live node")
    out = failed.setup_ended(0, 2.0)
    assert not failed.becoming and not failed.still_holds(0) and Leads(False) in out  # given up at once
    at = compiling.election.next_wakeup
    assert renewals(failed.tick(at)) == [] and failed.election.heartbeat(at) is None  # no lease, no beats
    assert renewals(compiling.tick(at))  # while the set-up is still under way, the lease is renewed


def test_fork_choice_drops_the_losing_rounds_from_what_status_shows(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A node on the losing side of a partition showed rounds of term 0 as committed; the winning
    term 1 continues from an earlier round (Worker.on_commit's fork choice). Status must then show
    the winning chain only, and say how many rounds it dropped (the netlab partition test drives
    this with real processes; this is the bookkeeping alone)."""
    from pcp_p2p.diloco.protocol.messages import CommitRecord

    m = lone_machine(tmp_path)
    me = m.peer_id

    def commit(term: int, round_: int, theta: str, prev: str) -> CommitRecord:
        return CommitRecord(run_id="run", term=term, round=round_, attempt=0, prev_theta_cid=prev, theta_cid=theta,
                            checkpoint_cid="", participants=(me,), tokens=1, mean_loss=1.0, val_loss=None,
                            shepherd="s")

    for r in range(5):  # rounds 1..5 in term 0, this node counted in each
        m._commit_seen(commit(0, r, f"old{r}", f"old{r - 1}"), 2.0 + r)
    m._commit_seen(commit(1, 2, "new2", "old1"), 10.0)  # term 1's round 3 wins over term 0's rounds 3..5
    assert [(h["round"], h["term"], h["theta"]) for h in m.stats.history] == [
        (1, 0, "old0"), (2, 0, "old1"), (3, 1, "new2")]
    assert m.stats.contributed_rounds == [1, 2, 3] and m.stats.superseded == 3
    m._commit_seen(commit(1, 3, "new3", "new2"), 11.0)  # the winning chain goes on: nothing more dropped
    assert [h["round"] for h in m.stats.history] == [1, 2, 3, 4] and m.stats.superseded == 3


def test_fork_choice_drops_losing_rounds_below_the_winning_commit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The winning side committed *more* rounds while cut off, so the first commit of its term this
    node sees lies above every round it showed (seen in the netlab partition test: the losing
    side's round 18 of term 1 stayed beside term 2's rounds 19..40). The commit's ``prev_theta_cid``
    and its term's ``from_round`` both tell that those rounds are not on the winning chain."""
    from pcp_p2p.diloco.protocol.election import TermRecord
    from pcp_p2p.diloco.protocol.messages import CommitRecord

    m = lone_machine(tmp_path)
    me = m.peer_id

    def commit(term: int, round_: int, theta: str, prev: str) -> CommitRecord:
        return CommitRecord(run_id="run", term=term, round=round_, attempt=0, prev_theta_cid=prev, theta_cid=theta,
                            checkpoint_cid="", participants=(me,), tokens=1, mean_loss=1.0, val_loss=None,
                            shepherd="s")

    for r in range(5):  # rounds 1..5 in term 0; the cut came after round 2
        m._commit_seen(commit(0, r, f"old{r}", f"old{r - 1}"), 2.0 + r)
    # This node's own late claim of term 1 (after the heal, from its side's round 4) came first;
    # the winner's term 1 continued from round 2 (its lease's from_round) and reached round 7.
    m.election.history.append(TermRecord(1, me, 4))
    m.election.history.append(TermRecord(1, "s", 2))
    m._commit_seen(commit(1, 6, "new6", "new5"), 20.0)
    assert [(h["round"], h["term"], h["theta"]) for h in m.stats.history] == [
        (1, 0, "old0"), (2, 0, "old1"), (7, 1, "new6")]
    assert m.stats.contributed_rounds == [1, 2, 7] and m.stats.superseded == 3

    # Without the term's record, the parent θ alone still drops the parent round that is not on the chain.
    n = lone_machine(tmp_path / "n")
    me = n.peer_id
    for r in range(2):
        n._commit_seen(commit(0, r, f"old{r}", f"old{r - 1}"), 2.0 + r)
    n._commit_seen(commit(1, 2, "new2", "new1"), 10.0)
    assert [(h["round"], h["theta"]) for h in n.stats.history] == [(1, "old0"), (3, "new2")]
    assert n.stats.superseded == 1


def test_a_members_uptime_counts_from_when_this_node_first_saw_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``Member.started_at`` is the member's own word: a fresh key that dates it back must not be
    eligible to lead at once (``min_uptime_s``). Only members already in view during this node's
    first look are taken at their word (it cannot tell them from members older than itself)."""
    from pcp_p2p.diloco.run.run_machine import FIRST_LOOK_S

    me, old, fresh = Identity.generate(), Identity.generate(), Identity.generate()
    config = dataclasses.replace(SwarmConfig(spec=SPEC).election, min_uptime_s=5.0)
    m = RunMachine.for_spec(SPEC, run_id="run", owner=Identity.generate().peer_id, identity=me,
                            ledger=ReputationLedger(tmp_path / "ledger.json", "run"), target="cpu",
                            tokens_per_s=64.0, started_at=100.0, config=config)
    m.start(100.0)
    m.on_members([Member(me.peer_id, 100.0), Member(old.peer_id, 0.0)], 100.0)

    def uptimes(members: list[Member], now: float) -> dict[str, float]:
        m.on_members(members, now)
        return {c.peer_id: c.uptime_s for c in m.candidates(now)}

    later = 100.0 + FIRST_LOOK_S + 1.0
    view = [Member(me.peer_id, 100.0), Member(old.peer_id, 0.0), Member(fresh.peer_id, 0.0)]  # "up since 0"
    up = uptimes(view, later)
    assert up[old.peer_id] == later  # there at this node's first look: its own word
    assert up[fresh.peer_id] == 0.0  # appeared since: counted from when this node saw it
    assert up[me.peer_id] == later - 100.0  # a later start than first seen: the later one counts
    assert old.peer_id in m.election.view and fresh.peer_id not in m.election.view
    up = uptimes(view, later + 5.0)
    assert up[fresh.peer_id] == 5.0 and fresh.peer_id in m.election.view
    uptimes(view[:2], later + 6.0)  # it leaves the view and comes back: new again
    assert uptimes(view, later + 7.0)[fresh.peer_id] == 0.0 and fresh.peer_id not in m.election.view


# --- the failover wiring, machine by machine (no pump) ------------------------------------------

BEATING = dataclasses.replace(SwarmConfig(spec=SPEC).election, heartbeat_s=0.5, suspect_s=1.5)


def _machine(tmp_path, me: Identity, run: str, target: str | None = "cpu") -> RunMachine:  # type: ignore[no-untyped-def]
    return RunMachine.for_spec(SPEC, run_id=run, owner=Identity.generate().peer_id, identity=me,
                               ledger=ReputationLedger(tmp_path / f"{me.peer_id[-8:]}.json", run), target=target,
                               tokens_per_s=64.0, started_at=0.0, config=BEATING)


def holder_and_follower(tmp_path, target: str | None = "cpu"):  # type: ignore[no-untyped-def]
    """Machines A and B of one run: A claims term 0 (it ranks first), B follows it from t = 1.6."""
    from pcp_p2p.diloco.protocol.election import ranked

    a, b = Identity.generate(), Identity.generate()
    run = next(r for r in (f"run-{n}" for n in range(1000)) if ranked(r, 0, [a.peer_id, b.peer_id])[0] == a.peer_id)
    ma, mb = _machine(tmp_path, a, run), _machine(tmp_path, b, run, target)
    members = [Member(a.peer_id, 0.0), Member(b.peer_id, 0.0)]
    claims = []
    for m in (ma, mb):
        m.start(0.0)
        m.on_lease_lookup(None, 0.1)
        claims += [e for e in m.on_commit_lookup(None, True, 0.1) + m.on_members(members, 1.5)
                   if isinstance(e, PublishLease)]
    (claim,) = claims
    assert claim.lease.holder == a.peer_id and ma.still_holds(0)
    mb.on_message(a.peer_id, claim.lease, 1.6)
    assert mb.shepherd_peer == a.peer_id and mb.holds_term(0, a.peer_id)
    return a, b, ma, mb


def test_a_heartbeat_counts_only_straight_from_the_lease_holder(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A genuine beat relayed (or replayed) by anyone else proves nobody alive: the follower that
    hears the holder's beats only through a third party fails over when its silence says so."""
    from pcp_p2p.diloco.protocol.election import Heartbeat, Role
    from pcp_p2p.diloco.protocol.messages import sign

    for sender, still_followed in (("holder", True), ("mallory", False)):
        a, _b, ma, mb = holder_and_follower(tmp_path / sender, target=None)
        beat = sign(Heartbeat(run_id=ma.run_id, term=0, holder=a.peer_id, sent_at=2.5), a)
        mb.on_message(a.peer_id if sender == "holder" else Identity.generate().peer_id, beat, 2.5)
        mb.tick(3.2)  # 1.6 s after the lease: past suspect_s (1.5 s) unless the beat at 2.5 counted
        assert (mb.election.role is Role.FOLLOWER) is still_followed, sender
        assert (a.peer_id in mb.election.suspected) is not still_followed


def test_a_failover_successor_takes_over_the_attempt_its_worker_holds(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``shepherd_built`` → ``_take_over_attempt``: the successor's new shepherd adopts the dead term's
    signed announcement its own worker holds, and does not wait for the dead holder's worker. An
    announcement whose signer this node never accepted for its term is not adopted, and a shepherd
    built for a term this node no longer holds does not lead."""
    import numpy as np

    from pcp_p2p.diloco.algorithm.outer import OuterState
    from pcp_p2p.diloco.protocol.effects import Send, StoreBlob
    from pcp_p2p.diloco.protocol.messages import Join, RoundAnnouncement, sign
    from pcp_p2p.diloco.protocol.shepherd import Shepherd

    theta = {"w": np.arange(8, dtype=np.float32).reshape(2, 4)}
    a, b, ma, mb = holder_and_follower(tmp_path)
    dead = Shepherd(spec=SPEC, run_id=ma.run_id, identity=a, term=0, state=OuterState.initial(theta))
    for who in (a, b):
        dead.on_join(sign(Join(run_id=ma.run_id, worker=who.peer_id, target="cpu", tokens_per_s=64.0), who), 2.0)
    anns = [e.message for e in dead.tick(2.0 + dead.join_grace_s)
            if isinstance(e, Send) and isinstance(e.message, RoundAnnouncement)]
    ann = anns[0]
    assert anns == [ann, ann]  # to both workers
    mb.on_message(a.peer_id, ann, 3.0)
    assert mb.worker is not None and mb.worker.current == ann
    # A dies: B's silence passes suspect_s, the lookups find nothing newer, and B claims term 1.
    # (B last heard A at 1.6, its lease; a tick much later than that would give A a late tick's grace.)
    t = 1.6 + BEATING.suspect_window_s + 0.1
    mb.tick(t)
    mb.on_lease_lookup(None, t)
    setups = [e for e in mb.on_commit_lookup(None, True, t) + mb.tick(t) if isinstance(e, SetUpShepherd)]
    assert [s.become.term for s in setups] == [1] and mb.still_holds(1)

    def successor(term: int = 1) -> Shepherd:
        return Shepherd(spec=SPEC, run_id=mb.run_id, identity=b, term=term, state=OuterState.initial(theta))

    built = successor()
    effects = mb.shepherd_built(built, t + 1.0)
    assert mb.shepherd is built and built.adopted == ann  # the attempt in flight goes on: not announced again
    assert StoreBlob(built.theta_cid, built.theta_bytes) in effects
    assert not [e for e in effects if isinstance(e, Send) and isinstance(e.message, RoundAnnouncement)]
    assert a.peer_id in built.round_agg.reported  # the dead holder's own worker is not waited for

    mallory = Identity.generate()
    forged = sign(dataclasses.replace(ann, shepherd=mallory.peer_id, signature=b""), mallory)
    mb.worker.current = forged  # (as if the worker had taken it: the machine still checks its signer's term)
    other = successor()
    mb.shepherd_built(other, t + 1.0)
    assert mb.shepherd is other and other.adopted is None
    late = successor(term=7)  # a term this node does not hold
    mb.shepherd_built(late, t + 1.0)
    assert mb.shepherd is other


# --- a set-up that keeps failing (#19): claims back off --------------------------------------------


def pump(machines: list[RunMachine], start: float, until: float, *, step: float = 0.25,
         stop_at_claim: bool = False, first: list | None = None) -> list[tuple[float, str, int]]:  # type: ignore[type-arg]
    """Tick ``machines`` every ``step`` from ``start`` to ``until`` (sans-IO, time injected): leases
    and heartbeats go to the others, lookups find nothing. ``first``: effects to carry out first.
    Returns the claims: (time, peer, term) of every ``SetUpShepherd``."""
    from pcp_p2p.diloco.protocol.effects import Send
    from pcp_p2p.diloco.protocol.election import Heartbeat, Lease
    from pcp_p2p.diloco.run.run_effects import LookUpCommit, LookUpLease

    by_peer = {m.peer_id: m for m in machines}
    claims: list[tuple[float, str, int]] = []

    def carry_out(m: RunMachine, out: list, t: float) -> None:  # type: ignore[type-arg]
        i = 0
        while i < len(out):
            e = out[i]
            if isinstance(e, LookUpLease):
                out += m.on_lease_lookup(None, t)
            elif isinstance(e, LookUpCommit) and e.for_election:
                out += m.on_commit_lookup(None, True, t)
            elif isinstance(e, SetUpShepherd):
                claims.append((t, m.peer_id, e.become.term))
            elif isinstance(e, PublishLease):
                for other in machines:
                    if other is not m:
                        carry_out(other, other.on_message(m.peer_id, e.lease, t), t)
            elif isinstance(e, Send) and isinstance(e.message, (Lease, Heartbeat)) and e.to in by_peer:
                to = by_peer[e.to]
                carry_out(to, to.on_message(m.peer_id, e.message, t), t)
            i += 1

    if first:
        carry_out(machines[0], first, start)
    t = start
    while t <= until + 1e-9 and not (stop_at_claim and claims):
        for m in machines:
            carry_out(m, m.tick(t), t)
        t += step
    return claims


def test_a_sole_node_whose_set_up_keeps_failing_backs_off_and_stays_stoppable(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The only candidate, whose set-up fails every time (a dataset it cannot read): it used to
    claim the next term and fail again for ever. Now each failure gives the term up and pauses
    its claims 10 s, doubling to 5 min; the phase says when it tries next; a success resets the
    back-off; and the owner's stop is taken at any point of it."""
    from pcp_p2p.diloco.algorithm.outer import OuterState
    from pcp_p2p.diloco.protocol.lifecycle import STOPPED, sign_stop
    from pcp_p2p.diloco.protocol.shepherd import Shepherd
    from pcp_p2p.diloco.run.run_effects import RunEnded
    from pcp_p2p.diloco.run.run_machine import SETUP_BACKOFF_MAX_S, SETUP_BACKOFF_S

    owner = Identity.generate()
    m = lone_machine(tmp_path, owner)
    why = "dataset 'x.txt' cannot be read"

    def fail(term: int, at: float) -> list:  # type: ignore[type-arg]
        m.setup_failed(why)
        return m.setup_ended(term, at)

    term, at, waits = 0, 2.0, []
    for _ in range(7):
        out = fail(term, at)
        wait = min(SETUP_BACKOFF_MAX_S, SETUP_BACKOFF_S * 2 ** len(waits))
        assert m.setup_phase(at) == f"{why}; next try in {wait:.0f} s"
        assert m.setup_phase(at + wait / 2) == f"{why}; next try in {wait / 2:.0f} s"
        ((claimed, _, term),) = pump([m], at, at + 400.0, stop_at_claim=True, first=out)
        waits.append(claimed - at)
        at = claimed + 0.5  # it fails again half a second later
    assert waits == [10.0, 20.0, 40.0, 80.0, 160.0, 300.0, 300.0]

    # A success resets the back-off: the next failure waits 10 s again.
    m.shepherd_built(Shepherd(spec=SPEC, run_id="run", identity=m.identity, term=term,
                              state=OuterState.initial({"w": np.zeros((2, 2), np.float32)})), at)
    m.setup_failed(None)
    m.setup_ended(term, at)
    assert m.shepherd is not None and m.setup_phase(at) is None
    lapse = m.election.lease.expiry  # (it stops being ticked: its lease lapses, and it claims again)
    ((claimed, _, term),) = pump([m], lapse, lapse + 30.0, stop_at_claim=True)
    fail(term, claimed + 0.5)
    assert m.setup_phase(claimed + 0.5) == f"{why}; next try in 10 s"

    # Stoppable in the middle of a back-off: the owner's order ends the run at once.
    ended = m.stop(sign_stop(owner, "run", now=claimed + 3.0), claimed + 3.0)
    assert RunEnded(STOPPED, "") in ended and m.phase == STOPPED and m.finished


def test_a_new_candidate_that_can_set_up_takes_over_from_one_that_cannot(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Holder A's set-up fails; X, a candidate that can set up, claims the next term within the
    heartbeat suspicion (A gives the term up and falls silent, rather than beating for a lease
    nobody leads under until it lapses), and A, backing off, follows X instead of competing."""
    _a, x, ma, mx = holder_and_follower(tmp_path)
    assert ma.still_holds(0)
    ma.setup_failed("no checkpoint")
    out = ma.setup_ended(0, 2.0)
    claims = pump([ma, mx], 2.0, 2.0 + 10.0, first=out)
    assert [(who, term) for _, who, term in claims] == [(x.peer_id, 1)], claims
    assert claims[0][0] - 2.0 <= BEATING.suspect_window_s + 0.5  # no wait for A's lease to lapse (10 s)
    assert mx.still_holds(1) and ma.shepherd_peer == x.peer_id and ma.holds_term(1, x.peer_id)


def test_a_node_back_after_the_end_that_claimed_the_last_terms_number_still_finishes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Back after the run ended, alone in its view, it claims the term after its anchor's before the
    DHT answers: the same number as the run's real last term. The run's last commit, of that term
    by the node that really held it, is adopted by the election, and the worker takes it too (it
    used to refuse it as not its shepherd's, so the node never finished: slow-suite run W2)."""
    from pcp_p2p.diloco.protocol.election import Lease
    from pcp_p2p.diloco.protocol.messages import CommitRecord, sign
    from pcp_p2p.diloco.run.run_effects import Fetch

    me, owner, first, last = (Identity.generate() for _ in range(4))
    m = RunMachine.for_spec(SPEC, run_id="run", owner=owner.peer_id, identity=me,
                            ledger=ReputationLedger(tmp_path / "ledger.json", "run"), target="cpu",
                            tokens_per_s=64.0, started_at=0.0, config=SwarmConfig(spec=SPEC).election)
    m.restore(sign(Lease(run_id="run", term=0, holder=first.peer_id, claimed_at=0.0, issued=0.0, expiry=6.0,
                         from_round=0, from_theta_cid="", from_checkpoint_cid=""), first))
    m.start(100.0)
    m.on_lease_lookup(None, 100.1)
    out = m.on_commit_lookup(None, True, 100.1) + m.on_members([Member(me.peer_id, 0.0)], 101.5)
    assert [e.become.term for e in out if isinstance(e, SetUpShepherd)] == [1]  # its own term 1
    final = sign(CommitRecord(run_id="run", term=1, round=ROUNDS - 1, attempt=0, prev_theta_cid="p",
                              theta_cid="final", checkpoint_cid="ck", participants=(last.peer_id,), tokens=1,
                              mean_loss=1.0, val_loss=None, shepherd=last.peer_id), last)
    out = m.on_commit_lookup(final, False, 102.0)
    assert m.worker is not None and m.worker.last_commit == final
    assert any(isinstance(e, Fetch) and e.cid == "final" for e in out)  # it goes on to fetch the final θ


def test_a_bigger_run_spaces_each_members_owner_record_lookups_so_the_whole_run_looks_alike(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A stop not stored yet is a full DHT lookup whose answers reach the same closest peers from
    every member: alone (or up to four) a member looks every 30 s; in a run of 16, every 128 s,
    so the run as a whole still looks about once per 8 s (issue #15: the shepherd's bytes)."""
    from pcp_p2p.diloco.run.run_effects import LookUpOwnerRecord

    def lookups_in_ten_minutes(others: int) -> int:
        m = lone_machine(tmp_path / f"n{others}")
        view = [Member(m.peer_id, 0.0), *(Member(Identity.generate().peer_id, 0.0) for _ in range(others))]
        return sum(isinstance(e, LookUpOwnerRecord) for t in range(2, 602) for e in m.on_members(view, float(t)))

    # (lone_machine looked at 1.5 s; ten minutes more from 2 s)
    assert lookups_in_ten_minutes(0) == 19  # every 30 s: 32, 62, ..., 572
    assert lookups_in_ten_minutes(15) == 4  # every 16 x 8 = 128 s: 130, 258, 386, 514

"""Strangers against a live run, over real libp2p on 127.0.0.1.

A bootstrap server and three worker processes that trust only the run owner train
the tiny GPT. A stranger — a fresh key that joined through the bootstrap server,
trusted by nobody and taking part in no run — then tries what worked on earlier
versions (issue #12): seize the run with a backdated, never-expiring lease for the
next term; stall it with a self-signed "final" commit of a far-future term, sent to
every member and stored in the DHT; fill the members' disks with commits naming a
32 MiB junk checkpoint it serves. The run must keep committing on honest θ, led by
its own members only, and no node may fetch the junk. Every accepted submission
is audited by deterministic replay on another worker (``audit_rate = 1``): the
honest ones must all match, bit for bit.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import numpy as np
import pytest
import trio
from conftest import TEST_CAPS
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from test_training_swarm import committed, create_run, wait_for

from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import PcpError
from pcp_p2p.core.identity import load_or_create_identity
from pcp_p2p.dht.records import MAX_TTL_S, sign_record
from pcp_p2p.diloco.algorithm.params import codec_of, unpack_tensors
from pcp_p2p.diloco.protocol.audit import AUDIT_MESSAGES
from pcp_p2p.diloco.protocol.commits import commit_seq
from pcp_p2p.diloco.protocol.election import LEASE_KIND, Lease
from pcp_p2p.diloco.protocol.messages import (
    FRESH_STATE,
    CommitRecord,
    CommitWithUpdate,
    Join,
    RoundAnnouncement,
    Submission,
    sign,
)
from pcp_p2p.executor.cpu import best_cpu_target
from pcp_p2p.node.local_swarm import local_swarm
from pcp_p2p.node.node import NodeConfig, open_node, transport_addrs

pytestmark = pytest.mark.timeout(420)

ROUNDS = 8
SPEC = f"""
name = "strangers"
[model]
preset = "tiny"
[inner]
lr = 3e-3
[round]
time_budget_s = 2.0
max_inner_steps = 200
deadline_s = 12.0
rounds = {ROUNDS}
min_quorum = 2
[aggregation]
audit_rate = 1.0   # every accepted submission is replayed by another worker
"""
JUNK_MIB = 32


def run_history(statuses: dict[str, dict]) -> list[dict]:
    """The run's commits as the nodes saw them, one per round: a node may miss one (a commit
    whose checkpoint it could not fetch in time is not taken) and see the next; the nodes
    that saw a round must agree on it."""
    by_round: dict[int, dict] = {}
    for st in statuses.values():
        for h in st.get("history", []):
            seen = by_round.setdefault(h["round"], h)
            assert seen["theta"] == h["theta"], f"two θs for round {h['round']}"
    return [by_round[r] for r in sorted(by_round)]


async def attack(node, run_id: str, members: list[str], term: int, rounds: int) -> int:  # type: ignore[no-untyped-def]
    """Every message of the attack, sent to every member and put in the DHT; returns how many were sent."""
    me, now = node.identity, time.time()
    junk = bytes(range(256)) * (JUNK_MIB * 4096)
    junk_cid = await trio.to_thread.run_sync(lambda: node.blobs.store.put_bytes(junk, pin=True))
    try:
        await node.blobs.announce(junk_cid)
    except PcpError:
        pass  # the junk is still served to whoever asks this node for it

    def lease(**kw: object) -> Lease:
        fields: dict[str, object] = dict(run_id=run_id, term=term + 1, holder=me.peer_id, claimed_at=now - 1e6,
                                         issued=now, expiry=now + 1e9, from_round=0, from_theta_cid="",
                                         from_checkpoint_cid="")
        fields.update(kw)
        return sign(Lease(**fields), me)  # type: ignore[arg-type]

    def commit(term_: int, round_: int, theta: str, ckpt: str) -> CommitRecord:
        return sign(CommitRecord(run_id=run_id, term=term_, round=round_, attempt=0, prev_theta_cid="",
                                 theta_cid=theta, checkpoint_cid=ckpt, participants=(me.peer_id,), tokens=1,
                                 mean_loss=0.01, val_loss=0.01, shepherd=me.peer_id), me)

    seize = [lease(), lease(expiry=now + 5.0, claimed_at=now - 100.0)]  # absurd, and sane-looking
    stall = commit(10**6, rounds - 1, cid_of(b"stranger's theta"), junk_cid)  # a "final" far-future commit
    fill = [commit(term, r, cid_of(b"junk theta %d" % r), junk_cid) for r in range(3)]
    sent = 0
    for msg in [*seize, stall, *fill]:
        for peer in members:
            try:
                await node.messenger.send(peer, msg, timeout=10.0)
                sent += 1
            except PcpError:
                pass  # refused: what we want
    for signed in (sign_record(me, LEASE_KIND, run_id, seize[1], ttl_s=60, seq=seize[1].term),
                   sign_record(me, "commit", run_id, stall, ttl_s=MAX_TTL_S, seq=commit_seq(stall))):
        try:
            await node.put_record(signed, timeout=10.0)
        except PcpError:
            pass
    return sent


async def test_a_stranger_can_neither_seize_nor_stall_nor_fill_a_run(tmp_path: Path) -> None:
    owner = load_or_create_identity(tmp_path / "owner")
    async with local_swarm(tmp_path, extra_args=["--trust", owner.peer_id]) as swarm:
        boot = await swarm.start_bootstrap()
        await swarm.add_workers(3, deadline_s=60)
        members = [w.peer_id for w in swarm.workers]
        run_id = (await create_run(swarm, boot.addr, tmp_path, SPEC))["run_id"]
        statuses = await wait_for(swarm, swarm.workers, lambda s: committed(s) >= 2, 240)
        term = max(s.get("term") or 0 for s in statuses.values())

        cfg = NodeConfig(tmp_path / "stranger", listen=("/ip4/127.0.0.1/tcp/0",), capabilities=TEST_CAPS,
                         op_timeout=5.0, bootstrap=(boot.addr,))
        async with open_node(cfg) as stranger:
            await stranger.wait_until(lambda: set(members) <= {m.record.peer_id for m in stranger.membership.live()},
                                      timeout=30)
            await attack(stranger, run_id, members, term, ROUNDS)
            statuses = await wait_for(
                swarm, swarm.workers,
                lambda s: len(s) == 3 and all(st.get("phase") == "finished" for st in s.values()), 300,
            )

    history = run_history(statuses)
    assert [h["round"] for h in history] == list(range(1, ROUNDS + 1))  # every round, honestly committed
    assert {h["shepherd"] for h in history} <= set(members)  # led by members only
    assert all(h["val_loss"] > 0.5 for h in history)  # not the stranger's "0.01"
    assert {st["theta"] for st in statuses.values()} == {history[-1]["theta"]}  # one θ
    for st in statuses.values():
        assert all(t["holder"] in members for t in st["shepherd_history"])
    # every round was audited by replay, and every honest replay matched exactly
    verdicts = [st.get("audits", {}) for st in statuses.values()]
    assert sum(v.get("match", 0) for v in verdicts) >= ROUNDS
    assert sum(v.get("mismatch", 0) for v in verdicts) == 0
    assert all(st.get("banned") == 0 for st in statuses.values())
    for w in swarm.workers:  # nobody fetched the junk checkpoint
        big = [p for p in (w.data_dir / "blobs").rglob("*") if p.is_file() and p.stat().st_size >= JUNK_MIB << 20]
        assert big == [], big


POISON_ROUNDS = 12
POISON_SPEC = SPEC.replace(f"rounds = {ROUNDS}", f"rounds = {POISON_ROUNDS}").replace(
    "min_quorum = 2", "min_quorum = 2\n[election]\nrotate_every = 0")


class Poisoner:
    """A stranger that joins the run as a worker, claims 1e12 tokens/s and never trains.

    Odd rounds: a random Δ of the honest scale times 30 (poison). Even rounds: a tiny
    Δ that looks harmless (a lazy cheat the scores cannot see). Every submission is
    well formed and signed, and claims fresh inner moments so the shepherd's state
    chain accepts it.
    """

    def __init__(self, node, run_id: str, target: str) -> None:  # type: ignore[no-untyped-def]
        self.node, self.run_id, self.target = node, run_id, target
        self.assigned: list[int] = []
        self.announcements: list[RoundAnnouncement] = []
        self.send, self.inbox = trio.open_memory_channel[RoundAnnouncement](100)

    async def on_message(self, sender: str, msg) -> None:  # type: ignore[no-untyped-def]
        if isinstance(msg, RoundAnnouncement) and msg.run_id == self.run_id:
            self.send.send_nowait(msg)

    async def join(self, shepherd: str) -> None:
        join = sign(Join(run_id=self.run_id, worker=self.node.peer_id, target=self.target, tokens_per_s=1e12),
                    self.node.identity)
        try:
            await self.node.messenger.send(shepherd, join, timeout=10.0)
        except PcpError:
            pass

    async def keep_joining(self, members: list[str]) -> None:
        """Join again every few seconds, at every member, as a real worker that finds itself
        unassigned does: a shepherd that changed (a failover) knows nothing of the poisoner,
        and a shepherd sends announcements to its roster only, so without this a failover
        left it outside the run for good and the test proved nothing (one CI run in five)."""
        while True:
            for peer in members:
                await self.join(peer)  # (only the shepherd takes it; the others refuse it)
            await trio.sleep(3.0)  # (the attacker's cadence, not a synchronisation)

    async def serve(self) -> None:
        rng = np.random.default_rng(7)
        async for ann in self.inbox:
            self.announcements.append(ann)
            mine = ann.assignment_for(self.node.peer_id)
            if mine is None:
                await self.join(ann.shepherd)  # evicted or refused: ask again
                continue
            self.assigned.append(ann.round)
            member = self.node.membership.get(ann.shepherd)
            providers = ([PeerInfo(ID.from_base58(ann.shepherd), transport_addrs(member.record.addrs))]
                         if member else None)
            try:
                theta = unpack_tensors(bytes(await self.node.blobs.fetch_into(ann.theta_cid, providers=providers)))
            except PcpError:
                continue
            scale = 0.03 if ann.round % 2 else 1e-6
            delta = {k: (scale * rng.standard_normal(v.shape)).astype(np.float32) for k, v in theta.items()}
            steps = (mine.max_steps // 5) * 5
            sub = sign(Submission(
                run_id=self.run_id, term=ann.term, round=ann.round, attempt=ann.attempt, worker=self.node.peer_id,
                base_theta_cid=ann.theta_cid, codec="int8", delta_cid=None,
                delta_inline=codec_of("int8").encode(delta), steps=steps, tokens=steps * 16 * 64,
                losses=(2.5, 2.4), state_in=FRESH_STATE, state_out=secrets.token_hex(32),
            ), self.node.identity)
            try:
                await self.node.messenger.send(ann.shepherd, sub, timeout=10.0)
            except PcpError:
                pass


async def test_a_poisoning_worker_is_refused_and_a_lazy_one_is_audited_and_banned(tmp_path: Path) -> None:
    """Poison (issue #12): a stranger joins as a worker claiming 1e12 tokens/s and sends random Δs.

    Its poison is refused (held-out score, norm screen) and the run's val loss keeps
    falling; its lazy rounds that pass the scores are replayed by other workers
    (audit_rate = 1), two replays contradict it, and it is banned: no later round
    assigns it.
    """
    owner = load_or_create_identity(tmp_path / "owner")
    async with local_swarm(tmp_path, extra_args=["--trust", owner.peer_id]) as swarm:
        boot = await swarm.start_bootstrap()
        await swarm.add_workers(3, deadline_s=60)
        members = [w.peer_id for w in swarm.workers]
        run_id = (await create_run(swarm, boot.addr, tmp_path, POISON_SPEC))["run_id"]
        statuses = await wait_for(swarm, swarm.workers, lambda s: committed(s) >= 1, 240)
        shepherd = next(s["shepherd"] for s in statuses.values() if s.get("shepherd"))

        cfg = NodeConfig(tmp_path / "poisoner", listen=("/ip4/127.0.0.1/tcp/0",), capabilities=TEST_CAPS,
                         op_timeout=5.0, bootstrap=(boot.addr,))
        async with open_node(cfg) as node, trio.open_nursery() as nursery:
            poisoner = Poisoner(node, run_id, best_cpu_target().name)
            node.messenger.register((RoundAnnouncement, CommitRecord, CommitWithUpdate, Lease, *AUDIT_MESSAGES),
                                    poisoner.on_message)  # (it acks what a member acks, and ignores it)
            await node.wait_until(lambda: shepherd in {m.record.peer_id for m in node.membership.live()}, timeout=30)
            nursery.start_soon(poisoner.serve)
            await poisoner.join(shepherd)
            nursery.start_soon(poisoner.keep_joining, members)
            statuses = await wait_for(
                swarm, swarm.workers,
                lambda s: len(s) == 3 and all(st.get("phase") == "finished" for st in s.values()), 360,
            )
            nursery.cancel_scope.cancel()

    history = run_history(statuses)
    assert [h["round"] for h in history] == list(range(1, POISON_ROUNDS + 1))
    assert {h["shepherd"] for h in history} <= set(members)
    assert history[-1]["val_loss"] < history[0]["val_loss"]  # the poison never landed
    assert poisoner.assigned, "the poisoner was never assigned a round: the test proved nothing"
    # two replays contradicted its lazy round; the evidence reached every member, which
    # checked it and recorded the ban (the next term's shepherd would refuse it too)
    assert all(st.get("banned", 0) >= 1 for st in statuses.values()), (  # (what to look at when it does not)
        [st.get("banned") for st in statuses.values()], poisoner.assigned,
        [st.get("audits") for st in statuses.values()])
    # banned: refused from then on, so the last round went on without it (a shepherd sends
    # announcements to its roster only, so the poisoner sees none after its ban). How many rounds
    # the ban takes is the audits' turnaround under load, not what this test claims: the bound
    # was the last two rounds, and a full CI run on two cores once banned it one round later.
    assert max(poisoner.assigned) < POISON_ROUNDS - 1, poisoner.assigned

"""A busy shepherd keeps beating: the runtime feeds its machine off the event loop.

The election's suspicion rule is tested on pure machines (tests/test_election_heartbeat.py).
What makes it honest on a real node is that a shepherd busy with a heavy input (a
commit: Δ decoding, JAX evaluation, the robust rule, the checkpoint) still sends its
heartbeats. Here the machine's step is a stand-in that blocks its thread until the
test has seen the heartbeats that went out meanwhile: had the step run on the event
loop, none would have (the step gives up after 10 s and the test fails).

And a new holder starts from what survived of its predecessor: the checkpoint, else
the committed θ, else the θ that round started from (the round is trained again).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import trio

from pcp_p2p.core.errors import BlobNotFound
from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.algorithm.params import pack_tensors
from pcp_p2p.diloco.protocol.election import (
    BecomeShepherd,
    Candidate,
    Election,
    ElectionConfig,
    Heartbeat,
    Lease,
    PublishLease,
    Role,
    ranked,
)
from pcp_p2p.diloco.protocol.messages import CommitRecord, sign
from pcp_p2p.diloco.protocol.spec import parse_spec
from pcp_p2p.diloco.run.run_effects import Wake
from pcp_p2p.diloco.run.run_setup import TermSetUp
from pcp_p2p.diloco.run.runtime import MAX_BEATS_QUEUED, RunRuntime

CONFIG = ElectionConfig(lease_s=6.0, renew_every_s=2.0, grace_s=1.0, min_uptime_s=0.0, rotate_every=0,
                        claim_timeout_s=10.0, settle_s=0.0, heartbeat_s=0.25, suspect_s=1.5)
BUSY_S = 2.0  # how long the stand-in step holds the machine, at least (a commit on a loaded machine)


def two_elections(now: float) -> tuple[Election, Election]:
    """(holder, follower) of term 0 of a run, the lease accepted at ``now``."""
    ids = [Identity.generate(), Identity.generate()]
    first = ranked("run", 0, [i.peer_id for i in ids])[0]
    ids.sort(key=lambda i: i.peer_id != first)
    holder, follower = (Election("run", i, CONFIG) for i in ids)
    view = [Candidate(i.peer_id, 100.0) for i in ids]
    for e in (holder, follower):
        e.start(now)
        e.on_lookups_done(now)
    (claim,) = [x.lease for x in holder.on_members(view, now) if isinstance(x, PublishLease)]
    follower.on_members(view, now)
    follower.on_lease(claim, now)
    assert holder.role is Role.HOLDER and follower.role is Role.FOLLOWER
    return holder, follower


async def test_a_shepherd_busy_with_a_long_input_keeps_beating_and_is_not_deposed() -> None:
    start = time.time()
    holder, follower = two_elections(start)
    silent = two_elections(start)[1]  # the follower of a holder that sends nothing
    released = threading.Event()
    beats: list[Heartbeat] = []
    enough = trio.Event()

    def busy_step(ev: Any, now: float) -> list[Any]:
        released.wait(10.0)  # a heavy input: the thread is busy, the event loop is not
        return []

    class Messenger:
        async def post(self, peer: str, msg: Any) -> None:  # beats go on a line (Messenger.post)
            assert peer == follower.peer_id and isinstance(msg, Heartbeat)
            beats.append(msg)
            if msg.sent_at - beats[0].sent_at >= BUSY_S:
                enough.set()

    rt = RunRuntime.__new__(RunRuntime)
    rt.run_id, rt.clock = "run", time.time
    rt.node = SimpleNamespace(peer_id=holder.peer_id, messenger=Messenger())  # type: ignore[assignment]
    rt.machine = SimpleNamespace(  # type: ignore[assignment]
        election=holder, handle=busy_step, run_members=lambda: [follower.peer_id])
    rt._machine_lock, rt._machine_thread = threading.Lock(), trio.CapacityLimiter(1)
    rt._beat_at, rt._beating, rt._beats_in = float("-inf"), set(), []
    async with trio.open_nursery() as nursery:
        rt._nursery = nursery
        nursery.start_soon(rt._heartbeats)
        nursery.start_soon(rt._dispatch, Wake())
        with trio.fail_after(20):
            await enough.wait()
        assert not released.is_set()  # all of them went out while the step was still running
        released.set()
        nursery.cancel_scope.cancel()
    assert all(b.term == 0 and b.holder == holder.peer_id for b in beats)
    gaps = [b.sent_at - a.sent_at for a, b in itertools.pairwise(beats)]
    assert max(gaps) < CONFIG.suspect_window_s  # never silent for a suspicion window

    end = beats[-1].sent_at
    for b in beats:
        follower.on_heartbeat(b, b.sent_at)
    follower.tick(end)
    assert follower.role is Role.FOLLOWER  # busy, and alive: not deposed
    silent.tick(end)  # heard nothing for BUSY_S > suspect_s: suspected, the term ends ...
    # (... after a late tick's grace: a tick that long past due gives queued beats two more)
    silent.tick(end + 2 * CONFIG.heartbeat_s)
    assert silent.history[0].ended == "failover"
    assert silent.current_term == 1 and silent.holder == silent.peer_id  # ... and the next is claimed


async def test_only_the_holders_own_heartbeats_are_queued_for_the_machine() -> None:
    """A stranger's beats (its own, or the holder's relayed) would crowd the holder's out of the
    bounded queue, and a follower would then suspect a live shepherd: none of them is kept."""
    start = time.time()
    holder, follower = two_elections(start)
    mallory = Identity.generate()
    rt = RunRuntime.__new__(RunRuntime)
    rt.run_id, rt._beats_in = "run", []
    rt.machine = SimpleNamespace(election=follower)  # type: ignore[assignment]
    genuine = sign(Heartbeat(run_id="run", term=0, holder=holder.peer_id, sent_at=start), holder.identity)
    own = sign(Heartbeat(run_id="run", term=0, holder=mallory.peer_id, sent_at=start), mallory)
    for _ in range(2 * MAX_BEATS_QUEUED):
        await rt.deliver(mallory.peer_id, own)
        await rt.deliver(mallory.peer_id, genuine)  # relayed: proves nothing about the holder now
    assert rt._beats_in == []
    await rt.deliver(holder.peer_id, genuine)
    assert rt._beats_in == [(holder.peer_id, genuine)]


async def test_a_renewal_is_posted_on_the_beats_line_and_a_claim_is_sent_with_an_ack() -> None:
    """A renewal goes every renew_every_s to every member: posted on the line the beats use (no
    stream, negotiation and ack each: issue #15); sent instead where a beat holds that line (a
    post there would be dropped), and a claim, which must arrive, is always sent and acked."""
    holder, _follower = two_elections(time.time())
    assert holder.lease is not None
    posted: list[tuple[str, str]] = []
    sent: list[tuple[str, str]] = []

    async def post(peer: str, msg: Any) -> None:
        posted.append((peer, msg.TAG))

    async def send_to(peer: str, msg: Any) -> bool:
        sent.append((peer, msg.TAG))
        return True

    rt = RunRuntime.__new__(RunRuntime)
    rt._beating, rt._beat_at, rt.clock = {"busy"}, 0.0, time.time  # type: ignore[method-assign]
    rt.machine = SimpleNamespace(run_members=lambda: ["p1", "p2", "busy"],  # type: ignore[assignment]
                                 election=holder)
    rt.node = SimpleNamespace(messenger=SimpleNamespace(post=post), log_once=lambda *a: None)  # type: ignore[assignment]
    rt.send_to = send_to  # type: ignore[method-assign]
    await rt._publish_lease(holder.lease, renewal=True, store=False)
    assert sorted(posted) == [("p1", "diloco.lease"), ("p2", "diloco.lease")]
    assert sent == [("busy", "diloco.lease")] and rt._beating == {"busy"} and rt._beat_at > 0
    posted.clear()
    sent.clear()
    await rt._publish_lease(holder.lease, renewal=False, store=False)
    assert posted == [] and sorted(sent) == [("busy", "diloco.lease"), ("p1", "diloco.lease"), ("p2", "diloco.lease")]


def lost_commit_set_up(held: dict[str, bytes]) -> tuple[TermSetUp, BecomeShepherd, CommitRecord]:
    """The set-up of term 5, whose lease continues from round 3's commit (term 4's last), on a
    node where only the blobs in ``held`` can be fetched (a dead holder had the rest)."""
    ident = Identity.generate()
    rec = sign(CommitRecord(run_id="run", term=4, round=2, attempt=0, prev_theta_cid="cid-theta2",
                            theta_cid="cid-theta3", checkpoint_cid="cid-ckpt3", participants=(ident.peer_id,),
                            tokens=1, mean_loss=1.0, val_loss=None, shepherd=ident.peer_id), ident)
    lease = sign(Lease(run_id="run", term=5, holder=ident.peer_id, claimed_at=0.0, issued=0.0, expiry=6.0,
                       from_round=3, from_theta_cid="cid-theta3", from_checkpoint_cid="cid-ckpt3"), ident)
    asked: list[str] = []

    async def fetch_bytes(cid: str, **kw: Any) -> bytes:
        asked.append(cid)
        if cid not in held:
            raise BlobNotFound(f"no provider for {cid}")
        return held[cid]

    rt = SimpleNamespace(run_id="run", spec=parse_spec("[round]\nrounds = 10\n"), node=SimpleNamespace(identity=ident),
                         io=SimpleNamespace(fetch_bytes=fetch_bytes, asked=asked), state_bound=lambda copies: 1 << 20,
                         machine=SimpleNamespace(election=SimpleNamespace(lease=lease, best_commit=rec)))
    return TermSetUp(rt), BecomeShepherd(5, "cid-ckpt3", 3, None), rec  # type: ignore[arg-type]


async def test_a_holder_killed_as_it_committed_costs_a_round_not_the_run() -> None:
    """Neither the checkpoint nor the θ of the last commit survived its holder: the next term trains
    that round again from the θ it started from, which every worker of the round fetched."""
    theta2 = {"w": np.arange(4, dtype=np.float32)}
    set_up, eff, rec = lost_commit_set_up({"cid-theta2": pack_tensors(theta2)})
    state = (await set_up._continuing(eff, {})).state
    assert set_up.rt.io.asked == ["cid-ckpt3", "cid-theta3", "cid-theta2"]  # type: ignore[attr-defined]
    assert state.round == rec.round  # round 3 (1-based) again: the next commit supersedes term 4's
    np.testing.assert_array_equal(state.theta["w"], theta2["w"])
    assert not state.momentum["w"].any()

    # The committed θ, when it survived, is taken before that: no round is lost.
    theta3 = {"w": np.ones(4, dtype=np.float32)}
    set_up, eff, rec = lost_commit_set_up({"cid-theta2": pack_tensors(theta2), "cid-theta3": pack_tensors(theta3)})
    state = (await set_up._continuing(eff, {})).state
    assert state.round == rec.round + 1 and state.theta["w"].tolist() == [1.0] * 4

    # With nothing to fall back on (the commit this node knows is not the lease's base), the set-up fails.
    set_up, eff, rec = lost_commit_set_up({"cid-theta2": pack_tensors(theta2)})
    set_up.rt.machine.election.best_commit = replace(rec, theta_cid="cid-other")  # type: ignore[misc]
    with pytest.raises(BlobNotFound):
        await set_up._continuing(eff, {})

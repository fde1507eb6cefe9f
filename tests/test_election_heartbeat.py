"""Failover on missed heartbeats: the election detects a dead shepherd without waiting for its lease.

Pure machines with explicit times (the election never reads a clock), then the
whole run machine on trio's ``MockClock`` (:mod:`pcp_p2p.testing.run_harness`).
"""

from __future__ import annotations

import dataclasses
import random

import trio
from trio.testing import MockClock

from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.protocol.effects import Rejected
from pcp_p2p.diloco.protocol.election import (
    GAP_SAMPLES,
    MIN_GAPS,
    PATIENCE_DECAY_BEATS,
    Candidate,
    Election,
    ElectionConfig,
    FollowShepherd,
    Heartbeat,
    Lease,
    PublishLease,
    Role,
    SendHeartbeat,
    ranked,
)
from pcp_p2p.diloco.protocol.messages import sign
from pcp_p2p.testing.memnet import FaultPlan, Kill
from pcp_p2p.testing.run_harness import RunSwarm, SwarmConfig

CONFIG = ElectionConfig(lease_s=10.0, renew_every_s=3.0, grace_s=1.0, min_uptime_s=0.0, rotate_every=0,
                        claim_timeout_s=10.0, settle_s=0.5, heartbeat_s=0.5, suspect_s=1.5)
IDS = [Identity.generate() for _ in range(3)]


def run_where(first0: int, first1_order: list[int]) -> str:
    """A run id whose ranking puts node ``first0`` first for term 0 and ``first1_order`` in that
    order for term 1 (found by trying ids: the ranking is a hash)."""
    peers = [i.peer_id for i in IDS]
    for n in range(100_000):
        run = f"run-{n}"
        r0, r1 = ranked(run, 0, peers), ranked(run, 1, peers)
        if r0[0] == peers[first0] and r1[: len(first1_order)] == [peers[i] for i in first1_order]:
            return run
    raise AssertionError("no such run id")


def swarm(run: str, config: ElectionConfig = CONFIG) -> list[Election]:
    """Three elections that all see each other; term 0 claimed and followed at t = 1."""
    es = [Election(run, ident, config) for ident in IDS]
    view = [Candidate(i.peer_id, 100.0) for i in IDS]
    leases = []
    for e in es:
        e.start(0.0)
        e.on_lookups_done(0.0)
        leases += [x.lease for x in e.on_members(view, 1.0) if isinstance(x, PublishLease)]
    assert len(leases) == 1
    for e in es:
        e.on_lease(leases[0], 1.0)
    return es


def test_the_holder_sends_a_signed_heartbeat_every_interval() -> None:
    es = swarm(run_where(0, [1]))
    holder = es[0]
    assert holder.role is Role.HOLDER
    beats = [x.heartbeat for t in (1.2, 1.5, 1.7, 2.0) for x in holder.tick(t) if isinstance(x, SendHeartbeat)]
    assert [b.sent_at for b in beats] == [1.5, 2.0]
    assert holder.next_wakeup == 2.5
    assert es[1].on_heartbeat(beats[0], 1.5) == []  # checks out at a follower


def test_a_silent_holder_is_suspected_and_replaced_long_before_its_lease_lapses() -> None:
    es = swarm(run_where(0, [0, 1]))  # the dead holder would rank first for term 1 too
    holder, b, c = es
    beat = sign(Heartbeat(run_id=holder.run_id, term=0, holder=holder.peer_id, sent_at=1.5), holder.identity)
    for e in (b, c):
        e.on_heartbeat(beat, 1.5)
        assert e.tick(2.9) == [] and e.role is Role.FOLLOWER  # 1.4 s of silence: not yet
    # The holder dies at 1.5. B's silence reaches suspect_s first.
    out = b.tick(3.0) + b.on_lookups_done(3.0)
    claims = [x.lease for x in out if isinstance(x, PublishLease) and not x.renewal]
    assert [(c.term, c.holder) for c in claims] == [(1, b.peer_id)]  # holder left out of the ranking
    assert claims[0].claimed_at == 3.0 < holder.lease.expiry  # 8 s before the lease would lapse
    # At 2.95 C has not suspected the holder yet (1.45 s of silence), and the claim skips a
    # holder it still counts as alive: held back, not followed.
    assert [type(x) for x in c.on_lease(claims[0], 2.95)] == [Rejected]
    assert c.role is Role.FOLLOWER and c.holder == holder.peer_id
    # Once C's own silence agrees, the held claim is taken.
    out = c.tick(3.05)
    assert any(isinstance(x, FollowShepherd) and x.peer == b.peer_id and x.term == 1 for x in out)


def test_one_nodes_silence_cannot_depose_a_holder_the_others_still_hear() -> None:
    # B ranks first for term 1 even with the live holder counted: its rank alone would
    # entitle its claim. C still hears the holder, so the claim waits until C's own
    # silence agrees (and the holder, busy but alive, keeps its term meanwhile).
    es = swarm(run_where(0, [1, 0]))
    holder, b, c = es
    out = b.tick(2.6) + b.on_lookups_done(2.6)  # B's own loop stalled: it heard nothing since 1.0
    (claim,) = [x.lease for x in out if isinstance(x, PublishLease) and not x.renewal]
    beat = sign(Heartbeat(run_id=holder.run_id, term=0, holder=holder.peer_id, sent_at=2.5), holder.identity)
    c.on_heartbeat(beat, 2.5)
    assert [type(x) for x in c.on_lease(claim, 2.7)] == [Rejected]
    assert c.role is Role.FOLLOWER and c.holder == holder.peer_id and c.current_term == 0
    assert c.tick(3.9) == [] and c.current_term == 0  # still heard 1.4 s ago: the claim stays held
    # The holder really is gone: once C's silence reaches suspect_s, B's claim is taken.
    out = c.tick(4.05)
    assert any(isinstance(x, FollowShepherd) and x.peer == b.peer_id and x.term == 1 for x in out)


def test_a_heartbeat_from_anyone_but_the_holder_does_not_keep_it_alive() -> None:
    es = swarm(run_where(0, [1]))
    holder, b, _ = es
    mallory = Identity.generate()
    forged = sign(Heartbeat(run_id=holder.run_id, term=0, holder=holder.peer_id, sent_at=2.5), mallory)
    assert [type(x) for x in b.on_heartbeat(forged, 2.5)] == [Rejected]
    other = sign(Heartbeat(run_id=holder.run_id, term=0, holder=mallory.peer_id, sent_at=2.5), mallory)
    assert b.on_heartbeat(other, 2.5) == []  # not the holder of term 0: dropped
    b.tick(2.6)
    assert b.role is Role.VACANT  # last heard at 1.0 (the lease): suspected at 2.5


def test_a_holder_heard_again_before_anyone_took_its_term_is_followed_again() -> None:
    es = swarm(run_where(0, [1]))
    holder, b, _ = es
    b.tick(2.6)
    assert b.role is Role.VACANT and holder.peer_id in b.suspected
    beat = sign(Heartbeat(run_id=holder.run_id, term=0, holder=holder.peer_id, sent_at=2.7), holder.identity)
    assert b.on_heartbeat(beat, 2.7) == []
    assert b.role is Role.FOLLOWER and b.holder == holder.peer_id and not b.suspected


def test_a_holder_that_announced_its_departure_is_not_followed_again_on_a_late_heartbeat() -> None:
    """A heartbeat it sent before leaving may arrive after the ``Leave``: that holder is gone."""
    es = swarm(run_where(0, [1]))
    holder, b, _ = es
    late = sign(Heartbeat(run_id=holder.run_id, term=0, holder=holder.peer_id, sent_at=1.9), holder.identity)
    b.on_departure(holder.peer_id, 2.0, 2.0)
    assert b.role is Role.VACANT
    assert b.on_heartbeat(late, 2.1) == [] and b.role is Role.VACANT and b.history[-1].ended == "failover"


def test_heartbeats_off_keeps_failover_on_lease_expiry() -> None:
    off = dataclasses.replace(CONFIG, heartbeat_s=0.0)
    e = Election("run", IDS[1], off)
    assert not off.heartbeats
    e.start(0.0)
    assert all(not isinstance(x, SendHeartbeat) for x in e.tick(5.0))


class Timed(RunSwarm):
    """The harness, noting when the shepherd was killed and when the next term was claimed."""

    def __init__(self, cfg: SwarmConfig) -> None:
        super().__init__(cfg)
        self.killed_at: float | None = None
        self.claims: list[tuple[float, int]] = []

    def kill(self, node, restart_after):  # type: ignore[no-untyped-def]
        self.killed_at = trio.current_time()
        return super().kill(node, restart_after)

    def _carry_out_now(self, node, effects):  # type: ignore[no-untyped-def]
        for e in effects:
            if isinstance(e, PublishLease) and not e.renewal:
                self.claims.append((trio.current_time(), e.lease.term))
        return super()._carry_out_now(node, effects)


def test_a_killed_shepherd_is_replaced_within_the_suspicion_window_on_mock_time() -> None:
    from tests.test_run_machine import ROUNDS, SPEC, check

    plan = FaultPlan(seed=5, kills=(Kill("announced", round=2, restart_after=None),))
    base = SwarmConfig(spec=SPEC)
    cfg = dataclasses.replace(base, plan=plan, election=dataclasses.replace(base.election, heartbeat_s=0.5,
                                                                            suspect_s=1.5))
    world = Timed(cfg)
    r = trio.run(world.run, clock=MockClock(autojump_threshold=0))
    check(r)
    assert world.killed_at is not None
    after = [(t, term) for t, term in world.claims if t > world.killed_at]
    assert after, "no term was claimed after the kill"
    took = after[0][0] - world.killed_at
    # suspect_s of silence, the settling lookups, one claim: well under the 10 s lease.
    assert took < cfg.election.suspect_window_s + cfg.election.settle_s + 1.0, took
    assert ROUNDS == r.final.round + 1


# --- adaptive suspicion: a slow holder is not a dead one ---------------------------------------

QUICK = dataclasses.replace(CONFIG, heartbeat_s=0.25, suspect_s=1.5)  # the run machine's timing


def alive(holder: Election, follower: Election | list[Election], t: float) -> None:
    """The holder's machine steps at ``t`` and its beat (or lease renewal) reaches each follower at once."""
    out = holder.tick(t)
    renewals = [x.lease for x in out if isinstance(x, PublishLease)]
    for f in follower if isinstance(follower, list) else [follower]:
        for lease in renewals:
            f.on_lease(lease, t)
        if not renewals:
            beat = holder.heartbeat(t)
            assert beat is not None
            f.on_heartbeat(beat, t)


def until(follower: Election, t: float) -> None:
    """Tick ``follower`` at every wake-up it asks for before ``t``, on time (a scheduled node)."""
    while (w := follower.next_wakeup) is not None and w < t and follower.role is Role.FOLLOWER:
        follower.tick(w)


def test_a_jittery_but_alive_holder_is_not_suspected_once_the_window_has_adapted() -> None:
    """Beats up to 2.1 s apart (1.4 x suspect_s: a loaded machine) from a live holder: a fixed
    1.5 s window suspects it again and again; the adapted one never does."""
    holder, f, _ = swarm(run_where(0, [1]), QUICK)
    rng = random.Random(7)
    # The first beats (before there are enough to adapt on) come within the least window.
    gaps = [min(1.4, rng.uniform(0.3, 2.1)) for _ in range(MIN_GAPS)]
    gaps += [2.1] + [rng.uniform(0.3, 2.1) for _ in range(60)]
    t = 1.0
    for gap in gaps:
        until(f, t + gap)
        assert f.role is Role.FOLLOWER and not f.suspected, t + gap
        t += gap
        alive(holder, f, t)
    assert f.suspect_after_s > 2.1 and f.patience == 1.0  # never falsely suspected


def test_a_holder_that_stops_is_suspected_within_the_adapted_window() -> None:
    holder, f, _ = swarm(run_where(0, [1]), QUICK)
    t = 1.0
    for _ in range(20):  # a steady beat: the window stays suspect_s
        t += 0.25
        alive(holder, f, t)
    assert f.suspect_after_s == QUICK.suspect_window_s and f.next_wakeup == t + 1.5
    until(f, t + 1.5)
    assert f.role is Role.FOLLOWER
    f.tick(t + 1.5)
    assert f.role is Role.VACANT and holder.peer_id in f.suspected  # 1.5 s after its last beat

    holder, f, _ = swarm(run_where(0, [1]), QUICK)
    rng, t = random.Random(3), 1.0
    for gap in [0.5] * MIN_GAPS + [rng.uniform(0.3, 2.1) for _ in range(40)]:
        t += gap
        alive(holder, f, t)
    window = f.suspect_after_s
    assert 1.5 < window < QUICK.lease_s and f.next_wakeup == t + window  # widened, and bounded
    until(f, t + window)
    assert f.role is Role.FOLLOWER
    f.tick(t + window)  # the holder died after its last beat: suspected one adapted window later
    assert f.role is Role.VACANT and holder.peer_id in f.suspected
    assert t + window < f.lease.expiry  # long before its lease lapses


def test_a_false_suspicion_doubles_the_patience_and_on_time_beats_halve_it() -> None:
    holder, f, _ = swarm(run_where(0, [1]), QUICK)
    alive(holder, f, 1.25)
    f.tick(2.75)
    assert f.role is Role.VACANT  # 1.5 s of silence: suspected
    alive(holder, f, 2.9)  # it was only slow
    assert f.role is Role.FOLLOWER and f.patience == 2.0
    assert f.next_wakeup == 2.9 + 2 * 1.5  # (too few gaps to adapt yet: the least window, doubled)
    f.tick(2.9 + 2.9)
    assert f.role is Role.FOLLOWER  # 2.9 s of silence: a fixed window would have suspected again
    alive(holder, f, 5.85)
    assert f.patience == 2.0  # (that gap was late)
    t = 5.85
    for _ in range(PATIENCE_DECAY_BEATS):
        t += 0.25
        alive(holder, f, t)
    assert f.patience == 1.0  # halved back after a run of on-time beats
    for _ in range(GAP_SAMPLES):  # the slow gaps age out of the kept ones too
        t += 0.25
        alive(holder, f, t)
    assert f.suspect_after_s == QUICK.suspect_window_s


def test_a_late_tick_gives_the_holder_grace_for_its_queued_beats() -> None:
    """This node was not scheduled: its tick comes long after it was due, and the holder's beats
    sit in its queue behind it. One grace of two heartbeats lets them in before any suspicion."""
    for queued in (True, False):
        holder, f, _ = swarm(run_where(0, [1]), QUICK)
        for t in (1.25, 1.5, 1.75):
            alive(holder, f, t)
        assert f.next_wakeup == 3.25
        f.tick(4.25)  # due at 3.25, runs a second late
        assert f.role is Role.FOLLOWER and f.next_wakeup == 4.75
        if queued:
            beat = holder.heartbeat(3.0)
            assert beat is not None
            f.on_heartbeat(beat, 4.3)  # sent at 3.0, queued behind the stalled tick
            f.tick(4.75)
            assert f.role is Role.FOLLOWER and not f.suspected
        else:
            f.tick(4.74)
            assert f.role is Role.FOLLOWER
            f.tick(4.75)  # nothing came: the holder is suspected after the grace
            assert f.role is Role.VACANT and holder.peer_id in f.suspected
    holder, f, _ = swarm(run_where(0, [1]), QUICK)
    alive(holder, f, 1.25)
    f.tick(2.8)  # on time (within two heartbeats of due): no grace
    assert f.role is Role.VACANT


def test_what_followers_learned_of_the_swarm_carries_over_to_the_next_holder() -> None:
    """The window learned from one holder's beats is kept when the term changes hands: a new
    holder is busiest as it starts (its set-up), and meeting it with the bare least window
    deposed every new holder of a loaded swarm in turn."""
    old, b, c = swarm(run_where(0, [1]), QUICK)
    rng, t = random.Random(5), 1.0
    for gap in [0.5] * MIN_GAPS + [rng.uniform(0.3, 2.1) for _ in range(40)]:
        t += gap
        alive(old, [b, c], t)
    learned = c.suspect_after_s
    assert learned > 2.1
    # The old holder dies after its beat at t; B suspects it, looks the lease up and claims term 1.
    claims: list[Lease] = []
    while not claims and (now := b.next_wakeup) is not None and now < t + 2 * learned:
        claims = [x.lease for x in b.tick(now) if isinstance(x, PublishLease) and not x.renewal]
    (claim,) = claims
    assert claim.term == 1 and claim.holder == b.peer_id
    until(c, now)
    c.tick(now)
    c.on_lease(claim, now)
    assert c.role is Role.FOLLOWER and c.holder == b.peer_id
    assert c.suspect_after_s == learned  # not the bare 1.5 s
    c.tick(now + 2.0)  # the new holder is silent for 2 s while it sets up
    assert c.role is Role.FOLLOWER and b.peer_id not in c.suspected


def test_with_many_followers_the_holder_spreads_its_beats_and_followers_wait_accordingly() -> None:
    """Under ``beats_per_s`` the holder's beats per second do not grow with its followers (issue
    #15: they were its largest traffic that did): 6 followers at 6 beats a second are beaten every
    second, not every 0.25 s; the beat says so, and a follower waits 3 of those extra spacings
    longer before it suspects the holder, still well before its lease lapses."""
    config = dataclasses.replace(QUICK, beats_per_s=6.0)
    assert config.beat_every_s(0) == config.beat_every_s(1) == 0.25  # few followers: as before
    assert config.beat_every_s(6) == 1.0
    assert config.beat_every_s(1000) == 1.5  # never less than twice per renewal
    holder, f, g = swarm(run_where(0, [1]), config)
    for e in (holder, f):
        e.followers = 6
    g.followers = 0  # its view lags: it counts nobody yet, but the beat tells it the spacing
    sent = [x.heartbeat for t in (1.25, 1.5, 2.0, 2.25) for x in holder.tick(t) if isinstance(x, SendHeartbeat)]
    assert [(b.sent_at, b.every_s) for b in sent] == [(2.0, 1.0)]  # 1 s after the claim, not 0.25
    assert holder.next_wakeup == 3.0
    g.on_heartbeat(sent[0], 2.0)
    assert g.suspect_after_s == 1.5 + 3 * (1.0 - 0.25)  # the least window, widened by 3 spacings
    t = 2.0
    for _ in range(2 * MIN_GAPS):  # a beat (or a renewal) every second: no one suspects the holder
        t += 1.0
        for e in (f, g):
            until(e, t)
        alive(holder, [f, g], t)
    for e in (f, g):
        assert e.role is Role.FOLLOWER and not e.suspected
    window = f.suspect_after_s
    assert 3.75 <= window < 5.0
    until(f, t + window)  # the holder stopped after its beat at t
    assert f.role is Role.FOLLOWER
    f.tick(t + window)
    assert f.role is Role.VACANT and holder.peer_id in f.suspected
    assert f.lease is not None and t + window < f.lease.expiry  # before the lease would have lapsed

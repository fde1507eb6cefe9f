"""The SWIM membership machine, on trio's MockClock and in an in-memory network of real machines."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from pcp_p2p.core.errors import BadSignature, MalformedMessage, VerificationError
from pcp_p2p.core.identity import Identity
from pcp_p2p.dht.records import sign_record
from pcp_p2p.net.membership import (
    MAX_HAVE,
    Gossip,
    Have,
    MemberJoined,
    MemberRecord,
    Membership,
    Refute,
    Send,
    SwimConfig,
    SwimPacket,
    boot_ms,
)
from pcp_p2p.testing.swim_net import CAPS, SwimNet, run_on_trio
from pcp_p2p.wire import decode, encode

SELF, A, B = Identity.generate(), Identity.generate(), Identity.generate()
CFG = SwimConfig()
# Longest a dead node may stay in a view on a lossless network: first probe within
# two passes of the view, the probe's own timeout, suspicion, and a few periods of spread.
def detection_bound(n: int) -> float:
    return 2 * n * CFG.period_s + CFG.probe_timeout_s + CFG.suspicion_s + 5 * CFG.period_s


def signed(ident: Identity, seq: int = 1, *, started_at: float = 1000.0, role: str = "worker",
           name: str | None = None, runs: tuple[str, ...] = ()) -> bytes:
    rec = MemberRecord(ident.peer_id, ("/ip4/127.0.0.1/tcp/1",), role, started_at, CAPS, runs=runs)
    return encode(sign_record(ident, "member", name or ident.peer_id, rec, ttl_s=600, seq=seq))


def alive(ident: Identity, seq: int = 1, started_at: float = 1000.0, **kw) -> Gossip:  # type: ignore[no-untyped-def]
    return Gossip("alive", ident.peer_id, int(started_at * 1000), seq, signed(ident, seq, started_at=started_at, **kw))


def machine(**cfg: float) -> Membership:
    m = Membership(SELF.peer_id, config=SwimConfig(**cfg))  # type: ignore[arg-type]
    m.set_self(signed(SELF), now=0.0)
    return m


# -- the machine alone ---------------------------------------------------------------


def test_sync_teaches_members_and_ping_is_answered_with_an_ack() -> None:
    m = machine()
    reply, relay, events = m.respond(A.peer_id, SwimPacket("sync", updates=(alive(A), alive(B))), 0.0)
    assert events == [MemberJoined(A.peer_id), MemberJoined(B.peer_id)] and relay is None
    assert reply is not None and reply.kind == "sync"
    assert {g.peer_id for g in reply.updates} >= {SELF.peer_id, A.peer_id, B.peer_id}
    ack, _, _ = m.respond(A.peer_id, SwimPacket("ping", 7, SELF.peer_id), 0.1)
    assert ack is not None and (ack.kind, ack.probe) == ("ack", 7)
    # A holds an older record of ours (known_seq 0): the ack carries our record first.
    assert ack.updates[0].peer_id == SELF.peer_id and ack.updates[0].kind == "alive"



def test_a_sync_sends_what_it_holds_by_incarnation_and_gets_back_only_what_it_lacks() -> None:
    """A sync carried ~1.2 KB records of every member each way, nearly all already held: most of a
    shepherd's SWIM bytes (issue #15). Now a request is this node's own record and a digest
    (``have``); the reply is the records the requester lacks or holds older; a joiner (an empty
    digest) still gets the whole sample; a stranger's oversized or bogus digest changes nothing."""
    C = Identity.generate()
    m = machine()
    m.respond(A.peer_id, SwimPacket("sync", updates=(alive(A), alive(B, 3), alive(C))), 0.0)
    request = m.join(0.5)  # (the request every sync sends: join's, and each one after)
    assert [g.peer_id for g in request.updates] == [SELF.peer_id]  # its own record, no others
    assert {(h.peer_id, h.seq) for h in request.have} == {(A.peer_id, 1), (B.peer_id, 3), (C.peer_id, 1)}
    assert len(encode(request)) < 2 * len(signed(SELF))  # ~80 bytes an entry, not a record (~725) each
    (send,) = [e for e in m.tick(30.0)[0] if isinstance(e, Send) and e.packet.kind == "sync"]
    assert send.packet.have  # the periodic one too

    boot_a, boot_b = alive(A).boot, alive(B).boot
    have = (Have(SELF.peer_id, *m._self.incarnation), Have(A.peer_id, boot_a, 1), Have(B.peer_id, boot_b, 2))
    reply, _, _ = m.respond(A.peer_id, SwimPacket("sync", updates=(alive(A),), have=have), 1.0)
    assert reply is not None and reply.kind == "sync"
    assert sorted(g.peer_id for g in reply.updates) == sorted([B.peer_id, C.peer_id])  # B held older, C not at all
    assert all(g.record for g in reply.updates)

    reply, _, _ = m.respond(C.peer_id, SwimPacket("sync", updates=(alive(C),)), 1.0)  # a joiner's: no digest
    assert reply is not None and {g.peer_id for g in reply.updates} == {SELF.peer_id, A.peer_id, B.peer_id, C.peer_id}

    bogus = (*(Have(f"peer-{i}", 10**15, 10**9) for i in range(MAX_HAVE)), Have(A.peer_id, 10**15, 10**9))
    reply, _, events = m.respond(B.peer_id, SwimPacket("sync", have=bogus), 1.0)
    assert reply is not None and A.peer_id not in {g.peer_id for g in reply.updates}  # it "holds" a newer A: fine
    assert events == [] and set(m._members) == {A.peer_id, B.peer_id, C.peer_id}  # nobody added or dropped

async def test_unanswered_probe_escalates_to_indirect_then_suspicion_then_dead(
    autojump_clock: trio.testing.MockClock,
) -> None:
    m = machine()
    m.respond(A.peer_id, SwimPacket("sync", updates=(alive(A), alive(B))), 0.0)
    sent: list[Send] = []
    left = []
    while trio.current_time() < 30 and not left:
        await trio.sleep(0.1)
        effects, events = m.tick(trio.current_time())
        sent += [e for e in effects if isinstance(e, Send)]
        left += events
        for e in effects:  # B answers everything, A nothing
            if isinstance(e, Send) and e.peer == B.peer_id and e.packet.kind == "ping":
                m.receive(B.peer_id, SwimPacket("ack", e.packet.probe, B.peer_id), trio.current_time())
            elif isinstance(e, Send) and e.peer == B.peer_id and e.packet.kind == "ping_req":
                m.receive(B.peer_id, SwimPacket("nack", e.packet.probe, e.packet.target), trio.current_time())
    kinds = [(s.peer, s.packet.kind) for s in sent]
    assert (A.peer_id, "ping") in kinds and (B.peer_id, "ping_req") in kinds
    assert [e.peer_id for e in left] == [A.peer_id] and left[0].reason == "dead"
    assert m.stats.suspicions == 1 and m.stats.confirmed == 1
    assert A.peer_id not in m and B.peer_id in m


async def test_failed_probes_slow_this_node_down_and_answered_ones_speed_it_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Lifeguard's local health: a node whose probes fail (it is likely the slow one)
    probes less often and waits longer before suspecting anyone."""
    m = machine(suspicion_s=1000.0, max_suspicion_s=1000.0)  # A stays (suspected) in view throughout
    m.respond(A.peer_id, SwimPacket("sync", updates=(alive(A),)), 0.0)
    pings: list[float] = []
    while m.health < 2:  # A never answers: each failed probe raises the score
        await trio.sleep(0.1)
        effects, _ = m.tick(trio.current_time())
        pings += [trio.current_time() for e in effects if isinstance(e, Send) and e.packet.kind == "ping"]
    # the second probe waited twice as long
    assert m.health == 2 and trio.current_time() > CFG.probe_timeout_s * (1 + 2)
    # (the first ping is the "buddy" one telling A it is suspected; the last is the new probe)
    probe = [e for e in m.tick(trio.current_time() + 100)[0] if isinstance(e, Send) and e.packet.kind == "ping"][-1]
    score = m.health  # (the probe in flight timed out first: 3)
    assert score >= 2 and probe.timeout_s == pytest.approx(CFG.ping_timeout_s * (1 + score))  # scaled by 1 + score
    m.receive(A.peer_id, SwimPacket("ack", probe.packet.probe, A.peer_id), trio.current_time() + 100.5)
    assert m.health == score - 1  # an answered probe brings it back down


def test_a_probe_whose_helpers_all_nack_blames_the_target_not_this_node() -> None:
    """Lifeguard's nacks: helpers that could not reach the target either show that our
    own links work, so the failed probe leaves our health score where it was."""
    helper_ids = [Identity.generate() for _ in range(3)]
    for nack_all in (True, False):
        m = machine()
        m.respond(A.peer_id, SwimPacket("sync", updates=(alive(A), *(alive(h) for h in helper_ids))), 0.0)
        effects, _ = m.tick(1.0)
        ping = next(e for e in effects if isinstance(e, Send) and e.packet.kind == "ping")
        target = ping.peer
        effects, _ = m.tick(2.1)  # no ack: ask the helpers
        reqs = [e for e in effects if isinstance(e, Send) and e.packet.kind == "ping_req"]
        assert len(reqs) == 3
        for req in reqs if nack_all else reqs[:2]:
            m.receive(req.peer, SwimPacket("nack", req.packet.probe, target), 2.5)
        m.tick(4.2)  # the probe times out: the target is suspect
        assert m.get(target).suspect_since is not None  # type: ignore[union-attr]
        assert m.health == (0 if nack_all else 1)


async def test_suspect_that_answers_directly_is_cleared(autojump_clock: trio.testing.MockClock) -> None:
    m = machine(suspicion_s=10.0)
    m.respond(A.peer_id, SwimPacket("sync", updates=(alive(A),)), 0.0)
    suspect_a = Gossip("suspect", A.peer_id, 1_000_000, 1)
    m.respond(B.peer_id, SwimPacket("ping", 1, SELF.peer_id, updates=(suspect_a,)), 0.0)
    assert m.suspected() == [A.peer_id]
    m.respond(A.peer_id, SwimPacket("ping", 2, SELF.peer_id), 1.0)  # A itself talks to us
    assert m.suspected() == []
    assert not any(True for _ in m.tick(20.0)[1])


def test_claim_about_this_node_asks_for_a_refutation_and_a_higher_seq_clears_it() -> None:
    m = machine()
    claim = Gossip("dead", SELF.peer_id, 1_000_000, 1)
    m.respond(A.peer_id, SwimPacket("ping", 1, SELF.peer_id, updates=(claim,)), 0.0)
    effects, _ = m.tick(0.1)
    assert any(isinstance(e, Refute) for e in effects)
    m.set_self(signed(SELF, 2), now=0.2)  # the pump re-signs
    assert not any(isinstance(e, Refute) for e in m.tick(0.3)[0])
    # ... and the new record is what we gossip next
    ack, _, _ = m.respond(A.peer_id, SwimPacket("ping", 2, SELF.peer_id, known_boot=1_000_000, known_seq=1), 0.4)
    assert ack is not None and any(g.peer_id == SELF.peer_id and g.seq == 2 for g in ack.updates)


def test_stale_claims_and_records_change_nothing() -> None:
    m = machine()
    m.respond(A.peer_id, SwimPacket("sync", updates=(alive(A, 5),)), 0.0)
    m.respond(B.peer_id, SwimPacket("sync", updates=(alive(A, 3), Gossip("suspect", A.peer_id, 1_000_000, 4))), 0.0)
    member = m.get(A.peer_id)
    assert member is not None and member.signed.seq == 5 and m.suspected() == []
    assert m.stats.stale == 2 and m.take_errors() == []


def test_bad_gossip_is_refused_alone_and_the_rest_of_the_packet_counts() -> None:
    m = machine()
    forged = Gossip("alive", A.peer_id, 1_000_000, 1, signed(B, name=A.peer_id))  # B signs A's key
    mismatch = Gossip("alive", A.peer_id, 1_000_000, 9, signed(A, 1))  # claims seq 9, record says 1
    client = alive(B, role="client")
    garbage = Gossip("alive", B.peer_id, 1, 1, b"\x00garbage")
    unknown = Gossip("resurrect", A.peer_id, 1, 1)
    good = alive(A)
    updates = (forged, mismatch, client, garbage, unknown, good)
    _, _, events = m.respond(B.peer_id, SwimPacket("sync", updates=updates), 0.0)
    errors = m.take_errors()
    assert [type(e) for e in errors][:2] == [BadSignature, BadSignature]
    assert isinstance(errors[2], VerificationError) and isinstance(errors[4], MalformedMessage)
    assert len(errors) == 5 and events == [MemberJoined(A.peer_id)] and B.peer_id not in m


def test_requests_that_are_not_requests_are_refused() -> None:
    m = machine()
    with pytest.raises(MalformedMessage):
        m.respond(A.peer_id, SwimPacket("ack", 1, SELF.peer_id), 0.0)
    with pytest.raises(MalformedMessage):
        m.respond(A.peer_id, SwimPacket("ping", 1, B.peer_id), 0.0)  # a ping for someone else
    with pytest.raises(MalformedMessage):
        m.receive(A.peer_id, SwimPacket("ping", 1, SELF.peer_id), 0.0)
    assert decode(encode(SwimPacket("ping", 1, SELF.peer_id)), SwimPacket).kind == "ping"


def test_full_view_is_bounded_and_run_mates_are_never_evicted() -> None:
    m = machine(max_view=8)
    m.set_interest({"run-1"})
    mates = [Identity.generate() for _ in range(3)]
    for ident in mates:
        m.respond(ident.peer_id, SwimPacket("sync", updates=(alive(ident, runs=("run-1",)),)), 0.0)
    for _ in range(60):
        ident = Identity.generate()
        m.respond(ident.peer_id, SwimPacket("sync", updates=(alive(ident),)), 0.0)
    assert len(m) - 1 == 8  # the view (self not counted) never exceeds max_view
    assert all(ident.peer_id in m for ident in mates)
    assert m.stats.evicted > 0


def test_a_full_view_admits_those_who_contact_it_not_those_it_hears_of() -> None:
    m = machine(max_view=4)
    for _ in range(4):
        ident = Identity.generate()
        m.respond(ident.peer_id, SwimPacket("sync", updates=(alive(ident),)), 0.0)
    assert len(m) - 1 == 4
    heard_of, prober = Identity.generate(), Identity.generate()
    m.respond(A.peer_id, SwimPacket("gossip", updates=(alive(heard_of),)), 1.0)  # a third party's news
    assert heard_of.peer_id not in m and m.stats.evicted == 0
    ack, _, _ = m.respond(prober.peer_id, SwimPacket("ping", 3, SELF.peer_id, updates=(alive(prober),)), 2.0)
    assert prober.peer_id in m and len(m) - 1 == 4 and m.stats.evicted == 1
    assert ack is not None and (ack.known_boot, ack.known_seq) == (1_000_000, 1)  # "I hold your record now"


def test_a_ping_carries_our_record_until_the_target_holds_it_and_a_direct_ack_clears_suspicion() -> None:
    m = machine(ping_timeout_s=1.0, probe_timeout_s=3.0)
    m.respond(A.peer_id, SwimPacket("sync", updates=(alive(A),)), 0.0)
    m.settle()  # nothing queued to spread: what a ping carries is its own choice
    effects, _ = m.tick(1.0)
    ping = next(e for e in effects if isinstance(e, Send)).packet
    assert ping.kind == "ping" and any(g.peer_id == SELF.peer_id and g.kind == "alive" for g in ping.updates)
    m.receive(A.peer_id, SwimPacket("ack", ping.probe, A.peer_id, 1_000_000, 1), 1.1)  # A now holds us
    effects, _ = m.tick(3.0)
    ping = next(e for e in effects if isinstance(e, Send)).packet
    assert not any(g.peer_id == SELF.peer_id for g in ping.updates)
    m.tick(5.0)  # ping unanswered, then ping_req unanswered
    effects, _ = m.tick(7.0)
    assert m.get(A.peer_id).suspect_since is not None  # type: ignore[union-attr]
    buddy = [e.packet for e in effects if isinstance(e, Send) and e.packet.kind == "ping"]
    assert buddy  # the suspect is told at once
    m.receive(A.peer_id, SwimPacket("ack", buddy[-1].probe, A.peer_id), 7.2)
    assert m.get(A.peer_id).suspect_since is None  # type: ignore[union-attr]


def _queued(m: Membership) -> list[Gossip]:
    """What the machine piggybacks on its next packet."""
    return m._piggyback()


def test_a_target_record_carried_by_a_ping_req_is_used_not_spread() -> None:
    m = machine()
    m.respond(A.peer_id, SwimPacket("sync", updates=(alive(A),)), 0.0)
    m.settle()
    reply, relay, _ = m.respond(A.peer_id, SwimPacket("ping_req", 4, B.peer_id, updates=(alive(B),)), 1.0)
    assert reply is None and relay is not None and relay.peer == B.peer_id  # we ping B for A
    # B's record came to let us ping it, not as news: nothing about B goes on to the swarm.
    assert not any(g.peer_id == B.peer_id for g in _queued(m))


def test_a_record_resigned_for_age_is_not_gossiped_but_reaches_those_who_ping() -> None:
    m = machine()
    m.respond(A.peer_id, SwimPacket("sync", updates=(alive(A),)), 0.0)
    m.settle()
    m.set_self(signed(SELF, 2), now=1.0, news=False)
    assert _queued(m) == ()
    # A still holds seq 1 and says so in its ping: the ack brings it seq 2.
    ack, _, _ = m.respond(A.peer_id, SwimPacket("ping", 5, SELF.peer_id, known_boot=1_000_000, known_seq=1), 2.0)
    assert ack is not None and ack.updates[0].peer_id == SELF.peer_id and ack.updates[0].seq == 2
    # A claim about the older record needs no new seq, only that the current one travels.
    old_claim = Gossip("suspect", SELF.peer_id, 1_000_000, 1, origin=A.peer_id)
    m.respond(A.peer_id, SwimPacket("gossip", updates=(old_claim,)), 3.0)
    effects, _ = m.tick(3.1)
    assert not any(isinstance(e, Refute) for e in effects)
    assert any(g.peer_id == SELF.peer_id and g.kind == "alive" and g.seq == 2 for g in _queued(m))


def test_suspicions_of_a_peer_outside_the_view_are_passed_on_for_a_few_origins_only() -> None:
    m = machine()
    m.settle()
    passed_on: set[str] = set()
    for _ in range(6):
        claim = Gossip("suspect", B.peer_id, 1_000_000, 1, origin=Identity.generate().peer_id)
        reply, _, _ = m.respond(A.peer_id, SwimPacket("gossip", updates=(claim,)), 0.0)
        assert reply is not None
        passed_on |= {g.origin for g in reply.updates if g.peer_id == B.peer_id}
    assert len(passed_on) == CFG.confirmations


# -- many real machines on an in-memory network ------------------------------------------


async def test_a_swarm_converges_and_a_dead_node_leaves_every_view(autojump_clock: trio.testing.MockClock) -> None:
    net = SwimNet(12, seed=1)
    net.join_all()
    await run_on_trio(net, 20)
    everyone = set(net.nodes)
    assert all(net.view(p) == everyone for p in net.nodes)
    victim = list(net.nodes)[5]
    net.kill(victim)
    t0 = trio.current_time()
    while any(victim in net.view(p) for p in net.live_ids()):
        await run_on_trio(net, 0.5)
        assert trio.current_time() - t0 < detection_bound(12)
    assert all(net.view(p) == everyone - {victim} for p in net.live_ids())
    assert all(e.reason == "dead" for p in net.live_ids() for e in net.nodes[p].left)


async def test_lossy_network_without_deaths_confirms_nobody(autojump_clock: trio.testing.MockClock) -> None:
    """15% of packets lost: hundreds of suspicions, refutations clear them, nobody is declared dead."""
    net = SwimNet(16, seed=2, loss=0.15)
    net.join_all()
    await run_on_trio(net, 120)
    assert all(net.view(p) == set(net.nodes) for p in net.nodes)
    assert sum(n.machine.stats.confirmed for n in net.nodes.values()) == 0
    assert sum(n.machine.stats.suspicions for n in net.nodes.values()) > 0  # the test could have failed


async def test_restarted_node_comes_back_with_a_higher_incarnation(autojump_clock: trio.testing.MockClock) -> None:
    net = SwimNet(8, seed=3)
    net.join_all()
    await run_on_trio(net, 15)
    victim = list(net.nodes)[2]
    net.kill(victim)
    await run_on_trio(net, detection_bound(8))
    assert all(victim not in net.view(p) for p in net.live_ids())
    old_boot = boot_ms(net.nodes[victim].machine.get(victim).record)  # type: ignore[union-attr]
    back = net.restart(victim)
    back.machine.join(net.now)
    net._exchange(victim, Send(next(iter(net.nodes)), (), back.machine.join(net.now), 1.0))
    await run_on_trio(net, 20)
    assert all(victim in net.view(p) for p in net.live_ids())
    assert boot_ms(net.nodes[next(iter(net.nodes))].machine.get(victim).record) > old_boot  # type: ignore[union-attr]


async def test_partition_splits_the_views_and_healing_merges_them(autojump_clock: trio.testing.MockClock) -> None:
    net = SwimNet(10, seed=4)
    net.join_all()
    await run_on_trio(net, 15)
    ids = list(net.nodes)
    left, right = set(ids[:5]), set(ids[5:])
    net.partition(left, right)
    await run_on_trio(net, 2 * detection_bound(5))
    assert all(net.view(p) == left for p in left) and all(net.view(p) == right for p in right)
    net.heal()
    await run_on_trio(net, 4 * CFG.sync_every_s)
    assert all(net.view(p) == set(ids) for p in ids)

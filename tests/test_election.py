"""The election state machine on its own: ranking, leases, rotation, failover, fencing.

Time is a plain float passed in; every node's machine is driven by hand.
"""

from __future__ import annotations

import pytest

from pcp_p2p.core.errors import (
    BadSignature,
    ConfigError,
    ExpiredRecord,
    MalformedMessage,
    NotElected,
    StaleMessage,
    VerificationError,
)
from pcp_p2p.core.identity import Identity
from pcp_p2p.dht.records import record_key, sign_record, verify_record
from pcp_p2p.diloco.protocol.effects import FetchBlob, LookupCommit, Rejected
from pcp_p2p.diloco.protocol.election import (
    LEASE_KIND,
    BecomeShepherd,
    Candidate,
    CommitChecked,
    Election,
    ElectionConfig,
    FollowShepherd,
    Lease,
    LookupLease,
    PublishLease,
    Role,
    StepDown,
    commit_key,
    eligible,
    ranked,
    term_rank,
)
from pcp_p2p.diloco.protocol.messages import CommitRecord, sign
from pcp_p2p.net.reachability import HOLE_PUNCHABLE, PUBLIC
from pcp_p2p.node.record_kinds import RECORD_KINDS
from pcp_p2p.wire import encode

RUN = "run-election-test"
CFG = ElectionConfig(lease_s=10.0, renew_every_s=3.0, grace_s=1.0, min_uptime_s=5.0, rotate_every=2,
                     claim_timeout_s=10.0, settle_s=1.0)
IDS = [Identity(bytes([i + 1]) * 32) for i in range(5)]


def view(ids=IDS, uptime=100.0):
    return [Candidate(i.peer_id, uptime) for i in ids]


def order(term: int, ids=IDS) -> list[Identity]:
    by_id = {i.peer_id: i for i in ids}
    return [by_id[p] for p in ranked(RUN, term, by_id)]


def of(effects, kind):
    return [e for e in effects if isinstance(e, kind)]


def errors(effects):
    return [e.error for e in of(effects, Rejected)]


def make_lease(holder: Identity, term: int, now: float, *, signer: Identity | None = None, **kw) -> Lease:
    fields = dict(run_id=RUN, term=term, holder=holder.peer_id, claimed_at=now, issued=now, expiry=now + 10.0,
                  from_round=0, from_theta_cid="", from_checkpoint_cid="")
    fields.update(kw)
    return sign(Lease(**fields), signer or holder)


def make_commit(shepherd: Identity, term: int, round_: int, theta: str, prev: str = "p") -> CommitRecord:
    return sign(
        CommitRecord(run_id=RUN, term=term, round=round_, attempt=0, prev_theta_cid=prev, theta_cid=theta,
                     checkpoint_cid="ck-" + theta, participants=(), tokens=1, mean_loss=1.0, val_loss=None,
                     shepherd=shepherd.peer_id),
        shepherd,
    )


def started(ident: Identity, now: float = 0.0, ids=IDS) -> Election:
    e = Election(RUN, ident, CFG)
    assert of(e.start(now), LookupLease) and e.role is Role.VACANT
    e.on_members(view(ids), now)
    return e


# --- ranking ---------------------------------------------------------------------------


def test_ranking_is_the_same_everywhere_and_reshuffled_per_term():
    a = ranked(RUN, 3, [i.peer_id for i in IDS])
    b = ranked(RUN, 3, [i.peer_id for i in reversed(IDS)])
    assert a == b
    firsts = {ranked(RUN, t, [i.peer_id for i in IDS])[0] for t in range(40)}
    assert len(firsts) >= 3  # not one peer forever
    assert term_rank(RUN, 0, IDS[0].peer_id) != term_rank("other-run", 0, IDS[0].peer_id)


def test_eligibility_needs_uptime_and_a_compiler():
    cands = [Candidate("a", 10.0), Candidate("b", 1.0), Candidate("c", 50.0, can_compile=False)]
    assert eligible(cands, CFG) == ["a"]


def test_bad_config_is_a_config_error():
    with pytest.raises(ConfigError):
        ElectionConfig(lease_s=5.0, renew_every_s=5.0).validate()


def test_standbys_are_the_failover_ranking_of_the_next_term_the_same_at_every_node():
    """Who builds a hot standby: the first k of the next term's ranking, the holder left out
    (who would claim it if the holder failed now), and every node computes the same list."""
    first = order(0)[0]
    es = [started(i) for i in IDS]
    holder = next(e for e in es if e.peer_id == first.peer_id)
    (pub,) = of(holder.tick(1.0), PublishLease)
    for e in es:
        if e is not holder:
            e.on_lease(pub.lease, 1.1)
    expected = [p for p in ranked(RUN, 1, [i.peer_id for i in IDS]) if p != first.peer_id][:3]
    assert all(e.standbys(3) == expected for e in es)
    assert first.peer_id not in expected and len(expected) == 3
    assert started(IDS[0]).standbys(2) == ranked(RUN, 0, [i.peer_id for i in IDS])[:2]  # no lease yet: term 0


# --- claiming, following, renewing -------------------------------------------------------


def test_first_ranked_claims_after_settling_and_the_others_follow():
    first, second = order(0)[:2]
    e1, e2 = started(first), started(second)
    assert e1.tick(0.5) == []  # still settling: a running run's lease may arrive
    effects = e1.tick(1.0)
    (pub,) = of(effects, PublishLease)
    assert of(effects, BecomeShepherd) == [BecomeShepherd(0, None, 0, 2)]
    assert pub.lease.holder == first.peer_id and pub.lease.term == 0 and not pub.renewal
    assert e2.tick(1.0) == []  # second-ranked waits
    effects = e2.on_lease(encode(pub.lease), 1.1)
    assert effects == [FollowShepherd(0, first.peer_id)]
    assert e2.holder == first.peer_id and e2.current_term == 0
    # renewal every renew_every_s keeps claimed_at and moves the expiry
    (ren,) = of(e1.tick(4.0), PublishLease)
    assert ren.renewal and ren.lease.claimed_at == 1.0 and ren.lease.expiry == 14.0
    assert e2.on_lease(ren.lease, 4.1) == [] and e2.lease == ren.lease
    st = e2.status(5.0)
    assert st["term"] == 0 and st["lease_expires_s"] == pytest.approx(9.0)
    assert st["shepherd_history"] == [{"term": 0, "holder": first.peer_id, "rounds_served": 0, "ended": None}]


def test_renewals_go_into_the_dht_only_when_its_copy_runs_low_and_it_never_lapses():
    """Every renewal goes to the members; the DHT gets the claim, then a renewal only when the copy
    there would lapse before the renewal after next: half of them with a 6 s lease renewed every
    2 s, and at every moment the copy a newcomer would look up is still valid."""
    cfg = ElectionConfig(lease_s=6.0, renew_every_s=2.0, grace_s=1.0, min_uptime_s=5.0, rotate_every=0,
                         claim_timeout_s=10.0, settle_s=1.0)
    first = order(0)[0]
    e = Election(RUN, first, cfg)
    e.start(0.0)
    e.on_members(view(), 0.0)
    (claim,) = of(e.tick(1.0), PublishLease)
    assert claim.store and not claim.renewal
    stored, stores, renewals = claim.lease, 0, 0
    now = 1.0
    while now < 60.0:
        now = round(now + 0.25, 2)  # ticks a quarter second apart, as the runtime's
        for pub in of(e.tick(now), PublishLease):
            renewals += 1
            assert pub.renewal
            if pub.store:
                stores += 1
                stored = pub.lease
        assert stored.expiry > now + 1.0, f"the DHT's copy lapses at {stored.expiry}, now {now}"
    assert renewals == 29 and stores == 14  # every other renewal


def test_young_or_non_compiling_nodes_are_never_elected():
    first = order(0)[0]
    e = Election(RUN, first, CFG)
    e.start(0.0)
    e.on_members([Candidate(first.peer_id, 1.0), *view(IDS[1:])], 2.0)  # first is too young
    assert not of(e.tick(2.0), PublishLease)


# --- bad leases ---------------------------------------------------------------------------


def test_forged_lease_is_refused_and_changes_nothing():
    first, second = order(0)[:2]
    e = started(second)
    forged = make_lease(first, 0, 1.0, signer=second)  # claims to be first's, signed by second
    assert isinstance(errors(e.on_lease(forged, 1.0))[0], BadSignature)
    assert e.lease is None and e.role is Role.VACANT


def test_garbage_lease_bytes_are_a_protocol_error():
    e = started(IDS[0])
    assert isinstance(errors(e.on_lease(b"\x93not a lease", 1.0))[0], MalformedMessage)
    assert e.lease is None


def test_lease_for_another_run_or_with_inverted_times_is_refused():
    first = order(0)[0]
    e = started(order(0)[1])
    assert isinstance(errors(e.on_lease(make_lease(first, 0, 1.0, run_id="x"), 1.0))[0], VerificationError)
    bad = make_lease(first, 0, 1.0, issued=5.0, claimed_at=6.0)
    assert isinstance(errors(e.on_lease(bad, 1.0))[0], VerificationError)


def test_lease_from_a_peer_that_does_not_rank_first_is_refused():
    first, second, third = order(0)[:3]
    e = started(third)
    assert isinstance(errors(e.on_lease(make_lease(second, 0, 1.0), 1.0))[0], NotElected)
    outsider = Identity(b"\x77" * 32)
    assert isinstance(errors(e.on_lease(make_lease(outsider, 0, 1.0), 1.0))[0], NotElected)
    assert e.on_lease(make_lease(first, 0, 1.0), 1.0) == [FollowShepherd(0, first.peer_id)]


def test_replayed_old_lease_is_stale_and_an_expired_one_is_refused():
    e = started(IDS[4])
    old = make_lease(order(0)[0], 0, 1.0)
    assert e.on_lease(old, 1.0)
    h1 = order(1)[0]
    # term 0 lapses (its holder is gone from the view), term 1 is claimed
    e.on_members(view([i for i in IDS if i.peer_id != old.holder]), 12.0)
    new = make_lease(h1, 1, 12.0) if h1.peer_id != old.holder else make_lease(order(1)[1], 1, 12.0)
    assert of(e.on_lease(new, 12.5), FollowShepherd)
    assert isinstance(errors(e.on_lease(old, 12.6))[0], StaleMessage)  # replay of term 0
    assert isinstance(errors(e.on_lease(make_lease(h1, 2, 1.0), 12.6))[0], ExpiredRecord)
    assert e.current_term == 1


def test_lease_record_kind_in_the_dht():
    first = order(0)[0]
    lease = make_lease(first, 4, 100.0)
    rec = sign_record(first, LEASE_KIND, RUN, lease, ttl_s=10.0, seq=lease.term, now=100.0)
    got = verify_record(encode(rec), key=record_key(LEASE_KIND, RUN), now=101.0, kinds=RECORD_KINDS)
    assert got.payload == lease and got.record.seq == 4
    # stored by someone other than the holder: refused
    other = order(0)[1]
    rec2 = sign_record(other, LEASE_KIND, RUN, lease, ttl_s=10.0, seq=4, now=100.0)
    with pytest.raises(BadSignature):
        verify_record(encode(rec2), now=101.0, kinds=RECORD_KINDS)


# --- failover, skipping, rotation ------------------------------------------------------------


def test_failover_next_ranked_live_candidate_takes_the_next_term_from_the_last_commit():
    h0 = order(0)[0]
    rest = [i for i in IDS if i is not h0]
    es = {i.peer_id: started(i) for i in rest}
    lease0 = make_lease(h0, 0, 1.0)
    c = make_commit(h0, 0, 0, "theta1")
    for e in es.values():
        assert e.on_lease(lease0, 1.0) == [FollowShepherd(0, h0.peer_id)]
        assert e.on_commit(c, 5.0) == [CommitChecked(c)]
    # h0 dies: no renewal. Nobody moves before expiry + grace ...
    for e in es.values():
        assert e.tick(11.5) == [] and e.holder == h0.peer_id
    # ... then exactly one claims term 1 (h0 still in the lagging membership view, but left out)
    vacancy = {p: e.tick(11.0 + 1.0) for p, e in es.items()}
    for eff in vacancy.values():  # the term is over: look up the DHT's latest commit before claiming
        assert of(eff, LookupCommit) and of(eff, LookupLease) and not of(eff, PublishLease)
    claims = {p: e.on_lookups_done(12.1) for p, e in es.items()}
    claimers = [p for p, eff in claims.items() if of(eff, PublishLease)]
    expected = ranked(RUN, 1, [i.peer_id for i in rest])[0]
    assert claimers == [expected]
    (pub,) = of(claims[expected], PublishLease)
    assert (pub.lease.term, pub.lease.from_round, pub.lease.from_theta_cid) == (1, 1, "theta1")
    assert of(claims[expected], BecomeShepherd) == [BecomeShepherd(1, "ck-theta1", 1, 3)]
    for p, e in es.items():
        if p != expected:
            assert e.on_lease(pub.lease, 12.2) == [FollowShepherd(1, expected, 1, "theta1")]
    hist = es[expected].status(12.2)["shepherd_history"]
    assert [(h["term"], h["rounds_served"], h["ended"]) for h in hist] == [(0, 1, "failover"), (1, 0, None)]


def test_an_unclaimed_term_is_skipped_after_claim_timeout():
    ids = IDS
    h0 = order(0)[0]
    lease0 = make_lease(h0, 0, 1.0)
    hung = ranked(RUN, 1, [i.peer_id for i in ids if i is not h0])[0]  # ranks first for term 1, never claims
    others = [i for i in ids if i.peer_id not in (h0.peer_id, hung)]
    es = {i.peer_id: started(i) for i in others}
    for e in es.values():
        e.on_lease(lease0, 1.0)
        assert not of(e.tick(12.0), PublishLease)  # term 1 belongs to the hung peer
    # term 1 stays vacant for claim_timeout_s; then term 2 is up, with a fresh ranking
    t = 12.0 + CFG.claim_timeout_s
    claims = {p: e.tick(t) for p, e in es.items()}
    claimers = [(p, of(eff, PublishLease)[0].lease.term) for p, eff in claims.items() if of(eff, PublishLease)]
    want = ranked(RUN, 2, [i.peer_id for i in ids if i is not h0])[0]
    if want == hung:  # the hung one may rank first again: then term 3 after another timeout
        assert claimers == []
    else:
        assert claimers == [(want, 2)]


def test_rotation_after_rotate_every_rounds_hands_over_to_term_k_plus_1():
    h0 = order(0)[0]
    e_h = started(h0)
    effects = e_h.tick(1.0)
    assert of(effects, BecomeShepherd)[0].end_round == 2
    others = {i.peer_id: started(i) for i in IDS if i is not h0}
    lease0 = e_h.lease
    for e in others.values():
        e.on_lease(lease0, 1.1)
    c0, c1 = make_commit(h0, 0, 0, "t1"), make_commit(h0, 0, 1, "t2", prev="t1")
    assert e_h.on_commit(c0, 2.0) == [CommitChecked(c0)]
    out = e_h.on_commit(c1, 3.0)
    assert StepDown(0, "rotation") in out and e_h.role in (Role.VACANT, Role.HOLDER)
    all_es = {h0.peer_id: e_h, **others}
    for p, e in all_es.items():
        if p != h0.peer_id:
            assert of(e.on_commit(c1, 3.0), LookupCommit)
    # nobody claims while the lookups are out; without an answer, settle_s is the limit
    assert not any(of(e.tick(3.5), PublishLease) for e in all_es.values())
    claims = {p: e.tick(3.0 + CFG.settle_s) for p, e in all_es.items()}
    h1 = ranked(RUN, 1, [i.peer_id for i in IDS])[0]  # nobody is left out after a rotation
    claimed = {p: of(eff, PublishLease)[0].lease for p, eff in claims.items() if of(eff, PublishLease)}
    assert list(claimed) == [h1] and claimed[h1].from_round == 2 and claimed[h1].from_theta_cid == "t2"
    assert e_h.status(3.0)["shepherd_history"][0] == {"term": 0, "holder": h0.peer_id, "rounds_served": 2,
                                                      "ended": "rotation"}


# --- fencing, deposing, fork choice ------------------------------------------------------------


def test_deposed_holder_steps_down_and_its_commits_are_fenced():
    h0 = order(0)[0]
    e_old = started(h0)
    assert of(e_old.tick(1.0), PublishLease) and e_old.role is Role.HOLDER
    lease0 = e_old.lease
    # h0 hangs; the others see its lease lapse and the next-ranked claims term 1
    h1_id = ranked(RUN, 1, [i.peer_id for i in IDS if i is not h0])[0]
    h1 = next(i for i in IDS if i.peer_id == h1_id)
    watcher = started(next(i for i in IDS if i not in (h0, h1)))
    assert watcher.on_lease(lease0, 1.1) == [FollowShepherd(0, h0.peer_id)]
    lease1 = make_lease(h1, 1, 12.5)
    assert watcher.on_lease(lease1, 12.6) == [FollowShepherd(1, h1_id)]
    # h0 wakes up and commits the round it was collecting: refused, and nothing changes
    late = make_commit(h0, 0, 3, "zombie-theta")
    assert isinstance(errors(watcher.on_commit(late, 13.0))[0], StaleMessage)
    assert watcher.best_commit is None
    # h0 itself learns of term 1 and steps down
    out = e_old.on_lease(lease1, 13.0)
    assert out == [StepDown(0, "deposed"), FollowShepherd(1, h1_id)]
    assert e_old.role is Role.FOLLOWER and e_old.current_term == 1 and e_old.holder == h1_id
    assert e_old.status(13.0)["shepherd_history"][0]["ended"] == "failover"
    # a commit for term 1 signed by someone who does not hold it
    impostor = next(i for i in IDS if i.peer_id != h1_id)
    assert isinstance(errors(e_old.on_commit(make_commit(impostor, 1, 0, "x"), 13.1))[0], BadSignature)


def test_a_holder_that_hung_past_its_expiry_steps_down_on_its_own():
    h0 = order(0)[0]
    e = started(h0)
    e.tick(1.0)
    out = e.tick(11.0)  # no tick between 1 and 11: the renewals never went out
    assert StepDown(0, "lapsed") in out and not any(
        isinstance(x, PublishLease) and x.lease.term == 0 for x in out
    )


def test_same_term_claimed_twice_the_better_ranked_holder_stands():
    a, b = order(5)[:2]
    e = started(order(5)[2])
    e.on_members(view([i for i in IDS if i is not a]), 1.0)  # b's side of a partition: a unseen
    la = make_lease(a, 5, 1.0, claimed_at=-50.0)
    lb = make_lease(b, 5, 1.0, claimed_at=-50.0)
    assert e.on_lease(lb, 1.0) == [FollowShepherd(5, b.peer_id)]
    e.on_members(view(), 1.05)  # healed: a is in view, and outranks b for the term both claimed
    assert FollowShepherd(5, a.peer_id) in e.on_lease(la, 1.1)
    assert isinstance(errors(e.on_lease(lb, 1.2))[0], NotElected)
    assert e.holder == a.peer_id


def test_a_claim_made_before_the_public_nodes_were_known_gives_way_to_theirs():
    """A cone home that joined before its peers' records said they are public saw no public
    candidate, ranked first among everyone, and claimed term 0; a public node claimed it too.
    Once the home's view holds the public nodes it is itself no longer eligible: its claim must
    not keep out the eligible one, whatever their ranks (tests/test_netlab_training.py,
    2026-11-24: the home held its term alone, refused every round, and never trained)."""
    home, pub = order(0)[:2]  # the home outranks the public node for term 0 ...
    e = Election(RUN, home, CFG)
    e.start(0.0)
    e.on_members([Candidate(home.peer_id, 100.0, reachability=HOLE_PUNCHABLE), Candidate(pub.peer_id, 100.0)], 0.0)
    assert of(e.tick(1.0), PublishLease) and e.holder == home.peer_id  # ... and claims it, seeing no public node
    e.on_members([Candidate(home.peer_id, 100.0, reachability=HOLE_PUNCHABLE),
                  Candidate(pub.peer_id, 100.0, reachability=PUBLIC)], 1.5)  # the public node's record arrives
    effects = e.on_lease(make_lease(pub, 0, 2.0, claimed_at=1.2), 2.0)
    assert not errors(effects) and FollowShepherd(0, pub.peer_id) in effects
    assert of(effects, StepDown) and e.holder == pub.peer_id
    # An eligible incumbent still stands against a worse-ranked claim of its term.
    f = started(order(0)[2])
    assert FollowShepherd(0, home.peer_id) in f.on_lease(make_lease(home, 0, 1.0), 1.0)
    assert isinstance(errors(f.on_lease(make_lease(pub, 0, 1.2), 1.2))[0], NotElected)


def test_a_node_restarted_while_the_dht_is_silent_claims_past_the_term_it_last_knew():
    """Its lookups found nothing (churn), but its own disk says term 4 was held: it never claims a
    term at or below that one (term 0 would re-train the run from θ_0 beside the real chain)."""
    term = next(t for t in range(5, 40) if order(t)[0] == IDS[0])  # a term this node ranks first for, past the anchor
    e = Election(RUN, IDS[0], CFG)
    e.restore(make_lease(IDS[1], 4, 0.0))
    e.start(100.0)
    e.on_members(view(), 100.0)
    assert e.term_to_claim(100.0) == 5  # (term 0 before)
    effects = e.on_lookups_done(100.0 + (term - 5) * CFG.claim_timeout_s)  # skipped up to `term`
    (pub,) = of(effects, PublishLease)
    assert pub.lease.term == term


def test_same_term_claimed_a_minute_apart_the_earlier_claim_stands():
    """After a heal, a node that had not heard of the other side's term claims the same term
    number: it must not take the term over (the run would fork inside one term), whatever
    its rank; and a node that followed the late claim follows the earlier one once it hears it."""
    a, b = order(5)[:2]  # a outranks b for term 5
    e = started(order(5)[2])
    e.on_members(view([i for i in IDS if i is not a]), 1.0)
    lb = make_lease(b, 5, 60.0, claimed_at=1.0)  # b's side claimed term 5 at 1.0 and has led since
    assert e.on_lease(lb, 60.0) == [FollowShepherd(5, b.peer_id)]
    e.on_members(view(), 60.5)  # healed
    la = make_lease(a, 5, 61.0, claimed_at=61.0)  # a late claim of the same term
    assert isinstance(errors(e.on_lease(la, 61.0))[0], NotElected)
    assert e.holder == b.peer_id
    # A node that took a's late claim first moves to b's once it hears of it.
    f = started(order(5)[3])
    assert FollowShepherd(5, a.peer_id) in f.on_lease(la, 61.0)
    assert FollowShepherd(5, b.peer_id) in f.on_lease(make_lease(b, 5, 61.5, claimed_at=1.0), 61.5)
    assert f.holder == b.peer_id


def test_of_two_claims_of_one_term_the_one_that_led_rounds_stands_on_both_sides():
    """A partition: a (better-ranked) and b claimed term 0 within the fresh window, one on each
    side; b's side committed rounds. After the heal b's renewals say so (``committed_round``),
    and every node keeps or moves to b's claim: b's followers refuse a's, a's followers and a
    itself take b's (before, a's rank won, a refused b's commits and b's side refused a's
    announcements: the run stopped)."""
    a, b = order(0)[:2]  # a outranks b for term 0
    without_a, without_b = [i for i in IDS if i is not a], [i for i in IDS if i is not b]
    # a claims on its side of the partition
    ea = started(a)
    ea.on_members(view(without_b), 0.5)
    (claim,) = of(ea.tick(1.0), PublishLease)
    # b's follower, on the other side: b claimed there, committed, and its renewal says round 1
    fb = started(order(0)[2])
    fb.on_members(view(without_a), 1.0)
    assert fb.on_lease(make_lease(b, 0, 1.0, claimed_at=0.9), 1.0) == [FollowShepherd(0, b.peer_id)]
    lb = make_lease(b, 0, 40.0, claimed_at=0.9, committed_round=1)
    assert fb.on_lease(lb, 40.0) == []
    fb.on_members(view(), 40.5)  # healed
    for t in range(4, 41, 3):  # a renews on its side (b's side formed no quorum with it: no round)
        ea.tick(float(t))
    la = ea.lease
    assert la is not None and la.issued == 40.0 and la.committed_round == -1
    assert isinstance(errors(fb.on_lease(la, 41.0))[0], NotElected)  # better-ranked, but led no round
    assert fb.holder == b.peer_id
    # a's follower moves to b's claim once it hears it
    fa = started(order(0)[3])
    fa.on_members(view(without_b), 1.0)
    assert FollowShepherd(0, a.peer_id) in fa.on_lease(claim.lease, 1.1)
    assert fa.on_lease(la, 40.1) == []  # a's renewal
    fa.on_members(view(), 40.5)
    assert FollowShepherd(0, b.peer_id) in fa.on_lease(lb, 40.6)
    assert fa.holder == b.peer_id
    # and so does a itself: it steps down
    ea.on_members(view(), 40.5)
    effects = ea.on_lease(lb, 40.6)
    assert of(effects, StepDown) and FollowShepherd(0, b.peer_id) in effects and ea.holder == b.peer_id


def test_a_holders_renewal_says_the_last_round_it_committed_in_its_term_and_a_bad_one_is_refused():
    first = order(0)[0]
    e = started(first)
    (claim,) = of(e.tick(1.0), PublishLease)
    assert claim.lease.committed_round == -1
    e.on_commit(make_commit(first, 0, 0, "t0"), 2.0)
    (ren,) = of(e.tick(4.0), PublishLease)
    assert ren.renewal and ren.lease.committed_round == 0
    f = started(order(0)[1])
    f.on_lease(claim.lease, 1.1)
    bad = make_lease(first, 0, 4.5, claimed_at=1.0, from_round=2, committed_round=1)  # before the term's start
    assert isinstance(errors(f.on_lease(bad, 4.5))[0], VerificationError)


def test_fork_choice_orders_by_term_then_round_then_theta():
    x = IDS[0]
    assert commit_key(make_commit(x, 2, 1, "a")) > commit_key(make_commit(x, 1, 9, "z"))
    assert commit_key(make_commit(x, 2, 3, "a")) > commit_key(make_commit(x, 2, 2, "z"))
    assert commit_key(make_commit(x, 2, 3, "b")) > commit_key(make_commit(x, 2, 3, "a"))


def test_status_is_json_ready_before_any_lease():
    e = Election(RUN, IDS[0], CFG)
    assert e.status(0.0) == {"term": None, "holder": None, "role": "vacant", "lease_expires_s": None,
                             "shepherd_history": []}


# --- the worker's side of fencing and fork choice ----------------------------------------------


def _worker(shepherds: dict[int, str]):
    from pcp_p2p.diloco.protocol.spec import parse_spec
    from pcp_p2p.diloco.protocol.worker import Worker

    spec = parse_spec("[round]\nrounds = 4\nmin_quorum = 1\n")
    return Worker(spec=spec, run_id=RUN, identity=IDS[4], shepherds=shepherds, target="cpu", tokens_per_s=1.0)


def test_worker_takes_a_higher_terms_commit_for_a_round_it_already_has():
    a, b = IDS[0], IDS[1]
    w = _worker({0: a.peer_id})
    assert not errors(w.on_commit(make_commit(a, 0, 2, "side-a"), 1.0))
    w.set_shepherd(1, b.peer_id, 2.0)
    out = w.on_commit(make_commit(b, 1, 1, "side-b"), 3.0)  # lower round, higher term: fork choice
    assert not errors(out) and w.last_commit.theta_cid == "side-b"
    assert any(isinstance(e, FetchBlob) and e.cid == "side-b" for e in out)
    # and the losing term's commits are refused from now on
    assert isinstance(errors(w.on_commit(make_commit(a, 0, 3, "side-a2"), 4.0))[0], StaleMessage)


def test_worker_accepts_the_commit_its_new_term_continues_from_and_no_other_old_one():
    a, b = IDS[0], IDS[1]
    w = _worker({0: a.peer_id})
    assert not errors(w.on_commit(make_commit(a, 0, 0, "t1"), 1.0))
    w.set_shepherd(1, b.peer_id, 2.0, base=(2, "t2"))  # term 1 continues after round 1 (θ t2)
    assert isinstance(errors(w.on_commit(make_commit(a, 0, 1, "other"), 3.0))[0], StaleMessage)
    assert not errors(w.on_commit(make_commit(a, 0, 1, "t2", prev="t1"), 3.0))
    assert w.last_commit.theta_cid == "t2" and w.term == 1


# --- how a term ended, as status shows it: rotation vs failover ------------------------------


def _following_term0(now: float = 1.0):  # type: ignore[no-untyped-def]
    h0 = order(0)[0]
    watcher = started(next(i for i in IDS if i is not h0))
    lease0 = make_lease(h0, 0, now)
    assert watcher.on_lease(lease0, now) == [FollowShepherd(0, h0.peer_id)]
    return h0, watcher


def test_a_rotation_seen_as_the_next_lease_before_the_last_commit_is_labelled_rotation():
    h0, watcher = _following_term0()
    watcher.on_commit(make_commit(h0, 0, 0, "t1"), 2.0)
    # The next holder's lease (it starts at round 2 = the end of term 0) overtakes h0's last commit.
    h1 = next(i for i in IDS if i.peer_id == ranked(RUN, 1, [i.peer_id for i in IDS])[0])
    lease1 = make_lease(h1, 1, 3.0, from_round=2, from_theta_cid="t2")
    watcher.on_lease(lease1, 3.0)
    hist = watcher.status(3.0)["shepherd_history"]
    assert [(h["term"], h["ended"]) for h in hist] == [(0, "rotation"), (1, None)]


def test_a_term_taken_for_failed_over_is_relabelled_once_its_last_commit_arrives():
    h0, watcher = _following_term0()
    watcher.on_commit(make_commit(h0, 0, 0, "t1"), 2.0)
    watcher.tick(11.0 + CFG.grace_s)  # h0's last commit is late: the lease lapses first
    assert watcher.status(12.0)["shepherd_history"][0]["ended"] == "failover"
    watcher.on_commit(make_commit(h0, 0, 1, "t2", prev="t1"), 12.1)  # it served both its rounds after all
    assert watcher.status(12.1)["shepherd_history"][0]["ended"] == "rotation"


def test_a_holder_that_vanished_mid_term_is_a_failover_and_one_that_came_back_is_current():
    h0, watcher = _following_term0()
    watcher.tick(11.0 + CFG.grace_s)
    assert watcher.status(12.0)["shepherd_history"][0]["ended"] == "failover"
    # h0 renews before anyone claimed term 1: its term goes on
    watcher.on_lease(make_lease(h0, 0, 1.0, issued=12.5, expiry=22.5), 12.5)
    assert watcher.status(12.5)["shepherd_history"][0]["ended"] is None
    # a term-1 lease that starts mid-term (round 1 < 2): h0 vanished, a failover
    h1 = next(i for i in IDS if i is not h0)
    watcher.on_lease(make_lease(h1, 1, 30.0, from_round=1), 30.0)
    assert watcher.status(30.0)["shepherd_history"][0]["ended"] == "failover"

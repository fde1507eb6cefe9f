"""The authority chain of leases and commits: what a stranger (or an eligible member out of
turn) can no longer do to a run, and the neighbours of each attack.

Each test drives one node's ``Election`` by hand with plain float times, as
``test_election.py`` does; the same rules are exercised over real libp2p in
``test_strangers_swarm.py``.
"""

from __future__ import annotations

import dataclasses

import pytest

from pcp_p2p.core.errors import (
    BadSignature,
    ExpiredRecord,
    HeldBack,
    NotElected,
    StaleMessage,
    VerificationError,
)
from pcp_p2p.core.identity import Identity
from pcp_p2p.dht.records import sign_record
from pcp_p2p.dht.validator import PcpRecordValidator
from pcp_p2p.diloco.protocol.election import (
    LEASE_KIND,
    Candidate,
    CommitChecked,
    Election,
    ElectionConfig,
    FollowShepherd,
    Lease,
    PublishLease,
    Role,
    StepDown,
    ranked,
)
from pcp_p2p.diloco.protocol.messages import CommitRecord, sign
from pcp_p2p.node.record_kinds import RECORD_KINDS
from pcp_p2p.wire import encode

RUN = "run-authority-test"
CFG = ElectionConfig(lease_s=10.0, renew_every_s=3.0, grace_s=1.0, min_uptime_s=5.0, rotate_every=0,
                     claim_timeout_s=10.0, settle_s=1.0, max_skew_s=2.0, max_claim_age_s=600.0)
MEMBERS = [Identity(bytes([i + 1]) * 32) for i in range(4)]
STRANGER = Identity(b"\x77" * 32)


def view(ids=MEMBERS, uptime: float = 100.0) -> list[Candidate]:
    return [Candidate(i.peer_id, uptime) for i in ids]


def ranked_ids(term: int, ids=MEMBERS) -> list[Identity]:
    by_id = {i.peer_id: i for i in ids}
    return [by_id[p] for p in ranked(RUN, term, by_id)]


def lease(holder: Identity, term: int, now: float, **kw: object) -> Lease:
    fields: dict[str, object] = dict(run_id=RUN, term=term, holder=holder.peer_id, claimed_at=now, issued=now,
                                     expiry=now + CFG.lease_s, from_round=0, from_theta_cid="",
                                     from_checkpoint_cid="")
    fields.update(kw)
    return sign(Lease(**fields), holder)  # type: ignore[arg-type]


def commit(shepherd: Identity, term: int, round_: int, theta: str = "theta") -> CommitRecord:
    return sign(CommitRecord(run_id=RUN, term=term, round=round_, attempt=0, prev_theta_cid="p", theta_cid=theta,
                             checkpoint_cid="ck-" + theta, participants=(), tokens=1, mean_loss=1.0,
                             val_loss=0.01, shepherd=shepherd.peer_id), shepherd)


def errors(effects: list) -> list:
    from pcp_p2p.diloco.protocol.effects import Rejected

    return [e.error for e in effects if isinstance(e, Rejected)]


def follower(now: float = 0.0, config: ElectionConfig = CFG) -> tuple[Election, Identity]:
    """A member following term 0 of the first-ranked member; it ranks first for neither term 0
    nor term 1, so the tests' claims come from others."""
    holder0 = ranked_ids(0)[0]
    nxt1 = ranked_ids(1, [i for i in MEMBERS if i is not holder0])[0]
    me = next(i for i in MEMBERS if i not in (holder0, nxt1))
    e = Election(RUN, me, config)
    e.start(now)
    e.on_members(view(), now)
    holder = ranked_ids(0)[0]
    assert e.on_lease(lease(holder, 0, now + 0.5), now + 0.5) == [FollowShepherd(0, holder.peer_id)]
    return e, holder


# --- seize: a lease from outside the chain -----------------------------------------------------


def test_a_strangers_backdated_long_lease_is_refused_and_nothing_changes() -> None:
    """The seize attack: claimed far in the past, expiry far away, a fresh key outside the run."""
    e, holder = follower()
    forged = lease(STRANGER, 1, 1.0, claimed_at=-1e6, issued=0.9, expiry=1e9)
    assert isinstance(errors(e.on_lease(forged, 1.0))[0], VerificationError)  # expiry beyond one lease
    sane_times = lease(STRANGER, 1, 1.0, claimed_at=-100.0)
    (err,) = errors(e.on_lease(sane_times, 1.0))
    assert isinstance(err, HeldBack) and "not an eligible candidate" in str(err)
    assert e.holder == holder.peer_id and e.current_term == 0
    # even once the honest lease has lapsed, a stranger's lease is never followed
    out = e.tick(12.0)
    assert not [x for x in out if isinstance(x, FollowShepherd) and x.peer == STRANGER.peer_id]


@pytest.mark.parametrize(
    "kw, error",
    [
        (dict(issued=9.0, claimed_at=9.0, expiry=19.0), ExpiredRecord),  # issued 8 s in the future
        (dict(claimed_at=-700.0), ExpiredRecord),  # claimed longer ago than any term lasts
        (dict(expiry=1.0 + 3 * CFG.lease_s), VerificationError),  # valid for three leases
        (dict(claimed_at=2.0, issued=1.0), VerificationError),  # claimed after issue
    ],
)
def test_lease_times_outside_the_stated_skew_are_refused(kw: dict, error: type) -> None:
    e, _ = follower()
    nxt = ranked_ids(1)[0]
    (err,) = errors(e.on_lease(lease(nxt, 1, 1.0, **kw), 1.0))
    assert isinstance(err, error) and not isinstance(err, HeldBack)
    assert e.current_term == 0


def test_a_forged_signature_or_another_runs_lease_is_refused_outright() -> None:
    e, holder = follower()
    wrong_signer = sign(dataclasses.replace(lease(holder, 1, 1.0), signature=b""), STRANGER)
    assert isinstance(errors(e.on_lease(wrong_signer, 1.0))[0], BadSignature)
    other_run = sign(Lease(run_id="another-run", term=1, holder=holder.peer_id, claimed_at=1.0, issued=1.0,
                           expiry=11.0, from_round=0, from_theta_cid="", from_checkpoint_cid=""), holder)
    assert isinstance(errors(e.on_lease(other_run, 1.0))[0], VerificationError)
    assert e.held_leases == {}


def test_a_renewal_may_not_move_the_claim_time() -> None:
    e, holder = follower()
    moved = lease(holder, 0, 3.0, claimed_at=-50.0)
    assert isinstance(errors(e.on_lease(moved, 3.0))[0], VerificationError)


def test_an_eligible_member_out_of_turn_is_held_not_followed() -> None:
    """A fresh claim of the next term by a member that does not rank first."""
    e, holder = follower()
    e.tick(12.0)  # term 0 lapsed; vacant
    second = [i for i in ranked_ids(1) if i.peer_id not in (holder.peer_id, e.peer_id)][1]
    (err,) = errors(e.on_lease(lease(second, 1, 12.0), 12.0))
    assert isinstance(err, HeldBack) and "does not rank first" in str(err)
    assert e.role is Role.VACANT or e.holder != second.peer_id


def test_a_term_cannot_leap_ahead_of_the_chain() -> None:
    e, _ = follower()
    # while term 0 lives, only a fresh claim of term 1 may replace it
    jump = ranked_ids(7)[0]
    (err,) = errors(e.on_lease(lease(jump, 7, 2.0), 2.0))
    assert isinstance(err, HeldBack) and e.current_term == 0
    # vacant: at most the terms skipped by claim timeouts since
    e2, _ = follower()
    e2.tick(12.0)
    far = ranked_ids(50)[0]
    (err2,) = errors(e2.on_lease(lease(far, 50, 12.5), 12.5))
    assert isinstance(err2, HeldBack) and "leaps ahead" in str(err2)


def test_a_node_restarted_mid_term_accepts_the_established_term_despite_younger_members() -> None:
    """Members that joined after the claim cannot outrank the holder (uptime at the claim)."""
    term = 3
    old = MEMBERS[:2]
    young = MEMBERS[2:]
    holder = ranked_ids(term, old)[0]
    fresh = Election(RUN, young[-1], CFG)
    fresh.start(500.0)
    fresh.on_members(view(old, uptime=400.0) + view(young, uptime=6.0), 500.0)
    established = lease(holder, term, 499.0, claimed_at=300.0)
    assert fresh.on_lease(established, 500.0) == [FollowShepherd(term, holder.peer_id)]


# --- stall: a commit ahead of the chain ---------------------------------------------------------


def test_a_far_future_commit_without_a_lease_is_held_and_moves_nothing() -> None:
    e, holder = follower()
    honest = commit(holder, 0, 0, "honest")
    assert e.on_commit(honest, 2.0) == [CommitChecked(honest)]
    forged = commit(STRANGER, 10**6, 39, "junk")  # "final" and far ahead
    (err,) = errors(e.on_commit(forged, 2.1))
    assert isinstance(err, HeldBack)
    assert e.best_commit == honest
    with pytest.raises(HeldBack):  # what the runtime asks before fetching anything it names
        e.check_commit(forged)
    # renewals go on, and honest commits are still taken
    assert e.on_lease(lease(holder, 0, 3.0, claimed_at=0.5), 3.0) == []
    nxt = commit(holder, 0, 1, "honest2")
    assert e.on_commit(nxt, 3.1) == [CommitChecked(nxt)] and e.best_commit == nxt


def test_a_commit_for_the_current_term_by_anyone_but_its_holder_is_refused() -> None:
    e, holder = follower()
    other = next(i for i in MEMBERS if i is not holder)
    (err,) = errors(e.on_commit(commit(other, 0, 5, "x"), 1.0))
    assert isinstance(err, BadSignature) and e.best_commit is None


def test_a_held_commit_is_released_once_its_lease_is_accepted() -> None:
    e, holder = follower()
    e.tick(12.0)
    nxt = next(i for i in ranked_ids(1) if i.peer_id != holder.peer_id)
    early = commit(nxt, 1, 0, "term1")
    assert isinstance(errors(e.on_commit(early, 12.1))[0], HeldBack)
    out = e.on_lease(lease(nxt, 1, 12.2), 12.2)
    assert FollowShepherd(1, nxt.peer_id) in out and CommitChecked(early) in out
    assert e.best_commit == early


def test_replays_from_an_older_term_or_another_run_are_refused() -> None:
    e, holder = follower()
    e.tick(12.0)
    nxt = next(i for i in ranked_ids(1) if i.peer_id != holder.peer_id)
    e.on_lease(lease(nxt, 1, 12.2), 12.2)
    assert isinstance(errors(e.on_commit(commit(holder, 0, 3, "late"), 13.0))[0], StaleMessage)
    other = sign(dataclasses.replace(commit(nxt, 1, 0), run_id="another-run", signature=b""), nxt)
    assert isinstance(errors(e.on_commit(other, 13.0))[0], VerificationError)
    assert isinstance(errors(e.on_lease(lease(holder, 0, 0.5), 13.0))[0], (StaleMessage, ExpiredRecord))


# --- many identities at once --------------------------------------------------------------------


def test_many_strangers_hold_a_bounded_amount_and_change_nothing() -> None:
    e, holder = follower()
    # held first: the next term's lease of a member this node's view does not list yet, and
    # a commit of that term (both honest-looking, both waiting on what the node learns next)
    newcomer = Identity(b"\x55" * 32)
    e.on_lease(lease(newcomer, 1, 0.9), 0.9)
    e.on_commit(commit(newcomer, 1, 0, "next"), 0.9)
    for i in range(100):
        ident = Identity(i.to_bytes(2, "big") * 16)
        e.on_lease(lease(ident, 2 + i, 1.0 + i * 1e-3), 1.0 + i * 1e-3)
        e.on_commit(commit(ident, 2 + i, i), 1.0)
    assert len(e.held_leases) <= CFG.max_held and len(e.held_commits) <= CFG.max_held
    assert e.holder == holder.peer_id and e.current_term == 0 and e.best_commit is None
    # the flood's far-future terms went first, not what is held for the next term
    assert newcomer.peer_id in e.held_leases and (1, newcomer.peer_id, "next") in e.held_commits


# --- a term does not outlive its claim ---------------------------------------------------------


def test_a_holder_steps_down_before_its_claim_gets_too_old() -> None:
    me = ranked_ids(0)[0]
    e = Election(RUN, me, CFG)
    e.start(0.0)
    e.on_members(view(), 0.0)
    assert [x for x in e.tick(1.5) if isinstance(x, PublishLease)]
    t = 1.5
    while e.role is Role.HOLDER and t < 1000:
        t += CFG.renew_every_s
        out = e.tick(t)
        e.on_members(view(), t)
    assert StepDown(0, "aged") in out
    assert t - 1.5 <= CFG.max_claim_age_s  # type: ignore[operator]


# --- the DHT applies the same rules -------------------------------------------------------------


def test_the_dht_validator_refuses_and_never_selects_what_the_election_would_not_act_on() -> None:
    e, holder = follower()
    validator = PcpRecordValidator(RECORD_KINDS, now=lambda: 1.0)

    def authority(rec, now):  # type: ignore[no-untyped-def]
        if isinstance(rec.payload, Lease):
            e.check_lease(rec.payload, now)
        elif isinstance(rec.payload, CommitRecord):
            e.check_commit(rec.payload)

    validator.authorities.append(authority)
    honest = sign_record(holder, "commit", RUN, commit(holder, 0, 4), ttl_s=600, seq=4, now=1.0)
    forged = sign_record(STRANGER, "commit", RUN, commit(STRANGER, 10**6, 0), ttl_s=600, seq=10**6 << 32, now=1.0)
    key = honest.key
    validator.validate(key, encode(honest))
    with pytest.raises(NotElected):
        validator.validate(key, encode(forged))
    assert validator.select(key, [encode(forged), encode(honest)]) == 1
    honest_lease = sign_record(holder, LEASE_KIND, RUN, lease(holder, 0, 0.9, claimed_at=0.5), ttl_s=60, seq=0,
                               now=0.9)
    stranger_lease = sign_record(STRANGER, LEASE_KIND, RUN, lease(STRANGER, 99, 0.9), ttl_s=60, seq=99, now=0.9)
    assert validator.select(honest_lease.key, [encode(stranger_lease), encode(honest_lease)]) == 1

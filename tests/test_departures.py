"""Announced departures, fed by hand: the shepherd stops waiting for a leaver at once,
the election fails over at once when the leaver held the term, and nobody can announce
another node's departure or replay an old one."""

from __future__ import annotations

import math
import os
import signal
import time

import pytest
import trio
from test_diloco_protocol import Round, ident, rejections, sent
from test_election import IDS, make_lease, of, order, started

from pcp_p2p.core import shutdown
from pcp_p2p.core.errors import BadSignature, NotElected, PeerGone, RejectedUpdate, StaleMessage, VerificationError
from pcp_p2p.diloco.protocol.departures import LEAVE_FRESH_S, Departures, make_leave
from pcp_p2p.diloco.protocol.effects import Committed, Discarded, Rejected
from pcp_p2p.diloco.protocol.election import CommitChecked, FollowShepherd, LookupCommit, LookupLease, Role
from pcp_p2p.diloco.protocol.messages import Leave, RoundAnnouncement, sign

# --- the shepherd --------------------------------------------------------------------


def test_a_leaver_is_not_waited_for_the_round_commits_at_once():
    r = Round()  # three workers assigned, quorum 2, deadline at 20 s
    effects = []
    for who in r.ids[:2]:
        effects += r.shepherd.on_submission(r.submission(who), now=3.0)
    assert not any(isinstance(e, Committed) for e in effects)  # still waiting for the third
    leaver = r.ids[2]
    effects = r.shepherd.on_leave(make_leave(r.shepherd.run_id, leaver, 4.0), now=4.0)
    (commit,) = [e.record for e in effects if isinstance(e, Committed)]
    assert commit.round == 0 and leaver.peer_id not in commit.participants
    assert r.shepherd.round_agg is not None and r.shepherd.round_agg.announcement.deadline > 4.0  # long before it
    (ann,) = {a.signature: a for a in sent(effects, RoundAnnouncement)}.values()
    assert leaver.peer_id not in {a.worker for a in ann.assignments}  # no seat in the next round
    assert leaver.peer_id not in r.shepherd.roster and leaver.peer_id not in r.shepherd.misses


def test_a_leaver_before_anyone_reported_leaves_the_others_to_decide():
    r = Round()
    assert r.shepherd.on_leave(make_leave(r.shepherd.run_id, r.ids[0], 1.0), now=1.0) == []
    assert isinstance(r.shepherd.round_agg.refused[r.ids[0].peer_id], PeerGone)
    effects = []
    for who in r.ids[1:]:
        effects += r.shepherd.on_submission(r.submission(who), now=3.0)
    (commit,) = [e.record for e in effects if isinstance(e, Committed)]  # closed without the deadline
    assert set(commit.participants) == {w.peer_id for w in r.ids[1:]}


def test_leavers_below_quorum_discard_at_once_and_the_run_waits_for_joiners():
    r = Round()
    effects = r.shepherd.on_leave(make_leave(r.shepherd.run_id, r.ids[0], 1.0), now=1.0)
    effects += r.shepherd.on_leave(make_leave(r.shepherd.run_id, r.ids[1], 1.0), now=1.0)
    assert any(isinstance(e, Discarded) for e in effects)
    assert sent(effects, RoundAnnouncement) == []  # one worker left: below quorum
    assert list(r.shepherd.roster) == [r.ids[2].peer_id]


def test_a_leaver_that_already_submitted_still_counts():
    r = Round()
    r.shepherd.on_submission(r.submission(r.ids[0]), now=3.0)
    r.shepherd.on_leave(make_leave(r.shepherd.run_id, r.ids[0], 4.0), now=4.0)
    effects = r.shepherd.on_submission(r.submission(r.ids[1]), now=5.0)
    effects += r.shepherd.on_leave(make_leave(r.shepherd.run_id, r.ids[2], 6.0), now=6.0)
    (commit,) = [e.record for e in effects if isinstance(e, Committed)]
    assert set(commit.participants) == {r.ids[0].peer_id, r.ids[1].peer_id}


def test_a_departure_signed_by_another_changes_nothing():
    r = Round()
    victim, forger = r.ids[0], r.ids[1]
    forged = sign(Leave(run_id=r.shepherd.run_id, peer=victim.peer_id, at=1.0), forger)
    assert [type(x) for x in rejections(r.shepherd.on_leave(forged, now=1.0))] == [BadSignature]
    assert victim.peer_id in r.shepherd.roster and victim.peer_id not in r.shepherd.round_agg.refused
    other_run = make_leave("another-run", victim, 1.0)
    assert [type(x) for x in rejections(r.shepherd.on_leave(other_run, now=1.0))] == [RejectedUpdate]
    assert victim.peer_id in r.shepherd.roster


# --- the gate: who may announce, freshness, replays ----------------------------------


def test_only_the_leaver_or_the_shepherd_relaying_may_deliver_a_departure():
    d = Departures("run")
    leaver, stranger, shepherd = ident(20), ident(21), ident(22)
    leave = make_leave("run", leaver, 100.0)
    with pytest.raises(BadSignature):
        d.check(leave, stranger.peer_id, 100.0, relayer=shepherd.peer_id)  # a third party
    with pytest.raises(BadSignature):  # the right sender, the wrong signature
        d.check(sign(Leave(run_id="run", peer=leaver.peer_id, at=100.0), stranger), leaver.peer_id, 100.0)
    d.check(leave, shepherd.peer_id, 100.5, relayer=shepherd.peer_id)  # relayed, signed by the leaver
    assert d.gone(leaver.peer_id, started_at=50.0)


def test_replayed_stale_and_misrouted_departures_are_refused():
    d = Departures("run")
    leaver = ident(20)
    leave = make_leave("run", leaver, 100.0)
    d.check(leave, leaver.peer_id, 100.0)
    with pytest.raises(StaleMessage):
        d.check(leave, leaver.peer_id, 101.0)  # the same again
    with pytest.raises(StaleMessage):
        d.check(make_leave("run", leaver, 99.0), leaver.peer_id, 101.0)  # an older one
    with pytest.raises(StaleMessage):
        late = make_leave("run", ident(23), 100.0)
        d.check(late, late.peer, 100.0 + LEAVE_FRESH_S + 1)
    with pytest.raises(StaleMessage):
        odd = make_leave("run", ident(24), math.nan)
        d.check(odd, odd.peer, 100.0)
    with pytest.raises(VerificationError):
        d.check(make_leave("other", leaver, 200.0), leaver.peer_id, 200.0)
    assert not d.gone(ident(23).peer_id, 0.0)  # refused: not remembered as gone


def test_a_restart_under_the_same_peer_id_is_not_gone():
    d = Departures("run")
    leaver = ident(20)
    d.check(make_leave("run", leaver, 100.0), leaver.peer_id, 100.0)
    assert d.gone(leaver.peer_id, started_at=10.0)  # the incarnation that left
    assert not d.gone(leaver.peer_id, started_at=105.0)  # started again after it left


# --- the election ----------------------------------------------------------------------


def test_a_leaving_holder_ends_its_term_at_once_and_is_no_candidate():
    holder, me = order(0)[0], order(0)[1]
    e = started(me, 0.0)
    assert of(e.on_lease(make_lease(holder, 0, 0.5), 0.5), FollowShepherd) and e.role is Role.FOLLOWER
    effects = e.on_departure(holder.peer_id, at=2.0, now=2.0)
    assert e.role is Role.VACANT and e.history[-1].ended == "failover"  # not after expiry + grace (11 s)
    assert of(effects, LookupLease) and of(effects, LookupCommit)  # claims from the latest commit
    assert holder.peer_id not in e.view
    # its lease (a renewal in flight, or the DHT's copy) is not followed again
    renewal = make_lease(holder, 0, 0.5, issued=1.5, expiry=11.5)
    assert [type(r.error) for r in of(e.on_lease(renewal, 2.1), Rejected)] == [StaleMessage]
    assert e.role is Role.VACANT
    assert e.expected_holder(1, 3.0) != holder.peer_id


def test_a_leaving_follower_changes_no_term():
    holder, me, other = order(0)[0], order(0)[1], order(0)[2]
    e = started(me, 0.0)
    e.on_lease(make_lease(holder, 0, 0.5), 0.5)
    assert e.on_departure(other.peer_id, at=2.0, now=2.0) == []
    assert e.role is Role.FOLLOWER and e.holder == holder.peer_id and other.peer_id not in e.view
    assert len(IDS) - 1 == len(e.view)


# --- the farewell: before the stop cancels anything, and bounded ----------------------


def test_farewells_run_before_the_work_is_cancelled_and_are_bounded(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(shutdown, "FAREWELL_S", 0.3)
    seen: list[str] = []
    work = {"cancelled": False}

    async def polite() -> None:
        seen.append("farewell while the work runs" if not work["cancelled"] else "farewell too late")

    async def stuck() -> None:
        await trio.sleep_forever()  # a peer that never answers

    async def never() -> None:
        seen.append("a removed farewell ran")

    async def main() -> None:
        shutdown.add_farewell(polite)
        shutdown.add_farewell(stuck)
        shutdown.add_farewell(never)()  # added and removed
        try:
            os.kill(os.getpid(), signal.SIGINT)
            await trio.sleep(30)
        except trio.Cancelled:
            work["cancelled"] = True
            seen.append("work cancelled")
            raise

    t0 = time.monotonic()
    with pytest.raises(shutdown.Interrupted):
        # grace_s far beyond the session: a woken watchdog keeps counting until the process
        # ends (by design), and this process is pytest itself
        shutdown.run_until_signal(main, grace_s=1e7)
    assert seen == ["farewell while the work runs", "work cancelled"]
    assert time.monotonic() - t0 < 10  # the stuck farewell was cut off (at 0.3 s), not waited for


# --- catching up to a run that finished while this node was down -----------------------


def final_commit(shepherd, term: int, round_: int = 9, theta: str = "final"):
    from test_election import make_commit

    return make_commit(shepherd, term, round_, theta)


def restarted(anchor_holder, anchor_term: int, claimed_at: float = 0.0):
    """A node back up at t=1000 whose data dir kept the lease of ``anchor_term`` it had accepted."""
    me = IDS[4]
    e = started(me, 1000.0)
    e.restore(make_lease(anchor_holder, anchor_term, claimed_at))
    return e


def test_the_last_commit_of_the_anchors_term_is_adopted():
    holder = IDS[0]
    e = restarted(holder, 2)
    rec = final_commit(holder, 2)
    assert [type(x) for x in of(e.on_commit(rec, 1000.0), Rejected)] and e.best_commit is None  # held back
    (checked,) = e.adopt_final(rec, rounds=10, now=1000.0)
    assert checked.record == rec and e.best_commit == rec and not e.held_commits
    assert e.adopt_final(rec, rounds=10, now=1000.0) == []  # once


def test_a_later_term_is_adopted_only_within_reach_of_the_anchor():
    e = restarted(IDS[0], 2, claimed_at=900.0)  # 100 s ago: at most 2 + 1 + 10 terms since
    assert e.adopt_final(final_commit(IDS[1], 13), rounds=10, now=1000.0)
    e = restarted(IDS[0], 2, claimed_at=900.0)
    with pytest.raises(NotElected):  # HeldBack: a far-future term
        e.adopt_final(final_commit(IDS[1], 14), rounds=10, now=1000.0)


@pytest.mark.parametrize("case", ["not the last round", "another holder", "forged", "older term", "no anchor",
                                  "a live chain"])
def test_what_cannot_be_adopted(case: str):
    e = restarted(IDS[0], 2)
    rec = final_commit(IDS[0], 2)
    if case == "not the last round":
        rec, err = final_commit(IDS[0], 2, round_=5), NotElected
    elif case == "another holder":
        rec, err = final_commit(IDS[1], 2), BadSignature
    elif case == "forged":
        rec, err = sign(rec, IDS[1]), BadSignature
    elif case == "older term":
        rec, err = final_commit(IDS[0], 1), StaleMessage
    elif case == "no anchor":
        e, err = started(IDS[4], 1000.0), NotElected
    else:  # a commit accepted since the restart: a "last round" must pass the live chain instead
        e = restarted(IDS[0], 0)
        established = make_lease(IDS[0], 0, 500.0, issued=999.0, expiry=1009.0)  # claimed long ago
        assert of(e.on_lease(established, 1000.0), FollowShepherd)
        assert of(e.on_commit(final_commit(IDS[0], 0, round_=3, theta="r3"), 1000.0), CommitChecked)
        rec, err = final_commit(IDS[1], 1), NotElected
    before = e.best_commit
    with pytest.raises(err):
        e.adopt_final(rec, rounds=10, now=1000.0)
    assert e.best_commit is before


def test_a_restarted_node_takes_up_the_runs_its_data_dir_left_unfinished(tmp_path):
    from types import SimpleNamespace

    from pcp_p2p.diloco.run.pins import RunPins
    from pcp_p2p.diloco.run.runtime import PINS_FILE
    from pcp_p2p.diloco.run.training_service import TrainingService

    for run_id, finished in (("run-a", False), ("run-b", True), ("run-c", False)):
        (tmp_path / "runs" / run_id).mkdir(parents=True)
        pins = RunPins()
        pins.finished = finished
        pins.save(tmp_path / "runs" / run_id / PINS_FILE)
    (tmp_path / "runs" / "run-d").mkdir()  # started, nothing kept yet: unfinished too
    service = TrainingService.__new__(TrainingService)
    service.node = SimpleNamespace(config=SimpleNamespace(data_dir=tmp_path))  # type: ignore[assignment]
    assert service._unfinished_runs() == ["run-a", "run-c", "run-d"]
    service.node = SimpleNamespace(config=SimpleNamespace(data_dir=tmp_path / "none"))  # type: ignore[assignment]
    assert service._unfinished_runs() == []


def test_a_node_that_claimed_a_term_alone_after_its_restart_still_adopts_the_end():
    """Back after the end, it is the only member still listing the run: it claims a term
    before the DHT's commit arrives. The run's last commit still ends that."""
    me = IDS[4]
    e = started(me, 1000.0, ids=[me])
    e.restore(make_lease(IDS[0], 2, 0.0))
    e.on_lookups_done(1000.0)
    assert e.role is Role.HOLDER and e.lease.holder == me.peer_id
    (checked,) = e.adopt_final(final_commit(IDS[1], 3), rounds=10, now=1001.0)
    assert e.best_commit == checked.record


def test_its_own_claim_after_a_lapsed_lease_does_not_hide_the_real_holder_of_that_term():
    """Back after the end, it accepts the last lease seen live, which lapses as the run is
    over; it claims the next term itself. The run's real last commit of that term, by the
    node that really held it, still ends the run here (its own claim is no evidence)."""
    from test_election import view

    me = IDS[4]
    e = started(me, 1000.0, ids=[me, IDS[0]])
    e.restore(make_lease(IDS[0], 0, 0.0))
    last = make_lease(IDS[0], 0, 500.0, issued=999.5, expiry=1005.0)
    assert of(e.on_lease(last, 1000.0), FollowShepherd)
    e.on_lookups_done(1000.0)
    e.on_members(view([me]), 1001.0)  # the others finished: they no longer list the run
    for t in (1010.0, 1020.0, 1030.0, 1040.0):
        e.tick(t)
    assert e.lease is not None and e.lease.holder == me.peer_id and e.lease.term >= 1  # claimed alone
    (checked,) = e.adopt_final(final_commit(IDS[1], 1), rounds=10, now=1041.0)
    assert e.best_commit == checked.record

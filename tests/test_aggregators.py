"""Aggregators wired into the round (issue #15, item 3): workers send their Δs to the
aggregator of their group, each aggregator sends the shepherd one partial aggregate, and
the shepherd commits every worker from a few partials. Every bad partial is refused with
a typed error and the round goes on; a worker its aggregator left out sends its next Δ
to the shepherd itself.

The machines are fed by hand (worker, collector, shepherd: :class:`Bus`), then the same
round runs on N run machines (:mod:`pcp_p2p.testing.run_harness`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np
import pytest
import trio
from test_diloco_protocol import OWNER, RUN_ID, SPEC, THETA0, Round, rejections, sent
from test_run_machine import SPEC as RUN_MACHINE_SPEC
from trio.testing import MockClock

from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import BadSignature, HashMismatch, RejectedUpdate, StaleMessage, VerificationError
from pcp_p2p.diloco.algorithm.params import pack_tensors, unpack_tensors
from pcp_p2p.diloco.protocol.collector import GroupCollector, close_time
from pcp_p2p.diloco.protocol.effects import Committed, FetchBlob, Send, StoreBlob
from pcp_p2p.diloco.protocol.messages import CommitRecord, RoundAnnouncement, Submission, sign
from pcp_p2p.diloco.protocol.partial_audit import PartialAudit, PartialReplay, PartialVerdict
from pcp_p2p.diloco.protocol.partials import PartialAggregate, announced_groups, listed
from pcp_p2p.diloco.protocol.worker import InnerResult, Worker
from pcp_p2p.testing.run_harness import RunSwarm, SwarmConfig
from pcp_p2p.wire import Message, decode

AGG_SPEC = dataclasses.replace(SPEC, aggregation=dataclasses.replace(SPEC.aggregation, aggregators=3,
                                                                      aggregate_above=4))
N = 10


def step(worker: str) -> dict[str, np.ndarray]:
    """Each worker's own Δ (so a combine that loses or repeats one shows)."""
    k = int(worker.encode()[-1])
    return {name: np.full_like(v, 0.01 + 0.001 * (k % 7)) for name, v in THETA0.items()}


class Bus:
    """A shepherd, N workers and the announcement's aggregators, fed by hand: messages go
    where their ``Send`` says, blobs come from a shared store."""

    def __init__(self, spec: Any = AGG_SPEC, n: int = N) -> None:
        self.round = Round(spec, n=n)
        self.ann = self.round.ann
        self.ids = {i.peer_id: i for i in self.round.ids}
        self.blobs: dict[str, bytes] = {}
        self.workers = {p: Worker(spec=spec, run_id=RUN_ID, identity=i, shepherds={0: OWNER.peer_id},
                                  target="cpu", tokens_per_s=100.0) for p, i in self.ids.items()}
        self.collectors = {a: GroupCollector(spec, self.ann, self.ids[a], now=0.0) for a in self.ann.aggregators}
        self.to_shepherd: list[Message] = []
        self.effects: list[Any] = []  # everything the shepherd answered

    def train(self, worker: str, now: float = 10.0) -> Submission:
        """``worker`` takes the announcement, holds θ and finishes its inner steps."""
        w = self.workers[worker]
        w.on_announcement(self.ann, now=0.0)
        w.on_blob(self.ann.theta_cid, pack_tensors(THETA0, "fp32"), now=0.1)
        local = {k: v - step(worker)[k] for k, v in THETA0.items()}
        effects = w.on_inner_done(InnerResult(0, 0, local, 10, (1.0,) * 10, None), now=now)
        for e in effects:
            if isinstance(e, StoreBlob):
                self.blobs[e.cid] = e.data
        (send,) = [e for e in effects if isinstance(e, Send)]
        self.deliver(send.to, send.message, now)
        assert isinstance(send.message, Submission)
        return send.message

    def deliver(self, to: str, msg: Message, now: float) -> None:
        if to == OWNER.peer_id:
            self.to_shepherd.append(msg)
            self.shepherd_effects(self.round.shepherd.receive(msg, now), now)
        else:
            c = self.collectors[to]
            assert isinstance(msg, Submission) and c.takes(msg)
            self.collector_effects(c, c.on_submission(msg, now), now)

    def collector_effects(self, c: GroupCollector, effects: list[Any], now: float) -> None:
        for e in effects:
            if isinstance(e, FetchBlob):
                self.collector_effects(c, c.on_blob(e.cid, self.blobs[e.cid], now), now)
            elif isinstance(e, StoreBlob):
                self.blobs[e.cid] = e.data
            elif isinstance(e, Send):
                self.deliver(e.to, e.message, now)

    def shepherd_effects(self, effects: list[Any], now: float) -> None:
        self.effects += effects
        for e in effects:
            if isinstance(e, FetchBlob):
                self.shepherd_effects(self.round.shepherd.on_blob(e.cid, self.blobs[e.cid], now), now)

    def hold_theta(self) -> None:
        for c in self.collectors.values():
            c.hold_theta(THETA0, now=0.2)

    def commits(self) -> list[CommitRecord]:
        return [e.record for e in self.effects if isinstance(e, Committed)]


@pytest.mark.parametrize("quorum", [2, N - 1])
def test_a_round_through_aggregators_commits_every_worker_from_one_partial_per_group(quorum: int) -> None:
    # (the quorum counts workers, not partials: three partials meet a quorum of nine)
    spec = dataclasses.replace(AGG_SPEC, round=dataclasses.replace(AGG_SPEC.round, min_quorum=quorum))
    bus = Bus(spec)
    assert len(bus.ann.aggregators) == 3 and OWNER.peer_id not in bus.ann.aggregators  # (10 workers: 3 groups)
    bus.hold_theta()
    subs = [bus.train(w) for w in sorted(bus.ids)]
    assert all(s.delta_cid is not None and s.delta_inline is None for s in subs)  # by CID to an aggregator
    (rec,) = bus.commits()
    assert rec.participants == tuple(sorted(bus.ids))
    assert [type(m).__name__ for m in bus.to_shepherd] == ["PartialAggregate"] * 3  # no Δ reached it alone
    assert not rejections(bus.effects)
    # the two-level combine of Δs that differ stays between the smallest and the largest Δ
    lo, hi = min(step(w)["b"][0] for w in bus.ids), max(step(w)["b"][0] for w in bus.ids)
    # θ_{r+1} − θ_r = −lr·(1 + μ)·Δ̄ on Nesterov's first step (its momentum starts at Δ̄)
    mean = (THETA0["b"] - bus.round.shepherd.state.theta["b"]) / (SPEC.outer.lr * (1 + SPEC.outer.momentum))
    assert np.all(mean >= lo * 0.99) and np.all(mean <= hi * 1.01), (lo, mean, hi)


def test_a_group_closes_at_its_time_with_what_arrived_and_a_worker_left_out_goes_direct_next() -> None:
    bus = Bus()
    bus.hold_theta()
    late = sorted(bus.ids)[0]
    agg = announced_groups(bus.ann)[late]
    for w in sorted(bus.ids)[1:]:
        bus.train(w)
    c = bus.collectors[agg]
    assert not c.closed and c.next_wakeup is not None  # its group waits for the late worker
    bus.collector_effects(c, c.tick(c.close_at), c.close_at)
    (rec,) = bus.commits()
    assert late not in rec.participants and len(rec.participants) == N - 1
    # the late worker's Δ is refused by the closed group; it learns from the commit
    bus.train(late, now=c.close_at + 1)
    w = bus.workers[late]
    w.on_commit(rec, now=c.close_at + 2)
    assert list(w.dropped_by) == [agg]
    # an announcement that puts it in that aggregator's group again: its Δ goes to the shepherd
    ann2 = sign(dataclasses.replace(bus.ann, round=1, theta_cid=rec.theta_cid, aggregators=(agg,)), OWNER)
    w.on_announcement(ann2, now=30.0)
    w.on_blob(rec.theta_cid, bus.round.shepherd.theta_bytes, now=30.1)
    effects = w.on_inner_done(InnerResult(1, 0, dict(THETA0), 10, (1.0,) * 10, None), now=40.0)
    (send,) = [e for e in effects if isinstance(e, Send)]
    assert send.to == OWNER.peer_id and isinstance(send.message, Submission)
    assert send.message.delta_inline is not None  # (to the shepherd: small Δs ride inline again)


def partial_from(bus: Bus, aggregator: str, **change: Any) -> PartialAggregate:
    """A well-formed partial of ``aggregator``'s group, then ``change`` applied and signed by it."""
    c = GroupCollector(AGG_SPEC, bus.ann, bus.ids[aggregator], now=0.0)
    c.hold_theta(THETA0, now=0.0)
    for w in sorted(c.group):
        bus.workers[w].on_announcement(bus.ann, now=0.0)
        bus.workers[w].on_blob(bus.ann.theta_cid, pack_tensors(THETA0, "fp32"), now=0.1)
        local = {k: v - step(w)[k] for k, v in THETA0.items()}
        effects = bus.workers[w].on_inner_done(InnerResult(0, 0, local, 10, (1.0,) * 10, None), now=5.0)
        for e in effects:
            if isinstance(e, StoreBlob):
                bus.blobs[e.cid] = e.data
        (sub,) = sent(effects, Submission)
        for e in c.on_submission(sub, now=5.0):
            if isinstance(e, FetchBlob):
                for f in c.on_blob(e.cid, bus.blobs[e.cid], now=5.0):
                    if isinstance(f, StoreBlob):
                        bus.blobs[f.cid] = f.data
    assert c.partial is not None
    return sign(dataclasses.replace(c.partial, **change), bus.ids[aggregator]) if change else c.partial


def test_partials_the_shepherd_refuses_each_with_a_typed_error_and_the_round_goes_on() -> None:
    bus = Bus()
    s = bus.round.shepherd
    a0, a1, a2 = bus.ann.aggregators
    good = partial_from(bus, a0)
    # signed by a worker that is not an aggregator of the round
    outsider = next(w for w in sorted(bus.ids) if w not in bus.ann.aggregators)
    forged = sign(dataclasses.replace(good, aggregator=outsider), bus.ids[outsider])
    (err,) = rejections(s.on_partial(forged, now=6.0))
    assert isinstance(err, RejectedUpdate) and "not an aggregator" in str(err)
    # for another attempt
    (err,) = rejections(s.on_partial(sign(dataclasses.replace(good, attempt=1), bus.ids[a0]), now=6.0))
    assert isinstance(err, StaleMessage)
    # the good one is taken: its Δ is fetched from the aggregator
    (fetch,) = s.on_partial(good, now=6.0)
    assert isinstance(fetch, FetchBlob) and fetch.cid == good.delta_cid and fetch.hint == a0
    # a second, different partial from the same aggregator
    (err,) = rejections(s.on_partial(sign(dataclasses.replace(good, mean_loss=0.5), bus.ids[a0]), now=6.0))
    assert isinstance(err, RejectedUpdate) and "second" in str(err)
    # a tampered Δ: every worker of the group is refused, nothing counts
    effects = s.on_blob(good.delta_cid, bus.blobs[good.delta_cid][:-1] + b"\x00", now=6.5)
    assert [type(e).__name__ for e in rejections(effects)] == ["HashMismatch"]
    named = {sub.worker for sub in listed(good)}
    assert named <= set(s.round_agg.refused) and not s.round_agg.accepted
    # an aggregator's own Δ sent to the shepherd alone
    sub = bus.round.submission(bus.ids[a1])
    (err,) = rejections(s.on_submission(sub, now=7.0))
    assert isinstance(err, RejectedUpdate) and "partial aggregate" in str(err)
    # a partial listing a worker whose Δ came here itself
    direct = next(w for w in sorted(bus.ids) if announced_groups(bus.ann)[w] == a2
                  and w != a2)
    assert s.on_submission(bus.round.submission(bus.ids[direct]), now=7.0) == []
    (err,) = rejections(s.on_partial(partial_from(bus, a2), now=7.5))
    assert isinstance(err, RejectedUpdate) and "came here itself" in str(err)


def test_a_partial_whose_delta_is_not_thetas_shape_is_refused_and_its_workers_miss_the_round() -> None:
    bus = Bus()
    s = bus.round.shepherd
    a0 = bus.ann.aggregators[0]
    good = partial_from(bus, a0)
    wrong = pack_tensors({"w": np.zeros((2, 2), np.float32)}, "fp32")
    bus.blobs[cid_of(wrong)] = wrong
    bad = sign(dataclasses.replace(good, delta_cid=cid_of(wrong)), bus.ids[a0])
    (fetch,) = s.on_partial(bad, now=6.0)
    (err,) = rejections(s.on_blob(fetch.cid, wrong, now=6.1))
    assert isinstance(err, RejectedUpdate) and "other tensors" in str(err)
    assert {sub.worker for sub in listed(good)} <= set(s.round_agg.refused)


def test_a_collector_refuses_an_inline_delta_a_bad_signature_and_anything_after_it_closed() -> None:
    bus = Bus()
    a0 = bus.ann.aggregators[0]
    c = bus.collectors[a0]
    member = sorted(c.group)[0]
    inline = bus.round.submission(bus.ids[member])  # (a Δ inline: an aggregator lists Δs by CID)
    assert c.takes(inline)
    (err,) = rejections(c.on_submission(inline, now=1.0))
    assert isinstance(err, RejectedUpdate) and "by CID" in str(err)
    other = next(w for w in bus.ids if w not in c.group)
    assert not c.takes(bus.round.submission(bus.ids[other]))
    forged = dataclasses.replace(bus.round.submission(bus.ids[sorted(c.group)[1]], delta_cid="x", delta_inline=None),
                                 steps=9)
    (err,) = rejections(c.on_submission(forged, now=1.0))
    assert type(err).__name__ == "BadSignature"
    c.tick(c.close_at)
    assert c.closed and c.partial is None  # nothing arrived: nothing to send
    (err,) = rejections(c.on_submission(bus.round.submission(bus.ids[sorted(c.group)[2]]), now=c.close_at))
    assert isinstance(err, StaleMessage)


@pytest.mark.parametrize(("budget", "deadline", "closes"), [(10.0, 100.0, 85.0), (60.0, 66.0, 63.0), (5.0, 5.0, 5.0)])
def test_an_incomplete_group_closes_before_the_deadline_but_after_the_time_budget(
        budget: float, deadline: float, closes: float) -> None:
    ann = dataclasses.replace(Round(AGG_SPEC, n=N).ann, time_budget_s=budget, deadline=deadline)
    assert close_time(ann, now=0.0) == pytest.approx(closes)


def test_without_aggregators_or_below_the_size_every_delta_goes_to_the_shepherd() -> None:
    assert Round(SPEC, n=N).ann.aggregators == ()  # off by default
    small = dataclasses.replace(AGG_SPEC, aggregation=dataclasses.replace(AGG_SPEC.aggregation, aggregate_above=N))
    assert Round(small, n=N).ann.aggregators == ()  # not above the size the spec sets


# --- the same on N run machines -----------------------------------------------------------

SWARM_SPEC = dataclasses.replace(  # test_run_machine's run, shorter, with two aggregators
    RUN_MACHINE_SPEC, round=dataclasses.replace(RUN_MACHINE_SPEC.round, rounds=6),
    aggregation=dataclasses.replace(RUN_MACHINE_SPEC.aggregation, aggregators=2, aggregate_above=4))



def test_seven_run_machines_train_through_aggregators_and_the_shepherd_gets_only_partials() -> None:
    class Recording(RunSwarm):
        def __init__(self, cfg: SwarmConfig) -> None:
            super().__init__(cfg)
            self.got: collections.Counter[tuple[str, str]] = collections.Counter()

        async def deliver(self, sender: str, dst: str, msg: Message) -> bool:
            taken = await super().deliver(sender, dst, msg)
            if taken and isinstance(msg, (Submission, PartialAggregate, RoundAnnouncement)):
                self.got[(dst, type(msg).__name__)] += 1
            return taken

    async def go() -> tuple[Recording, Any]:
        swarm = Recording(SwarmConfig(spec=SWARM_SPEC, nodes=7))
        return swarm, await swarm.run()

    swarm, r = trio.run(go, clock=MockClock(autojump_threshold=0))
    assert r.finished and [c.round for c in r.chain] == list(range(6))
    assert set(r.theta_cids.values()) == {r.final.theta_cid}
    assert all(len(c.participants) == 7 for c in r.chain)  # nobody left out
    shepherds = {c.shepherd for c in r.chain}
    assert len(shepherds) == 1
    (shepherd,) = shepherds
    assert swarm.got[(shepherd, "PartialAggregate")] == 2 * 6  # two groups a round
    assert swarm.got[(shepherd, "Submission")] == 0
    assert sum(n for (dst, kind), n in swarm.got.items() if kind == "Submission") == 7 * 6
    assert r.val_losses[-1] < 0.5 * r.initial_val_loss
    assert not [e for _, _, e in r.rejected if isinstance(e, (HashMismatch, RejectedUpdate))]


class Lying(RunSwarm):
    """The first node that sends a partial aggregate lies in every partial from then on: it
    sends the group's Δ three times over (stored, named and signed as if it were the combine)."""

    def __init__(self, cfg: SwarmConfig) -> None:
        super().__init__(cfg)
        self.liar: str | None = None
        self.lies = 0
        self.got: collections.Counter[str] = collections.Counter()

    def _carry_out_now(self, node: Any, effects: list[Any]) -> None:
        sends = [e for e in effects if isinstance(e, Send) and isinstance(e.message, PartialAggregate)]
        if sends and self.liar is None:
            self.liar = node.peer_id
        if sends and node.peer_id == self.liar:
            effects = self._lie(node, effects, sends[0].message)
        super()._carry_out_now(node, effects)

    def _lie(self, node: Any, effects: list[Any], p: PartialAggregate) -> list[Any]:
        store = next(e for e in effects if isinstance(e, StoreBlob) and e.cid == p.delta_cid)
        blob = pack_tensors({k: 3 * v for k, v in unpack_tensors(store.data).items()}, "int8")
        forged = sign(dataclasses.replace(p, delta_cid=cid_of(blob)), node.identity)
        self.lies += 1
        out: list[Any] = []
        for e in effects:
            if e is store:
                out.append(StoreBlob(cid_of(blob), blob))
            elif isinstance(e, Send) and e.message is p:
                out.append(Send(e.to, forged))
            else:
                out.append(e)
        return out

    async def deliver(self, sender: str, dst: str, msg: Message) -> bool:
        taken = await super().deliver(sender, dst, msg)
        if taken and isinstance(msg, PartialVerdict):
            self.got[msg.verdict] += 1
        return taken


def test_an_aggregator_that_lies_is_caught_by_another_members_replay_and_banned_by_the_shepherd() -> None:
    spec = dataclasses.replace(SWARM_SPEC, aggregation=dataclasses.replace(SWARM_SPEC.aggregation,
                                                                           partial_audit_rate=1.0))

    async def go() -> tuple[Lying, Any]:
        swarm = Lying(SwarmConfig(spec=spec, nodes=7))
        return swarm, await swarm.run()

    swarm, r = trio.run(go, clock=MockClock(autojump_threshold=0))
    assert r.finished and swarm.liar is not None and swarm.lies >= 1
    assert swarm.got["mismatch"] >= 1  # another member's replay saw it
    (shepherd,) = {c.shepherd for c in r.chain}
    machine = swarm.by_id[shepherd].machine
    assert machine is not None and machine.ledger.banned(swarm.liar)  # confirmed by the shepherd's own replay
    ban = machine.ledger.ban_of(swarm.liar)
    assert ban is not None and "partial aggregate" in ban.reason
    # banned: not drawn again, and its own Δ is refused from then on
    later = [c for c in r.chain if c.round > min(c.round for c in r.chain if swarm.liar not in c.participants)]
    assert all(swarm.liar not in c.participants for c in later)
    assert swarm.got["match"] >= 1  # the honest aggregators' partials replayed to the same bytes


def test_partial_audits_are_asked_by_the_shepherd_replayed_by_another_member_and_not_believed_on_one_word() -> None:
    spec = dataclasses.replace(AGG_SPEC, aggregation=dataclasses.replace(AGG_SPEC.aggregation, partial_audit_rate=1.0))
    bus = Bus(spec)
    bus.hold_theta()
    bus.blobs[bus.ann.theta_cid] = pack_tensors(THETA0, "fp32")
    for w in sorted(bus.ids):
        bus.train(w)
    (rec,) = bus.commits()
    reqs = sent(bus.effects, PartialAudit)
    assert len(reqs) == 3  # every partial drawn at rate 1, each to another aggregator
    for req in reqs:
        p = decode(req.partial, PartialAggregate)
        assert req.auditor in bus.ann.aggregators and req.auditor != p.aggregator and req.beacon == rec.theta_cid
    req = reqs[0]
    # only the auditor named, only as the shepherd signed it
    other = next(i for p, i in bus.ids.items() if p != req.auditor)
    with pytest.raises(VerificationError):
        PartialReplay(spec, req, other, now=50.0)
    with pytest.raises(BadSignature):
        PartialReplay(spec, dataclasses.replace(req, beacon="x"), bus.ids[req.auditor], now=50.0)
    # the auditor's replay: θ_r and the listed Δs, then a verdict to the shepherd
    replay = PartialReplay(spec, req, bus.ids[req.auditor], now=50.0)
    effects: list[Any] = []
    for fetch in replay.start():
        assert isinstance(fetch, FetchBlob)
        effects += replay.on_blob(fetch.cid, bus.blobs[fetch.cid], now=51.0)
    (verdict,) = sent(effects, PartialVerdict)
    assert verdict.verdict == "match" and replay.done
    s = bus.round.shepherd
    # a verdict from anyone else, or on nothing open
    (err,) = rejections(s.receive(sign(dataclasses.replace(verdict, auditor=other.peer_id), other), now=52.0))
    assert isinstance(err, VerificationError)
    # a mismatch is not believed: the shepherd replays the group itself, and refutes it
    lie = sign(dataclasses.replace(verdict, verdict="mismatch"), bus.ids[req.auditor])
    fetches = s.receive(lie, now=52.0)
    assert fetches and all(isinstance(f, FetchBlob) for f in fetches)
    out: list[Any] = []
    for f in fetches:
        out += s.on_blob(f.cid, bus.blobs[f.cid], now=53.0)
    (err,) = rejections(out)
    assert isinstance(err, VerificationError) and "does not show" in str(err)
    (err,) = rejections(s.receive(verdict, now=54.0))  # the case is closed
    assert isinstance(err, StaleMessage)

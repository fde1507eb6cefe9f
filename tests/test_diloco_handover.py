"""A shepherd hands over between rounds: the next term continues from the checkpoint."""

from __future__ import annotations

import numpy as np

from pcp_p2p.diloco.effects import Committed, FetchBlob, LookupCommit, RunInner, Send, StoreBlob
from pcp_p2p.diloco.messages import CommitRecord, Join, RoundAnnouncement, Submission
from pcp_p2p.diloco.outer import OuterState
from pcp_p2p.diloco.shepherd import Shepherd
from pcp_p2p.diloco.sim import Quadratic
from pcp_p2p.diloco.spec import parse_spec, run_id_of, sign_spec
from pcp_p2p.diloco.tensors import params_cid
from pcp_p2p.diloco.worker import Worker
from pcp_p2p.node.identity import Identity
from pcp_p2p.wire import decode, encode

SPEC = parse_spec(
    """
[inner]
lr = 0.02
batch_size = 4
seq_len = 8
[round]
time_budget_s = 10.0
deadline_s = 20.0
max_inner_steps = 20
rounds = 6
min_quorum = 3
"""
)


class Pump:
    """Delivers effects synchronously, every message through the codec."""

    def __init__(self, shepherds: dict[str, Shepherd], workers: dict[str, Worker], problem: Quadratic):
        self.shepherds, self.workers, self.problem = shepherds, workers, problem
        self.blobs: dict[str, bytes] = {}
        self.board: CommitRecord | None = None
        self.queue: list[tuple[str, tuple]] = []
        self.commits: list[CommitRecord] = []
        self.now = 0.0

    def carry_out(self, node: str, effects: list) -> None:
        for e in effects:
            if isinstance(e, Send):
                self.queue.append((e.to, ("msg", encode(e.message))))
            elif isinstance(e, StoreBlob):
                self.blobs[e.cid] = e.data
            elif isinstance(e, FetchBlob):
                self.queue.append((node, ("blob", e.cid)))
            elif isinstance(e, LookupCommit):
                if self.board is not None:
                    self.queue.append((node, ("commit", self.board)))
            elif isinstance(e, RunInner):
                self.queue.append((node, ("inner", self.problem.inner(e, 10, SPEC))))
            elif isinstance(e, Committed):
                self.board = e.record
                self.commits.append(e.record)

    def run(self, until_round: int | None = None) -> None:
        """Deliver until round ``until_round`` is committed (or the queue is empty)."""
        while self.queue:
            if until_round is not None and self.commits and self.commits[-1].round >= until_round:
                return
            node, item = self.queue.pop(0)
            self.now += 0.01
            if node in self.shepherds:
                sh = self.shepherds[node]
                if item[0] == "msg":
                    self.carry_out(node, sh.receive(decode(item[1], Join, Submission), self.now))
                else:
                    self.carry_out(node, sh.on_blob(item[1], self.blobs[item[1]], self.now))
                continue
            w = self.workers[node]
            if item[0] == "msg":
                effects = w.receive(decode(item[1], RoundAnnouncement, CommitRecord), self.now)
            elif item[0] == "blob":
                effects = w.on_blob(item[1], self.blobs[item[1]], self.now)
            elif item[0] == "commit":
                effects = w.on_commit(item[1], self.now)
            else:
                effects = w.on_inner_done(item[1], self.now)
            self.carry_out(node, effects)

    def tick(self, sh: Shepherd) -> None:
        self.now += sh.join_grace_s
        self.carry_out(sh.peer_id, sh.tick(self.now))


def test_next_term_continues_exactly_from_the_last_commit():
    owner, successor = Identity(b"\x01" * 32), Identity(b"\x02" * 32)
    run_id = run_id_of(sign_spec(SPEC, owner))
    problem = Quadratic.make(np.random.default_rng(0), (6, 4))
    a = Shepherd(spec=SPEC, run_id=run_id, identity=owner, term=0,
                 state=OuterState.initial(problem.initial()), evaluate=problem.loss)
    workers = {}
    for i in range(3):
        w = Worker(spec=SPEC, run_id=run_id, identity=Identity(bytes([10 + i]) * 32),
                   shepherds={0: owner.peer_id}, target="cpu", tokens_per_s=100.0)
        workers[w.peer_id] = w
    pump = Pump({owner.peer_id: a}, workers, problem)
    for pid, w in workers.items():
        pump.carry_out(pid, w.start(pump.now))
    pump.run()  # deliver the joins
    pump.tick(a)
    pump.run(until_round=1)  # term 0 commits rounds 0 and 1
    assert [c.round for c in pump.commits] == [0, 1] and {c.term for c in pump.commits} == {0}
    last = pump.commits[-1]

    # term 0's shepherd goes silent; term 1's continues from the checkpoint blob alone
    b = Shepherd.from_checkpoint(spec=SPEC, run_id=run_id, identity=successor, term=1,
                                 checkpoint=pump.blobs[last.checkpoint_cid], evaluate=problem.loss)
    assert b.state.round == 2 and b.theta_cid == last.theta_cid
    for k, v in a.state.momentum.items():
        np.testing.assert_array_equal(b.state.momentum[k], v)
    pump.shepherds = {successor.peer_id: b}
    pump.queue = [(n, it) for n, it in pump.queue if n != owner.peer_id]  # A is gone
    for pid, w in workers.items():
        pump.carry_out(pid, w.set_shepherd(1, successor.peer_id, pump.now))
    pump.run()
    pump.tick(b)
    pump.run(until_round=SPEC.round.rounds - 1)
    pump.run()  # the last commit reaches the workers, who fetch the final θ

    rounds = [c.round for c in pump.commits]
    assert rounds == list(range(SPEC.round.rounds))  # strictly increasing across the handover
    assert [c.term for c in pump.commits] == [0, 0, 1, 1, 1, 1]
    assert pump.commits[2].prev_theta_cid == last.theta_cid  # no step lost, none repeated
    assert all(w.theta_cid == b.theta_cid == params_cid(b.state.theta) for w in workers.values())
    assert pump.commits[-1].val_loss < pump.commits[0].val_loss
    # a straggling message of the old term is refused by every worker now
    old = decode(encode(a.commits[-1]), CommitRecord)
    for w in workers.values():
        assert w.on_commit(old, pump.now) and w.last_commit.term == 1

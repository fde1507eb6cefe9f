"""A shepherd hands over between rounds: the next term continues exactly from the checkpoint.

Three nodes run the production run machine (:mod:`pcp_p2p.testing.run_harness`, trio's
``MockClock``); the election rotates the term every two rounds, and each new holder builds
its shepherd from the checkpoint its lease names (``Shepherd.from_checkpoint``).
"""

from __future__ import annotations

import numpy as np
import trio
from trio.testing import MockClock

from pcp_p2p.core.errors import StaleMessage
from pcp_p2p.diloco.algorithm.params import params_cid
from pcp_p2p.diloco.protocol.effects import Rejected
from pcp_p2p.diloco.protocol.election import ElectionConfig
from pcp_p2p.diloco.protocol.messages import CommitRecord
from pcp_p2p.diloco.protocol.spec import parse_spec
from pcp_p2p.diloco.run.run_effects import ShepherdBuilt
from pcp_p2p.testing.run_harness import MemNode, RunSwarm, SwarmConfig
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
ROTATING = ElectionConfig(lease_s=10.0, renew_every_s=3.0, grace_s=1.0, min_uptime_s=0.0, rotate_every=2,
                          claim_timeout_s=10.0, settle_s=1.0)


class Recording(RunSwarm):
    """The harness, keeping each term's shepherd and the momentum it started from."""

    def __init__(self, cfg: SwarmConfig) -> None:
        super().__init__(cfg)
        self.built: dict[int, tuple[MemNode, object, dict[str, np.ndarray]]] = {}

    def _carry_out(self, node, effects, ev):  # type: ignore[no-untyped-def]
        if isinstance(ev, ShepherdBuilt):
            sh = ev.shepherd
            self.built[sh.term] = (node, sh, {k: v.copy() for k, v in sh.state.momentum.items()})
        return super()._carry_out(node, effects, ev)


def test_each_term_continues_exactly_from_the_last_commit() -> None:
    world = Recording(SwarmConfig(spec=SPEC, nodes=3, election=ROTATING))
    r = trio.run(world.run, clock=MockClock(autojump_threshold=0))
    assert r.finished
    assert [c.round for c in r.chain] == list(range(SPEC.round.rounds))  # strictly increasing across handovers
    assert [c.term for c in r.chain] == [0, 0, 1, 1, 2, 2]
    for a, b in zip(r.chain, r.chain[1:]):
        assert b.prev_theta_cid == a.theta_cid  # no step lost, none repeated
    for term in (1, 2):
        _, new, momentum = world.built[term]
        _, old, _ = world.built[term - 1]
        last = [c for c in r.chain if c.term == term - 1][-1]
        assert new.state.round >= last.round + 1 and r.chain[2 * term].prev_theta_cid == last.theta_cid
        for k, v in old.state.momentum.items():  # the outer momentum carried over, bit for bit
            np.testing.assert_array_equal(momentum[k], v)
    final = world.built[2][1]
    assert set(r.theta_cids.values()) == {r.final.theta_cid} == {params_cid(final.state.theta)}
    assert r.chain[-1].val_loss < r.chain[0].val_loss
    # a straggling commit of the old term is refused by every worker now
    old_commit: CommitRecord = decode(encode(world.built[0][1].commits[-1]), CommitRecord)
    for node in world.nodes:
        m = node.machine
        out = m.on_message(old_commit.shepherd, old_commit, r.end_time)
        assert m.worker.last_commit.term == 2
        assert [type(e.error) for e in out if isinstance(e, Rejected)] == [StaleMessage]

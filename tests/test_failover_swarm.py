"""Shepherd failover over real libp2p on 127.0.0.1, every node its own process.

Four nodes train; the shepherd is SIGKILLed mid-round; the next-ranked node
takes the next term from the latest checkpoint, no committed round is lost,
and later terms rotate every K rounds as the spec says.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from test_training_swarm import committed, create_run, wait_for

from pcp_p2p.node.local_swarm import local_swarm

pytestmark = pytest.mark.timeout(420)

ROUNDS, ROTATE = 9, 3
SPEC = f"""
name = "failover"
[model]
preset = "tiny"
[round]
time_budget_s = 2.0
max_inner_steps = 200
deadline_s = 12.0
rounds = {ROUNDS}
min_quorum = 2
[election]
rotate_every = {ROTATE}
"""


async def test_shepherd_killed_mid_round_is_replaced_and_terms_rotate(tmp_path: Path) -> None:
    async with local_swarm(tmp_path, extra_args=["--trust-any"]) as swarm:
        boot = await swarm.start_bootstrap()
        await swarm.add_workers(4, deadline_s=60)
        await create_run(swarm, boot.addr, tmp_path, SPEC)

        statuses = await wait_for(swarm, swarm.workers, lambda s: committed(s) >= 2, 180)
        shepherd = next(s["shepherd"] for s in statuses.values() if s.get("shepherd"))
        term_before = max(s.get("term") or 0 for s in statuses.values())
        victim = next(w for w in swarm.workers if w.peer_id == shepherd)
        await swarm.kill(victim, signal.SIGKILL)

        live = [w for w in swarm.workers if w.running]
        statuses = await wait_for(
            swarm, live, lambda s: all(st.get("phase") == "finished" for st in s.values()), 300)

    history = next(iter(statuses.values()))["history"]
    assert [h["round"] for h in history] == list(range(1, ROUNDS + 1))  # no committed round lost (1-based)
    assert {st["theta"] for st in statuses.values()} == {history[-1]["theta"]}
    terms = [h["term"] for h in history]
    assert terms == sorted(terms) and terms[-1] > term_before  # a new term took over
    holders = {t["holder"] for st in statuses.values() for t in st["shepherd_history"] if t["term"] > term_before}
    assert shepherd not in holders  # the dead shepherd leads no later term
    # Rotation: no term served more than ROTATE rounds.
    served = {}
    for h in history:
        served[h["term"]] = served.get(h["term"], 0) + 1
    assert max(served.values()) <= ROTATE

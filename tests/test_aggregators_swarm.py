"""Aggregators over real libp2p on 127.0.0.1, every node its own process (issue #15, item 3).

Bootstrap + 7 workers train the tiny GPT with ``aggregation.aggregators = 2``: each
round's announcement names two aggregators, every worker's Δ goes to its group's, the
shepherd combines two partial aggregates a round and commits all seven workers, and
every partial is replayed by the other aggregator (``partial_audit_rate = 1``). The
quorum (5) is above the number of partials: it counts the workers they stand for.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_training_swarm import committed, create_run, wait_for

from pcp_p2p.node.local_swarm import local_swarm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROUNDS = 4
WORKERS = 7
SPEC = f"""
name = "aggregators"
[model]
preset = "tiny"
[inner]
lr = 3e-3
[round]
time_budget_s = 2.0
max_inner_steps = 100
deadline_s = 20.0
rounds = {ROUNDS}
min_quorum = 5
[aggregation]
aggregators = 2
aggregate_above = 4
partial_audit_rate = 1.0
"""


async def test_seven_processes_train_through_two_aggregators(tmp_path: Path) -> None:
    async with local_swarm(tmp_path, extra_args=["--trust-any"]) as swarm:
        boot = await swarm.start_bootstrap()
        await swarm.add_workers(WORKERS, deadline_s=120)
        assert (await create_run(swarm, boot.addr, tmp_path, SPEC))["nodes_reached"] == WORKERS
        statuses = await wait_for(
            swarm, swarm.workers,
            lambda s: len(s) == WORKERS and all(st.get("phase") == "finished" for st in s.values()), 480)

    assert committed(statuses) == ROUNDS
    shepherd = next(st for st in statuses.values() if st.get("is_shepherd"))
    history = shepherd["history"]
    assert [h["round"] for h in history] == list(range(1, ROUNDS + 1))
    assert {st["theta"] for st in statuses.values()} == {history[-1]["theta"]}  # one θ everywhere
    # the shepherd took two partials a round and no worker's Δ alone (its own went to a group too)
    agg = shepherd["aggregation"]
    assert agg["partials_combined"] >= 2 * (ROUNDS - 1), agg
    sent = sum(st["aggregation"]["partials_sent"] for st in statuses.values())
    assert sent >= 2 * ROUNDS - 1
    # every partial replayed by another member to the same bytes; nobody banned
    replays = [st["aggregation"]["partial_replays"] for st in statuses.values()]
    assert sum(r.get("match", 0) for r in replays) >= 2 * (ROUNDS - 2), replays
    assert not any(r.get("mismatch") for r in replays)
    assert all(st["banned"] == 0 for st in statuses.values())
    assert history[-1]["val_loss"] < history[0]["val_loss"]
    print(f"aggregation at the shepherd: {agg}; replays {replays}; participants {[h['participants'] for h in history]}")

"""Overlap over real libp2p on 127.0.0.1, every node its own process: early runs are adopted.

Three workers train with ``round.overlap = true``: each starts round r+1 while its Δ of
round r travels, and the run still commits every round with everyone on one θ.
The rules are tested in ``test_diloco_overlap.py``, the engine's shift in ``test_overlap_engine.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_training_swarm import create_run, wait_for

from pcp_p2p.node.local_swarm import local_swarm

pytestmark = pytest.mark.timeout(420)

ROUNDS = 6
SPEC = f"""
name = "overlap"
[model]
preset = "tiny"
[inner]
lr = 3e-3
[round]
time_budget_s = 2.0
max_inner_steps = 200
deadline_s = 12.0
rounds = {ROUNDS}
min_quorum = 2
overlap = true
[aggregation]
audit_rate = 0.0
"""


async def test_overlapped_rounds_commit_every_round_on_one_theta(tmp_path: Path) -> None:
    async with local_swarm(tmp_path, extra_args=["--trust-any"]) as swarm:
        boot = await swarm.start_bootstrap()
        await swarm.add_workers(3, deadline_s=60)
        await create_run(swarm, boot.addr, tmp_path, SPEC)
        statuses = await wait_for(
            swarm, swarm.workers, lambda s: all(st.get("phase") == "finished" for st in s.values()), 300)

    history = next(iter(statuses.values()))["history"]
    assert [h["round"] for h in history] == list(range(1, ROUNDS + 1))
    assert {st["theta"] for st in statuses.values()} == {history[-1]["theta"]}
    assert history[-1]["val_loss"] < history[0]["val_loss"]  # it learns
    # Every worker trained most rounds early (the first round cannot be; a round that the
    # roster or a late commit changed is trained when announced), and those rounds counted.
    for st in statuses.values():
        print("overlapped", st["overlapped_rounds"], "contributed", st["contributed_rounds"],
              "utilisation", st["utilisation"], "tau", st["overlap_tau"])
        assert 0 <= st["overlap_tau"] < 1  # every adopted run trained after its shift
        assert st["overlapped_rounds"] >= ROUNDS // 2, st["overlapped_rounds"]
        assert len(st["contributed_rounds"]) >= ROUNDS - 1
    # Each commit after the first reached the other workers as its update (the applied outer step, int8):
    # they built its checkpoint from the one before instead of fetching it (the first has no
    # checkpoint before it; the shepherd holds its own).
    for peer, st in statuses.items():
        print("checkpoints", st["checkpoints"])
        if peer != st["shepherd"]:
            assert st["checkpoints"]["rebuilt"] >= ROUNDS - 2, st["checkpoints"]

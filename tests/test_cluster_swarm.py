"""``mpiexec -n 2 pcp node join``: a worker group joins a loopback swarm as ONE worker and the run commits.

Bootstrap + one plain worker (a shepherd candidate) + the group, every node its own
process on 127.0.0.1, the group's two ranks started by the mpich wheel's mpiexec
from this environment. Slow (the shepherd compiles, three processes start, two
rounds run): the equivalence and failure tests in test_cluster.py cover the
group's arithmetic in the default run.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import trio
from test_training_swarm import create_run, wait_for

from pcp_p2p.core.launch import without_launch
from pcp_p2p.node.local_swarm import local_swarm
from pcp_p2p.node.status import to_json

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(420)]

MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
SPEC = """
name = "group-run"
[model]
preset = "tiny"
[inner]
batch_size = 4
seq_len = 32
[round]
time_budget_s = 3.0
max_inner_steps = 100
deadline_s = 30.0
rounds = 2
min_quorum = 1
[aggregation]
audit_rate = 1.0
"""
# every submission is audited: the plain worker replays the group's rounds (its split, part by part, from the
# rank states the group serves over MPI) and the group's rank 0 replays the plain worker's


async def test_a_two_rank_group_trains_as_one_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):  # this test may itself run under a launcher
        if k not in without_launch(os.environ):
            monkeypatch.delenv(k)
    async with local_swarm(tmp_path, extra_args=["--trust-any"]) as swarm:
        boot = await swarm.start_bootstrap()
        plain = await swarm.add_worker()
        group = await swarm.add_worker(["--group-timeout", "10"],
                                       prefix=[MPIEXEC, "-disable-auto-cleanup", "-n", "2"])
        await swarm.wait_views({plain.peer_id, group.peer_id}, deadline_s=60)
        await create_run(swarm, boot.addr, tmp_path, SPEC)
        statuses = await wait_for(swarm, [plain, group],
                                  lambda s: len(s) == 2 and all(st.get("phase") == "finished" for st in s.values())
                                  and all(st.get("audits", {}).get("match", 0) >= 1 for st in s.values()),
                                  300)
        node = to_json(await swarm.status(group))
        peers = {m["peer_id"]: m for m in node["members"]}
        # the group's record, as the other node sees it
        plain_view = to_json(await swarm.status(plain))
        seen = {m["peer_id"]: m for m in plain_view["members"]}[group.peer_id]["capabilities"]
        group.signal(signal.SIGTERM)  # a clean leave: rank 0 stops the other rank
        with trio.fail_after(30):
            assert await group.process.wait() == 0  # type: ignore[union-attr]
    del peers
    for st in statuses.values():  # each audited the other, and every replay matched
        assert st["audits"].get("match", 0) >= 1 and not st["audits"].get("mismatch"), st["audits"]
    run = statuses[group.peer_id]
    history = run["history"]
    assert [h["round"] for h in history] == [1, 2]
    assert run["contributed_rounds"]  # the group's one Δ went into a commit
    g = node["group"]
    assert g["size"] == 2 and g["live"] == 2 and g["rounds"] >= 1
    last = g["last_round"]
    assert last["ranks"] == [0, 1]  # both ranks trained...
    assert last["tokens"] == last["steps"] * 4 * 32 > 0  # ...and the tokens add up (B·T per step)
    assert sum(r["steps"] for r in g["ranks"]) == last["steps"]
    assert seen["group_ranks"] == 2 and len(seen["group_devices"]) == 2 and seen["group_gflops"] > 0

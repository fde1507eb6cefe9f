"""Nodes that always stop, announce it, and catch up: over real libp2p on 127.0.0.1, every node its own process.

Four workers train. A worker is stopped with SIGTERM mid-run: it exits cleanly within a
bound, its departure reaches the shepherd, and the round in flight does not wait out its
deadline for it. Then the shepherd itself is stopped with SIGTERM (a holder leaving its
term): it exits within the bound too, and the run goes on under a new term. The first
worker comes back with the same data dir only after the run has finished, and still ends
on the run's final θ. Finally every node, the holder of the last (now stale) term among
them, stops within the bound after SIGTERM.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import trio
from test_training_swarm import committed, create_run, wait_for

from pcp_p2p.node.local_swarm import LocalSwarm, NodeProcess, local_swarm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(720)]

STOP_BOUND_S = 15.0  # SIGTERM to exit; the watchdog (10 s) would exit 143 instead of 0
ROUNDS = 6
DEADLINE_S = 120.0  # long: a round that waited for a leaver would show
SPEC = f"""
name = "stops"
[model]
preset = "tiny"
[round]
time_budget_s = 2.0
max_inner_steps = 200
deadline_s = {DEADLINE_S}
rounds = {ROUNDS}
min_quorum = 2
[election]
rotate_every = 0
"""


async def stop(swarm: LocalSwarm, proc: NodeProcess) -> int:
    """SIGTERM, and the exit status, which must come within STOP_BOUND_S."""
    assert proc.process is not None
    with trio.fail_after(STOP_BOUND_S):
        await swarm.kill(proc, signal.SIGTERM)
    return proc.process.returncode


def log_of(proc: NodeProcess) -> str:
    assert proc.log_path is not None
    return proc.log_path.read_text(errors="replace")


async def test_nodes_stop_announce_their_departure_and_catch_up_after_the_run(tmp_path: Path) -> None:
    async with local_swarm(tmp_path, extra_args=["--trust-any"]) as swarm:
        boot = await swarm.start_bootstrap()
        await swarm.add_workers(4, deadline_s=60)
        await create_run(swarm, boot.addr, tmp_path, SPEC)

        # A worker that is not the shepherd leaves mid-run.
        statuses = await wait_for(swarm, swarm.workers, lambda s: committed(s) >= 1, 300)
        shepherd_id = next(s["shepherd"] for s in statuses.values() if s.get("shepherd"))
        leaver = next(w for w in swarm.workers if w.peer_id != shepherd_id)
        before = committed(statuses)
        left_at = time.monotonic()
        assert await stop(swarm, leaver) == 0  # a clean leave, not the watchdog's 143

        # The shepherd heard it, and the round in flight did not wait out its deadline.
        live = [w for w in swarm.workers if w.running]
        statuses = await wait_for(swarm, live, lambda s: committed(s) >= before + 1, DEADLINE_S)
        assert time.monotonic() - left_at < DEADLINE_S
        shepherd = next(w for w in live if w.peer_id == shepherd_id)
        assert f"{leaver.peer_id} left the run" in log_of(shepherd)

        # The shepherd leaves too: its term ends on the others at once, and a new term goes on.
        term_before = max(s.get("term") or 0 for s in statuses.values())
        assert await stop(swarm, shepherd) == 0
        live = [w for w in swarm.workers if w.running]
        statuses = await wait_for(
            swarm, live, lambda s: all(st.get("phase") == "finished" for st in s.values()), 400)
        history = next(iter(statuses.values()))["history"]
        assert [h["round"] for h in history] == list(range(1, ROUNDS + 1))  # 1-based, as people count
        final_theta = history[-1]["theta"]
        assert {st["theta"] for st in statuses.values()} == {final_theta}
        assert history[-1]["term"] > term_before
        assert all(f"{shepherd_id} left the run" in log_of(w) for w in live)

        # The worker that left comes back after the end, with the same data dir: it catches up.
        await swarm.restart(leaver)
        back = await wait_for(swarm, [leaver], lambda s: s.get(leaver.peer_id, {}).get("phase") == "finished", 180)
        assert back[leaver.peer_id]["theta"] == final_theta

        # Everyone stops within the bound, the holder of the last (stale) term too.
        last_holder = history[-1]["shepherd"]
        assert last_holder in {w.peer_id for w in live}
        for w in [*live, leaver]:
            assert await stop(swarm, w) == 0, w.name

"""DiLoCo over real libp2p on 127.0.0.1, every node its own process.

Bootstrap + 3 workers train the tiny GPT on Shakespeare; one worker is
SIGKILLed mid-round and the run goes on without it; a fresh node joins after
round 3 and contributes to a later round; validation loss falls and every live
node ends holding the same committed θ.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio

from pcp_p2p.core.errors import PcpError
from pcp_p2p.diloco.run.pins import KEEP_ROUNDS
from pcp_p2p.node.local_swarm import LocalSwarm, NodeProcess, local_swarm, pcp_command
from pcp_p2p.node.status import to_json

pytestmark = pytest.mark.timeout(420)

ROUNDS = 14
SPEC = f"""
name = "test"
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
"""


async def run_status(swarm: LocalSwarm, proc: NodeProcess) -> dict[str, Any]:
    try:
        return to_json(await swarm.status(proc, timeout=5)).get("run") or {}
    except PcpError:
        return {}


async def wait_for(swarm: LocalSwarm, procs: list[NodeProcess], predicate, deadline_s: float) -> dict[str, dict]:  # type: ignore[no-untyped-def]
    """Poll the nodes' run status (no cross-process event exists) until ``predicate`` holds."""
    with trio.fail_after(deadline_s):
        while True:
            statuses = {p.peer_id: await run_status(swarm, p) for p in procs if p.running}
            if predicate(statuses):
                return statuses
            await trio.sleep(0.5)


def committed(statuses: dict[str, dict]) -> int:
    return max((len(s.get("history", [])) for s in statuses.values()), default=0)


async def create_run(swarm: LocalSwarm, boot_addr: str, tmp_path: Path, spec: str) -> dict[str, Any]:
    (tmp_path / "run.toml").write_text(spec)
    created = await trio.to_thread.run_sync(lambda: subprocess.run(
        [*pcp_command(), "run", "create", str(tmp_path / "run.toml"), "--bootstrap", boot_addr,
         "--data-dir", str(tmp_path / "owner"), "--json"], capture_output=True, text=True, timeout=120))
    assert created.returncode == 0, created.stderr
    return json.loads(created.stdout)


async def test_training_survives_a_kill_and_a_late_joiner(tmp_path: Path) -> None:
    async with local_swarm(tmp_path, extra_args=["--trust-any"]) as swarm:
        boot = await swarm.start_bootstrap()
        await swarm.add_workers(3, deadline_s=60)
        assert (await create_run(swarm, boot.addr, tmp_path, SPEC))["nodes_reached"] == 3

        # Round 1 commits with everyone; then kill a worker that is not the shepherd, mid-round.
        statuses = await wait_for(swarm, swarm.workers, lambda s: committed(s) >= 1, 180)
        shepherd = next(s["shepherd"] for s in statuses.values() if s)
        victim = next(w for w in swarm.workers if w.peer_id != shepherd)
        await swarm.kill(victim, signal.SIGKILL)

        # The run goes on without it; after round 3 a fresh node joins.
        live = [w for w in swarm.workers if w.running]
        await wait_for(swarm, live, lambda s: committed(s) >= 3, 120)
        fresh = await swarm.add_worker()
        statuses = await wait_for(
            swarm, [*live, fresh],
            lambda s: all(st.get("phase") == "finished" for st in s.values()) and len(s) == 3, 240,
        )

    history = statuses[live[0].peer_id]["history"]
    assert [h["round"] for h in history] == list(range(1, ROUNDS + 1))  # every round committed, none lost (1-based)
    assert history[-1]["val_loss"] < history[0]["val_loss"]  # it learns
    # Everyone alive holds the last committed θ.
    assert {st["theta"] for st in statuses.values()} == {history[-1]["theta"]}
    # The killed worker is missing from the rounds after its death; the run did not wait for it.
    assert all(h["participants"] <= 3 for h in history)
    # The fresh node joined after round 3 and contributed to a later round.
    fresh_status = statuses[fresh.peer_id]
    assert fresh_status["contributed_rounds"] and min(fresh_status["contributed_rounds"]) >= 4
    # Pins do not grow with the rounds: the run's dataset and artifacts, plus the θs and
    # checkpoints of the last few commits (pcp_p2p/diloco/run/pins.py); older ones are cache.
    for w in live:
        pins = (w.data_dir / "blobs" / "pins").read_text().split()
        assert 0 < len(pins) <= 3 + 2 * (KEEP_ROUNDS + 2), pins
    print(f"late joiner's time to first contribution: {fresh_status['first_contribution_s']} s")

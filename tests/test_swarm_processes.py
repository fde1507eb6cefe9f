"""Integration over real libp2p on 127.0.0.1 with every node in its own process."""

from __future__ import annotations

import datetime
import re
import signal
import time
from pathlib import Path

import pytest
import trio

from pcp_p2p.net.membership import DEFAULT_TIMEOUT_S
from pcp_p2p.node.local_swarm import local_swarm

pytestmark = pytest.mark.timeout(240)


async def test_eight_nodes_see_each_other_leave_on_kill_and_rejoin_with_same_id(tmp_path: Path) -> None:
    async with local_swarm(tmp_path) as swarm:
        await swarm.start_bootstrap()
        ids = {w.peer_id for w in await swarm.add_workers(8, deadline_s=90)}
        assert len(ids) == 8

        # SIGKILL: no goodbye; every view must drop the node within the timeout
        # (plus the time a poll round and one heartbeat interval can add).
        victim = swarm.workers[3]
        await swarm.kill(victim, signal.SIGKILL)
        took = await swarm.wait_views(ids - {victim.peer_id}, deadline_s=DEFAULT_TIMEOUT_S + 10)
        print(f"killed node left every view after {took:.1f} s (timeout {DEFAULT_TIMEOUT_S} s)")

        # Restarted with the same data dir: same identity, back in every view.
        old_id = victim.peer_id
        await swarm.restart(victim)
        assert victim.peer_id == old_id
        await swarm.wait_views(ids, deadline_s=60)

        # SIGTERM leaves cleanly (exit code 0) and no process is left behind.
        leaver = swarm.workers[0]
        await swarm.kill(leaver, signal.SIGTERM)
        assert leaver.process is not None and leaver.process.returncode == 0


async def test_several_bootstrap_addresses_work_while_one_answers(tmp_path: Path) -> None:
    async with local_swarm(tmp_path) as swarm:
        boot = await swarm.start_bootstrap()
        dead = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWDyG8TR9AnbB2jHjZs94tWWT8KXoFXvFNgqrSrRLSviNv"
        a = await swarm.add_worker(["--bootstrap", dead])
        b = await swarm.add_worker(["--bootstrap", dead])
        await swarm.wait_views({a.peer_id, b.peer_id}, deadline_s=60)
        assert boot.running


def _left_lines(swarm) -> int:  # type: ignore[no-untyped-def]
    return sum(p.log_path.read_text(errors="replace").count("member left")
               for p in swarm.all_processes() if p.log_path is not None and p.log_path.exists())


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_thirty_two_idle_nodes_stay_stable_for_five_minutes_and_a_killed_one_leaves_every_view(
    tmp_path: Path,
) -> None:
    """Issue #18: 32 node processes and a bootstrap on a 2-core machine converge, hold
    their views for 5 idle minutes with no flap, and drop a SIGKILLed node in time."""
    async with local_swarm(tmp_path) as swarm:
        await swarm.start_bootstrap()
        ids = {w.peer_id for w in await swarm.add_workers(32, deadline_s=300)}
        before = _left_lines(swarm)
        await trio.sleep(300)  # the measured window itself, not a wait for an event
        # Counted before any request disturbs the idle swarm: 32 status calls at once (32
        # libp2p hosts and Noise handshakes in this process) starve 2 cores for seconds,
        # enough for probes to go unanswered; so the views are read one node at a time.
        left = _left_lines(swarm)
        views: dict = {}
        for p in swarm.workers:
            views.update(await swarm.views([p], timeout=30))
        assert left == before, "a member left and came back (a flap) while idle"
        assert None not in views.values(), "a node did not answer its status request"
        assert all(v == ids for v in views.values()), "a view changed during the idle window"
        victim = swarm.workers[7]
        killed_at = time.time()
        await swarm.kill(victim, signal.SIGKILL)
        took = await swarm.wait_views(ids - {victim.peer_id}, deadline_s=2 * DEFAULT_TIMEOUT_S + 10)
        # The status polls add their own delay (32 calls a round); each node's log line
        # says when it dropped the victim, to the second: an upper bound without it.
        dropped = _dropped_at(swarm, victim.peer_id, killed_at)
        by_logs = max(dropped) + 1.0 - killed_at
        print(f"killed node left every view after {took:.1f} s by polling, at most {by_logs:.1f} s "
              f"by the nodes' own logs (stated detection time {DEFAULT_TIMEOUT_S:g} s)")
        assert len(dropped) == 31 and by_logs <= DEFAULT_TIMEOUT_S


def _dropped_at(swarm, peer_id: str, after: float) -> list[float]:  # type: ignore[no-untyped-def]
    """Per surviving worker, when (epoch seconds, to the second) it logged "member left: <peer_id>"
    last after ``after``; the log's clock is this machine's, its stamps HH:MM:SS local time."""
    pattern = re.compile(rf"^(\d\d):(\d\d):(\d\d) I pcp.node: member left: {re.escape(peer_id)} \(dead", re.M)
    day = datetime.datetime.fromtimestamp(after).replace(hour=0, minute=0, second=0, microsecond=0)
    out = []
    for p in swarm.workers:
        if p.peer_id == peer_id or p.log_path is None or not p.log_path.exists():
            continue
        stamps = [(day + datetime.timedelta(hours=int(h), minutes=int(m), seconds=int(s))).timestamp()
                  for h, m, s in pattern.findall(p.log_path.read_text(errors="replace"))]
        stamps = [t + 86400 if t < after - 43200 else t for t in stamps]  # past midnight
        later = [t for t in stamps if t >= int(after)]
        if later:
            out.append(max(later))
    return out

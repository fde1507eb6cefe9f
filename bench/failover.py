"""Shepherd failover: time from SIGKILL of the shepherd to the next committed round.

A bootstrap server and ``--workers`` node processes on 127.0.0.1 train the tiny
GPT with rotation off, so terms change only by failover. Each time a round has
committed, the current shepherd is SIGKILLed (a stopwatch starts) and the
stopwatch stops when the next round commits under a new term; the killed node is
then restarted with its data dir and rejoins as a worker. Repeated ``--kills``
times; the headline is the median, printed beside the lease duration (the old
bound: failover waited for the lease to lapse; now followers fail over after
missing the shepherd's direct heartbeats, see docs/election.md). Target: the
issue's goal, 3 s.

Before each kill the bench waits until every live node but the shepherd reports a
hot standby (``run.standby`` in its status: artifacts cached and the evaluator
built and compiled), since that is the state a takeover is designed for; the
waits are printed (``standby_wait_s``). The stopwatch stops at the earliest time
a live node accepted the new term's first commit (``run.history[].at``, the
nodes' own wall clocks on this machine): the status poll notices it up to a
sweep later (``polled_s``, printed beside it).

Baseline measured in the same run: the median time between two consecutive
commits with no kill, so the figure can be read as "how much longer than a
normal round a failover costs".

    .venv/bin/python bench/failover.py [--workers 4] [--kills 3]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

LEASE_S = 6.0
GOAL_S = 3.0  # issue #20: at most this from SIGKILL to the next committed round (median)


def keep_logs(root: Path, keep: Path) -> None:
    keep.mkdir(parents=True, exist_ok=True)
    for log in root.glob("*.log"):
        (keep / log.name).write_bytes(log.read_bytes())


async def main(args: argparse.Namespace) -> dict:
    from pcp_p2p.core.errors import PcpError
    from pcp_p2p.node.local_swarm import local_swarm, pcp_command
    from pcp_p2p.node.status import to_json

    spec = f"""
name = "bench-failover"
[model]
preset = "tiny"
[round]
time_budget_s = 2.0
max_inner_steps = 200
deadline_s = 12.0
rounds = 1000
min_quorum = 2
[election]
lease_s = {LEASE_S}
renew_every_s = 2.0
grace_s = 1.0
rotate_every = 0
"""
    with tempfile.TemporaryDirectory(prefix="pcp-bench-failover-") as tmp:
        root = Path(tmp)
        async with local_swarm(root, extra_args=["--trust-any"]) as swarm:
            boot = await swarm.start_bootstrap()
            await swarm.add_workers(args.workers, deadline_s=60)
            (root / "run.toml").write_text(spec)
            await trio.to_thread.run_sync(lambda: subprocess.run(
                [*pcp_command(), "run", "create", str(root / "run.toml"), "--bootstrap", boot.addr,
                 "--data-dir", str(root / "owner")], check=True, capture_output=True, timeout=120))

            async def runs() -> list[dict]:
                """The ``run`` part of every live node's status (nodes that do not answer left out)."""
                out = []
                for w in swarm.workers:
                    if not w.running:
                        continue
                    try:
                        out.append(to_json(await swarm.status(w, timeout=5)).get("run") or {})
                    except PcpError:
                        continue
                    except BaseExceptionGroup:
                        # fetch_status's throwaway host, cancelled at its deadline on a
                        # loaded machine, can surface as a group of Cancelled from py-libp2p's
                        # services: no answer from this node this time (an outer
                        # cancellation is re-raised at the next checkpoint anyway).
                        continue
                return out

            async def latest() -> tuple[int, int, str | None, list[dict]]:
                """(rounds committed, term of the last commit, shepherd, every node's run), as the
                live nodes report it."""
                best: tuple[int, int, str | None] = (0, -1, None)
                got = await runs()
                for run in got:
                    hist = run.get("history") or []
                    if hist and len(hist) > best[0]:
                        best = (len(hist), hist[-1]["term"], run.get("shepherd"))
                return (*best, got)

            async def wait_commits(at_least: int, timeout: float) -> tuple[int, int, str | None, list[dict]]:
                with trio.fail_after(timeout):
                    while True:
                        got = await latest()
                        if got[0] >= at_least:
                            return got
                        await trio.sleep(0.25)

            async def wait_standby(timeout: float) -> float:
                """Until every live node but the shepherd reports a hot standby (artifacts and
                evaluator built: a takeover costs no compile); the seconds it took."""
                t = time.monotonic()
                with trio.fail_after(timeout):
                    while True:
                        got = await runs()
                        if len(got) == sum(w.running for w in swarm.workers) and all(
                                r.get("standby") or r.get("is_shepherd") for r in got):
                            return time.monotonic() - t
                        await trio.sleep(0.5)

            try:
                # Baseline: time between consecutive commits with no kill.
                n0, _, _, _ = await wait_commits(2, 240)
                gaps = []
                for _ in range(3):
                    t = time.monotonic()
                    n0, _, _, _ = await wait_commits(n0 + 1, 60)
                    gaps.append(time.monotonic() - t)

                times, polled, standby_waits = [], [], []
                for k in range(args.kills):
                    standby_waits.append(await wait_standby(300))
                    n0, term0, shepherd, _ = await wait_commits(n0, 60)
                    victim = next(w for w in swarm.workers if w.peer_id == shepherd and w.running)
                    t, killed_at = time.monotonic(), time.time()
                    await swarm.kill(victim, signal.SIGKILL)
                    while True:
                        n1, term1, _, got = await wait_commits(n0 + 1, 240)
                        if term1 > term0:
                            break
                        n0 = n1  # a round the old term had already closed; wait for the new term's
                    polled.append(time.monotonic() - t)
                    # When the first node accepted the new term's first commit (the nodes' wall clocks,
                    # on this machine): the poll above only notices it up to a status sweep later.
                    ats = [h["at"] for r in got for h in r.get("history") or []
                           if h["term"] > term0 and h.get("at") is not None]
                    times.append(min(ats) - killed_at if ats else polled[-1])
                    print(f"kill {k + 1}: next commit under term {term1} after {times[-1]:.2f} s "
                          f"(noticed by polling after {polled[-1]:.1f} s)", file=sys.stderr)
                    await swarm.restart(victim)
                    n0 = n1
            finally:
                if args.keep_logs:
                    await trio.to_thread.run_sync(keep_logs, root, Path(args.keep_logs))
    med = statistics.median(times)
    return {
        "headline": round(med, 2),
        "target": GOAL_S,
        "better": "lower",
        "unit": "s (SIGKILL of the shepherd to the next committed round, median)",
        "lease_s": LEASE_S,
        "kills": len(times),
        "times_s": [round(x, 2) for x in times],
        "spread_s": round(max(times) - min(times), 2),
        "polled_s": [round(x, 2) for x in polled],
        "standby_wait_s": [round(x, 1) for x in standby_waits],
        "baseline_round_gap_s": round(statistics.median(gaps), 2),
        "vs_lease": round(med / LEASE_S, 2),
        "workers": args.workers,
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--keep-logs", metavar="DIR",
                    help="copy every node's log here at the end (to see where the time went)")
    result = trio.run(main, ap.parse_args())
    print(json.dumps(result))

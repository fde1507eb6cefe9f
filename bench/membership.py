"""Membership cost of an idle swarm: CPU per node as the swarm grows.

For each N in ``--sizes`` (default 4 8 16 32): a bootstrap server and N idle
``pcp node join`` processes on 127.0.0.1. Once every node's view holds all N
(``convergence_s``), the CPU each node process spends (user + system, from
``/proc/PID/stat``) is measured over ``--window`` seconds, and the membership
messages each node sent and received in that window are read from its status
(``msgs_per_node_s``). A flap is a node dropping a live peer from its view
(``member left`` in its log) inside the window. Then one node is SIGKILLed and
the time until it has left every other view is ``detection_s``.

The baseline, measured in the same run, is the per-node CPU at the smallest N:
``cpu_growth`` = per-node CPU at the largest N / per-node CPU at the smallest.

Headline: CPU per idle node at N = 32, in % of a core (issue #18: goal <= 2).

    .venv/bin/python bench/membership.py [--sizes 4 8 16 32] [--window 60]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path

import trio

TARGET_CPU_PCT = 2.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (children not included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def count_left(log_path: Path | None) -> int:
    if log_path is None or not log_path.exists():
        return 0
    return log_path.read_text(errors="replace").count("member left")


async def measure(n: int, window: float, root: Path) -> dict:
    from pcp_p2p.node.local_swarm import local_swarm
    from pcp_p2p.node.status import to_json

    async with local_swarm(root) as swarm:
        boot = await swarm.start_bootstrap()
        t0 = trio.current_time()
        # Each status fetch starts a libp2p host here (a key, a Noise handshake): polling 32
        # nodes every 0.5 s would load the machine more than the swarm does. Poll less as N grows.
        poll = max(0.5, n / 8)
        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(swarm.add_worker)
        await swarm.wait_views({w.peer_id for w in swarm.workers}, deadline_s=120 + 8 * n, poll_s=poll)
        convergence = trio.current_time() - t0
        print(f"N={n}: converged in {convergence:.1f} s", file=sys.stderr)
        await trio.sleep(5)  # let start-up work (capability probes, first DHT puts) settle

        procs = [boot, *swarm.workers]
        left0 = {p.name: count_left(p.log_path) for p in procs}
        msgs0 = {}
        for p in swarm.workers:
            st = to_json(await swarm.status(p, timeout=20))
            msgs0[p.name] = st.get("network", {}).get("membership_msgs", 0)
        cpu0 = {p.name: cpu_seconds(p.process.pid) for p in procs}  # type: ignore[union-attr]
        w0 = trio.current_time()
        await trio.sleep(window)
        cpu1 = {p.name: cpu_seconds(p.process.pid) for p in procs}  # type: ignore[union-attr]
        elapsed = trio.current_time() - w0
        msgs1 = {}
        for p in swarm.workers:
            st = to_json(await swarm.status(p, timeout=20))
            msgs1[p.name] = st.get("network", {}).get("membership_msgs", 0)
        flaps = sum(count_left(p.log_path) - left0[p.name] for p in procs)
        per_node = [100 * (cpu1[p.name] - cpu0[p.name]) / elapsed for p in swarm.workers]
        boot_pct = 100 * (cpu1[boot.name] - cpu0[boot.name]) / elapsed
        msgs = [(msgs1[k] - msgs0[k]) / elapsed for k in msgs1]

        victim = swarm.workers[-1]
        rest = {w.peer_id for w in swarm.workers[:-1]}
        await swarm.kill(victim, signal.SIGKILL)
        detection = await swarm.wait_views(rest, deadline_s=120, poll_s=max(0.25, n / 16))
        row = {
            "n": n,
            "cpu_per_node_pct": round(statistics.mean(per_node), 2),
            "cpu_per_node_max_pct": round(max(per_node), 2),
            "cpu_bootstrap_pct": round(boot_pct, 2),
            "msgs_per_node_s": round(statistics.mean(msgs), 2) if msgs else None,
            "flaps": flaps,
            "convergence_s": round(convergence, 1),
            "detection_s": round(detection, 1),
        }
        print(json.dumps(row), file=sys.stderr)
        return row


async def main(args: argparse.Namespace) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(prefix="pcp-bench-membership-") as tmp:
        for n in args.sizes:
            rows.append(await measure(n, args.window, Path(tmp) / f"n{n}"))
    small, large = rows[0], rows[-1]
    return {
        "headline": large["cpu_per_node_pct"],
        "target": TARGET_CPU_PCT,
        "better": "lower",
        "unit": f"% of a core per idle node at N={large['n']}",
        "cpu_growth": round(large["cpu_per_node_pct"] / max(small["cpu_per_node_pct"], 1e-9), 2),
        "cpu_growth_target": 1.5,
        "msgs_per_node_s": large["msgs_per_node_s"],
        "flaps": sum(r["flaps"] for r in rows),
        "convergence_s": large["convergence_s"],
        "detection_s": large["detection_s"],
        "window_s": args.window,
        "rows": rows,
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--window", type=float, default=60.0, help="seconds of idle CPU measured per size")
    print(json.dumps(trio.run(main, ap.parse_args())))

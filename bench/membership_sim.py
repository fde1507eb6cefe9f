"""Membership at planetary scale: 10,000 real SWIM machines in virtual time, 1% message loss.

The machines are :class:`pcp_p2p.net.membership.Membership`, the class every
node runs, carried by :class:`pcp_p2p.testing.swim_net.SwimNet` (an in-memory
network that drops each packet with probability ``--loss``). Views start as a
random sample of ``--view`` members each (a swarm that has been running a while;
partial views, as a node of a 10,000-node swarm keeps). After ``--warmup``
seconds, ``--kills`` nodes are killed one by one, spread over the measured
window, and the run goes on until each has left every view or ``--window`` ends.

Figures (issue #18's goals): messages each node sends per second (requests and
replies, goal <= 20), the median time from a kill to the node leaving the last
view that held it (goal <= 10 s; beside it ``noticed_median_s``, the median over
each holder of the time it took that holder to drop the victim), and the share of suspicions of *live* nodes
that ended in them being declared dead (goal <= 0.1%).

Baseline, measured in the same run: the same machines at ``--baseline-n`` (100)
nodes, so the per-node rate's growth from 100 to 10,000 nodes is shown as
``msg_growth`` (flat is the point).

    .venv/bin/python bench/membership_sim.py [--n 10000] [--loss 0.01]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from pcp_p2p.net.membership import MemberLeft, SwimConfig
from pcp_p2p.testing.swim_net import SwimNet

TARGET_DETECTION_S = 10.0


def simulate(n: int, args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    config = SwimConfig(max_view=args.view * 2)
    net = SwimNet(n, seed=args.seed, loss=args.loss, config=config, cached=True)
    net.seed_views(min(args.view, n - 1))
    setup_s = time.perf_counter() - t0
    net.run(args.warmup, dt=args.dt)
    base_sent = sum(net.sent_by.values())
    base_now = net.now
    rng = random.Random(args.seed)
    victims = rng.sample(sorted(net.nodes), args.kills)
    kill_at = {v: base_now + 1.0 + i * (args.window / 2) / max(1, args.kills) for i, v in enumerate(victims)}
    holders: dict[str, set[str]] = {}
    gone_at: dict[str, float] = {}
    noticed: list[float] = []  # per (victim, holder): when that holder dropped the victim
    end = base_now + args.window
    # Measure the whole window, then go on (up to a minute) until every victim has left every view.
    while net.now < end - 1e-9 or (len(gone_at) < len(victims) and net.now < end + 60):
        net.step(args.dt)
        for v, at in kill_at.items():
            if v not in holders and net.now >= at:
                net.kill(v)
                holders[v] = {p for p in net.live_ids() if v in net.nodes[p].machine}
        for v, hs in holders.items():
            if v in gone_at:
                continue
            dropped = {p for p in hs if not net.nodes[p].alive or v not in net.nodes[p].machine}
            for p in dropped:
                if net.nodes[p].alive:
                    noticed.append(net.now - kill_at[v])
            hs -= dropped
            if not hs:
                gone_at[v] = net.now - kill_at[v]
    elapsed = net.now - base_now
    sent = sum(net.sent_by.values()) - base_sent
    live = net.live_ids()
    false_confirms = sum(
        1 for p in live for ev in net.nodes[p].left
        if isinstance(ev, MemberLeft) and ev.reason == "dead" and net.nodes[ev.peer_id].alive
    )
    suspicions = sum(net.nodes[p].machine.stats.suspicions for p in net.nodes)
    detections = [gone_at.get(v, float("inf")) for v in victims]
    row = {
        "n": n,
        "msgs_per_node_s": round(sent / len(net.nodes) / elapsed, 2),
        "detection_median_s": round(statistics.median(detections), 2),
        "noticed_median_s": round(statistics.median(noticed), 2) if noticed else None,
        "detection_max_s": round(max(detections), 2) if all(d < float("inf") for d in detections) else None,
        "undetected": sum(d == float("inf") for d in detections),
        "suspicions": suspicions,
        "false_confirmed": false_confirms,
        "false_confirmed_share": round(false_confirms / max(1, suspicions), 5),
        "packets_dropped": net.dropped,
        "setup_s": round(setup_s, 1),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(row), file=sys.stderr)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--baseline-n", type=int, default=100)
    ap.add_argument("--loss", type=float, default=0.01)
    ap.add_argument("--view", type=int, default=64, help="members each view starts with")
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--dt", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    base = simulate(args.baseline_n, argparse.Namespace(**{**vars(args), "kills": min(args.kills, 5)}))
    big = simulate(args.n, args)
    print(json.dumps({
        "headline": big["detection_median_s"],
        "target": TARGET_DETECTION_S,
        "better": "lower",
        "unit": f"s, median time for a killed node to leave every view, {args.n} nodes, {args.loss:.0%} loss",
        "msgs_per_node_s": big["msgs_per_node_s"],
        "msgs_per_node_s_target": 20,
        "msg_growth": round(big["msgs_per_node_s"] / base["msgs_per_node_s"], 2),
        "false_confirmed_share": big["false_confirmed_share"],
        "false_confirmed_share_target": 0.001,
        "rows": [base, big],
    }))


if __name__ == "__main__":
    main()

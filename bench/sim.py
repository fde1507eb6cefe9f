"""PCP at planetary scale: N real run machines on home links with 30% churn, in virtual time.

Each size runs :func:`pcp_p2p.testing.planet.simulate` (the real
:class:`~pcp_p2p.diloco.run.run_machine.RunMachine` on every node; what is modelled
and how is listed in that module's docstring and in ``docs/sim.md``) in a child
process of its own, one after another, so each size's memory per node is its own.

Figures per N: rounds committed / attempted (``goodput``: the share of announced
round attempts that became a commit on the winning chain), mean virtual seconds
per round, bytes the leading node sent per round (messages and blobs it served),
election convergence (from a vacancy to 95% of live nodes following the new
holder), memory per simulated node, wall and CPU seconds. The smallest N is the
baseline: ``round_time_growth`` and ``shepherd_bytes_growth`` are each size's
figure over the baseline's.

Goal (issue #13): 10,000 nodes, 30% churn over 50 rounds, in at most 600 s of wall
time on 2 cores, goodput >= 0.95. The headline is the largest N's wall seconds.

    .venv/bin/python bench/sim.py [--sizes 1000,3000,10000] [--rounds 50] [--churn 0.3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

TARGET_WALL_S = 600.0
TARGET_GOODPUT = 0.95


def run_one(args: argparse.Namespace) -> None:
    """One size in this process; its figures as one JSON line on stdout."""
    from pcp_p2p.testing.planet import PlanetConfig, simulate

    cpu = time.process_time()
    cfg = PlanetConfig(nodes=args.one, rounds=args.rounds, churn=args.churn, graceful=args.graceful,
                       shepherd_kills=args.shepherd_kills, pool=args.pool, seed=args.seed)
    result = simulate(cfg)
    out = result.as_dict()
    out["cpu_s"] = round(time.process_time() - cpu, 1)
    out["config"] = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("spec", "links")}
    print(json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,3000,10000", help="node counts, smallest first (the baseline)")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--churn", type=float, default=0.3, help="departures over the run, as a share of N")
    ap.add_argument("--graceful", type=float, default=0.1, help="share of departures that announce a Leave")
    ap.add_argument("--shepherd-kills", type=int, default=1, help="extra kills of the leading node")
    ap.add_argument("--pool", type=int, default=16, help="shepherd-capable members")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        run_one(args)
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    rows: dict[int, dict] = {}
    for n in sizes:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--one", str(n), "--rounds", str(args.rounds),
               "--churn", str(args.churn), "--graceful", str(args.graceful),
               "--shepherd-kills", str(args.shepherd_kills), "--pool", str(args.pool), "--seed", str(args.seed)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"the {n}-node run failed (exit {proc.returncode})")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        row["process_wall_s"] = round(time.perf_counter() - t0, 1)
        rows[n] = row
        conv = row["election_convergence_s"]
        print(f"N={n:>6}: {row['rounds_committed']}/{row['rounds_attempted']} rounds committed/attempted "
              f"(goodput {row['goodput']:.3f}), {row['round_time_s']:.1f} s/round, "
              f"shepherd {row['shepherd_bytes_per_round'] / 1e6:.1f} MB/round, "
              f"{row['seated_mean']:.0f} workers/commit, elections {conv} s, "
              f"{row['rss_per_node_kib']:.0f} KiB/node, {row['departures']} departures "
              f"({row['departures'] / n:.0%}), wall {row['wall_s']:.0f} s, cpu {row['cpu_s']:.0f} s",
              flush=True)
    base = rows[sizes[0]]
    print(f"growth over N={sizes[0]} (baseline):")
    growth = {}
    for n, row in rows.items():
        growth[n] = {
            "round_time_growth": round(row["round_time_s"] / base["round_time_s"], 3),
            "shepherd_bytes_growth": round(row["shepherd_bytes_per_round"] / base["shepherd_bytes_per_round"], 3),
        }
        print(f"  N={n:>6} ({n / sizes[0]:.0f}x): round time x{growth[n]['round_time_growth']}, "
              f"shepherd bytes/round x{growth[n]['shepherd_bytes_growth']}")
    top = rows[sizes[-1]]
    summary = {
        "metric": f"sim_{sizes[-1]}_wall_s",
        "headline": top["wall_s"],
        "target": TARGET_WALL_S,
        "better": "lower",
        "unit": "s",
        "goodput": top["goodput"],
        "goodput_target": TARGET_GOODPUT,
        "cpu_s": top["cpu_s"],
        "nodes": sizes[-1],
        "rounds": args.rounds,
        "churn": args.churn,
        "baseline_n": sizes[0],
        "per_n": {str(n): {
            "wall_s": r["wall_s"], "cpu_s": r["cpu_s"], "goodput": r["goodput"],
            "rounds_committed": r["rounds_committed"], "rounds_attempted": r["rounds_attempted"],
            "round_time_s": r["round_time_s"], "shepherd_bytes_per_round": r["shepherd_bytes_per_round"],
            "election_convergence_s": r["election_convergence_s"], "rss_per_node_kib": r["rss_per_node_kib"],
            "workers_per_commit": r["seated_mean"], "departures": r["departures"], **growth[n],
        } for n, r in rows.items()},
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

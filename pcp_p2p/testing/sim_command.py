"""``pcp sim``: one run on N simulated nodes (the planetary simulator, :mod:`pcp_p2p.testing.planet`).

For a quick look at how the protocol behaves at a size; ``bench/sim.py`` runs the
1k/3k/10k series with its baseline and prints the bench's JSON line.
"""

from __future__ import annotations

import argparse
import json

from pcp_p2p.core.errors import ConfigError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sim",
        help="simulate one run on N nodes (real run machines, virtual time, churn)",
        description="Run one DiLoCo run on N simulated nodes in virtual time: every node runs the real run "
        "machine (election, worker, shepherd, signatures, codec) on a home link drawn from a distribution, "
        "with Poisson churn and kills at any phase (see docs/sim.md). Prints rounds committed/attempted, "
        "goodput, round time, shepherd bytes per round, election convergence and memory per node.",
    )
    p.add_argument("--nodes", type=int, default=1000, help="simulated nodes (default 1000)")
    p.add_argument("--rounds", type=int, default=20, help="rounds of the run (default 20)")
    p.add_argument("--churn", type=float, default=0.3, help="departures over the run, as a share of N (default 0.3)")
    p.add_argument("--graceful", type=float, default=0.1,
                   help="share of departures that announce a Leave; the rest are kills (default 0.1)")
    p.add_argument("--shepherd-kills", type=int, default=1, help="extra kills of the leading node (default 1)")
    p.add_argument("--pool", type=int, default=16, help="shepherd-capable members (default 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overlap", action="store_true",
                   help="round.overlap: workers train the next round while their Δ travels (docs/diloco.md)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.set_defaults(func=_cmd_sim)


def _cmd_sim(args: argparse.Namespace) -> int:
    if not 2 <= args.nodes <= 100_000:
        raise ConfigError("--nodes must be between 2 and 100000")
    if not 1 <= args.rounds <= 10_000:
        raise ConfigError("--rounds must be between 1 and 10000")
    if not (0 <= args.churn <= 10 and 0 <= args.graceful <= 1):
        raise ConfigError("--churn must be in [0, 10] and --graceful in [0, 1]")
    if not 1 <= args.pool <= args.nodes:
        raise ConfigError("--pool must be between 1 and --nodes")
    from pcp_p2p.testing.planet import PlanetConfig, simulate

    r = simulate(PlanetConfig(nodes=args.nodes, rounds=args.rounds, churn=args.churn, graceful=args.graceful,
                              shepherd_kills=args.shepherd_kills, pool=args.pool, seed=args.seed,
                              overlap=args.overlap))
    if args.json:
        print(json.dumps(r.as_dict()))
    else:
        print(f"{r.nodes} nodes, {r.rounds} rounds: {r.rounds_committed}/{r.rounds_attempted} committed/attempted "
              f"(goodput {r.goodput:.3f}){'' if r.finished else ', NOT finished'}")
        print(f"  round time {r.round_time_s:.1f} s (virtual), {r.seated_mean:.0f} workers per commit, "
              f"val loss {r.val_loss_first or 0:.4f} -> {r.val_loss_last or 0:.4f}"
              + (f", {r.early_runs} early runs" if args.overlap else ""))
        print(f"  shepherd {r.shepherd_bytes_per_round / 1e6:.2f} MB/round; elections converged in "
              f"{', '.join(f'{x:.1f}' for x in r.election_convergence_s) or '-'} s")
        print(f"  churn: {r.departures} departures ({r.kills} kills), {r.returns} returns")
        print(f"  {r.rss_per_node_kib:.0f} KiB/node, {r.events} events, {r.wall_s:.1f} s wall")
    return 0 if r.finished else 1

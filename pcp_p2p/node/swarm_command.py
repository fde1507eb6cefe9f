"""``pcp swarm``: a whole local swarm with one command (the demo behind ``make demo``).

Starts a bootstrap server and N nodes as separate processes on 127.0.0.1,
waits until every node sees every other, prints each node's view, keeps the
swarm up for ``--seconds`` and stops it, leaving nothing running (also on
Ctrl+C or on failure: every node runs in a process group of its own, killed
when the swarm ends).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import trio

from pcp_p2p.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "swarm",
        help="run a local swarm: a bootstrap server and N nodes as processes on 127.0.0.1",
        description="Start a bootstrap server and N nodes as separate processes on 127.0.0.1, wait "
        "until they all see each other, print what each sees, and stop after --seconds. Nothing is "
        "left running, also on Ctrl+C.",
    )
    p.add_argument("--workers", type=int, default=4, help="number of nodes (default 4)")
    p.add_argument("--seconds", type=float, default=10.0, help="how long to keep the swarm up once formed (default 10)")
    p.add_argument("--dir", type=Path, default=None, help="keep the nodes' data dirs and logs here (default: a temporary dir)")
    p.add_argument("--json", action="store_true", help="end with one JSON line summarising the run")
    p.set_defaults(func=_cmd_swarm)


def _say(msg: str) -> None:
    print(msg, flush=True)


def _cmd_swarm(args: argparse.Namespace) -> int:
    if not 1 <= args.workers <= 64:
        raise ConfigError("--workers must be between 1 and 64")
    summary = trio.run(_run, args)
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["converged"] else 1


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from pcp_p2p.node.local_swarm import local_swarm
    from pcp_p2p.node.status import to_json

    t0 = time.monotonic()
    async with local_swarm(args.dir) as swarm:
        boot = await swarm.start_bootstrap()
        _say(f"bootstrap server  {boot.addr}")
        async with trio.open_nursery() as n:
            for _ in range(args.workers):
                n.start_soon(swarm.add_worker)
        for w in swarm.workers:
            _say(f"node up           {w.peer_id}")
        ids = {w.peer_id for w in swarm.workers}
        _say(f"waiting until all {len(ids)} nodes see each other ...")
        took = await swarm.wait_views(ids, deadline_s=120)
        _say(f"swarm formed in {took:.1f} s; what each node sees:")
        for w in swarm.workers:
            st = to_json(await swarm.status(w))
            net = st["network"]
            _say(f"  {w.peer_id[-12:]}: {len(st['members'])} members, {net['connected_peers']} connections, "
                 f"{net['routing_table_size']} in routing table")
            for m in st["members"]:
                c = m["capabilities"]
                _say(f"      {m['peer_id'][-12:]}  {','.join(c['backends'])}  {c['throughput_gflops']:.0f} GFLOP/s  "
                     f"seen {m['last_seen_s']:.1f} s ago")
        _say(f"keeping the swarm up for {args.seconds:.0f} s (Ctrl+C stops it) ...")
        await trio.sleep(args.seconds)
        final = await swarm.views()
        converged = all(v == ids for v in final.values())
        _say("stopping the swarm")
    return {
        "workers": args.workers,
        "converged": converged,
        "formed_s": round(took, 2),
        "wall_s": round(time.monotonic() - t0, 2),
    }

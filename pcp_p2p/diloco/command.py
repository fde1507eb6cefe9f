"""``pcp run create``: sign a run spec and hand it to the swarm."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import trio

from pcp_p2p import logs
from pcp_p2p.errors import ConfigError, PcpError
from pcp_p2p.node.identity import default_data_dir, load_or_create_identity
from pcp_p2p.shutdown import run_until_signal

log = logging.getLogger("pcp.run")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    run = sub.add_parser("run", help="create and inspect training runs")
    run_sub = run.add_subparsers(dest="run_command", metavar="ACTION", required=True)
    create = run_sub.add_parser(
        "create",
        help="sign a run spec (TOML) and publish it to the swarm",
        description="Sign SPEC.toml with this machine's key (which makes you the run's owner), store "
        "it in the swarm's DHT and send it to every node that is up. Nodes train for it only if they "
        "trust you: give them your peer id (printed here) for `pcp node join --trust`.",
    )
    create.add_argument("spec", type=Path, metavar="SPEC.toml")
    create.add_argument("--bootstrap", action="append", default=[], required=True, metavar="MULTIADDR",
                        help="a bootstrap server of the swarm; repeatable")
    create.add_argument("--data-dir", type=Path, default=None,
                        help=f"where the owner key lives (default {default_data_dir()})")
    create.add_argument("--swarm-key", type=Path, metavar="FILE", help="the private swarm's key, if any")
    create.add_argument("--wait", type=float, default=5.0,
                        help="seconds to wait for nodes to hand the spec to (default 5)")
    create.add_argument("--json", action="store_true", help="print one JSON object")
    create.set_defaults(func=_cmd_create)


def _cmd_create(args: argparse.Namespace) -> int:
    from pcp_p2p.diloco.spec import load_spec, run_id_of, sign_spec

    logs.configure(logging.WARNING)
    data_dir = args.data_dir or default_data_dir()
    identity = load_or_create_identity(data_dir)
    signed = sign_spec(load_spec(args.spec), identity)
    run_id = run_id_of(signed)
    reached = run_until_signal(_publish, args, data_dir, identity, signed)
    if args.json:
        print(json.dumps({"run_id": run_id, "owner": identity.peer_id, "nodes_reached": reached}))
    else:
        print(f"run {run_id}")
        print(f"owner {identity.peer_id}  (nodes need --trust {identity.peer_id})")
        print(f"handed to {reached} node(s); nodes joining later find it in the DHT", file=sys.stderr)
    return 0


async def _publish(args: argparse.Namespace, data_dir: Path, identity, signed) -> int:  # type: ignore[no-untyped-def]
    from pcp_p2p.dht.records import MAX_TTL_S, sign_record
    import pcp_p2p.diloco.runs  # noqa: F401  (registers the `run` record kind)
    from pcp_p2p.diloco.spec import run_id_of
    from pcp_p2p.node.node import NodeConfig, open_node

    config = NodeConfig(
        data_dir=data_dir / "client",
        listen=("/ip4/0.0.0.0/tcp/0",),
        bootstrap=tuple(args.bootstrap),
        role="client",
        swarm_key=args.swarm_key,
        benchmark_s=0.0,
    )
    async with open_node(config, identity=identity) as node:
        with trio.move_on_after(30):
            await node.bootstrapped.wait()
        if not node.bootstrapped.is_set():
            raise ConfigError(f"no bootstrap server answered within 30 s (tried {', '.join(args.bootstrap)})")
        run_id = run_id_of(signed)
        record = sign_record(identity, "run", run_id, signed, ttl_s=MAX_TTL_S)
        await node.put_record(record)
        # Members announce themselves within a heartbeat or two: wait (on membership
        # events, up to --wait) until the view has stopped growing for a second.
        def workers() -> int:
            return sum(m.record.role == "worker" for m in node.membership.live())

        with trio.move_on_after(args.wait):
            while True:
                seen = workers()
                try:
                    await node.wait_until(lambda: workers() > seen, timeout=1.0)
                except trio.TooSlowError:
                    if seen:
                        break
        reached = 0
        for m in node.membership.live():
            if m.record.role != "worker":
                continue
            try:
                await node.messenger.send(m.record.peer_id, signed)
                reached += 1
            except PcpError as exc:
                log.warning("could not hand the run to %s: %s", m.record.peer_id, exc)
        return reached

"""``pcp node join``, ``pcp bootstrap``, ``pcp status``, ``pcp swarm-key``: the node's commands."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import trio

from pcp_p2p.core import logs
from pcp_p2p.core.errors import ConfigError
from pcp_p2p.core.identity import default_data_dir
from pcp_p2p.net.capabilities import BACKENDS
from pcp_p2p.node.config_file import add_config_parser, with_config

ADDR_FILE = "node.addr"  # every running node writes its full multiaddr here, in its data dir
log = logging.getLogger("pcp.cli")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    node = sub.add_parser("node", help="run a PCP node")
    node_sub = node.add_subparsers(dest="node_command", metavar="ACTION", required=True)
    join = add_config_parser(
        node_sub,
        "join",
        help="join a swarm and stay up until interrupted",
        description="Join a PCP swarm through one or more bootstrap servers and stay up until "
        "Ctrl+C or SIGTERM. The node keeps its identity in --data-dir. Every option may also come "
        "from a TOML --config file (see examples/node.toml); flags given on the command line override it.",
    )
    join.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                      help="full multiaddr of a bootstrap server (.../p2p/<peer id>); repeatable, "
                           "any one answering is enough")
    join.add_argument("--listen", action="append", default=[], metavar="MULTIADDR",
                      help="address to listen on (default /ip4/0.0.0.0/tcp/0); repeatable")
    _common_node_args(join)
    join.add_argument("--backend", choices=BACKENDS, default="auto",
                      help="compute backend to offer (default: every one the IREE runtime finds)")
    join.add_argument("--relay", action=argparse.BooleanOptionalAction, default=False,
                      help="offer circuit relay reservations to nodes behind NAT (control traffic only, "
                      "small per-circuit limits); for nodes with a public address (default off)")
    join.add_argument("--client-mode", action="store_true",
                      help="DHT client mode, for nodes that cannot accept incoming connections")
    join.add_argument("--trust", action="append", default=[], metavar="OWNER_PEER_ID",
                      help="train for runs created by this owner (peer id printed by `pcp run create` and "
                      "`pcp id`); repeatable, adds to --trust-file")
    join.add_argument("--trust-file", type=Path, default=None, metavar="FILE",
                      help="train for the owners listed in FILE (one peer id per line, # comments); the node "
                      "re-reads it within 2 s of a change, no restart: new owners apply to their existing runs too")
    join.add_argument("--trust-any", action="store_true",
                      help="train for ANY run owner: anyone who can reach this node can make it download and run "
                      "their compiled code. For local demos only")
    join.add_argument("--group-timeout", type=float, default=30.0, metavar="SECONDS",
                      help="under mpiexec/srun (a worker group, docs/clusters.md): how long past a round's time "
                      "budget rank 0 waits for a rank before dropping it (default 30)")
    join.set_defaults(func=with_config(join, _cmd_join))

    boot = add_config_parser(
        sub,
        "bootstrap",
        help="run a long-lived bootstrap server (a DHT server with a stable identity)",
        description="Run a bootstrap server: a DHT server node with a stable identity that new nodes "
        "dial first. Prints its full multiaddr. Every option may also come from a TOML --config file "
        "(see bootstrap/pcp-bootstrap.toml); flags given on the command line override it.",
    )
    boot.add_argument("--listen", action="append", default=[], metavar="MULTIADDR",
                      help="address to listen on (default /ip4/0.0.0.0/tcp/4001); repeatable")
    boot.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                      help="other bootstrap servers to peer with; repeatable")
    boot.add_argument("--relay", action=argparse.BooleanOptionalAction, default=True,
                      help="offer circuit relay reservations to nodes behind NAT, so others reach them "
                      "(control traffic only, small per-circuit limits; default on)")
    _common_node_args(boot)
    boot.set_defaults(func=with_config(boot, _cmd_bootstrap))

    status = sub.add_parser(
        "status",
        help="show a node's status",
        description="Ask a node for its status over /pcp/status/1.0.0. Without --connect, asks the "
        "node running on --data-dir (it writes its address to <data-dir>/node.addr).",
    )
    status.add_argument("--connect", metavar="MULTIADDR", help="full multiaddr of the node to ask")
    status.add_argument("--data-dir", type=Path, default=None,
                        help=f"data dir of a local node (default {default_data_dir()})")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.add_argument("--swarm-key", type=Path, metavar="FILE", help="the private swarm's key, if the node is in one")
    status.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for an answer (default 10)")
    status.set_defaults(func=_cmd_status)

    ident = sub.add_parser("id", help="print this node's peer id (what owners list in --trust and allowlists)",
                           description="Print the peer id of the identity key in the data directory, creating "
                           "the key (mode 0600) if there is none yet; the same key a node started there uses.")
    ident.add_argument("--data-dir", type=Path, default=None,
                       help=f"where the identity key lives (default {default_data_dir()})")
    ident.set_defaults(func=_cmd_id)

    key = sub.add_parser("swarm-key", help="create a private-swarm key file",
                         description="Write a new random libp2p pre-shared key (go-libp2p swarm.key format, "
                         "mode 0600). Give the same file to every member with --swarm-key.")
    key.add_argument("path", type=Path)
    key.set_defaults(func=_cmd_swarm_key)


def _cmd_id(args: argparse.Namespace) -> int:
    from pcp_p2p.core.identity import load_or_create_identity

    print(load_or_create_identity(args.data_dir or default_data_dir()).peer_id)
    return 0


def _common_node_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", type=Path, default=None,
                   help=f"where the identity key and data live (default {default_data_dir()})")
    p.add_argument("--addr-file", type=Path, metavar="PATH",
                   help="write this node's full multiaddr here once it listens")
    p.add_argument("--swarm-key", type=Path, metavar="FILE", help="join a private swarm with this pre-shared key")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-json", action="store_true", help="one JSON object per log line")
    p.add_argument("--log-file", type=Path, metavar="PATH",
                   help=f"also log to this file, rotated by size (default <data-dir>/{logs.LOG_FILE_NAME})")
    p.add_argument("--no-log-file", action="store_true", help="log to stderr only")
    p.add_argument("--log-file-max-bytes", type=int, default=logs.LOG_FILE_MAX_BYTES, metavar="N",
                   help=f"rotate the log file when it reaches N bytes (default {logs.LOG_FILE_MAX_BYTES})")
    p.add_argument("--log-file-backups", type=int, default=logs.LOG_FILE_BACKUPS, metavar="N",
                   help=f"rotated log files kept, pcp.log.1 ... .N (default {logs.LOG_FILE_BACKUPS})")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics on http://HOST:PORT/metrics and health on /healthz (default: off)")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="address the metrics exporter binds (default 127.0.0.1; 0.0.0.0 exposes it)")


def _cmd_join(args: argparse.Namespace) -> int:
    from pcp_p2p.node.node import NodeConfig

    if not args.bootstrap:
        log.warning("no --bootstrap given: this node starts a swarm of its own")
    config = NodeConfig(
        data_dir=args.data_dir or default_data_dir(),
        listen=tuple(args.listen or ["/ip4/0.0.0.0/tcp/0"]),
        bootstrap=tuple(args.bootstrap),
        role="worker",
        client_mode=args.client_mode,
        swarm_key=args.swarm_key,
        backend=args.backend,
        relay=args.relay,
    )
    launch = _launch()
    if launch is not None:  # started by mpiexec/srun: this process is one rank of a worker group
        from pcp_p2p.cluster.join import join_as_group

        return join_as_group(launch, config, args, lambda c: _serve(c, args, print_addr=True, training=True))
    return _serve(config, args, print_addr=True, training=True)


def _launch() -> Any:
    import os

    from pcp_p2p.core.launch import detect_launch

    return detect_launch(os.environ)


def _cmd_bootstrap(args: argparse.Namespace) -> int:
    from pcp_p2p.node.node import NodeConfig

    config = NodeConfig(
        data_dir=args.data_dir or default_data_dir() / "bootstrap",
        listen=tuple(args.listen or ["/ip4/0.0.0.0/tcp/4001"]),
        bootstrap=tuple(args.bootstrap),
        role="bootstrap",
        swarm_key=args.swarm_key,
        benchmark_s=0.0,
        relay=args.relay,
    )
    return _serve(config, args, print_addr=True)


def _configure_logs(args: argparse.Namespace, data_dir: Path) -> None:
    """stderr, and unless ``--no-log-file`` the rotated log file (in the data dir by default)."""
    logs.configure(args.log_level.upper(), json_lines=args.log_json)
    if not args.no_log_file:
        path = args.log_file or data_dir / logs.LOG_FILE_NAME
        logs.log_to_file(path, max_bytes=args.log_file_max_bytes, backups=args.log_file_backups,
                         json_lines=args.log_json)


def _serve(config: Any, args: argparse.Namespace, *, print_addr: bool = False, training: bool = False) -> int:
    """Run a node until SIGINT/SIGTERM (see :mod:`pcp_p2p.core.shutdown`: bounded, a second signal forces).

    A graceful stop on SIGTERM is a clean leave (exit 0, what a service manager
    expects); on SIGINT it is 130, the shell's code for Ctrl+C.
    """
    from pcp_p2p.core.shutdown import Interrupted, run_until_signal
    from pcp_p2p.node.node import check_can_bind, open_node

    _configure_logs(args, config.data_dir)
    if getattr(args, "metrics_port", None) is not None:  # refused before the node starts, not after
        check_can_bind(args.metrics_host, args.metrics_port,
                       f"serve metrics on {args.metrics_host}:{args.metrics_port}")
    trust = None
    trust_file = None
    flag_owners: frozenset[str] = frozenset()
    if training:
        from pcp_p2p.diloco.protocol.runs import TrustPolicy
        from pcp_p2p.diloco.run.trust_file import TrustFile, check_owner

        flag_owners = frozenset(check_owner(p) for p in args.trust)
        trust_file = TrustFile(args.trust_file) if getattr(args, "trust_file", None) else None
        file_owners = trust_file.load() if trust_file is not None else frozenset()
        trust = TrustPolicy(flag_owners | file_owners, any_owner=args.trust_any)
        if args.trust_any:
            log.warning("--trust-any: this node will download and run compiled code from ANY run owner "
                        "who can reach it. Use it only in a swarm you control.")
        elif not trust.owners:
            log.info("no owner trusted (--trust, --trust-file): this node keeps the swarm company but "
                     "trains for nobody%s", " until the trust file lists one" if trust_file else "")
    addr_file = config.data_dir / ADDR_FILE
    wrote: list[Path] = []  # remove only our own node.addr: a refused second node must not delete the first's

    def forget_addr() -> None:
        for path in wrote:
            path.unlink(missing_ok=True)

    async def serve() -> None:
        async with open_node(config) as node, _metrics(node, args):
            if trust is not None:
                from pcp_p2p.diloco.run.training_service import install_training

                install_training(node, trust, trust_file=trust_file, flag_owners=flag_owners)
            addrs = node.addrs()
            _write_addr(addr_file, addrs[0])
            wrote.append(addr_file)
            if args.addr_file:
                _write_addr(args.addr_file, addrs[0])
            if print_addr:  # first line of stdout: what to give others (scripts wait for it)
                print(addrs[0], flush=True)
                for a in addrs[1:]:
                    log.info("also reachable at %s", a)
            await trio.sleep_forever()

    try:
        run_until_signal(serve, stopping="leaving the swarm", on_force=forget_addr)
    except Interrupted as exc:
        if exc.signum != signal.SIGTERM:
            raise
        log.info("left the swarm")
    finally:
        forget_addr()
    return 0


@contextlib.asynccontextmanager
async def _metrics(node: Any, args: argparse.Namespace) -> AsyncIterator[None]:
    """The Prometheus exporter for ``--metrics-port``, serving until the node stops.

    Scrapes run on the exporter's thread; the status is built on the node's
    trio thread (``from_thread``), where its state lives.
    """
    if getattr(args, "metrics_port", None) is None:
        yield
        return
    from pcp_p2p.node.metrics import serve_metrics
    from pcp_p2p.node.status import to_json

    token = trio.lowlevel.current_trio_token()
    server = serve_metrics(
        args.metrics_port,
        lambda: trio.from_thread.run_sync(lambda: to_json(node.status()), trio_token=token),
        host=args.metrics_host,
        health_fn=lambda: trio.from_thread.run_sync(lambda: node_health(node, time.time()), trio_token=token),
    )
    try:
        yield
    finally:
        server.close()


def node_health(node: Any, now: float) -> dict[str, Any]:
    """What ``GET /healthz`` reports (see :func:`pcp_p2p.node.metrics.health_reply`).

    Built from the node's own fields rather than its full status: a probe every
    few seconds must stay cheap and must not depend on the training sections.
    """
    return {
        "peer_id": node.peer_id,
        "role": node.config.role,
        "uptime_s": round(max(0.0, now - node.started_at), 1),
        "bootstrapped": node.bootstrapped.is_set(),
        "connected_peers": len(node.host.get_network().connections),
        "runs": sorted(node.runs),
    }


def _write_addr(path: Path, addr: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(addr + "\n")
    tmp.replace(path)


def _cmd_status(args: argparse.Namespace) -> int:
    from pcp_p2p.net.swarm_key import read_swarm_key
    from pcp_p2p.node.status import fetch_status, to_json

    logs.configure(logging.WARNING)
    addr = args.connect
    if addr is None:
        path = (args.data_dir or default_data_dir()) / ADDR_FILE
        try:
            addr = path.read_text().strip()
        except OSError:
            raise ConfigError(f"no --connect given and no running node found ({path} is missing)") from None
    psk = read_swarm_key(args.swarm_key) if args.swarm_key else None
    if not args.json and sys.stdout.isatty() and sys.stdin.isatty():
        # A person at a terminal: the live dashboard. Scripts (a pipe) keep the text below.
        from pcp_p2p.node.node import parse_peer_addr
        from pcp_p2p.tui.app import run_tui

        parse_peer_addr(addr)  # a typo fails here, before the screen is taken over
        return run_tui(_addr_source(args, addr), target=addr, timeout=min(args.timeout, 5.0), swarm_key=psk)
    from pcp_p2p.core.shutdown import run_until_signal

    reply = run_until_signal(lambda: fetch_status(addr, timeout=args.timeout, swarm_key=psk))
    obj = to_json(reply)
    if args.json:
        print(json.dumps(obj))
        return 0
    print(render_text(obj))
    return 0


def _addr_source(args: argparse.Namespace, first: str) -> Any:
    """Where the TUI finds the node on each attempt: ``--connect``, or the data dir's
    ``node.addr`` read again each time (a restarted node listens on a new port)."""
    if args.connect is not None:
        return lambda: first
    path = (args.data_dir or default_data_dir()) / ADDR_FILE

    def read() -> str:
        try:
            return path.read_text().strip() or first
        except OSError:
            return first

    return read


def render_text(obj: dict[str, Any]) -> str:
    """A plain-text status summary (the urwid TUI builds on the same JSON)."""
    import time

    from pcp_p2p.node.status import split_rejected, throughput_text
    from pcp_p2p.tui.fmt import phase_label, round_label
    caps = obj["capabilities"]
    lines = [
        f"node     {obj['peer_id']}  ({obj['role']}, pcp {obj['version']}, up {obj['uptime_s']:.0f} s)",
        f"addrs    {' '.join(obj['addrs'])}",
        f"hardware {caps['cpu_model']} x{caps['cpu_count']}, {throughput_text(caps, now=time.time())}, "
        f"backends {','.join(caps['backends']) or '-'}",
        f"network  {obj['network'].get('connected_peers', 0)} connected, "
        f"{obj['network'].get('routing_table_size', 0)} in routing table, rejected "
        "{} bad input, {} stale or duplicate".format(*split_rejected(obj["network"].get("rejected")))
        + f", {obj['network'].get('local_faults', 0)} local faults"
        + f", reachability {obj['network'].get('reachability', 'unknown')}",
        f"members  {len(obj['members'])}",
    ]
    for m in obj["members"]:
        c = m["capabilities"]
        lines.append(
            f"  {m['peer_id']}  {m['role']:<9} {','.join(c['backends']) or '-':<12} "
            f"{c['throughput_gflops']:>7.0f} GFLOP/s  seen {m['last_seen_s']:.1f} s ago"
            + (f"  {m['state']}" if m.get("state") else "")
            + (f"  group of {c['group_ranks']}, {c['group_gflops']:.0f} GFLOP/s" if c.get("group_ranks") else "")
            + (f"  {m['reachability']}" if m.get("reachability", "unknown") != "unknown" else "")
        )
    group = obj.get("group")
    if isinstance(group, dict):  # this node is rank 0 of an MPI worker group (docs/clusters.md)
        lines.append(f"group    {group['live']}/{group['size']} ranks via {group['launcher']}, "
                     f"{group['gflops']:.0f} GFLOP/s, {group['rounds']} rounds")
        for r in group["ranks"]:
            lines.append(f"  rank {r['rank']}  {r['host']}/{r['target']}  {r['gflops']:.0f} GFLOP/s  "
                         f"last round {r['steps']} steps, {r['tokens_per_s']:.0f} tokens/s"
                         + ("" if r["alive"] else f"  dropped: {r['why']}"))
    run = obj.get("run")
    if isinstance(run, dict):  # sections later parts add; absent or null before a run starts
        lines.append(
            f"run      {run.get('run_id')} round {round_label(run)} ({phase_label(run)}), "
            f"loss {run.get('loss')}, val {run.get('val_loss')}, "
            f"{run.get('participants')}/{run.get('quorum')} participants/quorum, shepherd {run.get('shepherd')}"
        )
    else:
        lines.append("run      none")
    if obj.get("term") is not None:
        lines.append(f"shepherd term {obj['term']}, lease expires in {obj.get('lease_expires_s')} s")
    return "\n".join(lines)


def _cmd_swarm_key(args: argparse.Namespace) -> int:
    from pcp_p2p.net.swarm_key import write_swarm_key

    write_swarm_key(args.path)
    print(f"wrote {args.path}; give it to every member with --swarm-key {args.path}", file=sys.stderr)
    return 0

"""``pcp run status``, ``pcp run watch`` and ``pcp run stop``: the owner's view of a run, and its end.

Like ``pcp run create`` and ``admit`` (:mod:`pcp_p2p.diloco.run.owner_commands`) each runs
a short-lived client node in the swarm. ``status`` and ``watch`` read what
anyone in the swarm can: the signed run spec, the latest commit record, the
lease and the owner's stop order from the DHT, the member records of the
nodes taking part, and the phase one of them reports over the status
protocol (the shepherd first). ``stop`` signs a
:class:`~pcp_p2p.diloco.protocol.lifecycle.StopOrder` with this data dir's key, which
must be the run's owner, stores it in the DHT and hands it to every node
taking part; each checks it in full before it stops (see
:mod:`pcp_p2p.diloco.protocol.lifecycle`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from pcp_p2p.core import logs
from pcp_p2p.core.errors import ConfigError, PcpError
from pcp_p2p.core.identity import default_data_dir, load_or_create_identity
from pcp_p2p.core.shutdown import run_until_signal
from pcp_p2p.diloco.run.owner_commands import _client, _client_flags, _hand_to_workers, _wait_for_workers

if TYPE_CHECKING:
    from pcp_p2p.core.identity import Identity
    from pcp_p2p.diloco.protocol.lifecycle import StopOrder
    from pcp_p2p.diloco.protocol.spec import SignedRunSpec
    from pcp_p2p.node.node import Node

log = logging.getLogger("pcp.run")

ASK_TIMEOUT_S = 5.0  # for one member's status reply
ASK_AT_MOST = 3  # members asked for the phase before giving up (each may cost ASK_TIMEOUT_S per address)
WATCH_EVERY_S = 2.0


def register_actions(run_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``status``, ``watch`` and ``stop`` under ``pcp run``."""
    status = run_sub.add_parser(
        "status",
        help="show a run's phase, round, shepherd, members and last val loss",
        description="Join the swarm briefly and show a run as the swarm knows it: its phase (as a node "
        "taking part reports it, the shepherd first), the round in progress (1-based, \"round 3/12\"), "
        "the shepherd, the nodes taking part against the quorum, and the last validation loss. "
        "Anyone may ask; no key is needed beyond a throwaway one.",
    )
    status.add_argument("--run", required=True, metavar="RUN_ID", help="the run id `pcp run create` printed")
    _reader_flags(status)
    status.set_defaults(func=_cmd_status)

    watch = run_sub.add_parser(
        "watch",
        help="follow a run: a line per change until it ends (Ctrl+C to leave)",
        description="Like `pcp run status`, asked again every --every seconds; prints one line each time "
        "the phase, round, shepherd, members or val loss change, and exits 0 once the run has finished "
        "or been stopped (Ctrl+C leaves earlier, exit 130). With --json, one JSON object per change.",
    )
    watch.add_argument("--run", required=True, metavar="RUN_ID", help="the run id `pcp run create` printed")
    watch.add_argument("--every", type=float, default=WATCH_EVERY_S, metavar="S",
                       help=f"seconds between looks (default {WATCH_EVERY_S:g})")
    _reader_flags(watch)
    watch.set_defaults(func=_cmd_watch)

    stop = run_sub.add_parser(
        "stop",
        help="end a run you own, on every node (owner only)",
        description="Sign a stop order for a run you own with this data dir's key and publish it: it is "
        "stored in the DHT (nodes that are down learn it when they come back) and handed to every node "
        "taking part. Each node checks that the run's owner signed it, then its worker stops training, "
        "its shepherd stops, and the run's blobs are released as at a normal end (the latest θ is kept). "
        "A stop cannot be undone; publishing it again is harmless.",
    )
    stop.add_argument("--run", required=True, metavar="RUN_ID", help="the run id `pcp run create` printed")
    stop.add_argument("--reason", default="", help="a short note kept with the stop order")
    _client_flags(stop)
    stop.set_defaults(func=_cmd_stop)


def _reader_flags(p: argparse.ArgumentParser) -> None:
    """The owner commands' flags, told for a command that only reads."""
    _client_flags(p)
    for action in p._actions:
        if action.dest == "wait":
            action.help = "seconds to wait for the swarm's members to show up (default 5)"
        elif action.dest == "data_dir":
            action.help = f"the key this short-lived client uses (any will do; default {default_data_dir()})"


# --- status and watch -------------------------------------------------------------------


async def _find_run(node: Node, run_id: str) -> SignedRunSpec:
    from pcp_p2p.diloco.protocol.spec import SignedRunSpec

    signed = await node.get_record("run", run_id)
    if not isinstance(signed, SignedRunSpec):
        raise ConfigError(f"run {run_id} not found in the swarm's DHT")
    return signed


async def _get(node: Node, kind: str, name: str) -> Any:
    """A DHT record's payload, or None when missing or unreachable (status shows what it can)."""
    try:
        return await node.get_record(kind, name)
    except PcpError as exc:
        log.debug("looking up %s/%s: %s", kind, name, exc)
        return None


async def _ask_member(node: Node, peers: list[str], run_id: str, swarm_key: str | None) -> dict[str, Any] | None:
    """The run's summary as the first of ``peers`` that answers reports it (``runs`` in its status)."""
    from pcp_p2p.node.status import fetch_status

    for peer in peers[:ASK_AT_MOST]:
        member = node.membership.get(peer)
        if member is None:
            continue
        for addr in member.record.addrs:
            if "/ip4/0.0.0.0/" in addr:
                continue
            try:
                reply = await fetch_status(f"{addr}/p2p/{peer}", timeout=ASK_TIMEOUT_S, members=False,
                                           swarm_key=swarm_key)
            except PcpError as exc:
                log.debug("asking %s for the run's status: %s", peer, exc)
                continue
            runs = reply.extra.get("runs")
            summary = runs.get(run_id) if isinstance(runs, dict) else None
            latest = reply.extra.get("run")  # a node without `runs` (older): its latest run only
            if not isinstance(summary, dict) and isinstance(latest, dict) and latest.get("run_id") == run_id:
                summary = latest
            if isinstance(summary, dict):
                return summary
            break  # it answered, without the run: ask the next member
    return None


async def _view(node: Node, run_id: str, swarm_key: str | None) -> dict[str, Any]:
    """What ``pcp run status --json`` prints (:func:`~pcp_p2p.diloco.protocol.lifecycle.describe_run`)."""
    from pcp_p2p.diloco.protocol.election import LEASE_KIND, Lease
    from pcp_p2p.diloco.protocol.lifecycle import STOP_KIND, StopLatch, StopOrder, describe_run, stop_name
    from pcp_p2p.diloco.protocol.messages import CommitRecord

    signed = await _find_run(node, run_id)
    spec = signed.spec
    stop = await _get(node, STOP_KIND, stop_name(run_id, signed.owner))
    if isinstance(stop, StopOrder):
        try:
            StopLatch(run_id, signed.owner).check(stop, time.time())
        except PcpError as exc:
            log.debug("ignoring a stop record: %s", exc)
            stop = None
    else:
        stop = None
    commit = await _get(node, "commit", run_id)
    commit = commit if isinstance(commit, CommitRecord) and commit.run_id == run_id else None
    lease = await _get(node, LEASE_KIND, run_id)
    lease = lease if isinstance(lease, Lease) and lease.run_id == run_id else None
    members = [m.record for m in node.membership.live() if m.record.role == "worker" and run_id in m.record.runs]
    leading = [r.peer_id for r in members if run_id in r.leads]
    shepherd = leading[0] if leading else (lease.holder if lease is not None else None)
    ask = sorted((r.peer_id for r in members), key=lambda p: p != shepherd)
    reported = await _ask_member(node, ask, run_id, swarm_key) if stop is None else None
    return describe_run(
        run_id=run_id, name=spec.name, owner=signed.owner, rounds=spec.round.rounds,
        quorum=spec.round.min_quorum, committed=commit.round + 1 if commit is not None else 0,
        val_loss=commit.val_loss if commit is not None else None, stopped=stop,
        members=[r.peer_id for r in members], shepherd=shepherd,
        term=lease.term if lease is not None else None, reported=reported,
    )


def _swarm_key_hex(args: argparse.Namespace) -> str | None:
    from pcp_p2p.net.swarm_key import read_swarm_key

    return read_swarm_key(args.swarm_key) if args.swarm_key else None


def render(view: dict[str, Any]) -> str:
    """The text ``pcp run status`` prints."""
    val = view.get("val_loss")
    lines = [
        f"run       {view['run_id']}  ({view['name']})",
        f"owner     {view['owner']}",
        f"phase     {view['phase']}" + (f"  ({view['stop_reason']})" if view.get("stop_reason") else ""),
        f"round     {view['round']}/{view['rounds']}  ({view['committed']} committed)",
        f"shepherd  {view['shepherd'] or '-'}" + (f"  (term {view['term']})" if view.get("term") is not None else ""),
        f"members   {view['members']}  (quorum {view['quorum']})",
        f"val loss  {f'{val:.4f}' if isinstance(val, (int, float)) else '-'}",
    ]
    return "\n".join(lines)


def _cmd_status(args: argparse.Namespace) -> int:
    logs.configure(logging.WARNING)
    data_dir = args.data_dir or default_data_dir()
    identity = load_or_create_identity(data_dir)
    psk = _swarm_key_hex(args)

    async def once() -> dict[str, Any]:
        async with _client(args, data_dir, identity) as node:
            await _wait_for_workers(node, args.wait)
            return await _view(node, args.run, psk)

    view = run_until_signal(once)
    print(json.dumps(view) if args.json else render(view))
    return 0


def _cmd_watch(args: argparse.Namespace) -> int:
    from pcp_p2p.diloco.protocol.lifecycle import ENDED, status_line

    if not args.every > 0:
        raise ConfigError("--every must be a number of seconds above 0")
    logs.configure(logging.WARNING)
    data_dir = args.data_dir or default_data_dir()
    identity = load_or_create_identity(data_dir)
    psk = _swarm_key_hex(args)

    async def follow() -> None:
        async with _client(args, data_dir, identity) as node:
            await _wait_for_workers(node, args.wait)
            last = None
            while True:
                view = await _view(node, args.run, psk)
                line = json.dumps(view) if args.json else status_line(view)
                if line != last:
                    print(f"{time.strftime('%H:%M:%S')} {line}" if not args.json else line, flush=True)
                    last = line
                if view["phase"] in ENDED:
                    return
                await trio.sleep(args.every)

    run_until_signal(follow)
    return 0


# --- stop ----------------------------------------------------------------------------------


def _cmd_stop(args: argparse.Namespace) -> int:
    from pcp_p2p.diloco.protocol.lifecycle import MAX_REASON_CHARS

    logs.configure(logging.WARNING)
    if len(args.reason) > MAX_REASON_CHARS:
        raise ConfigError(f"--reason is at most {MAX_REASON_CHARS} characters")
    data_dir = args.data_dir or default_data_dir()
    identity = load_or_create_identity(data_dir)
    order, reached, again = run_until_signal(_stop, args, data_dir, identity)
    if args.json:
        print(json.dumps({"run_id": args.run, "owner": order.owner, "issued": order.issued,
                          "republished": again, "nodes_reached": reached}))
    else:
        print(f"run {args.run} stopped{' (the stop order published again)' if again else ''}")
        print(f"handed to {reached} node(s); nodes that are down find the stop in the DHT", file=sys.stderr)
    return 0


async def _stop(args: argparse.Namespace, data_dir: Path, identity: Identity) -> tuple[StopOrder, int, bool]:
    from pcp_p2p.diloco.protocol.lifecycle import STOP_KIND, StopLatch, StopOrder, sign_stop, stop_name, stop_record

    run_id, me = args.run, identity.peer_id
    async with _client(args, data_dir, identity) as node:
        signed = await _find_run(node, run_id)
        if signed.owner != me:
            raise ConfigError(f"run {run_id:.20}… is owned by {signed.owner}, not by this key ({me}): "
                              "only the owner can stop it")
        now = time.time()
        prev = await _get(node, STOP_KIND, stop_name(run_id, me))
        again = isinstance(prev, StopOrder)
        order = prev if isinstance(prev, StopOrder) else sign_stop(identity, run_id, now=now, reason=args.reason)
        StopLatch(run_id, signed.owner).check(order, now)  # the check every node will make
        await node.put_record(stop_record(order, identity, now=now))
        reached = await _hand_to_workers(node, order, args.wait, only=lambda r: run_id in r.runs)
        return order, reached, again

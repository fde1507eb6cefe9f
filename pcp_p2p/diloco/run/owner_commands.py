"""``pcp run create`` and ``pcp run admit``: the run owner's commands.

``create`` signs a run spec and hands it to the swarm; ``admit`` amends an
allowlist run's admission list with an update the owner signs
(:mod:`pcp_p2p.diloco.protocol.admission`). Both publish a DHT record and hand the
message to the workers that are up, through a short-lived client node.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from pcp_p2p.core import logs
from pcp_p2p.core.errors import ConfigError, PcpError, Refused
from pcp_p2p.core.identity import default_data_dir, load_or_create_identity
from pcp_p2p.core.shutdown import run_until_signal

if TYPE_CHECKING:
    from pcp_p2p.core.identity import Identity
    from pcp_p2p.diloco.protocol.admission import AllowlistUpdate
    from pcp_p2p.diloco.protocol.owner_runs import OwnerRuns
    from pcp_p2p.diloco.protocol.spec import SignedRunSpec
    from pcp_p2p.net.membership import MemberRecord
    from pcp_p2p.node.node import Node
    from pcp_p2p.wire import Message

log = logging.getLogger("pcp.run")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = sub.add_parser("run", help="create, inspect and stop training runs")
    run_sub = run.add_subparsers(dest="run_command", metavar="ACTION", required=True)
    create = run_sub.add_parser(
        "create",
        help="sign a run spec (TOML) and publish it to the swarm",
        description="Sign SPEC.toml with this machine's key (which makes you the run's owner), store "
        "it in the swarm's DHT and send it to every node that is up. Nodes train for it only if they "
        "trust you: give them your peer id (printed here) for `pcp node join --trust` or their --trust-file "
        "(nodes that trust you later still find the run: it is listed under your id). Prints which nodes took "
        "the run, which refused it and why, and warns when fewer took it than its round.min_quorum.",
    )
    create.add_argument("spec", type=Path, metavar="SPEC.toml")
    _client_flags(create)
    create.set_defaults(func=_cmd_create)

    admit = run_sub.add_parser(
        "admit",
        help="amend a run's allowlist (owner only)",
        description="Sign an allowlist update for a run you own and publish it: --add admits peers to an "
        "allowlist run, --remove refuses them (in an open run too). Each update carries the whole amendment "
        "relative to the spec and a higher sequence number; the latest one found (in the DHT or kept here) "
        "is amended. With neither flag, the latest update is published again (DHT records last 7 days).",
    )
    admit.add_argument("--run", required=True, metavar="RUN_ID", help="the run id `pcp run create` printed")
    admit.add_argument("--add", nargs="+", action="extend", default=[], metavar="PEER_ID",
                       help="peers to admit; repeatable")
    admit.add_argument("--remove", nargs="+", action="extend", default=[], metavar="PEER_ID",
                       help="peers to refuse; repeatable")
    _client_flags(admit)
    admit.set_defaults(func=_cmd_admit)

    from pcp_p2p.diloco.run.run_commands import register_actions  # status, watch, stop

    register_actions(run_sub)


def _client_flags(p: argparse.ArgumentParser) -> None:
    """The flags every owner command needs to reach the swarm."""
    p.add_argument("--bootstrap", action="append", default=[], required=True, metavar="MULTIADDR",
                   help="a bootstrap server of the swarm; repeatable")
    p.add_argument("--data-dir", type=Path, default=None,
                   help=f"where the owner key lives (default {default_data_dir()})")
    p.add_argument("--swarm-key", type=Path, metavar="FILE", help="the private swarm's key, if any")
    p.add_argument("--wait", type=float, default=5.0,
                   help="seconds to wait for nodes to hand the message to (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _cmd_create(args: argparse.Namespace) -> int:
    from pcp_p2p.diloco.algorithm.data import check_dataset
    from pcp_p2p.diloco.protocol.spec import load_spec, run_id_of, sign_spec

    logs.configure(logging.WARNING)
    spec = load_spec(args.spec)
    check_dataset(spec.dataset)  # before anything is signed or published
    data_dir = args.data_dir or default_data_dir()
    identity = load_or_create_identity(data_dir)
    signed = sign_spec(spec, identity)
    run_id = run_id_of(signed)
    handoff = run_until_signal(_publish, args, data_dir, identity, signed)
    quorum = signed.spec.round.min_quorum
    short = len(handoff.accepted) < quorum
    warning = (f"the run needs {quorum} workers per round (round.min_quorum) but {len(handoff.accepted)} "
               "node(s) accepted it: its first round waits until enough nodes that trust you join") if short else None
    if args.json:
        print(json.dumps({
            "run_id": run_id, "owner": identity.peer_id, "nodes_reached": len(handoff.accepted),
            "refused": [{"peer": p, "reason": e.reason, "detail": e.detail} for p, e in handoff.refused],
            "unreachable": [{"peer": p, "error": str(e)} for p, e in handoff.unreachable],
            "min_quorum": quorum, "warnings": [warning] if warning else [],
        }))
    else:
        print(f"run {run_id}")
        print(f"owner {identity.peer_id}  (nodes need --trust {identity.peer_id})")
        print(_handoff_summary(handoff, identity.peer_id), file=sys.stderr)
    if warning:
        print(f"pcp: warning: {warning}", file=sys.stderr)
    return 0


def _handoff_summary(handoff: HandOff, owner: str) -> str:
    """``handed to N node(s)`` and, one line each, who refused and why (or could not be reached)."""
    from pcp_p2p.node.messaging import printable

    head = f"handed to {len(handoff.accepted)} node(s)"
    if not handoff.refused and not handoff.unreachable:
        return head + "; nodes joining later find it in the DHT"
    parts = [f"{len(handoff.refused)} refused"] if handoff.refused else []
    parts += [f"{len(handoff.unreachable)} unreachable"] if handoff.unreachable else []
    lines = [f"{head}; {', '.join(parts)}:"]
    for peer, exc in handoff.refused:
        lines.append(f"  {peer}: {printable(explain_refusal(exc.reason, exc.detail, owner), 400)}")
    for peer, err in handoff.unreachable:
        lines.append(f"  {peer}: unreachable ({printable(str(err), 200)})")
    return "\n".join(lines)


@asynccontextmanager
async def _client(args: argparse.Namespace, data_dir: Path, identity: Identity) -> AsyncIterator[Node]:
    """A short-lived client node in the swarm, bootstrapped (ConfigError if no bootstrap answers).

    A PcpError raised by the caller's block is re-raised once the node is shut,
    outside its nursery, so it reaches ``pcp`` bare (one ``pcp: error:`` line),
    not wrapped in an exception group.
    """
    from pcp_p2p.node.node import NodeConfig, open_node

    config = NodeConfig(
        data_dir=data_dir / "client",
        listen=("/ip4/0.0.0.0/tcp/0",),
        bootstrap=tuple(args.bootstrap),
        role="client",
        swarm_key=args.swarm_key,
        benchmark_s=0.0,
    )
    failure: PcpError | None = None
    async with open_node(config, identity=identity) as node:
        with trio.move_on_after(30):
            await node.bootstrapped.wait()
        if node.bootstrapped.is_set():
            try:
                yield node
            except PcpError as exc:
                failure = exc
        else:
            failure = ConfigError(f"no bootstrap server answered within 30 s (tried {', '.join(args.bootstrap)})")
    if failure is not None:
        raise failure


@dataclass
class HandOff:
    """What the live workers answered a hand-off: took it, declined it (with a reason), or could not be reached."""

    accepted: list[str] = field(default_factory=list)
    refused: list[tuple[str, Refused]] = field(default_factory=list)
    unreachable: list[tuple[str, PcpError]] = field(default_factory=list)


def explain_refusal(reason: str, detail: str, owner: str) -> str:
    """One line for the owner: what a worker's refusal means and what to do about it."""
    if reason == "not_trusted":
        return f"not trusted (start it with --trust {owner}, or add {owner} to its --trust-file)"
    if reason == "no_target":
        return f"cannot run the run's compile targets: {detail}"
    return detail


async def _wait_for_workers(node: Node, wait_s: float) -> None:
    """Members announce themselves within a probe period or two: wait (on membership
    events, up to ``wait_s``) until the view has stopped growing for a second."""
    def workers() -> int:
        return sum(m.record.role == "worker" for m in node.membership.live())

    with trio.move_on_after(wait_s):
        while True:
            seen = workers()
            try:
                # B023 is a false alarm: the lambda is awaited at once, within this iteration
                await node.wait_until(lambda: workers() > seen, timeout=1.0)  # noqa: B023
            except trio.TooSlowError:
                if seen:
                    break


async def _hand_to_workers(
    node: Node, msg: Message, wait_s: float, only: Callable[[MemberRecord], bool] | None = None,
) -> int:
    """Send ``msg`` to every live worker (for which ``only`` holds, if given); how many took it."""
    return len((await _hand_out(node, msg, wait_s, only)).accepted)


async def _hand_out(
    node: Node, msg: Message, wait_s: float, only: Callable[[MemberRecord], bool] | None = None,
) -> HandOff:
    """Send ``msg`` to every live worker (for which ``only`` holds); who took it, who refused it and why."""
    await _wait_for_workers(node, wait_s)
    out = HandOff()
    for m in node.membership.live():
        if m.record.role != "worker" or (only is not None and not only(m.record)):
            continue
        try:
            await node.messenger.send(m.record.peer_id, msg)
            out.accepted.append(m.record.peer_id)
        except Refused as exc:
            out.refused.append((m.record.peer_id, exc))
        except PcpError as exc:
            log.warning("could not hand the %s to %s: %s", msg.TAG, m.record.peer_id, exc)
            out.unreachable.append((m.record.peer_id, exc))
    return out


async def _publish(args: argparse.Namespace, data_dir: Path, identity: Identity, signed: SignedRunSpec) -> HandOff:
    from pcp_p2p.dht.records import MAX_TTL_S, sign_record
    from pcp_p2p.diloco.protocol.spec import run_id_of

    async with _client(args, data_dir, identity) as node:
        run_id = run_id_of(signed)
        record = sign_record(identity, "run", run_id, signed, ttl_s=MAX_TTL_S)
        await node.put_record(record)
        try:  # how nodes that trust this owner later find the run (docs/security.md)
            await publish_owned_run(node, identity, data_dir, run_id, now=time.time())
        except PcpError as exc:
            log.warning("could not list the run under its owner (nodes that trust you later may not find "
                        "it until you create another run): %s", exc)
        return await _hand_out(node, signed, args.wait)


OWNED_RUNS_FILE = "owner-runs"


def _read_owned_runs(path: Path, owner: str) -> OwnerRuns | None:
    from pcp_p2p.diloco.protocol.owner_runs import OwnerRuns
    from pcp_p2p.wire import decode

    try:
        kept = decode(path.read_bytes(), OwnerRuns)
    except FileNotFoundError:
        return None
    except (OSError, PcpError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return None
    return kept if kept.owner == owner else None


async def publish_owned_run(node: Node, identity: Identity, data_dir: Path, run_id: str, *, now: float) -> OwnerRuns:
    """Add ``run_id`` to the owner's list (kept locally and in the DHT); return the list published.

    Raises PcpError if the DHT put fails (the local copy is kept either way, so
    the next publish still lists this run).
    """
    from pcp_p2p.dht.records import MAX_TTL_S, sign_record
    from pcp_p2p.diloco.protocol.owner_runs import OWNER_RUNS_KIND, OwnerRuns, with_run
    from pcp_p2p.wire import encode

    path = data_dir / "owned-runs" / OWNED_RUNS_FILE
    found = [x for x in (_read_owned_runs(path, identity.peer_id),) if x is not None]
    try:
        in_dht = await node.get_record(OWNER_RUNS_KIND, identity.peer_id)
        if isinstance(in_dht, OwnerRuns):
            found.append(in_dht)
    except PcpError as exc:
        log.debug("owner-runs lookup failed (the local list is used): %s", exc)
    lst = with_run(found, identity.peer_id, run_id, now=now)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(encode(lst))
        tmp.replace(path)
    except OSError as exc:
        log.warning("cannot keep the owner-runs list in %s: %s", path, exc)
    await node.put_record(sign_record(identity, OWNER_RUNS_KIND, identity.peer_id, lst, ttl_s=MAX_TTL_S, now=now))
    return lst


# --- pcp run admit ---------------------------------------------------------------

UPDATE_FILE = "allowlist.update"


def _owned_run_dir(data_dir: Path, run_id: str) -> Path:
    """Where the owner keeps the latest update it signed for a run (so a DHT miss never resets seq)."""
    return data_dir / "owned-runs" / run_id


def _cmd_admit(args: argparse.Namespace) -> int:
    from pcp_p2p.core.identity import public_key_of

    logs.configure(logging.WARNING)
    for peer in (*args.add, *args.remove):
        try:
            public_key_of(peer)
        except PcpError as exc:
            raise ConfigError(f"{peer!r:.80} is not a peer id (12D3KooW…)") from exc
    data_dir = args.data_dir or default_data_dir()
    identity = load_or_create_identity(data_dir)
    update, reached, mode = run_until_signal(_admit, args, data_dir, identity)
    if args.json:
        print(json.dumps({"run_id": args.run, "seq": update.seq, "add": list(update.add),
                          "remove": list(update.remove), "mode": mode, "nodes_reached": reached}))
    else:
        print(f"allowlist update #{update.seq} for run {args.run}: {len(update.add)} added, "
              f"{len(update.remove)} removed (relative to the spec)")
        print(f"handed to {reached} node(s); nodes joining later find it in the DHT", file=sys.stderr)
    return 0


def _local_update(path: Path, run_id: str, owner: str) -> AllowlistUpdate | None:
    """The update this owner last signed for the run, if kept here and still valid."""
    from pcp_p2p.diloco.protocol.admission import AllowlistUpdate, verify_update
    from pcp_p2p.wire import decode

    try:
        update = decode(path.read_bytes(), AllowlistUpdate)
        verify_update(update)
    except FileNotFoundError:
        return None
    except (OSError, PcpError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return None
    return update if (update.run_id, update.owner) == (run_id, owner) else None


async def _admit(args: argparse.Namespace, data_dir: Path, identity: Identity) -> tuple[AllowlistUpdate, int, str]:
    from pcp_p2p.diloco.protocol.admission import (
        ALLOWLIST_KIND,
        Admission,
        AllowlistUpdate,
        allowlist_name,
        amend,
        update_record,
    )
    from pcp_p2p.diloco.protocol.spec import SignedRunSpec
    from pcp_p2p.wire import encode

    run_id, me = args.run, identity.peer_id
    local_path = _owned_run_dir(data_dir, run_id) / UPDATE_FILE
    async with _client(args, data_dir, identity) as node:
        signed = await node.get_record("run", run_id)
        if not isinstance(signed, SignedRunSpec):
            raise ConfigError(f"run {run_id} not found in the swarm's DHT")
        if signed.owner != me:
            raise ConfigError(f"run {run_id:.20}… is owned by {signed.owner}, not by this key ({me}): "
                              "only the owner can amend its allowlist")
        admission = Admission.for_run(signed)
        mode = admission.policy.mode
        if mode == "open" and args.add:
            print("pcp: note: the run is open: every peer is already admitted; --add only undoes a --remove",
                  file=sys.stderr)
        found = [u for u in (_local_update(local_path, run_id, me),
                             await node.get_record(ALLOWLIST_KIND, allowlist_name(run_id, me)))
                 if isinstance(u, AllowlistUpdate)]
        prev = max(found, key=lambda u: u.seq, default=None)
        now = time.time()
        if args.add or args.remove:
            try:
                update = amend(prev, identity, run_id, add=args.add, remove=args.remove, now=now)
            except ValueError as exc:
                raise ConfigError(f"allowlist update: {exc}") from exc
        elif prev is not None:
            update = prev  # republished as it is, in a fresh record
        else:
            raise ConfigError("nothing to publish: give --add or --remove")
        if update is not prev:
            admission.apply(update, now)  # the check every node will make
            tmp = local_path.with_name(local_path.name + ".tmp")
            try:  # kept before it is published: a failed put never reuses this seq
                local_path.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_bytes(encode(update))
                tmp.replace(local_path)
            except OSError as exc:
                raise ConfigError(f"cannot keep the update in {local_path}: {exc}") from exc
        await node.put_record(update_record(update, identity, now=now))
        return update, await _hand_to_workers(node, update, args.wait), mode

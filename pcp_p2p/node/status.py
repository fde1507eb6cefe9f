"""The status protocol, ``/pcp/status/1.0.0``: what a node knows, for people and scripts.

One request frame, one reply frame, then the stream closes. The reply is a
typed message (so a node that answers garbage is caught by the codec like any
other bad input) and converts to the JSON object that ``pcp status --json``
prints. Later parts of PCP add their own sections (run, shepherd, ...) through
``extra`` without changing this message's schema.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr

from pcp_p2p.core.errors import ConfigError, PcpError, PeerGone, PeerTimeout, ProtocolError
from pcp_p2p.core.identity import Identity
from pcp_p2p.net.capabilities import Capabilities
from pcp_p2p.wire import Message, decode, encode, wire_message, wire_struct
from pcp_p2p.wire.framing import read_frame, write_frame

STATUS_PROTOCOL = "/pcp/status/1.0.0"

# Rejections a healthy swarm makes all the time, which say nothing bad about the
# sender: a message overtaken by a newer one (a replayed heartbeat, the late
# commit of an older term, an announcement for a round already committed), a
# record whose validity has passed, or one that arrived before the record its
# authority rests on (held back, looked at again later). Everything else a node
# rejects is bad input: malformed, oversized, forged, unauthorised, over budget.
STALE_REASONS = frozenset({"StaleMessage", "ExpiredRecord", "HeldBack"})
MAX_REQUEST = 256
MAX_REPLY = 2 * 1024 * 1024


@wire_message("status.request", max_size=MAX_REQUEST)
class StatusRequest(Message):
    members: bool = True


@wire_struct
class MemberStatus(Message):
    peer_id: str
    addrs: tuple[str, ...]
    role: str
    capabilities: Capabilities
    last_seen_s: float  # since the last evidence of life this node had (an answered probe, fresh news)
    state: str = "idle"
    suspect: bool = False  # SWIM: a probe went unanswered; dead unless it refutes in time
    reachability: str = "unknown"  # the member's own verdict, from its record


@wire_message("status.reply", max_size=MAX_REPLY)
class StatusReply(Message):
    peer_id: str
    addrs: tuple[str, ...]
    version: str
    role: str
    uptime_s: float
    capabilities: Capabilities
    members: tuple[MemberStatus, ...]
    network: dict[str, Any]
    extra: dict[str, Any]


def split_rejected(rejected: Any) -> tuple[int, int]:
    """(refused as bad input, stale or duplicate) from ``Node.rejected``'s counts.

    Keys are ``"what:ExceptionName"`` (``heartbeat:StaleMessage``); a bare
    exception name is read the same way. Anything that is not a mapping of
    numbers counts as nothing, so a half-filled status still splits.
    """
    bad = stale = 0
    if not isinstance(rejected, Mapping):
        return 0, 0
    for key, n in rejected.items():
        if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n):
            continue
        n = int(n)
        if str(key).rsplit(":", 1)[-1] in STALE_REASONS:
            stale += n
        else:
            bad += n
    return bad, stale


def throughput_text(caps: Any, *, now: float) -> str:
    """``208 GFLOP/s (measured 3m ago)``: the probe's figure and how old it is.

    A node measures at start-up (and each run at its start); saying when tells a
    reader whether two figures are comparable. ``now`` is the wall time to count from.
    """
    caps = caps if isinstance(caps, Mapping) else {}
    g, at = caps.get("throughput_gflops"), caps.get("throughput_measured_at")
    if not isinstance(g, (int, float)) or isinstance(g, bool):
        return "- GFLOP/s"
    if not isinstance(at, (int, float)) or isinstance(at, bool) or at <= 0:
        return f"{g:.0f} GFLOP/s (not measured)" if g == 0 else f"{g:.0f} GFLOP/s"
    ago = max(0, int(now - at))
    when = f"{ago} s" if ago < 120 else f"{ago // 60} min" if ago < 7200 else f"{ago // 3600} h"
    return f"{g:.0f} GFLOP/s (measured {when} ago)"


def to_json(reply: StatusReply) -> dict[str, Any]:
    """The JSON object ``pcp status --json`` prints."""

    def plain(value: Any) -> Any:
        if isinstance(value, Message):
            return {name: plain(getattr(value, name)) for name in value.__dataclass_fields__}
        if isinstance(value, (tuple, list)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, bytes):
            return value.hex()
        return value

    obj: dict[str, Any] = plain(reply)
    extra = obj.pop("extra")
    obj.update(extra)
    return obj


async def fetch_status(
    addr: str, *, timeout: float = 10.0, members: bool = True, swarm_key: str | None = None
) -> StatusReply:
    """Ask the node at a full multiaddr (``.../p2p/<id>``) for its status.

    Uses a throwaway identity and host: asking for status needs no standing in
    the swarm (``swarm_key``, the hex pre-shared key, only for a private swarm).
    Raises only PcpError subclasses.
    """
    try:
        maddr = multiaddr.Multiaddr(addr)
        info = info_from_p2p_addr(maddr)
    except Exception as exc:
        raise ConfigError(f"not a full multiaddr with /p2p/<peer id>: {addr!r}") from exc
    host = new_host(key_pair=Identity.generate().key_pair, psk=swarm_key)
    # Errors are carried out of host.run(): raised inside it they would reach
    # the caller wrapped in the host nursery's ExceptionGroup.
    outcome: list[StatusReply | PcpError] = []
    with trio.move_on_after(timeout):
        async with host.run(listen_addrs=[]):
            try:
                if "/p2p-circuit" in addr:  # a node behind NAT: through its relay
                    from pcp_p2p.net.connectivity import circuit_dialer, connect

                    async with circuit_dialer(host) as circuits:
                        await connect(host, info.peer_id, [addr], circuits)
                        outcome.append(await _ask(host, info, addr, members, timeout))
                else:
                    outcome.append(await _ask(host, info, addr, members, timeout))
            except PcpError as exc:
                outcome.append(exc)
    if not outcome:
        raise PeerTimeout(f"no status from {addr} within {timeout:.0f} s")
    if isinstance(outcome[0], PcpError):
        raise outcome[0]
    return outcome[0]


async def ask_status(host: IHost, info: PeerInfo, addr: str, *, members: bool = True,
                     timeout: float = 10.0) -> StatusReply:
    """A status over a host the caller keeps running (``pcp doctor`` measures the same peers next)."""
    return await _ask(host, info, addr, members, timeout)


async def _ask(host: IHost, info: PeerInfo, addr: str, members: bool, timeout: float) -> StatusReply:
    try:
        if info.peer_id not in host.get_network().connections:
            await host.connect(info)
        stream = await host.new_stream(info.peer_id, [TProtocol(STATUS_PROTOCOL)])
    except trio.Cancelled:
        raise
    except Exception as exc:
        raise PeerGone(f"cannot reach {addr}: {exc or type(exc).__name__}") from exc
    try:
        await write_frame(stream, encode(StatusRequest(members=members)), timeout=timeout)
        reply = decode(await read_frame(stream, max_size=MAX_REPLY, timeout=timeout), StatusReply)
    finally:
        with trio.move_on_after(1):
            try:
                await stream.close()
            except Exception:
                pass
    if reply.peer_id != info.peer_id.to_base58():
        raise ProtocolError(f"status reply names {reply.peer_id}, not the peer asked")
    return reply

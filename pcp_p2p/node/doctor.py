"""``pcp doctor``: can peers reach this machine, behind what NAT, how fast are its links, what to do.

The first complaint of every peer system's users is "peers cannot reach each
other". ``pcp doctor --bootstrap MULTIADDR`` answers it before a node joins: a
throwaway host (its own identity, nothing kept) dials the bootstrap server and
up to :data:`MAX_PEERS` public members it lists, reads how each saw this
machine (identify's observed address, as a node does:
:func:`pcp_p2p.net.connectivity.verdict`), and measures the bandwidth to each
over ``/pcp/speed/1.0.0``. It prints a plain-language verdict:

- ``reachable``: peers dial this machine directly (no NAT, or a forwarded port);
- ``hole-punched``: behind a NAT that keeps ports (cone): reached through a
  relay first, then directly after DCUtR;
- ``relay-only``: behind a NAT that changes ports per destination (symmetric):
  reached through a relay only; it still trains, over connections it opens;
- ``unreachable``: not even the bootstrap server answered;

with ``--json``, one object whose ``reachability`` field holds the verdict.

``/pcp/speed/1.0.0`` (served by every node, :class:`SpeedServer`): the client
sends an 8-byte request ``up (u32) | down (u32)``, then ``up`` bytes; the
server answers a 1-byte ack once it read them all, then ``down`` bytes. Each
side times its own direction. A stranger can make a node spend bandwidth with
it, so it is budgeted: at most :data:`MAX_SPEED_BYTES` each way, one test at a
time, :data:`SPEED_TESTS_PER_MIN` a minute node-wide, and a read deadline.
"""

from __future__ import annotations

import argparse
import json
import logging
import struct
import sys
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr

from pcp_p2p.blob.server import close_stream
from pcp_p2p.core.errors import ConfigError, MalformedMessage, PeerGone
from pcp_p2p.core.faults import Boundary
from pcp_p2p.core.identity import Identity
from pcp_p2p.core.logs import LogOnce
from pcp_p2p.net.connectivity import observations, verdict
from pcp_p2p.net.reachability import HOLE_PUNCHABLE, PUBLIC, RELAY_ONLY, UNKNOWN

log = logging.getLogger("pcp.doctor")

SPEED_PROTOCOL = TProtocol("/pcp/speed/1.0.0")
MAX_SPEED_BYTES = 4 << 20
SPEED_TESTS_PER_MIN = 12
SPEED_READ_S = 30.0
MAX_PEERS = 3
REQUEST = struct.Struct(">II")
_CHUNK = 64 << 10

# The doctor's words for the node's verdicts (a person reads these), and what to do about each.
WORDS = {PUBLIC: "reachable", HOLE_PUNCHABLE: "hole-punched", RELAY_ONLY: "relay-only", UNKNOWN: "unknown"}
NAT_KIND = {PUBLIC: "none (a public address, or a forwarded port)",
            HOLE_PUNCHABLE: "cone (keeps ports: endpoint-independent mapping)",
            RELAY_ONLY: "symmetric (a new port per destination)", UNKNOWN: "unknown"}
ADVICE = {
    "reachable": "nothing to do: peers dial this machine directly; it may also lead runs and relay for others "
                 "(pcp node join --relay)",
    "hole-punched": "fine for training: peers reach this node through a relay and then directly after a hole "
                    "punch; forwarding a port to it (and --listen on that port) would make it reachable",
    "relay-only": "it can train (it opens its own connections) but never leads a run and cannot be reached "
                  "directly; forward a port to it and --listen on that port, or use a network whose NAT keeps "
                  "ports (most home routers do; carrier-grade NATs and some firewalls do not)",
    "unreachable": "the bootstrap server did not answer: check the address, this machine's internet "
                   "connection, and any firewall blocking outgoing TCP",
    "unknown": "no peer reported how it sees this machine; try again, or with another bootstrap server",
}


# --- the server side (every node) ------------------------------------------------------------


@dataclass
class SpeedServer:
    """``/pcp/speed/1.0.0``: receive ``up`` bytes, ack, send ``down`` bytes; budgeted (see module doc)."""

    clock: Any = trio.current_time
    _busy: trio.Lock = field(default_factory=trio.Lock)
    _recent: deque[float] = field(default_factory=deque)
    refused: int = 0
    boundary: Boundary = field(default_factory=lambda: Boundary(LogOnce(log)))  # the node's (pcp_p2p.core.faults)

    def admit(self, now: float) -> bool:
        """Whether one more test fits this minute's budget (and records it)."""
        while self._recent and now - self._recent[0] >= 60.0:
            self._recent.popleft()
        if len(self._recent) >= SPEED_TESTS_PER_MIN:
            return False
        self._recent.append(now)
        return True

    async def handle(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        try:
            if self._busy.locked() or not self.admit(self.clock()):
                self.refused += 1
                return
            async with self._busy:
                with trio.fail_after(SPEED_READ_S):
                    up, down = REQUEST.unpack(await _read_exactly(stream, REQUEST.size))
                    if up > MAX_SPEED_BYTES or down > MAX_SPEED_BYTES:
                        self.refused += 1
                        return
                    await _drain(stream, up)
                    await stream.write(b"\x01")
                    await _send_zeros(stream, down)
        except Exception as exc:  # a stranger's broken test: close, nothing else; a bug of ours: logged, counted
            self.boundary.judge(peer, exc, "speed", level=logging.DEBUG)
        finally:
            await close_stream(stream)


async def _read_exactly(stream: INetStream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        data = await stream.read(n - len(buf))
        if not data:
            raise PeerGone(f"stream closed after {len(buf)} of {n} bytes")
        buf += data
    return bytes(buf)


async def _drain(stream: INetStream, n: int) -> None:
    left = n
    while left > 0:
        data = await stream.read(min(left, _CHUNK))
        if not data:
            raise PeerGone(f"stream closed with {left} bytes to go")
        left -= len(data)


async def _send_zeros(stream: INetStream, n: int) -> None:
    chunk = bytes(_CHUNK)
    left = n
    while left > 0:
        await stream.write(chunk[: min(left, _CHUNK)])
        left -= min(left, _CHUNK)


# --- the client side -------------------------------------------------------------------------


@dataclass
class PeerSpeed:
    peer_id: str
    addr: str
    up_mbit: float | None = None
    down_mbit: float | None = None
    error: str | None = None


async def measure(host: IHost, peer: ID, up: int, down: int, timeout: float) -> PeerSpeed:
    """Mbit/s up (this machine to ``peer``: until the ack, so one round trip is counted in) and
    down (from the ack to the last byte) over one ``/pcp/speed`` stream."""
    out = PeerSpeed(peer.to_base58(), "")
    try:
        with trio.fail_after(timeout):
            stream = await host.new_stream(peer, [SPEED_PROTOCOL])
            try:
                t0 = trio.current_time()
                await stream.write(REQUEST.pack(up, down))
                await _send_zeros(stream, up)
                if await _read_exactly(stream, 1) != b"\x01":
                    raise MalformedMessage("speed test: bad ack")
                t1 = trio.current_time()
                await _drain(stream, down)
                t2 = trio.current_time()
            finally:
                await close_stream(stream)
        out.up_mbit = round(up * 8 / max(t1 - t0, 1e-6) / 1e6, 2) if up else None
        out.down_mbit = round(down * 8 / max(t2 - t1, 1e-6) / 1e6, 2) if down else None
    except trio.TooSlowError:
        out.error = f"speed test not done within {timeout:.0f} s"
    except PeerGone as exc:
        out.error = f"{exc} (the peer refused: busy, or its test budget is spent)"
    except Exception as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


@dataclass
class Diagnosis:
    """What ``pcp doctor`` found (``--json`` prints it as one object)."""

    reachability: str  # reachable | hole-punched | relay-only | unreachable | unknown
    nat: str
    advice: str
    bootstrap: str
    observed_addrs: list[str] = field(default_factory=list)
    local_ips: list[str] = field(default_factory=list)
    peers: list[PeerSpeed] = field(default_factory=list)
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        out = [f"reachability: {self.reachability}", f"NAT: {self.nat}"]
        if self.observed_addrs:
            out.append(f"seen by peers as: {', '.join(sorted(set(self.observed_addrs)))}")
        for p in self.peers:
            if p.error:
                out.append(f"bandwidth to {p.peer_id[:16]}…: not measured ({p.error})")
            else:
                out.append(f"bandwidth to {p.peer_id[:16]}… ({p.addr}): "
                           f"up {p.up_mbit} Mbit/s, down {p.down_mbit} Mbit/s")
        if self.error:
            out.append(f"error: {self.error}")
        out.append(f"advice: {self.advice}")
        return out


def judge(local_ips: list[str], obs: list[Any], reached: bool) -> tuple[str, str]:
    """(the doctor's word, the NAT kind) from the node's own verdict rule (pure)."""
    if not reached:
        return "unreachable", "unknown"
    v = verdict(local_ips, obs)
    return WORDS[v], NAT_KIND[v]


async def diagnose(bootstrap: str, *, peers: int = MAX_PEERS, up: int = 1 << 20, down: int = 2 << 20,
                   timeout: float = 20.0, swarm_key: str | None = None) -> Diagnosis:
    """Dial the bootstrap server and up to ``peers`` public members; judge; measure bandwidth."""
    from pcp_p2p.node.node import _local_ipv4s, transport_addrs
    from pcp_p2p.node.status import ask_status

    try:
        info = info_from_p2p_addr(multiaddr.Multiaddr(bootstrap))
    except Exception as exc:
        raise ConfigError(f"not a full multiaddr with /p2p/<peer id>: {bootstrap!r}") from exc
    local_ips = _local_ipv4s()
    host = new_host(key_pair=Identity.generate().key_pair, psk=swarm_key)
    result = Diagnosis("unreachable", "unknown", ADVICE["unreachable"], bootstrap, local_ips=local_ips)
    # It listens (on a port of its own, closed afterwards): py-libp2p's identify records a peer's
    # observation of us only for connections it can match to a listen address.
    async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/0.0.0.0/tcp/0")]):
        with trio.move_on_after(timeout):
            try:
                await host.connect(info)
                status = await ask_status(host, info, bootstrap, timeout=timeout)
            except Exception as exc:
                result.error = str(exc) or type(exc).__name__
                return result
            targets: list[tuple[ID, str]] = [(info.peer_id, bootstrap)]
            for m in status.members:
                direct = transport_addrs(m.addrs)
                if m.peer_id != status.peer_id and direct and len(targets) <= peers:
                    try:
                        pid = ID.from_base58(m.peer_id)
                        with trio.move_on_after(min(5.0, timeout)):
                            await host.connect(PeerInfo(pid, direct))
                            targets.append((pid, str(direct[0])))
                    except Exception as exc:
                        log.debug("doctor: %s unreachable: %s", m.peer_id, exc)
            # Identify runs just after each connection: wait (bounded) for its observations.
            # Polled: py-libp2p's identify fills the peerstore and signals nothing we could wait on.
            with trio.move_on_after(5.0):
                while len(observations(host)) < len(targets):  # noqa: ASYNC110
                    await trio.sleep(0.2)
            obs = observations(host)
            result.observed_addrs = [f"{o.ip}:{o.port}" for o in obs]
            word, nat = judge(local_ips, obs, reached=True)
            result.reachability, result.nat, result.advice = word, nat, ADVICE[word]
            for pid, addr in targets[: peers]:
                speed = await measure(host, pid, up, down, timeout)
                speed.addr = addr
                result.peers.append(speed)
    return result


# --- the command -----------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    doctor = sub.add_parser(
        "doctor",
        help="check whether peers can reach this machine, its NAT and its bandwidth",
        description="Dial a bootstrap server and a few public members with a throwaway identity; say "
        "whether this machine is reachable, hole-punchable (cone NAT) or relay-only (symmetric NAT), "
        "measure the bandwidth to those peers, and what to do about it. Nothing is kept.",
    )
    doctor.add_argument("--bootstrap", required=True, metavar="MULTIADDR",
                        help="full multiaddr of a bootstrap server (.../p2p/<peer id>)")
    doctor.add_argument("--json", action="store_true",
                        help="print one JSON object (its `reachability` field: the verdict)")
    doctor.add_argument("--peers", type=int, default=MAX_PEERS, help=f"peers to measure (default {MAX_PEERS})")
    doctor.add_argument("--timeout", type=float, default=30.0, help="seconds for the whole check (default 30)")
    doctor.add_argument("--swarm-key", metavar="FILE", default=None, help="the private swarm's key, if any")
    doctor.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from pcp_p2p.net.swarm_key import read_swarm_key

    key = read_swarm_key(args.swarm_key) if args.swarm_key else None
    peers = max(0, min(args.peers, 8))
    result = trio.run(lambda: diagnose(args.bootstrap, peers=peers, timeout=args.timeout, swarm_key=key))
    if args.json:
        print(json.dumps(result.as_json()))
    else:
        print("\n".join(result.lines()))
    sys.stdout.flush()
    return 0 if result.reachability != "unreachable" else 1

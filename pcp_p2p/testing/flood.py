"""A stream flood against a real node, and the node's memory while it lasts.

The attack (issue #12, "inflate memory"): open many ``/pcp/msg`` streams at
once, each declaring a frame just under the hard limit, write all of it but
the last byte, and hold. A node that buffers what it is sent before the frame
is complete holds ``streams x frame`` bytes for as long as its deadline lets
the attacker wait; one with budgets refuses (resets) the streams beyond them.

- :func:`flood_streams` is the attacker alone: fresh identities (libp2p hosts
  in this process) flooding any node's address. Tests run it against a node
  in their own process while an honest peer sends.
- :func:`flood_node` starts a real ``pcp node join`` process on 127.0.0.1,
  floods it, samples its resident memory from ``/proc`` and returns the growth
  and the counts; the process is killed on every exit path (it runs in a
  :func:`~pcp_p2p.node.local_swarm.local_swarm`). :func:`flood` is the same
  for synchronous callers (benchmarks).

Counts are what the attacker saw, so they mean the same on a node with or
without budgets: a stream is *refused* when the node ended it before the
attacker had written its body (while it was being opened, or after), *accepted* when the node read the body (all
but the last byte) and then held it until its deadline cut it or the flood
ended.
"""

from __future__ import annotations

import functools
import logging
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.peer.peerinfo import info_from_p2p_addr

from pcp_p2p.core.identity import Identity
from pcp_p2p.node.messaging import MSG_PROTOCOL
from pcp_p2p.wire import HARD_MAX_SIZE

log = logging.getLogger("pcp.testing.flood")

_PIECE = 256 * 1024  # what one write hands yamux (its initial window)
_MIB = 1024 * 1024


def rss_mib(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB (``VmRSS`` from ``/proc``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise ProcessLookupError(f"no VmRSS for pid {pid}")


@dataclass
class StreamTally:
    """What the attacker saw of its streams."""

    opened: int = 0
    failed_to_open: int = 0  # of the refused, reset while the stream was being opened
    refused: int = 0  # ended by the node before the body was written
    accepted: int = 0  # body written (all but the last byte): the node read it
    cut: int = 0  # of the accepted, ended by the node before the flood ended
    errors: dict[str, int] = field(default_factory=dict)

    def _error(self, exc: BaseException) -> None:
        key = type(exc).__name__
        self.errors[key] = self.errors.get(key, 0) + 1


@dataclass
class FloodResult:
    """One flood against one node process."""

    streams: int
    frame_size: int
    rss_before_mib: float
    rss_peak_mib: float
    tally: StreamTally
    node_rejected: dict[str, int]  # the node's own rejection counters, from its status
    node_extra: dict[str, Any]

    @property
    def growth_mib(self) -> float:
        return self.rss_peak_mib - self.rss_before_mib

    @property
    def refused(self) -> int:
        return self.tally.refused

    @property
    def accepted(self) -> int:
        return self.tally.accepted

    def as_dict(self) -> dict[str, Any]:
        return {
            "streams": self.streams,
            "frame_size": self.frame_size,
            "rss_before_mib": round(self.rss_before_mib, 1),
            "rss_peak_mib": round(self.rss_peak_mib, 1),
            "growth_mib": round(self.growth_mib, 1),
            "refused": self.refused,
            "accepted": self.accepted,
            "cut": self.tally.cut,
            "failed_to_open": self.tally.failed_to_open,
            "node_rejected": self.node_rejected,
        }


async def flood_streams(
    target_addr: str,
    *,
    peers: int = 1,
    streams_per_peer: int = 48,
    frame_size: int = HARD_MAX_SIZE - 1,
    hold_s: float = 20.0,
    at_full_pressure: trio.Event | None = None,
    stop: trio.Event | None = None,
) -> StreamTally:
    """Flood ``target_addr`` from ``peers`` fresh identities, ``streams_per_peer`` streams each.

    Every stream declares ``frame_size`` bytes and writes all but the last
    one; it then holds until the node ends it, ``hold_s`` seconds after the
    flood started, or ``stop`` is set. ``at_full_pressure`` is set once every
    stream was either refused or has written its body (the moment to probe the
    node).
    """
    info = info_from_p2p_addr(multiaddr.Multiaddr(target_addr))
    tally = StreamTally()
    total = peers * streams_per_peer
    settled = 0
    body = bytes(_PIECE)

    def settle() -> None:
        nonlocal settled
        settled += 1
        if settled == total and at_full_pressure is not None:
            at_full_pressure.set()

    async def one_stream(host: IHost) -> None:
        try:
            stream = await host.new_stream(info.peer_id, [MSG_PROTOCOL])
        except Exception as exc:  # the node reset it during negotiation (a refusal) or is gone
            tally.failed_to_open += 1
            tally.refused += 1
            tally._error(exc)
            settle()
            return
        tally.opened += 1
        written = False
        try:
            await stream.write(struct.pack(">I", frame_size))
            left = frame_size - 1
            while left:
                k = min(_PIECE, left)
                await stream.write(body[:k])
                left -= k
            written = True
            tally.accepted += 1
            settle()
            while await stream.read(65536):  # the node never answers an incomplete frame
                pass
            tally.cut += 1
        except trio.Cancelled:
            raise
        except Exception as exc:  # reset, EOF, yamux gave up: the node ended the stream
            tally._error(exc)
            if written:
                tally.cut += 1
            else:
                tally.refused += 1
                settle()
        finally:
            with trio.move_on_after(1) as scope:
                scope.shield = True
                try:
                    await stream.reset()
                except Exception:
                    pass

    async def one_peer() -> None:
        host = new_host(key_pair=Identity.generate().key_pair)
        async with host.run(listen_addrs=[]):
            await host.connect(info)
            async with trio.open_nursery() as nursery:
                for _ in range(streams_per_peer):
                    nursery.start_soon(one_stream, host)

    with trio.move_on_after(hold_s) as scope:
        async with trio.open_nursery() as nursery:
            if stop is not None:

                async def stop_on_request() -> None:
                    await stop.wait()
                    scope.cancel()

                nursery.start_soon(stop_on_request)
            async with trio.open_nursery() as streams:
                for _ in range(peers):
                    streams.start_soon(one_peer)
            nursery.cancel_scope.cancel()  # every peer ended before the hold did
    return tally


async def flood_node(
    *,
    peers: int = 1,
    streams_per_peer: int = 48,
    frame_size: int = HARD_MAX_SIZE - 1,
    hold_s: float = 20.0,
    root: Path | None = None,
    sample_s: float = 0.05,
) -> FloodResult:
    """Start a ``pcp node join`` process on 127.0.0.1, flood it, measure its RSS.

    The baseline is the node's RSS once it has settled (listening, idle); the
    peak is the highest sample during the flood. The process and everything it
    started are killed when this returns or raises.
    """
    from pcp_p2p.node.local_swarm import local_swarm
    from pcp_p2p.node.status import fetch_status

    async with local_swarm(root) as swarm:
        node = await swarm.add_worker(["--backend", "cpu", "--log-level", "warning"])
        assert node.process is not None
        pid = node.process.pid
        await fetch_status(node.addr, timeout=30)  # up and answering
        before = await _settled_rss(pid)
        peak = before
        done = trio.Event()

        async def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, rss_mib(pid))
                with trio.move_on_after(sample_s):
                    await done.wait()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample)
            try:
                tally = await flood_streams(node.addr, peers=peers, streams_per_peer=streams_per_peer,
                                            frame_size=frame_size, hold_s=hold_s)
            finally:
                done.set()
        peak = max(peak, rss_mib(pid))
        status = await fetch_status(node.addr, timeout=30)
        rejected = {k: int(v) for k, v in status.network.get("rejected", {}).items()}
        return FloodResult(peers * streams_per_peer, frame_size, before, peak, tally, rejected,
                           dict(status.extra))


async def _settled_rss(pid: int, *, within_s: float = 10.0, tolerance_mib: float = 2.0) -> float:
    """RSS once two samples a second apart agree within ``tolerance_mib`` (or after ``within_s``)."""
    last = rss_mib(pid)
    with trio.move_on_after(within_s) as scope:
        while not scope.cancel_called:
            await trio.sleep(1.0)  # a process settling: there is no event to wait on
            now = rss_mib(pid)
            if abs(now - last) <= tolerance_mib:
                return now
            last = now
    return rss_mib(pid)


def flood(**kwargs: Any) -> FloodResult:
    """:func:`flood_node` for synchronous callers (benchmarks); same arguments."""
    return trio.run(functools.partial(flood_node, **kwargs))


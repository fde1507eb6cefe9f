"""Resource budgets: how much one peer, and all peers together, may make this node hold.

Every peer is a stranger and identities are free, so a limit per peer alone
bounds nothing: a thousand fresh keys each inside its own share still add up.
A :class:`Budget` therefore keeps two ledgers, one per peer and one for the
node, for two resources an inbound stream costs:

- **streams**: a slot held from the moment a stream arrives until its handler
  ends (each costs a task and a yamux receive window);
- **bytes**: what the node buffers for it, reserved from the *declared* size
  (a frame's length prefix) before any of the body is read, so a peer cannot
  make the node allocate first and refuse later. A slice of the total is kept
  for small requests (:class:`Limits`), so large frames from many identities
  cannot crowd out the small messages a run lives on.

A request beyond either ledger is refused at once with :class:`OverBudget`
(the caller resets the stream) and counted by reason; nothing waits, since a
waiting stream would itself hold a slot. Reservations are context managers,
so every exit path (refusal, timeout, cancellation, a handler's bug) gives
back what it took.

Holding is bounded in time too: :class:`Pace` turns a size into an overall
deadline, ``start + grace + size / min_rate``. That is a deadline for the whole
transfer (not a per-read timeout a trickler resets with every byte) and a
minimum average rate at once, so a slot or a reservation is never held by a
peer that stopped sending, nor for longer than an honest peer at the minimum
rate would need.

This module is sans-IO: it keeps counts and computes deadlines from a time the
caller passes in (trio's clock in handlers, ``time.monotonic`` in worker
threads, a fake in tests); the pumps in :mod:`pcp_p2p.node.messaging` and
:mod:`pcp_p2p.blob.server` enforce them.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from pcp_p2p.core.errors import ConfigError, OverBudget

# Why a request was refused (the keys of Budget.refusals).
STREAMS_PER_PEER = "streams_per_peer"
STREAMS_TOTAL = "streams_total"
BYTES_PER_PEER = "bytes_per_peer"
BYTES_TOTAL = "bytes_total"
RATE_PER_PEER = "rate_per_peer"
RATE_TOTAL = "rate_total"


@dataclass(frozen=True)
class Limits:
    """The most one peer, and all peers together, may hold at once.

    ``small_reserve`` bytes of the total are kept for requests of at most
    ``small`` bytes: many identities filling the total with large frames then
    still leave room for the small control messages (leases, announcements,
    commits) a run needs to go on.
    """

    streams_per_peer: int
    streams_total: int
    bytes_per_peer: int
    bytes_total: int
    small: int = 64 * 1024
    small_reserve: int = 0

    def __post_init__(self) -> None:
        for name in ("streams_per_peer", "streams_total", "bytes_per_peer", "bytes_total", "small"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"budget: {name} must be positive")
        if self.streams_per_peer > self.streams_total or self.bytes_per_peer > self.bytes_total:
            raise ConfigError("budget: a peer's share cannot exceed the total")
        if not 0 <= self.small_reserve < self.bytes_total:
            raise ConfigError("budget: the reserve for small requests must be below the total")

    def total_for(self, nbytes: int) -> int:
        """The total a request of ``nbytes`` may fill (large ones leave the reserve alone)."""
        return self.bytes_total if nbytes <= self.small else self.bytes_total - self.small_reserve


@dataclass(frozen=True)
class Pace:
    """An overall deadline that also demands a minimum average rate.

    ``grace_s`` covers latency and the first bytes (a round trip, a busy
    scheduler); ``min_rate`` (bytes per second) is the slowest transfer still
    taken for an honest one.
    """

    grace_s: float
    min_rate: float

    def __post_init__(self) -> None:
        if self.grace_s <= 0 or self.min_rate <= 0:
            raise ConfigError("pace: grace and minimum rate must be positive")

    def deadline(self, start: float, nbytes: int) -> float:
        """When ``nbytes`` begun at ``start`` must all have arrived."""
        return start + self.grace_s + nbytes / self.min_rate

    def remaining(self, start: float, nbytes: int, now: float) -> float:
        """Seconds left (≤ 0: overdue) for ``nbytes`` begun at ``start``."""
        return self.deadline(start, nbytes) - now


@dataclass(frozen=True)
class Usage:
    streams: int
    bytes: int


class Budget:
    """Stream slots and buffered bytes, per peer and in total (see the module docstring)."""

    def __init__(self, limits: Limits, name: str = "budget") -> None:
        self.limits = limits
        self.name = name
        self._streams: Counter[str] = Counter()
        self._bytes: Counter[str] = Counter()
        self.streams = 0  # held now, all peers
        self.bytes = 0
        self.peak = Usage(0, 0)  # the most ever held at once, all peers
        self.refusals: Counter[str] = Counter()  # by reason (STREAMS_PER_PEER, ...)

    def usage(self, peer: str | None = None) -> Usage:
        """What ``peer`` holds now, or (``None``) what everyone does."""
        if peer is None:
            return Usage(self.streams, self.bytes)
        return Usage(self._streams[peer], self._bytes[peer])

    def open(self, peer: str) -> Reservation:
        """A stream slot for ``peer``; :class:`OverBudget` if its share or the total is full."""
        if self._streams[peer] >= self.limits.streams_per_peer:
            self._refuse(STREAMS_PER_PEER, f"{peer} already has {self._streams[peer]} streams open")
        if self.streams >= self.limits.streams_total:
            self._refuse(STREAMS_TOTAL, f"{self.streams} streams open in total")
        self._streams[peer] += 1
        self.streams += 1
        self._note_peak()
        return Reservation(self, peer)

    def snapshot(self) -> dict[str, Any]:
        """For status and metrics: limits, what is held, the peak and the refusals."""
        lim = self.limits
        return {
            "streams": self.streams,
            "bytes": self.bytes,
            "peak_streams": self.peak.streams,
            "peak_bytes": self.peak.bytes,
            "peers": len(self._streams),
            "limits": {STREAMS_PER_PEER: lim.streams_per_peer, STREAMS_TOTAL: lim.streams_total,
                       BYTES_PER_PEER: lim.bytes_per_peer, BYTES_TOTAL: lim.bytes_total,
                       "small_reserve": lim.small_reserve},
            "refused": dict(self.refusals),
        }

    # -- used by Reservation --------------------------------------------------------

    def _take_bytes(self, peer: str, n: int) -> None:
        if n < 0:
            raise ValueError("cannot reserve a negative size")
        if self._bytes[peer] + n > self.limits.bytes_per_peer:
            self._refuse(BYTES_PER_PEER, f"{peer} would hold {self._bytes[peer] + n} bytes "
                                         f"> {self.limits.bytes_per_peer}")
        total = self.limits.total_for(n)
        if self.bytes + n > total:
            self._refuse(BYTES_TOTAL, f"{self.bytes + n} bytes in total > {total}")
        self._bytes[peer] += n
        self.bytes += n
        self._note_peak()

    def _give_bytes(self, peer: str, n: int) -> None:
        self._bytes[peer] -= n
        self.bytes -= n
        if self._bytes[peer] == 0:
            del self._bytes[peer]

    def _close(self, peer: str) -> None:
        self._streams[peer] -= 1
        self.streams -= 1
        if self._streams[peer] == 0:
            del self._streams[peer]  # memory stays bounded by the peers holding something

    def _refuse(self, reason: str, detail: str) -> None:
        self.refusals[reason] += 1
        raise OverBudget(f"{self.name}: {detail} ({reason.replace('_', ' ')} budget)", reason)

    def _note_peak(self) -> None:
        if self.streams > self.peak.streams or self.bytes > self.peak.bytes:
            self.peak = Usage(max(self.streams, self.peak.streams), max(self.bytes, self.peak.bytes))


class Reservation:
    """One stream's slot and the bytes reserved for it; give everything back on exit."""

    def __init__(self, budget: Budget, peer: str) -> None:
        self._budget = budget
        self.peer = peer
        self.bytes = 0
        self._open = True

    def reserve(self, nbytes: int) -> None:
        """Hold ``nbytes`` more for this stream, or raise :class:`OverBudget` (holding nothing more)."""
        if not self._open:
            raise RuntimeError("reservation already closed")
        self._budget._take_bytes(self.peer, nbytes)
        self.bytes += nbytes

    def release_bytes(self) -> None:
        """Give back the bytes (the buffer is gone) but keep the stream slot."""
        if self.bytes:
            self._budget._give_bytes(self.peer, self.bytes)
            self.bytes = 0

    def close(self) -> None:
        """Give back everything (once; later calls do nothing)."""
        if self._open:
            self.release_bytes()
            self._budget._close(self.peer)
            self._open = False

    def __enter__(self) -> Reservation:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@dataclass(frozen=True)
class RateLimits:
    """How many requests per second one peer, and all peers together, may make.

    A bucket holds up to ``burst`` requests and refills at ``per_s``; the total
    is kept the same way, since identities are free. ``peers`` bounds how many
    per-peer buckets are remembered (the least recently heard from is forgotten,
    which gives it a full bucket again; the total still bounds what that buys).
    """

    per_peer_s: float
    per_peer_burst: float
    total_s: float
    total_burst: float
    peers: int = 4096

    def __post_init__(self) -> None:
        if min(self.per_peer_s, self.per_peer_burst, self.total_s, self.total_burst, self.peers) <= 0:
            raise ConfigError("rate: every limit must be positive")
        if self.per_peer_s > self.total_s or self.per_peer_burst > self.total_burst:
            raise ConfigError("rate: a peer's share cannot exceed the total")


class Rate:
    """Token buckets, per peer and in total: a stream-slot budget bounds how much
    a peer holds *at once*, this bounds how *often* it may ask (a cheap request
    answered at once never holds a slot for long, so slots alone would let one
    peer make the node answer as fast as the link carries).

    Sans-IO: the caller passes the time. A refused request costs nothing: the
    buckets are only debited when both have a token.
    """

    def __init__(self, limits: RateLimits, name: str = "rate") -> None:
        self.limits = limits
        self.name = name
        self._peers: OrderedDict[str, tuple[float, float]] = OrderedDict()  # peer -> (tokens, at)
        self._total: tuple[float, float] | None = None
        self.refusals: Counter[str] = Counter()

    @staticmethod
    def _fill(bucket: tuple[float, float] | None, now: float, per_s: float, burst: float) -> float:
        if bucket is None:
            return burst
        tokens, at = bucket
        return min(burst, tokens + max(0.0, now - at) * per_s)

    def take(self, peer: str, now: float) -> None:
        """Debit one request from ``peer``, or raise :class:`OverBudget` (debiting nothing)."""
        lim = self.limits
        mine = self._fill(self._peers.get(peer), now, lim.per_peer_s, lim.per_peer_burst)
        total = self._fill(self._total, now, lim.total_s, lim.total_burst)
        if mine < 1.0:
            self.refusals[RATE_PER_PEER] += 1
            raise OverBudget(f"{self.name}: {peer} asks faster than {lim.per_peer_s:g}/s "
                             f"(rate per peer budget)", RATE_PER_PEER)
        if total < 1.0:
            self.refusals[RATE_TOTAL] += 1
            raise OverBudget(f"{self.name}: more than {lim.total_s:g} requests/s from all peers "
                             f"(rate total budget)", RATE_TOTAL)
        self._peers[peer] = (mine - 1.0, now)
        self._peers.move_to_end(peer)
        while len(self._peers) > lim.peers:
            self._peers.popitem(last=False)
        self._total = (total - 1.0, now)

    def snapshot(self) -> dict[str, Any]:
        lim = self.limits
        return {"limits": {"per_peer_s": lim.per_peer_s, "per_peer_burst": lim.per_peer_burst,
                           "total_s": lim.total_s, "total_burst": lim.total_burst},
                "peers": len(self._peers), "refused": dict(self.refusals)}

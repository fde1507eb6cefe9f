"""Sans-IO Kademlia value lookups and store fan-outs, as PCP runs them.

Why not py-libp2p 0.8.1's own ``get_value``/``put_value``: both first run a
full iterative FIND_NODE walk (up to ten queries in flight, every round
waiting for its slowest answer) and only then talk to the peers that hold the
value; a get then asks *every* peer the walk found and waits for all of them,
and corrects stale replicas before it returns. On 8 nodes that is two rounds of
eight RPCs per operation: 120-160 ms where one stream round trip is ~5 ms.
(Worse, py-libp2p servers reset every FIND_NODE whose key is over 50 bytes and
not a peer id, which every ``/pcp/<kind>/<name>`` key is: that walk never
learned anything, it only cost the round trips.)

The machines here start from the routing table instead, which on a small or
well-refreshed swarm already holds the closest peers:

- :class:`ValueLookup`: ask the closest known peer for the value; each
  ``hedge_s`` without an answer (and at once on a failure) one more query goes
  out, up to ``alpha`` in flight (a hedged request: on a healthy swarm a get
  costs one RPC, a slow or dead peer costs ``hedge_s``, not a timeout); learn
  closer peers from the answers; stop as soon as ``quorum`` valid answers are
  in, or no unasked peer is closer than the ``k`` closest that answered. The
  newest valid value wins; peers among the closest that answered with an older
  value or none are named for a store afterwards (entry correction, off the
  caller's path).
- :class:`StoreFanout`: store at the closest peers of the routing table,
  just enough at once to reach ``quorum`` acknowledgements; the put returns
  then; the rest of the ``k`` closest, and any closer peer a check-up walk
  finds, are stored at off the caller's path, one at a time.
- :class:`ClosestWalk`: that check-up walk (``alpha`` queries in flight):
  it goes on while answers bring peers into the ``k`` closest, and stops after
  ``alpha`` answers in a row brought none (the paper's "no progress" rule).

No I/O and no clock: the node's trio tasks send the RPCs and feed the
answers in (:mod:`pcp_p2p.dht.table`). Values arrive here already checked by
the record validator; the machines only order them (``newer``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

P = TypeVar("P", bound=Hashable)

ALPHA = 3  # queries in flight per lookup at most (the Kademlia paper's alpha)
K = 20  # replicas per key (the Kademlia k)
# Replicas of what its author puts again soon: a shepherd's lease (every other renewal), a round's
# commit record (the next round's replaces it), a provider record (each holder announces its own
# copy, and peers mostly fetch by the hint that names the holder). k copies are for
# surviving churn until the next put; each put at k peers cost the shepherd O(N) up to k = 20
# (issue #15). Four: a lookup that reaches the key's closest peers finds one even with a few gone.
REFRESHED_REPLICAS = 4
GET_QUORUM = 1  # valid answers a get waits for: the first valid record ends it (as in the paper)
PUT_QUORUM = 1  # remote stores a put waits for (with the local copy: three replicas) before it returns
HEDGE_S = 0.025  # a lookup adds one more query in flight each time this passes without an answer
MAX_QUERIES = 3 * K  # a lookup's budget of RPCs, whatever peers keep naming


@dataclass
class ValueLookup(Generic[P]):
    """One get: which peers to ask next, when to stop, which value wins.

    ``distance`` orders peers by XOR distance to the key; ``newer(a, b)`` says
    whether value ``a`` supersedes ``b`` (both valid).
    """

    distance: Callable[[P], int]
    newer: Callable[[bytes, bytes], bool]
    started_at: float = 0.0
    alpha: int = ALPHA
    k: int = K
    quorum: int = GET_QUORUM
    hedge_s: float = HEDGE_S
    max_queries: int = MAX_QUERIES
    best: bytes | None = None
    valid_answers: int = 0
    _candidates: list[P] = field(default_factory=list)
    _seen: set[P] = field(default_factory=set)
    _in_flight: set[P] = field(default_factory=set)
    _answered: list[P] = field(default_factory=list)  # peers that answered, in no order
    _holders: set[P] = field(default_factory=set)  # peers that returned ``best``
    _queried: int = 0

    def add_candidates(self, peers: Iterable[P]) -> None:
        """Peers that may hold the value (the routing table's, or named in an answer)."""
        fresh = [p for p in peers if p not in self._seen]
        self._seen.update(fresh)
        self._candidates = sorted([*self._candidates, *fresh], key=self.distance)

    def width(self, now: float) -> int:
        """Queries allowed in flight at ``now``: one, plus one per ``hedge_s`` waited, at most
        ``alpha`` (a failed or empty answer frees its slot at once)."""
        if self.hedge_s <= 0:
            return self.alpha
        waited = max(0.0, now - self.started_at)
        return min(self.alpha, 1 + int(waited / self.hedge_s))

    def next_wakeup(self, now: float) -> float:
        """When :meth:`width` next grows while there is someone left to ask (else ``inf``)."""
        if self.done or not self._candidates or self.width(now) >= self.alpha or self.hedge_s <= 0:
            return float("inf")
        waited = max(0.0, now - self.started_at)
        return self.started_at + self.hedge_s * (int(waited / self.hedge_s) + 1)

    def next_queries(self, now: float) -> list[P]:
        """Peers to ask at ``now`` (none once done, or while :meth:`width` are in flight)."""
        out: list[P] = []
        while (not self.done and self._candidates and len(self._in_flight) < self.width(now)
               and self._queried < self.max_queries):
            peer = self._candidates.pop(0)
            self._in_flight.add(peer)
            self._queried += 1
            out.append(peer)
        return out

    def on_answer(self, peer: P, value: bytes | None, closer: Iterable[P] = ()) -> None:
        """``peer`` answered: ``value`` is its valid record (``None``: none, or an invalid one)."""
        self._in_flight.discard(peer)
        self._answered.append(peer)
        if value is not None:
            self.valid_answers += 1
            if self.best is None or self.newer(value, self.best):
                self.best = value
                self._holders = {peer}
            elif value == self.best:
                self._holders.add(peer)
        self.add_candidates(closer)

    def on_failure(self, peer: P) -> None:
        """``peer`` did not answer (refused, reset, timed out): it counts for nothing, and its slot
        goes to the next candidate at once."""
        self._in_flight.discard(peer)

    @property
    def quorum_reached(self) -> bool:
        return self.valid_answers >= self.quorum

    @property
    def converged(self) -> bool:
        """No unasked candidate is closer than the ``k``-th closest peer that answered."""
        if not self._candidates:
            return True
        if len(self._answered) < self.k:
            return False
        kth = sorted(self.distance(p) for p in self._answered)[self.k - 1]
        return self.distance(self._candidates[0]) > kth

    @property
    def done(self) -> bool:
        """Stop asking: quorum, convergence (nothing closer left), or budget spent."""
        return self.quorum_reached or (
            not self._in_flight and (self.converged or self._queried >= self.max_queries)
        )

    def stale_peers(self) -> list[P]:
        """Peers among the ``k`` closest that answered without the winning value (to correct)."""
        if self.best is None:
            return []
        closest = sorted(self._answered, key=self.distance)[: self.k]
        return [p for p in closest if p not in self._holders]


@dataclass
class StoreFanout(Generic[P]):
    """One put: which stores the caller waits for, and which go on in the background.

    Targets come closest first. :meth:`next_urgent` hands out just enough of
    them to reach ``quorum`` acknowledgements (a failure hands out the next
    one); once :attr:`satisfied`, :meth:`rest` hands the others to the
    background, with any closer peer a :class:`ClosestWalk` adds later.
    """

    quorum: int = PUT_QUORUM
    acked: int = 0
    failed: int = 0
    _pending: list[P] = field(default_factory=list)
    _seen: set[P] = field(default_factory=set)
    _in_flight: int = 0

    def add_targets(self, peers: Iterable[P]) -> list[P]:
        """Peers to store at as well (closest first); returns the ones not seen before."""
        fresh = [p for p in peers if p not in self._seen]
        self._seen.update(fresh)
        self._pending.extend(fresh)
        return fresh

    def next_urgent(self) -> list[P]:
        """Stores to start now for the caller: enough, with those in flight, to reach ``quorum``."""
        out: list[P] = []
        while self._pending and self.acked + self._in_flight < self.quorum:
            out.append(self._pending.pop(0))
            self._in_flight += 1
        return out

    def rest(self) -> list[P]:
        """Every target not handed out yet (for the background)."""
        out, self._pending = self._pending, []
        self._in_flight += len(out)
        return out

    def on_result(self, peer: P, ok: bool) -> None:
        self._in_flight -= 1
        if ok:
            self.acked += 1
        else:
            self.failed += 1

    @property
    def satisfied(self) -> bool:
        """The caller may go on: ``quorum`` stores acknowledged, or nobody left to ask."""
        return self.acked >= self.quorum or (not self._pending and self._in_flight == 0)


@dataclass
class ClosestWalk(Generic[P]):
    """A walk towards a key (who is closest?) that stops once answers stop bringing closer peers."""

    distance: Callable[[P], int]
    alpha: int = ALPHA
    k: int = K
    max_queries: int = MAX_QUERIES
    _closest: list[P] = field(default_factory=list)  # the k closest seen, closest first
    _seen: set[P] = field(default_factory=set)
    _asked: set[P] = field(default_factory=set)
    _in_flight: set[P] = field(default_factory=set)
    _since_progress: int = 0
    _queried: int = 0

    def add(self, peers: Iterable[P]) -> list[P]:
        """Peers heard of; returns those that entered the ``k`` closest (new store targets)."""
        fresh = [p for p in peers if p not in self._seen]
        self._seen.update(fresh)
        self._closest = sorted([*self._closest, *fresh], key=self.distance)[: self.k]
        kept = set(self._closest)
        return [p for p in fresh if p in kept]

    def next_queries(self) -> list[P]:
        out: list[P] = []
        for peer in self._closest:
            if self.done or len(self._in_flight) >= self.alpha or self._queried >= self.max_queries:
                break
            if peer not in self._asked:
                self._asked.add(peer)
                self._in_flight.add(peer)
                self._queried += 1
                out.append(peer)
        return out

    def on_answer(self, peer: P, closer: Iterable[P]) -> list[P]:
        """``peer`` named ``closer``; returns the peers that entered the ``k`` closest."""
        self._in_flight.discard(peer)
        entered = self.add(closer)
        self._since_progress = 0 if entered else self._since_progress + 1
        return entered

    def on_failure(self, peer: P) -> None:
        self._in_flight.discard(peer)
        self._closest = [p for p in self._closest if p != peer]

    @property
    def done(self) -> bool:
        if self._since_progress >= self.alpha or self._queried >= self.max_queries:
            return True
        return not self._in_flight and all(p in self._asked for p in self._closest)

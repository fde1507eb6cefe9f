"""Round deadlines that follow the links: how long the shepherd waits, from the arrivals it saw.

A fixed ``round.deadline_s`` is wrong both ways on real networks: sized for the
slowest home link, every round in which a worker silently dies waits it out in
full; sized for a data-centre, a volunteer on a 20 Mbit/s uplink is dropped
every round for nothing. :class:`ArrivalDeadline` (sans-IO: times are passed
in) learns, per worker, how long after an announcement its Δ was admitted, and
sets the next round's deadline to what the *slowest expected* worker needs:

    deadline = max over the round's workers of (median_w + k · MAD_w)

clamped to the spec's bounds: never below ``time_budget_s + min_slack_s`` (a
worker must have time to submit after it trains) and never above the spec's
``deadline_s``. A worker with fewer than ``min_samples`` arrivals seen is not
known yet: the round waits the spec's full ``deadline_s`` for it. Per worker,
not pooled: a pooled median would cut the one slow home every round, which is
what "dropped for nothing" means; per worker, the slow home gets its own
(longer) allowance and a dead worker costs its own expected time, not the
spec's upper bound. The MAD is scaled by 1.4826 (a standard deviation for
normal data) and floored at ``min_spread_s``, so a run of identical arrivals
does not make a zero-width allowance out of timer noise.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

MAD_TO_SIGMA = 1.4826


@dataclass
class ArrivalDeadline:
    """Per-worker arrival times (s after the announcement) → the next round's deadline (s)."""

    time_budget_s: float
    max_s: float  # the spec's round.deadline_s: the upper bound, and the wait for an unknown worker
    k: float = 5.0
    window: int = 8  # the latest arrivals per worker that count (links change: a train, a new Wi-Fi)
    min_samples: int = 3
    min_slack_s: float = 2.0  # beyond time_budget_s: submitting a Δ takes time even on a fast link
    min_spread_s: float = 0.25
    min_spread_share: float = 0.25  # of the median: a loaded machine jitters in proportion
    max_workers: int = 4096  # bounded: the roster is bounded too, this is a second belt
    _seen: dict[str, deque[float]] = field(default_factory=dict)

    @property
    def min_s(self) -> float:
        return min(self.max_s, self.time_budget_s + self.min_slack_s)

    def observe(self, worker: str, seconds: float) -> None:
        """``worker``'s Δ was admitted ``seconds`` after the announcement."""
        if not seconds >= 0.0:  # NaN or negative: a clock went backwards; nothing learned
            return
        if worker not in self._seen and len(self._seen) >= self.max_workers:
            self._seen.pop(next(iter(self._seen)))
        self._seen.setdefault(worker, deque(maxlen=self.window)).append(seconds)

    def missed(self, worker: str, deadline_s: float) -> None:
        """``worker`` did not make a ``deadline_s`` deadline: counted as an arrival at 1.5 times it,
        so a link slower than its history walks its allowance up (towards ``max_s``) instead of
        being dropped round after round."""
        self.observe(worker, 1.5 * deadline_s)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop workers no longer in the roster (left, evicted, banned)."""
        keep = set(keep)
        for w in [w for w in self._seen if w not in keep]:
            del self._seen[w]

    def expected_s(self, worker: str) -> float | None:
        """median + k·MAD of ``worker``'s arrivals, or None when too few were seen."""
        seen = self._seen.get(worker)
        if seen is None or len(seen) < self.min_samples:
            return None
        med = statistics.median(seen)
        mad = statistics.median(abs(x - med) for x in seen) * MAD_TO_SIGMA
        return med + self.k * max(mad, self.min_spread_s, self.min_spread_share * med)

    def deadline_s(self, workers: Iterable[str]) -> float:
        """How long after its announcement the round with ``workers`` closes."""
        need = self.min_s
        for w in workers:
            e = self.expected_s(w)
            if e is None:
                return self.max_s
            need = max(need, e)
        return min(self.max_s, need)

"""The fetch planner: which chunks to ask of which provider, and what to do when one fails.

This is the sans-IO core of a multi-provider fetch. It holds no sockets and no
clock; the service's trio tasks ask it for work and report what happened:

    worker for provider P:  batch = plan.next_batch(P)
        None  -> P has nothing more to do (fetch complete, or P is banned)
        []    -> nothing to hand out right now; wait for a change and ask again
        [i..] -> fetch these contiguous chunks from P
    per chunk:  plan.chunk_ok(P, i)      verified and written
                plan.chunk_bad(P, i)     hash mismatch: P is banned, its chunks go back
    on error:   plan.provider_failed(P)  stalled / dropped / refused: same

Rules, and why:

- A chunk verified once is never fetched again: a provider that vanishes
  mid-transfer costs only the chunks it had in flight (resume).
- A provider that sent one bad chunk is banned for the rest of the fetch; a bad
  chunk is never retried from the same provider.
- Batches are contiguous runs (one request and one side connection per batch);
  a batch is ``ceil(pending / (2 * active providers))`` chunks, so one provider
  takes everything in one request while several share the work in a few rounds
  each and a failure strands at most a couple of batches. ``max_batch`` caps it.
- The fetch fails when chunks remain and every provider is banned.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

MAX_BATCH = 64  # chunks in one data request (256 MiB at 4 MiB chunks)


@dataclass
class FetchPlan:
    wanted: Iterable[int]
    providers: Iterable[str]
    max_batch: int = MAX_BATCH
    pending: list[int] = field(init=False)
    in_flight: dict[int, str] = field(init=False, default_factory=dict)
    done: set[int] = field(init=False, default_factory=set)
    active: set[str] = field(init=False)
    banned: dict[str, str] = field(init=False, default_factory=dict)
    served: dict[str, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.pending = sorted(set(self.wanted))
        self.active = set(self.providers)
        self._total = len(self.pending)

    @property
    def complete(self) -> bool:
        return len(self.done) == self._total

    @property
    def failed(self) -> bool:
        """Chunks remain and nobody is left to ask."""
        return not self.complete and not self.active

    def next_batch(self, provider: str) -> list[int] | None:
        if self.complete or provider not in self.active:
            return None
        if not self.pending:
            return []
        size = -(-len(self.pending) // (2 * len(self.active))) if len(self.active) > 1 else len(self.pending)
        return self._take(provider, max(1, min(size, self.max_batch)))

    def _take(self, provider: str, size: int) -> list[int]:
        """The next run of consecutive pending chunks (at most ``size``), now in flight at ``provider``
        (one request reads a contiguous range)."""
        batch = [self.pending[0]]
        k = 1
        while k < len(self.pending) and len(batch) < size and self.pending[k] == batch[-1] + 1:
            batch.append(self.pending[k])
            k += 1
        del self.pending[:k]
        for i in batch:
            self.in_flight[i] = provider
        return batch

    def chunk_ok(self, provider: str, index: int) -> None:
        if self.in_flight.get(index) != provider:
            raise ValueError(f"chunk {index} was not in flight at {provider}")
        del self.in_flight[index]
        self.done.add(index)
        self.served[provider] = self.served.get(provider, 0) + 1

    def chunk_bad(self, provider: str, index: int) -> None:
        self.provider_failed(provider, f"chunk {index} failed its hash")

    def provider_failed(self, provider: str, reason: str) -> None:
        """Ban ``provider`` and put whatever it still had in flight back in the queue."""
        self.active.discard(provider)
        self.banned.setdefault(provider, reason)
        back = [i for i, p in self.in_flight.items() if p == provider]
        for i in back:
            del self.in_flight[i]
        self.pending = sorted(set(self.pending).union(back))

    def provider_finished_batch(self, provider: str, batch: list[int]) -> None:
        """A batch ended without error but some chunks were not delivered: requeue them."""
        missing = [i for i in batch if self.in_flight.get(i) == provider]
        for i in missing:
            del self.in_flight[i]
        if missing:
            self.pending = sorted(set(self.pending).union(missing))

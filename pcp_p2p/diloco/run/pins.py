"""Which of a run's blobs a node keeps pinned, and when it lets them go (sans-IO).

Why: a run stores or fetches blobs every round (θ, the checkpoint, a Δ above
the inline limit) and used to pin every one of them for good. Pinned blobs are
never evicted, so a node's store only grew: a model whose θ is 40 MB fills the
default 10 GiB store in about 250 rounds, and from then on every fetch fails
with ``StoreFull``. What a run really needs kept:

- for its whole life: the dataset and the artifacts (manifests and vmfbs), which
  every joining worker fetches (:meth:`RunPins.for_run`);
- of the per-round blobs, those of the last :data:`KEEP_ROUNDS` commits: the
  θ every worker starts the next round from, the checkpoints a new shepherd
  takes over from, the Δs still being collected (:meth:`RunPins.for_round`).

Older per-round blobs are unpinned once a newer commit is accepted
(:meth:`RunPins.on_commit`): they stay in the store as a cache the LRU may
evict, not deleted. When the run ends (:meth:`RunPins.on_finish`) everything
is released except the final θ (what ``pcp generate`` and late nodes ask for)
and the dataset (its tokenizer); a pin asked for after that is refused, so a
message naming a blob once the run is over cannot pin it for good.

The ledger is saved with the run's state (:meth:`RunPins.load` /
:meth:`RunPins.save`), so pins taken before a restart (churn restarts nodes
often) are still released later.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

KEEP_ROUNDS = 2
log = logging.getLogger(__name__)


class RunPins:
    """The pin ledger of one run on one node; the caller pins and unpins in the store."""

    def __init__(self, keep_rounds: int = KEEP_ROUNDS) -> None:
        self.keep_rounds = keep_rounds
        self.committed = -1  # the latest committed round this node accepted
        self._for_run: set[str] = set()
        self._since: dict[str, int] = {}  # per-round cid -> `committed` when last pinned
        self._dataset: set[str] = set()
        self.finished = False  # set by on_finish: no new pins

    def for_run(self, cid: str) -> None:
        """``cid`` stays pinned as long as the run (dataset, artifacts)."""
        self._for_run.add(cid)
        self._since.pop(cid, None)

    def for_round(self, cid: str) -> None:
        """``cid`` belongs to the current rounds; pinning it again renews it."""
        if cid not in self._for_run:
            self._since[cid] = self.committed

    def on_commit(self, round_: int) -> list[str]:
        """Round ``round_`` was committed (and accepted): the CIDs to unpin now."""
        if round_ <= self.committed:
            return []
        self.committed = round_
        old = [cid for cid, since in self._since.items() if since < round_ - self.keep_rounds]
        for cid in old:
            del self._since[cid]
        return old

    def on_finish(self, final_theta_cid: str) -> list[str]:
        """The run is over: every CID to unpin now (all but the final θ and the dataset)."""
        keep = {final_theta_cid} | {c for c in self._for_run if c in self._dataset}
        released = sorted((set(self._since) | self._for_run) - keep)
        self._since = {c: r for c, r in self._since.items() if c in keep}
        self._for_run &= keep
        self.finished = True
        return released

    def for_dataset(self, cid: str) -> None:
        """``cid`` is the run's dataset: kept even after the run ends (its tokenizer)."""
        self._dataset.add(cid)
        self.for_run(cid)

    def __contains__(self, cid: str) -> bool:
        return cid in self._for_run or cid in self._since

    # --- persistence ------------------------------------------------------------------

    def save(self, path: Path) -> None:
        """Write the ledger atomically (a torn write must not lose it)."""
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"keep_rounds": self.keep_rounds, "committed": self.committed,
                                   "for_run": sorted(self._for_run), "since": self._since,
                                   "dataset": sorted(self._dataset), "finished": self.finished}))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, keep_rounds: int = KEEP_ROUNDS) -> RunPins:
        """The saved ledger, or an empty one if there is none or it does not parse
        (its pins then stay pinned: safe, only not released)."""
        pins = cls(keep_rounds)
        try:
            raw = json.loads(path.read_text())
            committed, for_run, since = raw["committed"], raw["for_run"], raw["since"]
            if not (isinstance(committed, int) and isinstance(for_run, list) and isinstance(since, dict)
                    and all(isinstance(c, str) for c in for_run)
                    and all(isinstance(c, str) and isinstance(r, int) for c, r in since.items())):
                raise ValueError("unexpected types")
        except FileNotFoundError:
            return pins
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("pin ledger %s unreadable (%s); starting a new one", path, exc)
            return pins
        pins.committed, pins._for_run, pins._since = committed, set(for_run), dict(since)
        pins._dataset = {c for c in raw.get("dataset", []) if isinstance(c, str)}
        pins.finished = raw.get("finished") is True
        return pins

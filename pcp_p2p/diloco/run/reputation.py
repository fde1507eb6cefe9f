"""A run's reputation ledger on one node: credits, strikes and bans, kept on disk.

The shepherd refuses submissions for many reasons (stale, over the norm, worse
held-out loss, …) and an audit can prove that a worker lied about what it
computed. This ledger remembers both per peer, for one run:

- **credits** (accepted submissions) and **strikes** counted by reason (the
  refusing error's class name, e.g. ``RejectedUpdate``), from which
  :meth:`ReputationLedger.score` gives a number in [0, 1];
- **bans**: a peer caught by an audit is banned from the run, with the signed
  evidence that convicted it (opaque bytes from the audit helper, kept by CID
  and, within bounds, in full). :class:`~pcp_p2p.diloco.protocol.admission.Admission`
  consults :meth:`ReputationLedger.ban_reason`, so a banned peer can neither
  join nor submit nor be elected.

Why on disk: nodes restart often (churn, upgrades), and a ban that a restart
forgets is a ban an offender only has to wait out. The file is JSON in the
run's work directory (:data:`LEDGER_FILE`), written atomically (temporary file,
fsync, rename): a crash leaves the old ledger or the new one, never half of
each. A file that cannot be read or does not parse is moved aside
(``reputation.json.corrupt``) with a warning and the node starts a fresh
ledger: losing reputation is better than refusing to run.

Why bounded: identities are free, so a flood of strangers must not grow the
ledger without end. At most :data:`MAX_PEERS` peers are scored (the least
recently seen is forgotten first), at most :data:`MAX_BANS` bans are kept (the
oldest goes first, with a warning), a strike reason is cut to
:data:`MAX_REASON_CHARS` with at most :data:`MAX_REASONS` distinct reasons per
peer, and evidence is kept in full only up to :data:`MAX_EVIDENCE_BYTES` per ban
and :data:`MAX_EVIDENCE_TOTAL` in all (beyond that, its CID alone).

Strikes are saved at most every :data:`SAVE_EVERY_S` seconds (a refused
message must not cost a disk write); bans are saved at once. Time is passed in
(``now``), never read here. Whose strike it is is the caller's care: strike the
peer the transport authenticated as the sender, not a peer id a message claims.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pcp_p2p.core.cid import cid_of

log = logging.getLogger("pcp.reputation")

LEDGER_FILE = "reputation.json"
FORMAT_VERSION = 1
MAX_PEERS = 4096
MAX_BANS = 4096
MAX_REASONS = 16
MAX_REASON_CHARS = 64
MAX_BAN_REASON_CHARS = 300
MAX_EVIDENCE_BYTES = 16 * 1024
MAX_EVIDENCE_TOTAL = 1 << 20
SAVE_EVERY_S = 5.0
OTHER_REASON = "other"


@dataclass
class PeerScore:
    """What one peer's submissions earned in this run."""

    first_seen: float
    last_seen: float
    accepted: int = 0
    strikes: dict[str, int] = field(default_factory=dict)

    @property
    def total_strikes(self) -> int:
        return sum(self.strikes.values())


@dataclass(frozen=True)
class Ban:
    """A peer banned from the run, and the evidence that convicted it."""

    peer: str
    reason: str
    at: float
    evidence_cid: str
    evidence: bytes | None  # None when it was above the bounds: the CID alone is kept


class ReputationLedger:
    """Credits, strikes and bans of one run on one node, saved to ``path``."""

    def __init__(self, path: Path, run_id: str, *, max_peers: int = MAX_PEERS, max_bans: int = MAX_BANS) -> None:
        self.path = path
        self.run_id = run_id
        self.max_peers = max_peers
        self.max_bans = max_bans
        self._peers: dict[str, PeerScore] = {}  # least recently seen first
        self._bans: dict[str, Ban] = {}  # oldest first
        self._dirty = False
        self._saved_at: float | None = None

    # --- questions ----------------------------------------------------------------

    def banned(self, peer: str) -> bool:
        return peer in self._bans

    def ban_of(self, peer: str) -> Ban | None:
        return self._bans.get(peer)

    def ban_reason(self, peer: str) -> str | None:
        """Why ``peer`` is banned (with the evidence's CID), or None; what Admission asks."""
        ban = self._bans.get(peer)
        return None if ban is None else f"{ban.reason} (evidence {ban.evidence_cid})"

    def bans(self) -> list[Ban]:
        return list(self._bans.values())

    def score_of(self, peer: str) -> PeerScore | None:
        return self._peers.get(peer)

    def score(self, peer: str) -> float:
        """(accepted + 1) / (accepted + strikes + 2): 0.5 for a stranger, 0 once banned.

        Laplace's rule of succession: a peer's record moves its score only as far
        as the evidence supports, so one refusal does not condemn a newcomer.
        """
        if peer in self._bans:
            return 0.0
        s = self._peers.get(peer)
        if s is None:
            return 0.5
        return (s.accepted + 1) / (s.accepted + s.total_strikes + 2)

    def __len__(self) -> int:
        return len(self._peers)

    # --- inputs --------------------------------------------------------------------

    def credit(self, peer: str, now: float) -> None:
        """``peer``'s submission was accepted."""
        self._touch(peer, now).accepted += 1
        self._changed(now)

    def strike(self, peer: str, reason: str, now: float) -> None:
        """``peer``'s input was refused for ``reason`` (say, the error's class name)."""
        s = self._touch(peer, now)
        key = " ".join(reason.split())[:MAX_REASON_CHARS] or "unspecified"
        if key not in s.strikes and len(s.strikes) >= MAX_REASONS - 1:
            key = OTHER_REASON
        s.strikes[key] = s.strikes.get(key, 0) + 1
        self._changed(now)

    def ban(self, peer: str, evidence: bytes, reason: str, now: float) -> Ban:
        """Ban ``peer`` from the run on ``evidence``; saved at once. A second ban keeps the first."""
        if peer in self._bans:
            return self._bans[peer]
        evidence = bytes(evidence)
        keep = len(evidence) <= MAX_EVIDENCE_BYTES and self._evidence_bytes() + len(evidence) <= MAX_EVIDENCE_TOTAL
        ban = Ban(peer, " ".join(reason.split())[:MAX_BAN_REASON_CHARS] or "unspecified", now,
                  cid_of(evidence), evidence if keep else None)
        while len(self._bans) >= self.max_bans:
            oldest = next(iter(self._bans))
            log.warning("reputation ledger full (%d bans): forgetting the ban of %s", self.max_bans, oldest)
            del self._bans[oldest]
        self._bans[peer] = ban
        self._touch(peer, now)
        log.warning("run %s: banned %s: %s", self.run_id[:16], peer, ban.reason)
        self._dirty = True
        self.save(now)
        return ban

    def flush(self, now: float) -> None:
        """Save if anything changed since the last save (call on shutdown and now and then)."""
        if self._dirty:
            self.save(now)

    # --- internals -----------------------------------------------------------------

    def _touch(self, peer: str, now: float) -> PeerScore:
        s = self._peers.pop(peer, None)
        if s is None:
            s = PeerScore(first_seen=now, last_seen=now)
            while len(self._peers) >= self.max_peers:
                del self._peers[next(iter(self._peers))]  # the least recently seen
        s.last_seen = now
        self._peers[peer] = s  # most recently seen last
        return s

    def _changed(self, now: float) -> None:
        self._dirty = True
        if self._saved_at is None or now - self._saved_at >= SAVE_EVERY_S:
            self.save(now)

    def _evidence_bytes(self) -> int:
        return sum(len(b.evidence) for b in self._bans.values() if b.evidence is not None)

    # --- persistence ---------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION,
            "run_id": self.run_id,
            "peers": {
                p: {"first_seen": s.first_seen, "last_seen": s.last_seen, "accepted": s.accepted, "strikes": s.strikes}
                for p, s in self._peers.items()
            },
            "bans": {
                p: {"reason": b.reason, "at": b.at, "evidence_cid": b.evidence_cid,
                    "evidence": None if b.evidence is None else base64.b64encode(b.evidence).decode("ascii")}
                for p, b in self._bans.items()
            },
        }

    def save(self, now: float) -> None:
        """Write the ledger atomically. A failing disk is logged, not raised: the
        ledger stays in memory and the next save tries again."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.to_json(), f, separators=(",", ":"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("reputation ledger %s not saved (%s); kept in memory", self.path, exc)
            return
        self._dirty = False
        self._saved_at = now

    @classmethod
    def open(cls, work_dir: Path, run_id: str, **kw: Any) -> ReputationLedger:
        """The ledger in a run's work directory (:data:`LEDGER_FILE`), or a fresh one."""
        return cls.load(work_dir / LEDGER_FILE, run_id, **kw)

    @classmethod
    def load(cls, path: Path, run_id: str, **kw: Any) -> ReputationLedger:
        """The saved ledger; a fresh one if there is none, and (with a warning, the
        bad file moved aside) if it cannot be read, does not parse or is another run's."""
        ledger = cls(path, run_id, **kw)
        try:
            raw = json.loads(path.read_bytes())
            ledger._fill(raw)
        except FileNotFoundError:
            return ledger
        except (OSError, ValueError, KeyError, TypeError, AttributeError, binascii.Error) as exc:
            aside = path.with_name(path.name + ".corrupt")
            log.warning("reputation ledger %s unreadable (%s); moved to %s, starting afresh", path, exc, aside.name)
            try:
                os.replace(path, aside)
            except OSError:
                pass
            return cls(path, run_id, **kw)
        return ledger

    def _fill(self, raw: Any) -> None:
        """Load ``raw`` (parsed JSON) into this empty ledger, checking every type; raise on anything off."""
        def num(x: Any) -> float:
            if type(x) not in (int, float):
                raise TypeError(f"expected a number, got {type(x).__name__}")
            return float(x)

        def text(x: Any) -> str:
            if not isinstance(x, str):
                raise TypeError(f"expected a string, got {type(x).__name__}")
            return x

        if not isinstance(raw, dict) or raw.get("version") != FORMAT_VERSION:
            raise ValueError(f"not a version-{FORMAT_VERSION} reputation ledger")
        if raw["run_id"] != self.run_id:
            raise ValueError(f"a ledger of another run ({text(raw['run_id'])[:16]})")
        for peer, s in raw["peers"].items():
            strikes = {text(k)[:MAX_REASON_CHARS]: int(num(v)) for k, v in s["strikes"].items()}
            if type(s["accepted"]) is not int or len(strikes) > MAX_REASONS:
                raise ValueError(f"bad score for {peer[:16]}")
            self._peers[text(peer)] = PeerScore(num(s["first_seen"]), num(s["last_seen"]), s["accepted"], strikes)
        for peer, b in raw["bans"].items():
            ev = b["evidence"]
            evidence = None if ev is None else base64.b64decode(text(ev), validate=True)
            self._bans[text(peer)] = Ban(peer, text(b["reason"])[:MAX_BAN_REASON_CHARS], num(b["at"]),
                                         text(b["evidence_cid"]), evidence)
        # A file written with larger bounds (or edited by hand) is trimmed, oldest first.
        while len(self._peers) > self.max_peers:
            del self._peers[next(iter(self._peers))]
        while len(self._bans) > self.max_bans:
            del self._bans[next(iter(self._bans))]
        if self._evidence_bytes() > MAX_EVIDENCE_TOTAL:
            raise ValueError("more evidence than the ledger keeps")

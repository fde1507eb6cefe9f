"""Runs findable by owner: the ``owner-runs`` DHT record.

A run's spec reaches nodes by hand-off, by the ``/pcp/run/<run id>`` record,
and through the member records of the nodes taking part (:mod:`.runs`). All
three fail one case: a run that no node trusted when it was created has no
member advertising it, and a node that comes to trust its owner later knows
no run id to look up. So ``pcp run create`` also keeps, under
``/pcp/owner-runs/<owner peer id>``, the list of the owner's runs (run ids
with an expiry); a node that starts trusting an owner — at start, or when its
trust file changes — reads that list and takes up each run as if it had been
announced.

Authority: the record is valid only if signed by the peer its key names and
its payload names that same owner (a stranger cannot list runs under another
owner's id, and every node's DHT validator refuses such a record). The list
is only a pointer: each run id is then fetched as a ``run`` record, which only
the spec's owner can sign and only for the spec that hashes to that id, and
the spec is checked against the node's trust like any other. An owner listing
a stranger's run gains nothing; the stranger's run is still refused.

The owner keeps its latest list in ``<data dir>/owned-runs/owner-runs`` too,
so a DHT miss at publishing time never drops older runs from it. This module is
the record (its type, its rule, how lists merge); publishing it is the owner's
command's I/O (:func:`pcp_p2p.diloco.run.owner_commands.publish_owned_run`).
"""

from __future__ import annotations

import math

from pcp_p2p.core.errors import BadSignature
from pcp_p2p.dht.records import MAX_TTL_S, KindRule
from pcp_p2p.wire import Message, wire_message, wire_struct

OWNER_RUNS_KIND = "owner-runs"
MAX_OWNED_RUNS = 64
"""Runs one record lists (the newest by expiry): 64 entries of ~80 bytes fit a 16 KiB record."""
MAX_RUN_ID_CHARS = 128


@wire_struct
class OwnedRun(Message):
    run_id: str
    expires_at: float  # the owner's clock; the run's own record lasts as long


@wire_message("diloco.owner_runs", max_size=12 * 1024)
class OwnerRuns(Message):
    """The runs an owner has published, newest last."""

    owner: str
    runs: tuple[OwnedRun, ...]

    def __post_init__(self) -> None:
        if len(self.runs) > MAX_OWNED_RUNS:
            raise ValueError(f"an owner-runs list holds at most {MAX_OWNED_RUNS} runs")
        ids = [r.run_id for r in self.runs]
        if len(set(ids)) != len(ids):
            raise ValueError("an owner-runs list names a run twice")
        if not all(0 < len(r) <= MAX_RUN_ID_CHARS for r in ids):
            raise ValueError("an owner-runs list names an empty or overlong run id")
        if not all(math.isfinite(r.expires_at) for r in self.runs):
            raise ValueError("an owner-runs entry's expiry is not a number")

    def live(self, now: float) -> list[str]:
        """Run ids not yet expired, newest first."""
        return [r.run_id for r in sorted(self.runs, key=lambda r: -r.expires_at) if r.expires_at > now]


def _owner_signs_its_list(name: str, signer: str, payload: Message) -> None:
    assert isinstance(payload, OwnerRuns)
    if name != signer or payload.owner != signer:
        raise BadSignature("an owner-runs record must be signed by the owner it is stored under")


OWNER_RUNS_RULE = KindRule(OwnerRuns, _owner_signs_its_list)


def with_run(lists: list[OwnerRuns], owner: str, run_id: str, *, now: float, ttl_s: float = MAX_TTL_S) -> OwnerRuns:
    """``owner``'s list: the union of ``lists`` (latest expiry per run), expired runs dropped,
    ``run_id`` added with a fresh expiry, cut to the :data:`MAX_OWNED_RUNS` newest."""
    expiry: dict[str, float] = {}
    for lst in lists:
        if lst.owner != owner:
            continue
        for r in lst.runs:
            if r.expires_at > now:
                expiry[r.run_id] = max(r.expires_at, expiry.get(r.run_id, r.expires_at))
    expiry[run_id] = now + ttl_s
    newest = sorted(expiry.items(), key=lambda kv: kv[1])[-MAX_OWNED_RUNS:]
    return OwnerRuns(owner=owner, runs=tuple(OwnedRun(rid, exp) for rid, exp in newest))

"""Swarming: a blob many peers want at once reaches them through each other, not all from its origin.

Why: in a DiLoCo round every worker wants the same new θ (and the checkpoint
that holds it) at the same moment, from the shepherd that just computed it.
Fetched from the shepherd directly, its uplink carries N copies per round: on
a 20 Mbit/s home uplink that was 2-2.7 s of every WAN round, growing with N.

How (sans-IO, no sockets, no clock): the peers that want a blob are arranged
in a **relay tree** that every one of them computes alike from the same
inputs (the blob's CID and the member list a signed record named): members
sorted by ``sha256(cid | peer)``, position 0 is the root, position ``p``'s
parent is ``(p - 1) // fanout``. The root fetches from the origin; every
other member fetches from its parent, which serves each chunk as soon as it
has verified it (a *partial holding*: :class:`~pcp_p2p.blob.server.PartialBlob`),
so the chunks flow down the tree in a pipeline rather than blob by blob.
The origin's uplink carries one copy whatever N is; an interior member
uploads at most ``fanout`` copies (bounded by its upload slots anyway), and
the hash order moves the interior positions to other members with every
blob, so no member relays every round.

Failures climb the tree: a fetcher's sources are its ancestors, nearest
first, then the origin (:func:`upstream`). :class:`FallbackPlan` hands the
whole remaining blob to the first source still standing; a source that sent
a chunk failing its hash is banned for the fetch (the chunk is fetched again
from the next one), one that stalls or vanishes loses the chunks it had in
flight to the next (verified chunks are never fetched twice). So a lying or
dead relay costs its subtree one hop up, never the blob.

Every chunk is still checked against the manifest, which is checked against
the CID; relays never carry blobs (the blob service refuses relayed streams
both ways), and every upload takes one of the server's slots (a budget per
peer and in total).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from pcp_p2p.blob.transfer import FetchPlan

DEFAULT_FANOUT = 2
DIRECT_BYTES = 1 << 20
"""Below this many bytes of copies in all (members × size), a blob goes from its origin to every
member directly (:func:`worth_a_tree`): 0.4 s on a 20 Mbit/s home uplink."""


def worth_a_tree(members: int, size: int, direct_bytes: int = DIRECT_BYTES) -> bool:
    """Whether ``members`` peers that want a ``size``-byte blob at once should fetch it through
    their relay tree rather than each from the origin.

    A tree saves the origin's uplink all but one copy, and costs every level a hop: a stream, a
    manifest and a chunk's round trips, on home links with tens of milliseconds each way and a
    loaded CPU at both ends. For a small blob the copies are cheaper than the hops: the tiny
    model's 216 KB commit update took 0.6-2.1 s down a tree of three on the network lab
    (docs/connectivity.md, run 12), where the origin sends all three in
    0.3 s. So: a tree once the copies would weigh more than ``direct_bytes``.
    """
    return members * size > direct_bytes


def tree_order(cid: str, members: Iterable[str]) -> list[str]:
    """The members in relay-tree order for ``cid`` (position 0 is the root).

    A hash of the CID and the peer id, so every member computes the same
    order, and each blob puts other members at the interior positions.
    """
    return sorted(set(members), key=lambda p: hashlib.sha256(f"{cid}|{p}".encode()).digest())


def upstream(cid: str, members: Iterable[str], me: str, fanout: int = DEFAULT_FANOUT) -> list[str]:
    """Whom ``me`` asks for ``cid``, nearest first: its parent, the parent's parent, ... the root.

    The origin is not a member and comes after these (the caller appends it).
    A fetcher that is not a member (a late joiner) takes the position after
    the members' last, a leaf: the members' own trees do not depend on it.
    """
    if fanout < 1:
        raise ValueError("fanout must be at least 1")
    everyone = set(members)
    others = everyone - {me}
    if me in everyone:  # a member: its own place in the order
        order = tree_order(cid, [*others, me])
        pos = order.index(me)
    else:  # not a member: the next position after the members' (a leaf)
        order = [*tree_order(cid, others), me]
        pos = len(order) - 1
    chain: list[str] = []
    while pos > 0:
        pos = (pos - 1) // fanout
        chain.append(order[pos])
    return chain


@dataclass
class FallbackPlan(FetchPlan):
    """A fetch plan that takes everything from the first provider still standing.

    ``providers`` in preference order (the relay tree's ancestors, then the
    origin). Unlike :class:`FetchPlan`, which spreads a blob over every
    provider, this one keeps the later ones idle: they are there for when the
    earlier fail, and asking them at once would put the origin's uplink back
    in every fetch. The primary gets the whole pending run (up to
    ``max_batch`` chunks) in one request; a failure requeues what it had in
    flight and the next provider in order takes over.
    """

    order: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.providers = list(self.providers)
        super().__post_init__()
        self.order = list(dict.fromkeys(self.providers))

    @property
    def primary(self) -> str | None:
        """The provider that gets batches now (``None``: everyone failed)."""
        return next((p for p in self.order if p in self.active), None)

    def next_batch(self, provider: str) -> list[int] | None:
        if self.complete or provider not in self.active:
            return None
        if provider != self.primary or not self.pending:
            return []
        return self._take(provider, self.max_batch)

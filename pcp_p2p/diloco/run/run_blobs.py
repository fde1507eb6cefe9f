"""A run's blobs on one node: fetched (hinted peer first, retried), stored, pinned and announced.

A blob every worker wants at once (θ's checkpoint after a commit, θ itself) is
fetched by swarming when the caller names the ``swarm`` (the peers a signed
record says are fetching it too): from this node's ancestors in the blob's
relay tree first, the hinted origin last (:mod:`pcp_p2p.blob.swarm`), so the
origin's uplink carries about one copy whatever the number of workers.

I/O only: which blob is fetched when, and for which machine, is the run
machine's call (:mod:`pcp_p2p.diloco.run.run_machine`); this module carries it out
against the node's :class:`~pcp_p2p.blob.service.BlobService` and keeps the
run's pin ledger (:mod:`pcp_p2p.diloco.run.pins`) on disk.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from pcp_p2p.blob.swarm import upstream
from pcp_p2p.core.errors import BlobNotFound, LocalError, OversizedMessage, PcpError, PeerError
from pcp_p2p.diloco.run.pins import RunPins
from pcp_p2p.net.reachability import dialable

if TYPE_CHECKING:
    from pcp_p2p.blob.service import BlobService
    from pcp_p2p.blob.store import BlobStore
    from pcp_p2p.node.node import Node

log = logging.getLogger("pcp.run")

FETCH_ATTEMPTS = 6
PINS_FILE = "pins.json"


class RunBlobs:
    """The blob side of one run on one node."""

    def __init__(self, node: Node | None, blobs: BlobService, work_dir: Path, nursery: trio.Nursery | None = None,
                 hint: Callable[[], str | None] = lambda: None) -> None:
        """``hint``: the peer to ask first when a fetch names none (the current shepherd)."""
        self.node = node
        self.blobs = blobs
        self.work_dir = work_dir
        self.nursery = nursery
        self.default_hint = hint
        self.storing: dict[str, trio.Event] = {}  # blobs being stored: nobody names them before
        self.fetching: dict[str, trio.Event] = {}  # blobs being fetched into the store: fetched once
        self.pins = RunPins.load(work_dir / PINS_FILE)  # what this run keeps pinned, and until when

    @property
    def store(self) -> BlobStore:
        return self.blobs.store

    # -- storing --------------------------------------------------------------------------

    def store_later(self, cid: str, data: bytes | bytearray) -> None:
        """Store ``data`` (expected to hash to ``cid``) in the background. Registered now, not
        when the task starts: our own worker may ask for this blob before the task has run.
        ``data`` must not change until :meth:`stored` says the store has ended."""
        self.storing.setdefault(cid, trio.Event())
        assert self.nursery is not None
        self.nursery.start_soon(self._store, cid, data)

    async def _store(self, cid: str, data: bytes | bytearray) -> None:
        try:
            got = await self.keep(data)
            if got != cid:
                log.error("stored blob hashes to %s, expected %s", got, cid)
        except (PcpError, OSError) as exc:  # (a full disk, say): nothing kept; stored() tells the waiters
            self._log_once(exc if isinstance(exc, PcpError) else LocalError(str(exc)), "storing a blob failed")
        finally:
            done = self.storing.pop(cid, None)
            if done is not None:
                done.set()

    def holds(self, cid: str) -> bool:
        """In the store, or on its way there (:meth:`store_later`)."""
        return cid in self.storing or self.blobs.store.has(cid)

    async def stored(self, cid: str) -> bool:
        """Whether ``cid`` is in the store, once a store of it in flight has ended."""
        if (busy := self.storing.get(cid)) is not None:
            await busy.wait()
        return self.blobs.store.has(cid)

    async def stores_done(self) -> None:
        """Wait for the stores in flight (never name a blob before we hold it)."""
        for stored in list(self.storing.values()):
            await stored.wait()

    async def keep(self, data: bytes | bytearray, *, for_run: bool = False) -> str:
        """Store and pin a blob now (for the run's life, or for its round); announce it in the
        background. Peers that need it get the hint of who holds it, so they need not wait for
        a provider record (a DHT announcement on a busy swarm can take tens of seconds)."""
        cid = await trio.to_thread.run_sync(lambda: self.blobs.store.put_bytes(data, pin=True))
        self.pin(cid, for_run)
        self.announce_later(cid)
        return cid

    def announce_later(self, cid: str) -> None:
        async def announce() -> None:
            try:
                await self.blobs.announce(cid)
            except PcpError as exc:
                self._log_once(exc, "announcing a blob failed")

        assert self.nursery is not None
        self.nursery.start_soon(announce)

    # -- pins -----------------------------------------------------------------------------

    def pin(self, cid: str, for_run: bool) -> None:
        if self.pins.finished:
            return  # the run is over: nothing more is kept for it
        (self.pins.for_run if for_run else self.pins.for_round)(cid)
        self.blobs.store.pin(cid)
        self.save_pins()

    def release_run_pins(self, final_theta_cid: str) -> None:
        """The run is over on this node: keep the final θ and the dataset, release the rest."""
        for cid in self.pins.on_finish(final_theta_cid):
            self.blobs.store.unpin(cid)
        self.save_pins()

    def release_pins(self, round_: int) -> None:
        """Round ``round_``'s commit was accepted: let the old rounds' blobs go."""
        before = self.pins.committed
        for cid in self.pins.on_commit(round_):
            self.blobs.store.unpin(cid)
        if self.pins.committed != before:
            self.save_pins()

    def save_pins(self) -> None:
        try:
            self.pins.save(self.work_dir / PINS_FILE)
        except OSError as exc:  # a full disk: the pins stay, only their release may be late
            self._log_once(LocalError(str(exc)), "saving the pin ledger failed")

    def _log_once(self, exc: PcpError, what: str) -> None:
        if self.node is not None:
            self.node.log_once("self", exc, what)
        else:
            log.warning("%s: %s", what, exc)

    # -- fetching -------------------------------------------------------------------------

    async def fetch_bytes(
        self, cid: str, hint: str | None = None, *, keep: bool = True, for_run: bool = False,
        max_size: int | None = None, swarm: Sequence[str] | None = None,
    ) -> bytes:
        """A blob, from the hinted peer first (a blob just published may not have a provider
        record in the DHT yet), then from any provider, retrying a few times while provider
        records propagate. With ``swarm`` (the peers fetching it too, as a signed record named
        them), from this node's relay-tree ancestors first and the hinted origin last. A blob
        already being fetched for the store is waited for, not fetched twice.

        ``keep=False`` is for a Δ the shepherd averages once and nobody asks it for again: it
        is fetched into memory only, not written to disk, pinned or announced. A blob above the
        in-memory limit goes through the store after all. A kept blob is pinned for the run's
        life (``for_run``: dataset, artifacts) or for its round.
        """
        in_memory = await self.hold(cid, hint, keep=keep, for_run=for_run, max_size=max_size, swarm=swarm)
        if in_memory is not None:
            return in_memory
        return await trio.to_thread.run_sync(self.blobs.store.read, cid)

    async def hold(
        self, cid: str, hint: str | None = None, *, keep: bool = True, for_run: bool = False,
        max_size: int | None = None, swarm: Sequence[str] | None = None,
    ) -> bytes | None:
        """:meth:`fetch_bytes` without reading a kept blob back (``None``: it is in the store).
        For a blob held for others (a replicated checkpoint) that this node does not read now."""
        storing = self.storing.get(cid)
        if storing is not None:
            await storing.wait()
        while keep and (flight := self.fetching.get(cid)) is not None:
            await flight.wait()  # (if that fetch failed, this one tries for itself)
        if not self.blobs.store.has(cid):
            if keep:
                self.fetching[cid] = trio.Event()
            try:
                in_memory = await self._fetch(cid, hint, keep=keep, max_size=max_size, swarm=swarm)
            finally:
                if keep:
                    self.fetching.pop(cid).set()
            if in_memory is not None:
                return in_memory
            keep = True  # (a blob above the in-memory limit went through the store)
        if keep:
            self.pin(cid, for_run)
        return None

    async def _fetch(self, cid: str, hint: str | None, *, keep: bool, max_size: int | None,
                     swarm: Sequence[str] | None) -> bytes | None:
        """Fetch ``cid`` into the store; with ``keep=False`` into memory, returning its bytes."""
        origin = hint or self.default_hint()
        hinted = self.peer_info(origin)
        swarmed: list[PeerInfo] = []
        if swarm is not None and hinted is not None and self.node is not None:
            me = self.node.peer_id
            chain = upstream(cid, [p for p in swarm if p != origin], me, self.blobs.config.swarm_fanout)
            # The tree's positions are everyone's (every member computes the same order); whom this
            # node asks skips ancestors that cannot serve it: one it can reach through a relay alone
            # (a relay-only member; a cone one, when this node is relay-only), as relays never carry
            # blobs. Asking it first cost its subtree a connect timeout per blob, and a checkpoint that
            # came too late for its commit (test_netlab_training, 2026-11-24: a public home missed round 4).
            swarmed = [i for i in map(self.peer_info, filter(self.direct_to, chain)) if i is not None]
            swarmed.append(hinted)
        delay = 0.5
        for attempt in range(FETCH_ATTEMPTS):
            providers = (swarmed or [hinted]) if hinted and attempt % 2 == 0 else None
            try:
                if not keep:
                    try:
                        return bytes(await self.blobs.fetch_into(cid, providers=providers, max_size=max_size))
                    except OversizedMessage:
                        keep = True
                await self.blobs.fetch(cid, pin=True, providers=providers, announce=False, max_size=max_size,
                                       ordered=providers is swarmed and len(swarmed) > 1)
                self.announce_later(cid)
                return None
            except (PeerError, BlobNotFound) as exc:  # not provided yet, or provider gone
                if attempt == FETCH_ATTEMPTS - 1:
                    raise
                log.debug("fetch of %s failed (%s); retrying in %.1f s", cid, exc, delay)
                await trio.sleep(delay)
                delay = min(delay * 2, 8.0)
        return None  # (not reached: the last attempt returns or raises)

    def direct_to(self, peer_id: str) -> bool:
        """Whether this node can open a direct connection to ``peer_id`` by their verdicts
        (``reachability.dialable``; its own, from its record: a stranger that lies about it only
        loses the chunks it would relay): whether it can serve this node a blob, and whether a
        message to it can carry bulk (a commit's update). A relay-only member serves nobody, and
        a relay-only node is served by public members only: relays never carry blobs."""
        if self.node is None:
            return True
        member = self.node.membership.get(peer_id)
        return member is None or dialable(self.node.connectivity.reachability, member.record.reachability)

    def peer_info(self, peer_id: str | None) -> PeerInfo | None:
        from pcp_p2p.node.node import transport_addrs

        if self.node is None or not peer_id:
            return None
        member = self.node.membership.get(peer_id)
        if member is None or peer_id == self.node.peer_id:
            return None
        return PeerInfo(ID.from_base58(peer_id), transport_addrs(member.record.addrs))

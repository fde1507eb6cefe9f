"""A run's DHT records on one node: commits and leases stored (retried) and looked up.

I/O only: when a record is stored or looked up is the run machine's call
(:mod:`pcp_p2p.diloco.run.run_machine`), and whether a record found may be acted
on is its election's. A failed lookup answers ``None``; a failed store is
logged once (the protocol has other paths: direct messages, later lookups).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from pcp_p2p.core.errors import PcpError
from pcp_p2p.dht.lookup import REFRESHED_REPLICAS, K
from pcp_p2p.dht.records import MAX_TTL_S, sign_record
from pcp_p2p.diloco.protocol.admission import owner_record_name
from pcp_p2p.diloco.protocol.commits import commit_seq
from pcp_p2p.diloco.protocol.election import LEASE_KIND, Lease
from pcp_p2p.diloco.protocol.messages import CommitRecord
from pcp_p2p.wire import Message

if TYPE_CHECKING:
    from pcp_p2p.node.node import Node

log = logging.getLogger("pcp.run")

COMMIT_PUT_ATTEMPTS = 4  # DHT puts of a commit record (2, 4, 8 s apart)


class RunRecords:
    """The DHT records of run ``run_id``, through ``node``."""

    def __init__(self, node: Node, run_id: str, owner: str = "") -> None:
        self.node, self.run_id, self.owner = node, run_id, owner

    async def publish_commit(self, rec: CommitRecord, *, final: bool = False) -> None:
        """Store the commit record in the DHT, retrying a few times: at ``REFRESHED_REPLICAS`` peers
        (the next round's commit replaces it), the run's ``final`` one at k with a check-up walk
        (nothing replaces it, and a node that was down looks it up for good).

        Why retry: the record is how a node that was down when the commit went out
        (restarted after churn, joining late) learns it. A put that timed out on a
        busy swarm, never retried, left such a node waiting for a commit it could not
        see; after the last round nobody sends it again.
        """
        signed = sign_record(self.node.identity, "commit", self.run_id, rec, ttl_s=MAX_TTL_S, seq=commit_seq(rec))
        delay = 2.0
        for attempt in range(COMMIT_PUT_ATTEMPTS):
            try:
                # Generous deadline: a swarm busy training answers DHT requests slowly.
                await self.node.put_record(signed, timeout=3 * self.node.config.op_timeout,
                                           replicas=K if final else REFRESHED_REPLICAS, checkup=final)
                return
            except PcpError as exc:
                if attempt == COMMIT_PUT_ATTEMPTS - 1:
                    self.node.log_once("self", exc, "storing the commit record failed")
                    return
                log.info("run %s: storing the commit of round %d failed (%s); again in %.0f s",
                         self.run_id[:16], rec.round + 1, exc, delay)
                await trio.sleep(delay)
                delay *= 2

    async def publish_lease(self, lease: Lease, lease_s: float, *, renewal: bool = False) -> None:
        """Store ``lease`` as the run's lease record (seq = term), at ``REFRESHED_REPLICAS`` peers; a
        claim also walks for closer peers than the routing table knows, a renewal does not (the
        record is replaced every other renewal: ``PublishLease``)."""
        signed = sign_record(self.node.identity, LEASE_KIND, self.run_id, lease,
                             ttl_s=max(60.0, 10 * lease_s), seq=lease.term)
        try:
            await self.node.put_record(signed, timeout=3 * self.node.config.op_timeout,
                                       replicas=REFRESHED_REPLICAS, checkup=not renewal)
        except PcpError as exc:
            self.node.log_once("self", exc, "storing the lease failed")

    async def lookup_commit(self) -> CommitRecord | None:
        rec = await self._get("commit", self.run_id)
        return rec if isinstance(rec, CommitRecord) else None

    async def lookup_lease(self) -> Lease | None:
        lease = await self._get(LEASE_KIND, self.run_id)
        return lease if isinstance(lease, Lease) else None

    async def lookup_owner_record(self, kind: str) -> Message | None:
        """The owner's ``<run>.<owner>`` record of ``kind`` (an allowlist update, a stop), or ``None``."""
        return await self._get(kind, owner_record_name(self.run_id, self.owner))

    async def _get(self, kind: str, name: str) -> Message | None:
        try:
            payload: Message | None = await self.node.get_record(kind, name)
            return payload
        except PcpError as exc:
            log.debug("%s lookup failed: %s", kind, exc)
            return None

"""The py-libp2p validator for the DHT's ``pcp`` namespace.

Registered with ``strict_validation=True`` so that a PCP node's DHT stores
nothing outside namespaces it validates. py-libp2p calls ``validate`` on every
put it receives and every value a get returns, and ``select`` to choose among
competing values; both delegate to :func:`~pcp_p2p.dht.records.verify_record`
with the table of record kinds the validator was made with (a node's is
:data:`~pcp_p2p.node.record_kinds.RECORD_KINDS`, every kind of the protocol).

A signature check alone would let any stranger's well-signed record for a far-
future term shadow the honest ones (``lease`` and ``commit`` kinds order by
term). So a node that takes part in a run adds an *authority* check
(``authorities``): the same rules its election applies before acting on a
lease or commit. Such a node then neither stores nor selects a record it would
not act on, and its own lookups never return one. A node outside the run (a
bootstrap server) can only check signatures; readers in the run discard what
it returns if their election refuses it (py-libp2p validates every value a
get collects, then selects among the survivors).

The validator is an error boundary (:mod:`pcp_p2p.core.faults`): a record a peer
sent or returned is refused with a :class:`~pcp_p2p.core.errors.PcpError`; a bug in
a check (an authority's, say) is this node's fault, so it is logged once with
its traceback, counted in the node's ``local_faults``, and the record refused
with :class:`~pcp_p2p.core.faults.InternalFault` (an unchecked record is never
stored), instead of vanishing into py-libp2p's catch-all as a bad put.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from libp2p.records.validator import Validator

from pcp_p2p.core.errors import PcpError
from pcp_p2p.core.faults import InternalFault, LocalFaults
from pcp_p2p.dht.records import KindRule, VerifiedRecord, newer, verify_record

log = logging.getLogger(__name__)


class PcpRecordValidator(Validator):
    """Accepts only signed, unexpired records whose signer may write the key."""

    def __init__(self, kinds: Mapping[str, KindRule], now: Callable[[], float] = time.time, *,
                 faults: LocalFaults | None = None) -> None:
        self.kinds = kinds
        self._now = now
        self.faults = faults if faults is not None else LocalFaults()
        self.authorities: list[Callable[[VerifiedRecord, float], None]] = []
        """Extra checks (raise a PcpError to refuse); a run's runtime adds its election's."""

    def check(self, key: str, value: bytes) -> VerifiedRecord:
        """The record ``value`` under ``key``, verified; a PcpError refuses it (a bug: InternalFault)."""
        try:
            now = self._now()
            verified = verify_record(value, kinds=self.kinds, key=key, now=now)
            for authority in self.authorities:
                authority(verified, now)
        except PcpError:
            raise
        except Exception as exc:  # the boundary: our bug, not a bad record
            self.faults.record(exc, "dht")
            raise InternalFault(f"checking a record for {key:.80} failed on this node") from exc
        return verified

    def validate(self, key: str, value: bytes) -> None:
        self.check(key, value)

    def select(self, key: str, values: list[bytes]) -> int:
        """Index of the newest valid value; invalid values never win."""
        best_i, best = -1, None
        for i, value in enumerate(values):
            try:
                rec = self.check(key, value).record
            except PcpError as exc:
                log.debug("select: dropping invalid value for %s: %s", key, exc)
                continue
            if best is None or newer(rec, best, self.kinds):
                best_i, best = i, rec
        if best_i < 0:
            raise ValueError(f"no valid value for {key}")
        return best_i

"""The py-libp2p validator for the DHT's ``pcp`` namespace.

Registered with ``strict_validation=True`` so that a PCP node's DHT stores
nothing outside namespaces it validates. py-libp2p calls ``validate`` on every
put it receives and every value a get returns, and ``select`` to choose among
competing values; both delegate to :func:`~pcp_p2p.dht.records.verify_record`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from libp2p.records.validator import Validator

from pcp_p2p.dht.records import newer, verify_record
from pcp_p2p.errors import PcpError

log = logging.getLogger(__name__)


class PcpRecordValidator(Validator):
    """Accepts only signed, unexpired records whose signer may write the key."""

    def __init__(self, now: Callable[[], float] = time.time) -> None:
        self._now = now

    def validate(self, key: str, value: bytes) -> None:
        verify_record(value, key=key, now=self._now())

    def select(self, key: str, values: list[bytes]) -> int:
        """Index of the newest valid value; invalid values never win."""
        best_i, best = -1, None
        for i, value in enumerate(values):
            try:
                rec = verify_record(value, key=key, now=self._now()).record
            except PcpError as exc:
                log.debug("select: dropping invalid value for %s: %s", key, exc)
                continue
            if best is None or newer(rec, best):
                best_i, best = i, rec
        if best_i < 0:
            raise ValueError(f"no valid value for {key}")
        return best_i

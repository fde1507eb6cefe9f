"""What the round state machines ask the outside world to do.

The machines in :mod:`~pcp_p2p.diloco.protocol.shepherd` and :mod:`~pcp_p2p.diloco.protocol.worker`
never touch a socket, a file, a thread or the clock. Each input (a message, a
blob that arrived, the inner loop finishing, the time passing) returns a list
of these effects, in the order they must happen; the trio glue (or the
in-memory simulator, or a test) carries them out and feeds the results back in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pcp_p2p.core.errors import PcpError
from pcp_p2p.diloco.protocol.messages import CommitRecord, DataAssignment
from pcp_p2p.wire import Message


@dataclass(frozen=True)
class Send:
    """Deliver ``message`` to peer ``to`` (best effort; the protocol tolerates loss)."""

    to: str
    message: Message


@dataclass(frozen=True)
class StoreBlob:
    """Keep ``data`` under ``cid`` and announce it as provided (pin it)."""

    cid: str
    data: bytes


@dataclass(frozen=True)
class FetchBlob:
    """Fetch ``cid`` (``hint``: a peer that should have it); answer with ``on_blob``."""

    cid: str
    hint: str | None = None


@dataclass(frozen=True)
class RunInner:
    """Run up to ``max_steps`` inner AdamW steps for ``time_budget_s`` from ``theta``.

    ``inner_state`` is the worker's opaque optimiser state (AdamW moments, step)
    carried across rounds; the executor hands the new one back in the result.
    """

    round: int
    attempt: int
    theta: dict[str, np.ndarray]
    theta_cid: str
    artifact_cid: str | None
    assignment: DataAssignment
    time_budget_s: float
    inner_state: Any


@dataclass(frozen=True)
class CancelInner:
    """Stop the inner run for (round, attempt): it was superseded."""

    round: int
    attempt: int


@dataclass(frozen=True)
class LookupCommit:
    """Look up the run's latest commit record (the DHT's latest-checkpoint record).

    A worker asks when it has heard nothing for a round's deadline: a lost
    commit or announcement must not strand it. Answer with ``on_commit``.
    """


@dataclass(frozen=True)
class Rejected:
    """An input was refused (log it; nothing else to do). ``peer`` is who sent it."""

    peer: str | None
    error: PcpError


@dataclass(frozen=True)
class Committed:
    """A round committed: publish ``record`` (e.g. the latest-checkpoint DHT record)."""

    record: CommitRecord


@dataclass(frozen=True)
class Discarded:
    """A round attempt ended without quorum; it will be retried."""

    round: int
    attempt: int
    error: PcpError


@dataclass(frozen=True)
class Finished:
    """The run reached its last round."""

    round: int
    theta_cid: str


@dataclass(frozen=True)
class Banned:
    """Two auditors' replays contradict ``peer``'s signed round: record the ban (``evidence``:
    encoded :class:`~pcp_p2p.diloco.protocol.audit.Evidence`, re-verifiable by anyone)."""

    peer: str
    evidence: bytes
    reason: str


Effect = (
    Send | StoreBlob | FetchBlob | RunInner | CancelInner | LookupCommit | Rejected | Committed | Discarded
    | Finished | Banned
)

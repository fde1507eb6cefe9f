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

    ``attempt`` = :data:`EARLY` marks an *early* run (``round.overlap``): round
    ``round`` started before its announcement, from ``theta``, the worker's own
    end point of the round before. It trains for the budget as any run, at most
    :data:`EARLY_SHARE` of it before a :class:`ShiftInner` has told it its real
    start, and it does not end before that; a :class:`CancelInner` for
    (round, EARLY) stops it.
    """

    round: int
    attempt: int
    theta: dict[str, np.ndarray]
    theta_cid: str
    artifact_cid: str | None
    assignment: DataAssignment
    time_budget_s: float
    inner_state: Any


EARLY = -1
"""The ``attempt`` of an early inner run: it precedes every announced attempt of its round, and
its own key keeps its cancellation apart from the announced run that may replace it."""

EARLY_SHARE = 0.5
"""The most of its time budget, and of its assignment's steps, an early run trains before its shift.

Steps before the shift start from an estimate (the worker's own end point), and what they
are worth falls with their share τ of the round: final val loss over synchronous data
parallel 1.028 at τ = 0.1, 1.042 at 0.5, 1.056 at 0.75, 1.076 at 1 (docs/diloco.md,
"Overlap"). Past this share the run waits for the shift: on a fast link the shift comes
long before; a worker whose step cap ends its round early (fast hardware) would otherwise
do every step from the estimate. After a late shift the run still trains the rest of a
round (``1 − EARLY_SHARE`` of the budget): its steps stay at most this share estimated."""


@dataclass(frozen=True)
class ShiftInner:
    """The early run of ``round`` learns its real start: move its parameters by ``to − theta``.

    ``to`` is where the announced round starts (θ_{r+1}, less an error-feedback residual);
    ``theta`` was the run's estimate of it (its ``RunInner.theta``). The moments and the
    progress made so far are kept: the "corrected" overlap of ``docs/diloco.md``. Applied at
    the next chunk boundary; the run then trains what is left of its budget (at least one
    chunk, and ``1 − EARLY_SHARE`` of a budget after a late shift) on ``assignment``, the
    announced one (the expected one unless the roster changed: then the steps before the
    shift were drawn from the expected shard, the rest from the announced).
    """

    round: int
    to: dict[str, np.ndarray]
    assignment: DataAssignment


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
    encoded :class:`~pcp_p2p.diloco.protocol.audit.Evidence`, re-verifiable by anyone), and send
    it to every member. ``shared`` false: a lie only this node could check (a partial aggregate
    its own replay disproved, :mod:`~pcp_p2p.diloco.protocol.partial_audit`): recorded here only."""

    peer: str
    evidence: bytes
    reason: str
    shared: bool = True


Effect = (
    Send | StoreBlob | FetchBlob | RunInner | ShiftInner | CancelInner | LookupCommit | Rejected | Committed
    | Discarded | Finished | Banned
)

"""The run machine's typed inputs (events) and what it asks its pump to do (effects).

Inputs: a pump posts one of the events below to its inbox when something happens
(a message arrived, a fetch or an inner run ended, a lookup answered, the set-up
of a term ended) and feeds each to :meth:`RunMachine.handle
<pcp_p2p.diloco.run.run_machine.RunMachine.handle>` with the time.

Effects:

The round machines' effects (:mod:`~pcp_p2p.diloco.protocol.effects`) and the election's
(:mod:`~pcp_p2p.diloco.protocol.election`) say what one machine needs; the run machine
combines the three and adds what only the combination knows: which machine a
fetched blob goes back to, which DHT lookup the election waits on, that a commit
is held until another node holds its checkpoint, that a term is being set up
(compiled) and must be cancelled, which pins to release, that the run ended.

The pump (the trio runtime on a node, or :mod:`pcp_p2p.testing.run_harness`
in memory) carries each out and feeds the result back as an input; none of
these carries a rule of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pcp_p2p.core.errors import PcpError
from pcp_p2p.diloco.protocol.effects import (
    CancelInner,
    Discarded,
    Finished,
    Rejected,
    RunInner,
    Send,
    ShiftInner,
    StoreBlob,
)
from pcp_p2p.diloco.protocol.election import BecomeShepherd, Lease, PublishLease
from pcp_p2p.diloco.protocol.messages import CommitRecord
from pcp_p2p.wire import Message

if TYPE_CHECKING:
    from pcp_p2p.diloco.protocol.shepherd import Shepherd
    from pcp_p2p.diloco.protocol.worker import InnerResult
    from pcp_p2p.diloco.run.run_machine import Member

# --- inputs ----------------------------------------------------------------------------


@dataclass(frozen=True)
class MessageIn:
    """``message`` from ``sender`` (authenticated by the transport), or an owner's record looked up."""

    sender: str
    message: Message


@dataclass(frozen=True)
class BlobIn:
    """The blob ``cid`` a ``Fetch`` for ``who`` asked for."""

    who: str
    cid: str
    data: bytes


@dataclass(frozen=True)
class BlobFailed:
    who: str
    cid: str
    error: PcpError


@dataclass(frozen=True)
class InnerDone:
    result: InnerResult


@dataclass(frozen=True)
class InnerFailed:
    round: int
    attempt: int
    error: PcpError


@dataclass(frozen=True)
class CommitLookedUp:
    """What a ``LookUpCommit`` found (``None``: nothing, or the lookup failed)."""

    record: CommitRecord | None
    for_election: bool


@dataclass(frozen=True)
class LeaseLookedUp:
    lease: Lease | None


@dataclass(frozen=True)
class MembersSeen:
    """The live members now (a pump reports them about once a second)."""

    members: list[Member]


@dataclass(frozen=True)
class Replicated:
    """A ``ReplicateCommit`` ended: ``acked`` hold the checkpoint (empty: the timeout passed)."""

    commit: CommitRecord
    acked: list[str]


@dataclass(frozen=True)
class ShepherdBuilt:
    """A ``SetUpShepherd`` built its shepherd."""

    shepherd: Shepherd


@dataclass(frozen=True)
class SetUpEnded:
    """The set-up of ``term`` is over (built, failed or cancelled)."""

    term: int


@dataclass(frozen=True)
class Wake:
    """Nothing happened: only wakes the pump's loop (the run ended)."""


Event = (MessageIn | BlobIn | BlobFailed | InnerDone | InnerFailed | CommitLookedUp | LeaseLookedUp
         | MembersSeen | Replicated | ShepherdBuilt | SetUpEnded | Wake)

# --- effects ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Fetch:
    """Fetch ``cid`` for ``who`` (``"worker"`` or ``"shepherd"``); answer with ``on_blob``/``on_blob_failed``.

    The shepherd's fetches are Δs, used once and never asked for again: the pump
    need not keep them.
    """

    who: str
    cid: str
    hint: str | None = None


@dataclass(frozen=True)
class LookUpCommit:
    """Look up the run's latest commit record; answer with ``on_commit_lookup(rec, for_election)``.

    ``for_election``: the election's settling waits for this answer (a worker's own
    lookups must not end that wait)."""

    for_election: bool


@dataclass(frozen=True)
class LookUpLease:
    """Look up the run's lease record; answer with ``on_lease_lookup`` (``None`` if none)."""


@dataclass(frozen=True)
class LookUpOwnerRecord:
    """Look up the owner's ``kind`` record of this run (a stop, an allowlist amendment) and hand
    what is found to ``on_message`` as if the owner had sent it: the same checks apply."""

    kind: str


@dataclass(frozen=True)
class PublishCommit:
    """Store ``record`` as the run's commit record in the DHT (retrying: a late joiner reads it there)."""

    record: CommitRecord


@dataclass(frozen=True)
class ReplicateCommit:
    """Send ``commit`` to ``targets`` (each acknowledges once it holds the checkpoint); answer with
    ``on_replicated(commit, acked)`` after the first ack or ``timeout_s``. Until then the
    shepherd's later effects are held: the commit is nowhere else.

    ``then``: (target, message) pairs, each sent to its target as soon as that target's commit
    send ended, acked or not (the next round's announcement: a worker that holds the
    checkpoint starts on it without waiting for the others' acks; one whose send failed gets
    it too, as it would have on the release)."""

    commit: CommitRecord
    targets: tuple[str, ...]
    timeout_s: float
    then: tuple[tuple[str, Message], ...] = ()
    update: bytes = b""  # the commit's update blob, sent along when it is small (CommitWithUpdate)


@dataclass(frozen=True)
class ReplicateCheckpoint:
    """Hold ``record``'s checkpoint (so any candidate can take the run over)."""

    record: CommitRecord

    @property
    def cid(self) -> str:
        return self.record.checkpoint_cid


@dataclass(frozen=True)
class SetUpShepherd:
    """Build this node's shepherd of ``become.term`` (compile, starting state); answer with
    ``shepherd_built`` (if it could) and then ``setup_ended``."""

    become: BecomeShepherd


@dataclass(frozen=True)
class CancelSetUp:
    """Stop the set-up in progress (another node holds the term, or this one stepped down)."""

    why: str


@dataclass(frozen=True)
class Leads:
    """This node leads the run (``True``) or no longer does: what its member record says."""

    leading: bool


@dataclass(frozen=True)
class SaveLease:
    """Keep ``lease`` (the latest accepted, once per term) where a restart finds it: its anchor."""

    lease: Lease


@dataclass(frozen=True)
class ReleasePins:
    """Round ``round`` committed here: the run's old rounds' blobs may go."""

    round: int


@dataclass(frozen=True)
class RunEnded:
    """The run is over on this node (finished or stopped).

    ``final_theta_cid``: keep that θ and the dataset, release every other pin; ``None``:
    release nothing (a shepherd without a worker)."""

    phase: str
    final_theta_cid: str | None


@dataclass(frozen=True)
class Stopped:
    """The owner's stop ``order`` was accepted: keep it where a restart finds it, and cancel every inner run."""

    order: Message


@dataclass(frozen=True)
class CommitAccepted:
    """The worker accepted ``record`` (a new commit). ``standby``: this node is among the first
    ``STANDBYS`` that would take the run over if its shepherd failed now, so it prepares the
    takeover (a hot standby: artifacts compiled and signed, the evaluator built)."""

    record: CommitRecord
    standby: bool = False


@dataclass(frozen=True)
class Audit:
    """An audit message (``AuditRequest`` or ``StateOffer``) from ``sender`` for the pump's audit jobs."""

    sender: str
    message: Message


RunEffect = (
    Send | StoreBlob | RunInner | ShiftInner | CancelInner | Rejected | Discarded | Finished | PublishLease
    | Fetch | LookUpCommit | LookUpLease | LookUpOwnerRecord | PublishCommit | ReplicateCommit | ReplicateCheckpoint
    | SetUpShepherd | CancelSetUp | Leads | SaveLease | ReleasePins | RunEnded | Stopped | CommitAccepted | Audit
)
"""Everything :class:`~pcp_p2p.diloco.run.run_machine.RunMachine` asks its pump to do: the round
machines' and the election's effects it passes on as they are, and the ones above."""

"""The DiLoCo round's wire messages, and signing helpers for them.

Every message carries ``run_id`` and ``term`` (and, where a round is involved,
``round`` and ``attempt``) so a receiver can drop anything replayed, misrouted or
left over from a discarded attempt without looking at its payload. Every
message is signed by its sender's node key: a submission by its worker, an
announcement and a commit by the shepherd of the term — so a shepherd that
changes between rounds (a later issue's terms and leases) needs no change here.

``round`` is the number of outer steps already committed when the round starts:
round ``r`` trains from θ_r and its commit record produces θ_{r+1}.
``attempt`` counts retries of the same round after a discarded (quorum-less)
attempt; data seeds depend on it so a retry draws fresh batches.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

from pcp_p2p.core.identity import Identity, verify_signature
from pcp_p2p.wire import HARD_MAX_SIZE, Message, decode, encode, signing_bytes, wire_message, wire_struct

S = TypeVar("S", bound=Message)

MAX_LOSSES = 4096
INLINE_DELTA_LIMIT = HARD_MAX_SIZE - 64 * 1024
"""A Δ payload above this goes out as a blob and the submission names its CID."""
FRESH_STATE = "fresh"
"""A submission's ``state_in`` when its inner loop started from fresh AdamW moments (zeros, step 0)."""


@wire_message("diloco.join", max_size=4 * 1024)
class Join(Message):
    """A worker asks to take part in a run from the next round on."""

    run_id: str
    worker: str
    target: str
    tokens_per_s: float
    signature: bytes = b""


@wire_struct
class DataAssignment(Message):
    """What one worker trains on in one round (see :mod:`pcp_p2p.diloco.algorithm.data`)."""

    worker: str
    shard: int
    num_shards: int
    seed: int
    max_steps: int


MAX_GROUP_PARTS = 256
"""The most ranks a worker group's submission may name (its split is signed and replayed part by part)."""


@wire_struct
class GroupPart(Message):
    """One rank's piece of a worker group's round (see :mod:`pcp_p2p.diloco.protocol.group_split`).

    Its position ``k`` in :attr:`Submission.group` makes it shard ``s·K + k`` of
    ``N·K`` of the group's assignment with seed ``sub_seed(seed, k)`` and step cap
    ``max_steps``; ``steps`` is what it trained (0: it contributed nothing).
    ``rank`` names its state in the group's state digest.
    """

    rank: int
    max_steps: int
    steps: int
    state_in: str
    state_out: str


@wire_message("diloco.announce", max_size=1 << 20)
class RoundAnnouncement(Message):
    """The shepherd opens round ``round`` (attempt ``attempt``) from θ ``theta_cid``."""

    run_id: str
    term: int
    round: int
    attempt: int
    theta_cid: str
    artifacts: dict[str, str]  # target -> vmfb CID
    time_budget_s: float
    deadline: float  # on the shepherd's clock
    assignments: tuple[DataAssignment, ...]
    shepherd: str
    dataset_cid: str = ""  # the tokenised dataset blob (see data.encode_dataset); "" = the workers' local copy
    # this attempt's aggregators (pcp_p2p.diloco.protocol.partials): a worker sends its submission to
    # its group's (``partials.group_map``); () = every submission goes to the shepherd
    aggregators: tuple[str, ...] = ()
    signature: bytes = b""

    def assignment_for(self, worker: str) -> DataAssignment | None:
        for a in self.assignments:
            if a.worker == worker:
                return a
        return None


@wire_message("diloco.submit", max_size=HARD_MAX_SIZE)
class Submission(Message):
    """A worker's pseudo-gradient Δ = θ_r − θ_local for one round, and its bill."""

    run_id: str
    term: int
    round: int
    attempt: int
    worker: str
    base_theta_cid: str
    codec: str
    delta_cid: str | None
    delta_inline: bytes | None
    steps: int
    tokens: int
    losses: tuple[float, ...]
    # The inner optimiser state (AdamW moments and step) the worker started from
    # and ended with, as :func:`~pcp_p2p.diloco.protocol.audit.inner_state_digest` hex
    # digests (``state_in`` may be FRESH_STATE). With θ, the assignment and the
    # step count they make the round replayable (:mod:`pcp_p2p.diloco.protocol.audit`);
    # "" = no commitment (a submission that cannot be audited).
    state_in: str = ""
    state_out: str = ""
    # A worker group's split of the round over its ranks, one part per rank in
    # sub-shard order; () = one process trained the whole assignment. With it an
    # auditor replays every part and recombines them (pcp_p2p.diloco.protocol.audit).
    group: tuple[GroupPart, ...] = ()
    signature: bytes = b""


@wire_message("diloco.commit", max_size=256 * 1024)
class CommitRecord(Message):
    """The one statement of what θ every worker must hold after round ``round``."""

    run_id: str
    term: int
    round: int
    attempt: int
    prev_theta_cid: str
    theta_cid: str
    checkpoint_cid: str
    participants: tuple[str, ...]
    tokens: int
    mean_loss: float
    val_loss: float | None
    shepherd: str
    update_cid: str = ""  # the applied outer step (pcp_p2p.diloco.algorithm.update); "": fetch the checkpoint
    signature: bytes = b""


INLINE_UPDATE_BYTES = 1 << 20
"""A commit's update up to this size rides with the commit to each participant (:class:`CommitWithUpdate`)."""


@wire_message("diloco.commit+update", max_size=INLINE_UPDATE_BYTES + 256 * 1024 + 4096)
class CommitWithUpdate(Message):
    """A commit and its update blob in one message, from the shepherd to a participant.

    Why: a participant builds the checkpoint from the update (:mod:`pcp_p2p.diloco.algorithm.update`),
    and a fetch of it cost a stream, a manifest and the chunks' round trips after the commit had
    arrived: 0.7-0.9 s for the tiny model's 216 KB on the network lab's home links, every round,
    on the path to the next round's shift. Sent along, it costs the shepherd's uplink the same
    bytes. Unsigned itself: the update counts only if its CID is the signed commit's
    ``update_cid``, and only after the commit passed the run's authority chain.
    """

    commit: CommitRecord
    update: bytes

    @property
    def run_id(self) -> str:
        return self.commit.run_id


@wire_message("diloco.leave", max_size=1024)
class Leave(Message):
    """``peer`` leaves ``run_id`` now (a graceful stop): rounds need not wait for it.

    Signed by ``peer`` itself, and only ``peer`` (or the shepherd relaying it)
    may send it: nobody can announce another node's departure. ``at`` is the
    leaver's clock when it left; with it a receiver refuses replays (see
    :mod:`pcp_p2p.diloco.protocol.departures`) and tells the leaver apart from the same
    peer id restarted later (its member record's ``started_at`` is newer).
    """

    run_id: str
    peer: str
    at: float
    signature: bytes = b""


def sign(msg: S, identity: Identity) -> S:
    """``msg`` with its ``signature`` field set by ``identity``.

    The message is first put through the codec once: a float field built from a
    Python ``int`` (``tokens_per_s=96``) encodes as a msgpack int but decodes as
    a float, so without this the receiver would re-encode different bytes and the
    signature would not verify.
    """
    canonical = decode(encode(msg), type(msg))
    return dataclasses.replace(canonical, signature=identity.sign(signing_bytes(canonical)))


def verify(msg: Message, signer: str) -> None:
    """Raise :class:`~pcp_p2p.core.errors.BadSignature` unless ``signer`` signed ``msg``."""
    signature = getattr(msg, "signature", None)
    if not isinstance(signature, bytes):  # the codec checked the field's type: this is a message with none
        raise TypeError(f"{msg.TAG} is not a signed message")
    verify_signature(signer, signing_bytes(msg), signature)


ROUND_MESSAGES: tuple[type[Message], ...] = (Join, RoundAnnouncement, Submission, CommitRecord, CommitWithUpdate,
                                              Leave)

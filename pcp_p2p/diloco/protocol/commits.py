"""The ``commit`` record kind: the latest committed round of a run, in the DHT.

Stored under ``/pcp/commit/<run id>`` by the shepherd that signed the commit;
a late joiner or a worker that missed a commit looks it up there. The record's
``seq`` is (term, round) (:func:`commit_seq`) and the highest wins, the same
fork choice as the election's: a higher term beats a longer chain of an older one.
"""

from __future__ import annotations

from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import BadSignature, HashMismatch, MalformedMessage, VerificationError
from pcp_p2p.dht.records import KindRule
from pcp_p2p.diloco.algorithm.checkpoint import (
    Checkpoint,
    decode_checkpoint,
    encode_checkpoint,
    lay_out_checkpoint,
    round_metrics,
)
from pcp_p2p.diloco.algorithm.outer import OuterState
from pcp_p2p.diloco.algorithm.params import unpack_tensors
from pcp_p2p.diloco.algorithm.update import apply_update
from pcp_p2p.diloco.protocol.messages import CommitRecord, verify
from pcp_p2p.diloco.protocol.spec import OuterOptimizer
from pcp_p2p.wire import Message


def _commit_rule(name: str, signer: str, payload: Message) -> None:
    assert isinstance(payload, CommitRecord)
    if payload.run_id != name:
        raise VerificationError("commit record stored under another run id")
    if payload.shepherd != signer:
        raise BadSignature("a commit record must be stored by the shepherd that signed it")
    verify(payload, signer)


COMMIT_KIND = "commit"
COMMIT_RULE = KindRule(CommitRecord, _commit_rule, order="seq")


def commit_seq(rec: CommitRecord) -> int:
    """The record ``seq`` of a commit: fork choice order (term, then round) in one number."""
    return (rec.term << 32) | rec.round


def rebuild_checkpoint(rec: CommitRecord, base: bytes | bytearray, update: bytes, outer: OuterOptimizer,
                       reuse: bytearray | None = None) -> bytearray:
    """The checkpoint ``rec`` names, built from the checkpoint its step started from
    (``base``) and its update blob, instead of fetched (:mod:`pcp_p2p.diloco.algorithm.update`).

    The caller checks ``rec``'s authority first; this checks the result: the
    base must be the round before ``rec``'s, and the bytes built must hash to
    ``rec``'s θ and checkpoint CIDs (:class:`HashMismatch` otherwise: a
    tampered update, a base that was not the step's, a shepherd on another
    build of numpy). A malformed base or update is :class:`MalformedMessage`.
    Either way nothing is kept, and the caller fetches the checkpoint instead.
    ``reuse``: a buffer the checkpoint may be built in (``lay_out_checkpoint``).
    """
    ckpt = decode_checkpoint(base)
    if ckpt.run_id != rec.run_id or ckpt.state.round != rec.round:
        raise MalformedMessage(f"the base checkpoint is of round {ckpt.state.round}, "
                               f"not round {rec.round} that commit {rec.round + 1} stepped from")
    metrics = round_metrics(rec.tokens, rec.mean_loss, rec.val_loss)
    shapes = {k: v.shape for k, v in ckpt.state.theta.items()}
    out = lay_out_checkpoint(rec.run_id, rec.term, rec.round + 1, metrics, shapes, with_momentum=outer.momentum != 0,
                             reuse=reuse)
    apply_update(ckpt.state, update, lr=outer.lr, momentum=outer.momentum, into=(out.theta, out.momentum))
    data = out.data
    if out.theta_cid() != rec.theta_cid or cid_of(data) != rec.checkpoint_cid:
        raise HashMismatch(f"commit of round {rec.round + 1}: its update applied to the last checkpoint "
                           "does not give the checkpoint it names")
    return data


def start_checkpoint(rec: CommitRecord, theta: bytes) -> bytes | None:
    """The checkpoint a run's first commit stepped from, out of its starting θ blob: θ with
    zero outer momentum at round 0 (``OuterState.initial``, how every term at round 0 starts).

    A worker holds that θ (it trained round 0 from it) but no checkpoint before the first
    commit, so without this it fetched the first commit's checkpoint whole (two θ's worth,
    through every hop of the tree) while its early run waited. ``None`` for a later commit;
    the caller's :func:`rebuild_checkpoint` checks the result against the commit's CIDs.
    """
    if rec.round != 0:
        return None
    state = OuterState.initial(unpack_tensors(theta))
    return encode_checkpoint(Checkpoint(rec.run_id, rec.term, state))[0]

"""The ``commit`` record kind: the latest committed round of a run, in the DHT.

Stored under ``/pcp/commit/<run id>`` by the shepherd that signed the commit;
a late joiner or a worker that missed a commit looks it up there. The record's
``seq`` is (term, round) (:func:`commit_seq`) and the highest wins, the same
fork choice as the election's: a higher term beats a longer chain of an older one.
"""

from __future__ import annotations

from dataclasses import dataclass

from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import BadSignature, HashMismatch, MalformedMessage, VerificationError
from pcp_p2p.dht.records import KindRule
from pcp_p2p.diloco.algorithm.checkpoint import (
    Checkpoint,
    CheckpointLayout,
    decode_checkpoint,
    encode_checkpoint,
    lay_out_checkpoint,
    round_metrics,
)
from pcp_p2p.diloco.algorithm.outer import OuterState
from pcp_p2p.diloco.algorithm.params import Params, unpack_tensors
from pcp_p2p.diloco.algorithm.update import decode_step, step_momentum, step_theta
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
    (``base``) and its update blob, instead of fetched (:mod:`pcp_p2p.diloco.algorithm.update`):
    :func:`rebuild_theta`, then :meth:`RebuiltTheta.finish`. ``reuse``: a buffer the
    checkpoint may be built in (``lay_out_checkpoint``)."""
    return rebuild_theta(rec, base, update, outer, reuse=reuse).finish()


@dataclass
class RebuiltTheta:
    """A checkpoint being built from its commit's update, θ written and checked: what a
    node trains the next round from. The momentum and the checkpoint's own CID come after
    (:meth:`finish`), off the path from the commit to the next round's inner steps."""

    rec: CommitRecord
    base: OuterState
    step: Params
    out: CheckpointLayout
    outer: OuterOptimizer

    def theta_bytes(self) -> bytes:
        """θ's blob, copied out (the checkpoint's buffer is reused for a later one)."""
        return self.out.theta_bytes()

    def finish(self) -> bytearray:
        """The momentum written and the whole checkpoint checked against ``rec``'s CID
        (:class:`HashMismatch` otherwise: a commit whose θ holds but whose checkpoint does
        not, which only its shepherd can sign); the checkpoint's bytes. Once: it spends the step."""
        step_momentum(self.base, self.step, lr=self.outer.lr, momentum=self.outer.momentum, into=self.out.momentum)
        if cid_of(self.out.data) != self.rec.checkpoint_cid:
            raise HashMismatch(f"commit of round {self.rec.round + 1}: its update applied to the last checkpoint "
                               "gives its θ but not the checkpoint it names")
        return self.out.data


def rebuild_theta(rec: CommitRecord, base: bytes | bytearray, update: bytes, outer: OuterOptimizer,
                  reuse: bytearray | None = None) -> RebuiltTheta:
    """The first half of :func:`rebuild_checkpoint`: θ of the checkpoint ``rec`` names, from
    the checkpoint its step started from (``base``) and its update blob, checked.

    The caller checks ``rec``'s authority first; this checks the result: the
    base must be the round before ``rec``'s, and θ built must hash to ``rec``'s
    θ CID (:class:`HashMismatch` otherwise: a tampered update, a base that was
    not the step's, a shepherd on another build of numpy). A malformed base or
    update is :class:`MalformedMessage`. Either way nothing is kept, and the
    caller fetches the checkpoint instead.
    """
    ckpt = decode_checkpoint(base)
    if ckpt.run_id != rec.run_id or ckpt.state.round != rec.round:
        raise MalformedMessage(f"the base checkpoint is of round {ckpt.state.round}, "
                               f"not round {rec.round} that commit {rec.round + 1} stepped from")
    step = decode_step(ckpt.state, update)
    metrics = round_metrics(rec.tokens, rec.mean_loss, rec.val_loss)
    shapes = {k: v.shape for k, v in ckpt.state.theta.items()}
    out = lay_out_checkpoint(rec.run_id, rec.term, rec.round + 1, metrics, shapes, with_momentum=outer.momentum != 0,
                             reuse=reuse)
    step_theta(ckpt.state, step, into=out.theta)
    if out.theta_cid() != rec.theta_cid:
        raise HashMismatch(f"commit of round {rec.round + 1}: its update applied to the last checkpoint "
                           "does not give the θ it names")
    return RebuiltTheta(rec, ckpt.state, step, out, outer)


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

"""Auditing a worker group's round: its signed split, replayed part by part and recombined.

A worker group (:mod:`pcp_p2p.cluster`) trains one assignment on K ranks, each
on its own sub-shard from its own inner state, and submits the token-weighted
average of their Δs. None of that is a private shortcut: the split is a pure
function of the signed announcement plus what the group signs in
:attr:`~pcp_p2p.diloco.protocol.messages.Submission.group` (per part: the rank, the
sub-shard's step cap, the steps trained and the rank's state digests). So an
auditor of the group's target replays each part exactly as a single worker's
round (:meth:`~pcp_p2p.diloco.run.engine.InnerEngine.replay`) and recombines the
replays with the very function the group uses, :func:`~pcp_p2p.diloco.protocol.group_split.combine`
(float64 sums, rank order, the same tokens), then judges the result like any
other round: Δ payload, the group's ``state_out`` digest, the per-step mean
losses.

Why the split cannot be bent. :func:`check_split` (run by the shepherd before it
accepts a group's submission, and again by the auditor) refuses a split that
does not tile the assignment: parts are sub-shards ``s·K+k`` of ``N·K`` by
their position, their caps are whole chunks summing to at most the assignment's
cap, the steps trained are whole chunks within each cap summing to the claimed
steps, and the state digests of the contributing parts must name the group's
``state_in``/``state_out``. A group that lies in its split lies about a replayable
fact, and the replay shows it.

Exactness. The group sums ``t_k·Δ_k`` with an MPI allreduce in float64. With at
most two contributing parts the sum is one IEEE addition, commutative, so the
replay reproduces it bit for bit and the comparison is exact. With three or
more, MPI's reduction tree may associate the additions differently from the
auditor's rank-order sum; the float64 results then differ by a few float64
ulps, which the cast to float32 turns into at most one float32 ulp of θ_local.
For those rounds :func:`group_tolerance` allows two float32 ulps of the largest
|θ| plus the codec's own rounding of the replayed Δ — still far below any
useful manipulation.

A group's inner state, served to an auditor, is the bundle of its contributing
ranks' state blobs (:func:`encode_group_state`), each checked against the
digest its part signed.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Mapping, Sequence

import numpy as np

from pcp_p2p.core.errors import MalformedMessage, RejectedUpdate
from pcp_p2p.diloco.algorithm.params import Params, codec_of
from pcp_p2p.diloco.protocol.group_split import combine, group_state, mean_losses, sub_assignments
from pcp_p2p.diloco.protocol.messages import FRESH_STATE, MAX_GROUP_PARTS, DataAssignment, GroupPart, Submission


def contributing(sub: Submission) -> tuple[GroupPart, ...]:
    """The parts that trained (and so enter the Δ, the losses and the state digests)."""
    return tuple(p for p in sub.group if p.steps > 0)


def check_split(sub: Submission, assignment: DataAssignment, chunk_steps: int) -> None:
    """:class:`RejectedUpdate` unless ``sub.group`` is a split of ``assignment`` consistent with ``sub``.

    Nothing to check for an ordinary (single-process) submission.
    """
    parts = sub.group
    if not parts:
        return
    if len(parts) > MAX_GROUP_PARTS:
        raise RejectedUpdate(f"a group split of {len(parts)} parts; at most {MAX_GROUP_PARTS}")
    ranks = [p.rank for p in parts]
    if ranks[0] < 0 or any(b <= a for a, b in itertools.pairwise(ranks)):
        raise RejectedUpdate("a group split's ranks must be distinct, non-negative and in order")
    cap = (assignment.max_steps // chunk_steps) * chunk_steps
    for p in parts:
        if p.max_steps < 0 or p.max_steps % chunk_steps or not 0 <= p.steps <= p.max_steps \
                or p.steps % chunk_steps:
            raise RejectedUpdate(f"rank {p.rank}'s part: {p.steps} of {p.max_steps} steps is not whole chunks "
                                 f"of {chunk_steps} within its cap")
        if p.steps == 0 and (p.state_in or p.state_out):
            raise RejectedUpdate(f"rank {p.rank} trained nothing yet names inner states")
        if p.steps > 0 and not (p.state_in and p.state_out):
            raise RejectedUpdate(f"rank {p.rank}'s part commits to no inner state")
    if sum(p.max_steps for p in parts) > cap:
        raise RejectedUpdate(f"the group's sub-shards allow {sum(p.max_steps for p in parts)} steps; "
                             f"the assignment allows {cap}")
    done = contributing(sub)
    if not done or sum(p.steps for p in done) != sub.steps:
        raise RejectedUpdate(f"the group's parts trained {sum(p.steps for p in parts)} steps; it claims {sub.steps}")
    if sub.steps <= 0 or sub.tokens % sub.steps:
        raise RejectedUpdate("a group's tokens must be whole tokens per step")
    if group_state({p.rank: p.state_in for p in done}) != sub.state_in:
        raise RejectedUpdate("the group's state_in is not named by its parts' starting states")
    if group_state({p.rank: p.state_out for p in done}) != sub.state_out:
        raise RejectedUpdate("the group's state_out is not named by its parts' end states")


def part_assignments(sub: Submission, assignment: DataAssignment) -> list[DataAssignment]:
    """Each part's sub-shard, exactly as the group's rank 0 cut it (:func:`sub_assignments`)."""
    return sub_assignments(assignment, [p.max_steps for p in sub.group])


def combine_replays(sub: Submission, theta: Params, replays: Sequence[tuple[Params, tuple[float, ...]]]
                    ) -> tuple[Params, tuple[float, ...]]:
    """The group's θ_local and per-step losses from the contributing parts' replays (in part order)."""
    done = contributing(sub)
    if len(replays) != len(done):
        raise RejectedUpdate(f"{len(replays)} replays for {len(done)} contributing parts")
    per_step = sub.tokens // sub.steps
    theta_local = combine(theta, [(local, p.steps * per_step) for (local, _), p in zip(replays, done)])
    return theta_local, mean_losses([losses for _, losses in replays])


def group_tolerance(sub: Submission, theta: Params, replay_delta: Params) -> float:
    """How far a group's Δ may differ from its replay: 0 (exact) unless MPI summed three or more parts."""
    if len(contributing(sub)) <= 2:
        return 0.0
    codec = codec_of(sub.codec)
    rounded = codec.decode(codec.encode(replay_delta))
    codec_err = max((float(np.max(np.abs(rounded[k] - replay_delta[k]))) for k in replay_delta
                     if replay_delta[k].size), default=0.0)
    biggest = max((float(np.max(np.abs(a))) for a in theta.values() if np.size(a)), default=0.0)
    return 2.0 * codec_err + 2.0 * float(np.spacing(np.float32(biggest)))


# --- the group's inner state as one blob ---------------------------------------------------------

_HEAD = struct.Struct(">IQ")  # rank, blob length


def stateful_ranks(sub: Submission) -> tuple[int, ...]:
    """The ranks whose starting state an auditor needs (contributing, not fresh)."""
    return tuple(p.rank for p in contributing(sub) if p.state_in != FRESH_STATE)


def encode_group_state(blobs: Mapping[int, bytes]) -> bytes:
    """Each rank's :func:`~pcp_p2p.diloco.protocol.audit.encode_inner_state` blob, in rank order."""
    return b"".join(_HEAD.pack(r, len(b)) + b for r, b in sorted(blobs.items()))


def decode_group_state(data: bytes, ranks: Sequence[int]) -> dict[int, bytes]:
    """The per-rank blobs back; exactly ``ranks``, in order, or :class:`MalformedMessage`."""
    out: dict[int, bytes] = {}
    view, pos = memoryview(data), 0
    while pos < len(view):
        if pos + _HEAD.size > len(view):
            raise MalformedMessage("a truncated group state blob")
        r, n = _HEAD.unpack_from(view, pos)
        pos += _HEAD.size
        if pos + n > len(view):
            raise MalformedMessage("a group state part runs past its end")
        out[r] = bytes(view[pos : pos + n])
        pos += n
    if list(out) != list(ranks):
        raise MalformedMessage(f"a group state blob for ranks {list(out)[:8]}, the split needs {list(ranks)[:8]}")
    return out


def fresh_parts(sub: Submission) -> bool:
    """Whether no contributing part needs a served state."""
    return not stateful_ranks(sub)


__all__ = ["check_split", "combine_replays", "contributing", "decode_group_state", "encode_group_state",
           "fresh_parts", "group_tolerance", "part_assignments", "stateful_ranks"]

"""Audits by deterministic replay: a sampled round re-executed by a peer, a mismatch made evidence.

Why a replay can be exact at all. A worker's round is a pure function of public
and committed inputs: the artifact (a byte-identical build per target, named by
its CID in the signed announcement), θ_r (by CID), the data assignment (shard,
seed and step cap in the signed announcement; :mod:`~pcp_p2p.diloco.algorithm.data` draws
the same windows on every node), the step count the worker claims, the spec's
learning rate — and the one input that is *not* public: the inner AdamW state
(moments and step) that DiLoCo keeps on the worker from round to round. We
measured the IREE CPU executor to be bit-for-bit deterministic for a fixed
artifact: the same call twice in one process, in two processes, and with 1, 2
or all task workers gives the same bytes (docs/diloco.md, "Audits"). Builds
for two targets do *not* agree (v4 vs generic: up to 1e-5 after 40 steps), so
only a worker of the same target replays, and the comparison is exact.

How the private input becomes checkable. Each submission commits to two
digests (:func:`inner_state_digest`, computed on the executor's side of the
pipe, so no moment crosses it in a normal round): ``state_in``, the state the
round started from (or ``FRESH_STATE``), and ``state_out``, the state it ended
with. A worker may start a round only from fresh moments or from the
``state_out`` of one of its own submissions that a commit took
(:class:`StateChain`, checked by the shepherd; the worker side keeps exactly
that rule, see :mod:`~pcp_p2p.diloco.protocol.worker`). The engine keeps its recent
states on the device as snapshots named by digest (no copy), so when a round
is audited the worker exports its ``state_in`` as a blob
(:func:`encode_inner_state`) and the auditor checks it against the digest the
worker signed before it knew it would be audited.

Who is audited, and why nobody can choose. :func:`should_audit` hashes the
round's identity with a *beacon*, the CID of the θ the round's commit produced.
A worker cannot predict that beacon when it submits (it depends on every other
accepted Δ), so it cannot cheat only in rounds it knows are unaudited; and every
node can recompute the draw, so a shepherd cannot pick victims (an
:class:`AuditRequest` for a submission the draw did not select is refused).
:func:`pick_auditor` draws the auditor the same way among the workers of the
same target.

What a report proves. An :class:`AuditReport` is the auditor's signed statement
of what the replay produced: the CID of the Δ payload (encoded with the
submission's codec: byte-exact when the run is), the ``state_out`` digest and a
digest of the per-step losses. :class:`Evidence` packs the worker's signed
submission, the shepherd's signed request and the auditors' signed reports;
:func:`verify_evidence` lets any node check every signature, that the draw
selected this submission, and that the reports agree with each other and
contradict the worker's signed claims. What it cannot prove by signatures
alone is *which* side lied: an auditor could sign a false replay. Re-execution
settles it — anyone holding θ_r, the state blob and the artifact can replay —
so the shepherd asks a second auditor on a mismatch and bans on two agreeing
reports (``min_reports=2``, the default here); one lying auditor then only
costs a second replay, and its report, contradicted by the second, marks it.

What a cheater can still do (the argument, stated plainly):

- Cheat in a round and hope: a round is audited with probability ``audit_rate``
  (default 0.05), unknowable in advance, so k cheating rounds escape with
  probability (1 − rate)^k (0.95^20 ≈ 0.36, 0.95^60 ≈ 0.05). Audits bound a
  persistent cheater's life; the robust aggregation bounds each round's damage.
- Forge its starting moments: only by signing a false ``state_out`` in an
  earlier *committed* round, which is itself audited at ``rate`` (the replay of
  that round checks ``state_out`` exactly). Moments decay (β1 = 0.9 per step), so
  steering needs a fresh forgery each round, each exposed to its own draw.
  A worker the shepherd has no chain for (first round after a term change,
  unless the chain is carried in the checkpoint) may start from any state once;
  with ``StateChain(strict=True)`` it must start fresh.
- Refuse to serve its state, or go offline when audited: the report says
  ``unavailable``. That is no proof of cheating (machines die), so it is not
  evidence; the shepherd may count it as a strike and refuse the worker's
  non-fresh states until it has been audited successfully.
- Lie about speed to earn weight: the claimed steps are replayed, so an audited
  round costs the auditor the same compute; the claim itself is bounded by the
  assignment's cap (aggregate.py) and must be whole chunks.
- Collude with its auditor: the auditor is drawn by hash among same-target
  workers; with c colluders among n same-target workers an audit meets a
  colluder with probability ≈ c/n, and then a second report is still needed.

Cost (``bench/audit.py``, docs/diloco.md). A normal round pays one digest of
the moments in the executor child and a snapshot (references): 67 ms for the
medium model's 86 MB of moments, 0.1% of a default 60 s round. An audited
round costs one replay of the same steps on the auditor (1.02× the round's
CPU time) and one export of the state blob (2 × |θ| bytes in fp32; 0.8 s for
medium). At ``audit_rate`` 0.05 the total was 5.3–5.5% of compute, nearly
all of it the replays themselves (``audit_rate`` × 1.0): the rate *is* the
budget, and auditability itself is ≤ 0.25%. So the default is 0.04 (≈ 4.3%),
under the 5% goal.

A worker group's round (``Submission.group``, an MPI cluster joining as one
worker) is audited the same way, part by part: :mod:`~pcp_p2p.diloco.protocol.group_replay`
checks its split, :meth:`AuditJob.replay_inputs` lists one replay per rank and
:meth:`AuditJob.finish_replays` recombines them as the group did before judging.

Everything here is sans-IO: messages, pure checks, and :class:`AuditJob`, a
small machine the runtime feeds blobs and offers and asks what to fetch.
"""

from __future__ import annotations

import hashlib
import struct
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from pcp_p2p.core.cid import check_cid, cid_of
from pcp_p2p.core.errors import (
    HashMismatch,
    MalformedMessage,
    NotElected,
    PcpError,
    RejectedUpdate,
    VerificationError,
)
from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.algorithm.params import Params, codec_of, pack_tensors, unpack_tensors
from pcp_p2p.diloco.protocol import group_replay
from pcp_p2p.diloco.protocol.group_split import group_state
from pcp_p2p.diloco.protocol.messages import (
    FRESH_STATE,
    MAX_GROUP_PARTS,
    DataAssignment,
    RoundAnnouncement,
    Submission,
    sign,
    verify,
)
from pcp_p2p.diloco.protocol.worker import pseudo_gradient  # the worker's own formula for Δ
from pcp_p2p.executor.executor_child import state_digest
from pcp_p2p.wire import HARD_MAX_SIZE, Message, decode, encode, wire_message

CHUNK_STEPS = 5
"""AdamW steps per executor call: small enough that a time budget is met within
one chunk's time, large enough that the per-call overhead stays negligible.
A protocol constant, not the engine's choice: a replay runs whole chunks, so the
shepherd checks step counts (and a worker group's split) against it."""

MATCH = "match"
MISMATCH = "mismatch"
UNAVAILABLE = "unavailable"
VERDICTS = (MATCH, MISMATCH, UNAVAILABLE)
DIFFERS = ("delta", "state_out", "losses", "steps")
"""What a replay can contradict: the Δ payload, the end state, the losses, an impossible step count."""

ShepherdCheck = Callable[[int, str], bool]
"""``is_shepherd(term, peer_id)``: whether ``peer_id`` holds the lease of ``term`` (the election's view)."""


# --- who is audited ----------------------------------------------------------------------


def _draw(kind: str, *parts: object) -> int:
    h = hashlib.sha256("|".join(["pcp-audit/1", kind, *map(str, parts)]).encode()).digest()
    return int.from_bytes(h[:8], "big")


def should_audit(run_id: str, term: int, round_: int, attempt: int, worker: str, rate: float,
                 beacon: str = "") -> bool:
    """Whether ``worker``'s submission for (term, round, attempt) is audited, at ``rate``.

    ``beacon`` is the CID of the θ the round's commit produced: unknown to a
    worker when it submits, known to every node afterwards. A pure function of
    public values, so anyone can check the shepherd's choice.
    """
    if rate <= 0:
        return False
    if rate >= 1:
        return True
    return _draw("select", run_id, term, round_, attempt, worker, beacon) < rate * 2**64


def pick_auditor(run_id: str, term: int, round_: int, attempt: int, worker: str,
                 candidates: Iterable[str], beacon: str = "") -> str | None:
    """The auditor of ``worker``'s round among ``candidates`` (same target; never the worker)."""
    pool = sorted(set(candidates) - {worker})
    if not pool:
        return None
    return min(pool, key=lambda c: _draw("auditor", run_id, term, round_, attempt, worker, beacon, c))


# --- the inner state as a digest and a blob ------------------------------------------------


class InnerState(NamedTuple):
    """AdamW moments (name -> float32 array, the model's parameter order) and the step."""

    m: Params
    v: Params
    step: int


def inner_state_digest(state: InnerState) -> str:
    """The digest a submission's ``state_in``/``state_out`` names; the executor computes the same."""
    arrays = [(f"m/{k}", a) for k, a in state.m.items()] + [(f"v/{k}", a) for k, a in state.v.items()]
    return state_digest(state.step, arrays)


def fresh_state(theta: Mapping[str, np.ndarray]) -> InnerState:
    """Zero moments and step 0: what ``FRESH_STATE`` stands for."""
    zeros = {k: np.zeros(np.shape(a), np.float32) for k, a in theta.items()}
    return InnerState(zeros, {k: z.copy() for k, z in zeros.items()}, 0)


_STEP = struct.Struct(">Q")


def encode_inner_state(state: InnerState) -> bytes:
    """The state blob an audited worker serves: the step (u64 BE), then an fp32 tensor bundle."""
    bundle = {f"m/{k}": a for k, a in state.m.items()} | {f"v/{k}": a for k, a in state.v.items()}
    return _STEP.pack(state.step) + pack_tensors(bundle, "fp32")


def decode_inner_state(data: bytes, like: Mapping[str, np.ndarray]) -> InnerState:
    """A state blob back, checked against the names and shapes of ``like`` (θ); ProtocolErrors only."""
    if len(data) < _STEP.size:
        raise MalformedMessage("inner state blob too short")
    (step,) = _STEP.unpack_from(data)
    if step >= 2**31:  # the train program's step is int32
        raise MalformedMessage(f"inner state step {step} out of range")
    limit = 2 * sum(int(np.asarray(a).size) for a in like.values()) * 4 + (1 << 20)
    tensors = unpack_tensors(data[_STEP.size :], max_bytes=limit)
    names = [f"m/{k}" for k in like] + [f"v/{k}" for k in like]
    if list(tensors) != names:
        raise MalformedMessage("inner state blob names other tensors than the model's")
    for k, a in like.items():
        for g in ("m", "v"):
            if tensors[f"{g}/{k}"].shape != np.shape(a):
                raise MalformedMessage(f"inner state {g}/{k} has shape {tensors[f'{g}/{k}'].shape}")
    return InnerState({k: tensors[f"m/{k}"] for k in like}, {k: tensors[f"v/{k}"] for k in like}, int(step))


# --- continuity (the shepherd's side) -------------------------------------------------------


class StateChain:
    """Which inner states each worker may start from: fresh, or an end state of its committed rounds.

    The shepherd calls :meth:`check` on every submission (before accepting it)
    and :meth:`committed` with the accepted submissions of each commit. The last
    ``keep`` committed end states per worker are allowed, not only the last one:
    a commit can reach a worker after the next announcement (it then trains
    from its previous state), and every committed end state was equally exposed
    to its own round's audit draw. ``strict``: a worker with no recorded chain
    must start fresh (right when the chain is known from the run's start, or
    carried over a term change with :meth:`to_dict`/:meth:`from_dict`).

    A worker group (``Submission.group``) keeps one inner state per rank, and a
    rank that sat a round out or left the group changes which ranks name the
    group's state; so for a group the rule holds per part: each contributing
    rank starts fresh or from the end state of a part of one of the group's
    last ``keep`` committed rounds (each exposed to that round's audit draw).
    """

    def __init__(self, keep: int = 4, strict: bool = False) -> None:
        self.keep = keep
        self.strict = strict
        self._outs: dict[str, deque[str]] = {}
        self._rank_outs: dict[str, deque[str]] = {}  # worker groups: end states of their parts

    def check(self, sub: Submission) -> None:
        """:class:`RejectedUpdate` unless ``sub`` commits to states and starts from an allowed one."""
        if not sub.state_in or not sub.state_out:
            raise RejectedUpdate("the submission commits to no inner state, so it cannot be audited")
        if sub.state_in == FRESH_STATE:
            return
        if sub.group:
            self._check_parts(sub)
            return
        known = self._outs.get(sub.worker)
        if known is None:
            if self.strict:
                raise RejectedUpdate("a worker without committed rounds must start from fresh moments")
            return
        if sub.state_in not in known:
            raise RejectedUpdate(f"inner state {sub.state_in:.16} is not the end of one of its committed rounds")

    def _check_parts(self, sub: Submission) -> None:
        known = self._rank_outs.get(sub.worker)
        for part in group_replay.contributing(sub):
            if part.state_in == FRESH_STATE:
                continue
            if known is None:
                if self.strict:
                    raise RejectedUpdate("a worker group without committed rounds must start from fresh moments")
                continue
            if part.state_in not in known:
                raise RejectedUpdate(f"rank {part.rank}'s inner state {part.state_in:.16} is not the end of a part "
                                     "of one of the group's committed rounds")

    def committed(self, subs: Iterable[Submission]) -> None:
        for sub in subs:
            if sub.state_out:
                outs = self._outs.setdefault(sub.worker, deque(maxlen=self.keep))
                if sub.state_out not in outs:
                    outs.append(sub.state_out)
            ends = [p.state_out for p in group_replay.contributing(sub)]
            if ends:
                cap = self.keep * len(sub.group)
                old = self._rank_outs.get(sub.worker, ())
                ranks = deque(old, maxlen=max(cap, len(old)))
                ranks.extend(e for e in ends if e not in ranks)
                self._rank_outs[sub.worker] = ranks

    def to_dict(self) -> dict[str, list[str]]:
        """Per worker its committed end states; a group's part end states under ``"<worker>/ranks"``."""
        out = {w: list(outs) for w, outs in sorted(self._outs.items())}
        out.update({f"{w}/ranks": list(outs) for w, outs in sorted(self._rank_outs.items())})
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Sequence[str]], keep: int = 4, strict: bool = True) -> StateChain:
        chain = cls(keep, strict)
        for w, outs in d.items():
            if w.endswith("/ranks"):
                ends = list(outs)[-keep * MAX_GROUP_PARTS :]
                chain._rank_outs[w[: -len("/ranks")]] = deque(ends, maxlen=max(len(ends), keep))
            else:
                chain._outs[w] = deque(list(outs)[-keep:], maxlen=keep)
        return chain


# --- messages -----------------------------------------------------------------------------


@wire_message("diloco.audit_request", max_size=64 * 1024)
class AuditRequest(Message):
    """The shepherd asks ``auditor`` to replay ``worker``'s round, and ``worker`` to serve its state.

    It restates what the replay needs from the (same shepherd's) signed
    announcement, so the auditor needs nothing else signed: the assignment, the
    artifact of the worker's target and the dataset blob. The submission itself
    travels as a blob (``submission_cid``, the encoded signed submission: a Δ
    inline in it can be megabytes).
    """

    run_id: str
    term: int
    round: int
    attempt: int
    worker: str
    submission_cid: str
    beacon: str  # the θ CID the round's commit produced (see should_audit)
    assignment: DataAssignment
    target: str
    artifact_cid: str
    dataset_cid: str
    auditor: str
    shepherd: str
    # The term whose lease ``shepherd`` holds as it asks: ``term`` itself, or a later one when
    # its term took the attempt over from a shepherd that died (``Shepherd.adopt``). The
    # auditors check the asker's authority against this term, the draw against ``term``.
    shepherd_term: int
    signature: bytes = b""


@wire_message("diloco.state_offer", max_size=4 * 1024)
class StateOffer(Message):
    """The audited worker names the blob holding the inner state its submission started from."""

    run_id: str
    term: int
    round: int
    attempt: int
    worker: str
    state_digest: str
    blob_cid: str
    signature: bytes = b""


@wire_message("diloco.audit_report", max_size=16 * 1024)
class AuditReport(Message):
    """The auditor's signed account of one replay (see the module essay for what it proves)."""

    run_id: str
    term: int
    round: int
    attempt: int
    worker: str
    request_digest: str  # sha256 hex of the encoded signed AuditRequest
    submission_cid: str
    auditor: str
    verdict: str  # MATCH | MISMATCH | UNAVAILABLE
    differs: tuple[str, ...]  # subset of DIFFERS (MISMATCH only)
    delta_cid: str  # the replay's Δ payload, encoded with the submission's codec ("" if unavailable)
    state_out: str
    losses_digest: str
    max_abs_diff: float  # between the decoded Δs (information; the comparison is exact)
    reason: str = ""  # why UNAVAILABLE
    signature: bytes = b""


@wire_message("diloco.audit_evidence", max_size=HARD_MAX_SIZE)
class Evidence(Message):
    """Proof that a worker signed a round its auditors' replays contradict (for the ban ledger).

    ``requests[i]`` is the shepherd's request ``reports[i]`` answers (a second
    opinion is a second request, to another auditor, for the same submission).
    Every part is signed by its own author; the whole needs no signature.
    """

    submission: bytes  # the worker's encoded signed Submission
    requests: tuple[AuditRequest, ...]
    reports: tuple[AuditReport, ...]
    differs: tuple[str, ...]

    @property
    def run_id(self) -> str:
        """The run it concerns, as its (signed) requests say: routes it to the run's runtime."""
        return self.requests[0].run_id if self.requests else ""


AUDIT_MESSAGES: tuple[type[Message], ...] = (AuditRequest, StateOffer, AuditReport, Evidence)
"""What travels on ``/pcp/msg`` for audits (evidence: the shepherd hands a ban to every member)."""


def digest_of(msg: Message) -> str:
    return hashlib.sha256(encode(msg)).hexdigest()


def losses_digest(losses: Sequence[float]) -> str:
    """Digest of the per-step losses as float32 (what the executor produced)."""
    return hashlib.sha256(np.asarray(losses, dtype="<f4").tobytes()).hexdigest()


def delta_cid_of(sub: Submission) -> str:
    """The CID of the Δ payload a submission names (inline or by blob)."""
    if sub.delta_inline is not None:
        return cid_of(sub.delta_inline)
    return sub.delta_cid or ""


# --- the shepherd's side --------------------------------------------------------------------


class PlannedAudit(NamedTuple):
    request: AuditRequest
    submission_bytes: bytes  # to store as blob ``request.submission_cid``


def plan_audits(
    *,
    run_id: str,
    rate: float,
    identity: Identity,
    announcement: RoundAnnouncement,
    accepted: Mapping[str, Submission],
    beacon: str,
    targets: Mapping[str, str],
    shepherd_term: int,
) -> list[PlannedAudit]:
    """The audits a commit draws: for each accepted submission the draw selects, a signed request.

    ``targets``: worker -> target for the roster (from their Joins); a worker
    with no other worker of its target cannot be audited this round.
    ``shepherd_term``: the term this shepherd holds (later than the submissions'
    own when it took their attempt over from a dead shepherd).
    """
    out: list[PlannedAudit] = []
    ann = announcement
    for worker, sub in sorted(accepted.items()):
        if not should_audit(run_id, sub.term, sub.round, sub.attempt, worker, rate, beacon):
            continue
        target = targets.get(worker)
        assignment = ann.assignment_for(worker)
        if target is None or assignment is None:
            continue
        peers = [w for w, t in targets.items() if t == target]
        auditor = pick_auditor(run_id, sub.term, sub.round, sub.attempt, worker, peers, beacon)
        if auditor is None:
            continue
        sub_bytes = encode(sub)
        req = sign(
            AuditRequest(
                run_id=run_id, term=sub.term, round=sub.round, attempt=sub.attempt, worker=worker,
                submission_cid=cid_of(sub_bytes), beacon=beacon, assignment=assignment, target=target,
                artifact_cid=ann.artifacts.get(target, ""), dataset_cid=ann.dataset_cid,
                auditor=auditor, shepherd=identity.peer_id, shepherd_term=shepherd_term,
            ),
            identity,
        )
        out.append(PlannedAudit(req, sub_bytes))
    return out


# --- the auditor's and the audited worker's side ---------------------------------------------


def check_request(req: AuditRequest, *, run_id: str, rate: float, is_shepherd: ShepherdCheck) -> None:
    """Refuse a request not signed by the shepherd of the term it names, for another run, or not drawn.

    The term that must be the asker's is ``shepherd_term``: the submission's own, or a
    later one whose shepherd took the attempt over (a failover; never an earlier one)."""
    if req.run_id != run_id:
        raise VerificationError(f"audit request for another run {req.run_id:.20}")
    if req.shepherd_term < req.term:
        raise VerificationError(f"an audit asked in term {req.shepherd_term} for a submission of term {req.term}")
    if not is_shepherd(req.shepherd_term, req.shepherd):
        raise NotElected(f"{req.shepherd:.16}… is not the shepherd of term {req.shepherd_term}")
    verify(req, req.shepherd)
    if req.auditor == req.worker:
        raise RejectedUpdate("a worker cannot audit itself")
    if not should_audit(req.run_id, req.term, req.round, req.attempt, req.worker, rate, req.beacon):
        raise RejectedUpdate("the audit draw does not select this submission")


def check_submission(req: AuditRequest, data: bytes) -> Submission:
    """The submission blob a request names, decoded and checked (hash, worker's signature, identity)."""
    check_cid(req.submission_cid, data)
    sub = decode(data, Submission)
    verify(sub, sub.worker)
    if (sub.run_id, sub.term, sub.round, sub.attempt, sub.worker) != (
        req.run_id, req.term, req.round, req.attempt, req.worker
    ):
        raise VerificationError("the submission is not the one the audit request names")
    return sub


def state_to_export(req: AuditRequest, sub: Submission, me: str) -> str | None:
    """For the audited worker: the digest of the state to serve (None: fresh, nothing to serve)."""
    if req.worker != me or sub.worker != me:
        raise VerificationError("the audit request names another worker")
    return None if sub.state_in == FRESH_STATE else sub.state_in


def make_offer(req: AuditRequest, digest: str, blob: bytes, identity: Identity) -> StateOffer:
    return sign(
        StateOffer(req.run_id, req.term, req.round, req.attempt, identity.peer_id, digest, cid_of(blob)), identity
    )


class ReplayInput(NamedTuple):
    """Everything :meth:`~pcp_p2p.diloco.run.engine.InnerEngine.replay` takes."""

    theta: Params
    state: InnerState | None  # None: fresh
    assignment: DataAssignment
    steps: int


class ReplayResult(Protocol):
    """What one replay hands back (:class:`~pcp_p2p.diloco.run.engine.Replay`, a frozen dataclass: read-only)."""

    @property
    def theta(self) -> Params: ...
    @property
    def state_out(self) -> str: ...
    @property
    def losses(self) -> tuple[float, ...]: ...


def impossible_claim(sub: Submission, assignment: DataAssignment, chunk_steps: int) -> bool:
    """Whether ``sub`` claims what no honest worker (or worker group) can: checkable without a replay."""
    s, cap = sub.steps, (assignment.max_steps // chunk_steps) * chunk_steps
    if s <= 0 or s % chunk_steps != 0 or s > cap:
        return True
    try:
        group_replay.check_split(sub, assignment, chunk_steps)
    except RejectedUpdate:
        return True
    return False


class AuditJob:
    """The auditor's side of one audit, sans-IO: gather the inputs, replay, judge, report.

    Build it from a request :func:`check_request` accepted. :meth:`wanted` lists
    CIDs to fetch (submission, θ, Δ payload, state blob); feed each with
    :meth:`on_blob` and the worker's :class:`StateOffer` with :meth:`on_offer`.
    Once :meth:`ready`, run the replay with :meth:`replay_input` and hand the
    result to :meth:`finish`; :meth:`give_up` answers UNAVAILABLE (deadline,
    fetch failed).
    """

    def __init__(self, req: AuditRequest, identity: Identity, *, chunk_steps: int) -> None:
        self.req = req
        self.identity = identity
        self.chunk_steps = chunk_steps
        self.sub: Submission | None = None
        self.theta: Params | None = None
        self.payload: bytes | None = None
        self.state: InnerState | None = None
        self.states: dict[int, InnerState] = {}  # a worker group's ranks' starting states
        self.state_ok = False
        self.offer: StateOffer | None = None

    def wanted(self) -> list[str]:
        cids: list[str] = []
        if self.sub is None:
            return [self.req.submission_cid]
        if self.theta is None:
            cids.append(self.sub.base_theta_cid)
        if self.payload is None and self.sub.delta_cid:
            cids.append(self.sub.delta_cid)
        if not self.state_ok and self.offer is not None:
            cids.append(self.offer.blob_cid)
        return cids

    def on_offer(self, offer: StateOffer) -> None:
        req = self.req
        if (offer.run_id, offer.term, offer.round, offer.attempt, offer.worker) != (
            req.run_id, req.term, req.round, req.attempt, req.worker
        ):
            raise VerificationError("a state offer for another audit")
        verify(offer, req.worker)
        if self.sub is not None and offer.state_digest != self.sub.state_in:
            raise VerificationError("the offered state is not the one the submission started from")
        self.offer = offer

    def on_blob(self, cid: str, data: bytes) -> None:
        """A fetched blob; raises a PcpError for one that does not check out (the audit goes on)."""
        check_cid(cid, data)
        if cid == self.req.submission_cid and self.sub is None:
            self.sub = check_submission(self.req, data)
            if self.sub.state_in == FRESH_STATE or (self.sub.group and group_replay.fresh_parts(self.sub)):
                self.state_ok = True
            if self.sub.delta_inline is not None:
                self.payload = self.sub.delta_inline
            if self.offer is not None and self.offer.state_digest != self.sub.state_in:
                self.offer = None
            return
        sub = self.sub
        if sub is None:
            return
        if cid == sub.base_theta_cid and self.theta is None:
            self.theta = unpack_tensors(data)
        elif cid == sub.delta_cid and self.payload is None:
            self.payload = data
        if self.offer is not None and cid == self.offer.blob_cid and not self.state_ok and self.theta is not None:
            if sub.group:
                self._on_group_state(sub, data)
                return
            state = decode_inner_state(data, self.theta)
            if inner_state_digest(state) != sub.state_in:
                raise HashMismatch("the served inner state does not hash to the submission's state_in")
            self.state, self.state_ok = state, True

    def _on_group_state(self, sub: Submission, data: bytes) -> None:
        """A group's state bundle: every stateful rank's blob, each hashing to its part's ``state_in``."""
        assert self.theta is not None
        blobs = group_replay.decode_group_state(data, group_replay.stateful_ranks(sub))
        states: dict[int, InnerState] = {}
        for part in group_replay.contributing(sub):
            if part.rank in blobs:
                state = decode_inner_state(blobs[part.rank], self.theta)
                if inner_state_digest(state) != part.state_in:
                    raise HashMismatch(f"rank {part.rank}'s served state does not hash to its part's state_in")
                states[part.rank] = state
        self.states, self.state_ok = states, True

    def ready(self) -> bool:
        return self.sub is not None and self.theta is not None and self.payload is not None and self.state_ok

    def impossible_steps(self) -> bool:
        """A claim no honest executor makes: not whole chunks, above the assignment's cap, or a bad group split."""
        assert self.sub is not None
        return impossible_claim(self.sub, self.req.assignment, self.chunk_steps)

    def replay_input(self) -> ReplayInput:
        assert self.ready() and self.sub is not None and self.theta is not None and not self.sub.group
        return ReplayInput(self.theta, self.state, self.req.assignment, self.sub.steps)

    def replay_inputs(self) -> list[ReplayInput]:
        """Every replay the round needs: one, or one per contributing part of a worker group's split."""
        assert self.ready() and self.sub is not None and self.theta is not None
        sub = self.sub
        if not sub.group:
            return [self.replay_input()]
        pieces = group_replay.part_assignments(sub, self.req.assignment)
        return [ReplayInput(self.theta, self.states.get(p.rank), a, p.steps)
                for p, a in zip(sub.group, pieces) if p.steps > 0]

    def finish_replays(self, replays: Sequence[ReplayResult]) -> AuditReport:
        """Judge the results of :meth:`replay_inputs` (in its order): a group's are recombined first."""
        assert self.sub is not None and self.theta is not None and self.payload is not None
        sub = self.sub
        if not sub.group:
            (rep,) = replays
            return self.finish(rep.theta, rep.state_out, rep.losses)
        theta_local, losses = group_replay.combine_replays(sub, self.theta, [(r.theta, r.losses) for r in replays])
        state_out = group_state({p.rank: r.state_out for p, r in zip(group_replay.contributing(sub), replays)})
        tolerance = group_replay.group_tolerance(sub, self.theta, pseudo_gradient(self.theta, theta_local))
        return self.finish(theta_local, state_out, losses, tolerance)

    def finish(self, theta_local: Params, state_out: str, losses: Sequence[float],
               tolerance: float = 0.0) -> AuditReport:
        """Judge the replay against the submission; the signed report."""
        assert self.sub is not None and self.theta is not None and self.payload is not None
        return judge(self.req, self.sub, self.theta, self.payload, theta_local, state_out, losses,
                     self.identity, tolerance)

    def finish_impossible(self) -> AuditReport:
        """The report for a claim :meth:`impossible_steps` refuses (no replay needed)."""
        assert self.sub is not None
        return self._report(MISMATCH, ("steps",), "", "", "", 0.0)

    def give_up(self, reason: str) -> AuditReport:
        return self._report(UNAVAILABLE, (), "", "", "", 0.0, reason)

    def _report(self, verdict: str, differs: tuple[str, ...], delta_cid: str, state_out: str,
                losses_dig: str, max_abs: float, reason: str = "") -> AuditReport:
        return _report(self.req, self.identity, verdict, differs, delta_cid, state_out, losses_dig, max_abs, reason)


def _report(req: AuditRequest, identity: Identity, verdict: str, differs: tuple[str, ...], delta_cid: str,
            state_out: str, losses_dig: str, max_abs: float, reason: str = "") -> AuditReport:
    return sign(
        AuditReport(
            run_id=req.run_id, term=req.term, round=req.round, attempt=req.attempt, worker=req.worker,
            request_digest=digest_of(req), submission_cid=req.submission_cid, auditor=identity.peer_id,
            verdict=verdict, differs=differs, delta_cid=delta_cid, state_out=state_out,
            losses_digest=losses_dig, max_abs_diff=float(max_abs), reason=reason[:200],
        ),
        identity,
    )


def judge(req: AuditRequest, sub: Submission, theta: Params, payload: bytes, theta_local: Params,
          state_out: str, losses: Sequence[float], identity: Identity, tolerance: float = 0.0) -> AuditReport:
    """Compare a replay with what the worker signed; the signed :class:`AuditReport`.

    The replay's Δ is computed and encoded exactly as the worker does
    (:func:`~pcp_p2p.diloco.protocol.worker.pseudo_gradient`, the submission's codec), so
    an honest round gives the same payload bytes. ``tolerance`` > 0 accepts a
    Δ whose decoded values differ by at most that much (for executors measured
    not to be bitwise deterministic; the default, 0, is what we measured).
    """
    codec = codec_of(sub.codec)
    replay_payload = codec.encode(pseudo_gradient(theta, theta_local))
    replay_cid = cid_of(replay_payload)
    max_abs = _max_abs_diff(codec.decode(payload), codec.decode(replay_payload))
    differs = []
    if replay_cid != delta_cid_of(sub) and not max_abs <= tolerance:
        differs.append("delta")
    if state_out != sub.state_out:
        differs.append("state_out")
    ld = losses_digest(losses)
    if ld != losses_digest(sub.losses):
        differs.append("losses")
    verdict = MISMATCH if differs else MATCH
    return _report(req, identity, verdict, tuple(differs), replay_cid, state_out, ld, max_abs)


def _max_abs_diff(a: Params, b: Params) -> float:
    if list(a) != list(b) or any(a[k].shape != b[k].shape for k in a):
        return float("inf")
    return max((float(np.max(np.abs(a[k] - b[k]))) for k in a if a[k].size), default=0.0)


# --- evidence --------------------------------------------------------------------------------


def claimed_differs(sub: Submission, report: AuditReport) -> tuple[str, ...]:
    """What in ``sub`` a MISMATCH report contradicts, recomputed from the two signed messages."""
    if report.differs == ("steps",):
        return ("steps",)  # the claim itself was impossible (checked against the request by the verifier)
    differs = []
    if "delta" in report.differs and report.delta_cid != delta_cid_of(sub):
        differs.append("delta")
    if report.state_out != sub.state_out:
        differs.append("state_out")
    if report.losses_digest != losses_digest(sub.losses):
        differs.append("losses")
    return tuple(differs)


def make_evidence(submission_bytes: bytes, requests: Sequence[AuditRequest],
                  reports: Sequence[AuditReport]) -> Evidence:
    """Evidence from a submission blob, the requests and their MISMATCH reports (in the same order)."""
    sub = decode(submission_bytes, Submission)
    return Evidence(submission_bytes, tuple(requests), tuple(reports), claimed_differs(sub, reports[0]))


def verify_evidence(ev: Evidence, *, rate: float | None = None, is_shepherd: ShepherdCheck | None = None,
                    min_reports: int = 2, chunk_steps: int | None = None) -> str:
    """Check evidence from anyone; the offender's peer id, or a VerificationError.

    Checks: the worker signed the submission and every request names exactly
    it; one shepherd signed every request (and held its ``shepherd_term``, the
    submission's term or a later one, if ``is_shepherd`` is given); with ``rate``, the draw selected it; at least
    ``min_reports`` MISMATCH reports by distinct auditors other than the worker,
    each signed and answering its own request, all agreeing on what the replay
    produced; and what they contradict is really what the worker signed.
    """
    if not ev.requests or len(ev.requests) != len(ev.reports):
        raise VerificationError("evidence: one request per report")
    first = ev.requests[0]
    for req in ev.requests:
        if (req.run_id, req.term, req.round, req.attempt, req.worker, req.submission_cid, req.beacon,
                req.shepherd, req.shepherd_term) != (first.run_id, first.term, first.round, first.attempt,
                                                     first.worker, first.submission_cid, first.beacon,
                                                     first.shepherd, first.shepherd_term):
            raise VerificationError("evidence: the requests are about different submissions")
        try:
            check_submission(req, ev.submission)
        except PcpError as exc:
            raise VerificationError(f"evidence: the submission does not check out: {exc}") from exc
        verify(req, req.shepherd)
    sub = decode(ev.submission, Submission)
    if first.shepherd_term < first.term:
        raise VerificationError("evidence: the audit was asked in a term before the submission's")
    if is_shepherd is not None and not is_shepherd(first.shepherd_term, first.shepherd):
        raise NotElected(f"evidence: {first.shepherd:.16}… was not the shepherd of term {first.shepherd_term}")
    if rate is not None and not should_audit(first.run_id, first.term, first.round, first.attempt, first.worker,
                                             rate, first.beacon):
        raise VerificationError("evidence: the audit draw did not select this submission")
    auditors = {r.auditor for r in ev.reports}
    if len(ev.reports) < min_reports or len(auditors) != len(ev.reports):
        raise VerificationError(f"evidence: {len(auditors)} distinct auditors, {min_reports} needed")
    if sub.worker in auditors:
        raise VerificationError("evidence: the worker cannot audit itself")
    r0 = ev.reports[0]
    for req, r in zip(ev.requests, ev.reports):
        verify(r, r.auditor)
        if (r.verdict != MISMATCH or r.auditor != req.auditor or r.request_digest != digest_of(req)
                or r.submission_cid != req.submission_cid):
            raise VerificationError("evidence: a report is not a mismatch answering its request")
        if (r.delta_cid, r.state_out, r.losses_digest, r.differs) != (
            r0.delta_cid, r0.state_out, r0.losses_digest, r0.differs
        ):
            raise VerificationError("evidence: the replays disagree with each other")
    differs = claimed_differs(sub, r0)
    if not differs or differs != ev.differs:
        raise VerificationError("evidence: the reports do not contradict what the worker signed")
    if differs == ("steps",):
        if chunk_steps is None:
            raise VerificationError("evidence: an impossible-step claim needs chunk_steps to check")
        if not impossible_claim(sub, first.assignment, chunk_steps):
            raise VerificationError("evidence: the claimed step count was possible")
    return sub.worker


def encode_evidence(ev: Evidence) -> bytes:
    """The bytes the ban ledger stores."""
    return encode(ev)


def decode_evidence(data: bytes) -> Evidence:
    """Evidence bytes back (ProtocolErrors only); then :func:`verify_evidence`."""
    return decode(data, Evidence)


__all__ = [
    "DIFFERS",
    "MATCH",
    "MISMATCH",
    "UNAVAILABLE",
    "AuditJob",
    "AuditReport",
    "AuditRequest",
    "Evidence",
    "InnerState",
    "PlannedAudit",
    "ReplayInput",
    "ReplayResult",
    "StateChain",
    "StateOffer",
    "check_request",
    "check_submission",
    "claimed_differs",
    "decode_evidence",
    "decode_inner_state",
    "delta_cid_of",
    "encode_evidence",
    "encode_inner_state",
    "fresh_state",
    "impossible_claim",
    "inner_state_digest",
    "judge",
    "losses_digest",
    "make_evidence",
    "make_offer",
    "pick_auditor",
    "plan_audits",
    "should_audit",
    "state_to_export",
    "verify_evidence",
]

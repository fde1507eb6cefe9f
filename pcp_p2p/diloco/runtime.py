"""One run on one node, over the real network: the trio glue around the round machines.

The :class:`~pcp_p2p.diloco.worker.Worker` (every trusting node) and the
:class:`~pcp_p2p.diloco.shepherd.Shepherd` (the node that ranks first for the
run) are sans-IO; this module carries out their effects:

=============  =====================================================================
effect         carried out by
=============  =====================================================================
Send           ``/pcp/msg/1.0.0`` (direct, acknowledged); to ourselves: the inbox
StoreBlob      the node's blob store, announced as a DHT provider record
FetchBlob      the blob exchange (any provider, hash-checked); for an artifact:
               manifest → signature check → vmfb → IREE executor started
RunInner       :class:`~pcp_p2p.diloco.engine.InnerEngine` in a thread
LookupCommit   the DHT record ``/pcp/commit/<run id>``
Committed      stored as that DHT record (signed by the shepherd)
=============  =====================================================================

One task owns both machines and feeds them one input at a time from an inbox
(messages, fetched blobs, finished inner runs, lookups); slow effects run in
tasks of their own and post their results to the inbox, so a machine never
sees two inputs at once. Time is the wall clock (``time.time``): deadlines in
round announcements are compared across nodes.

Who is shepherd: the :class:`~pcp_p2p.diloco.election.Election` decides (terms
ranked by ``sha256(run id, term, peer id)`` among live members that took up the
run and can compile, signed leases, rotation every ``election.rotate_every``
rounds, failover when a lease lapses, fencing by term). This runtime feeds it
the membership view, leases (direct messages and the DHT) and commits, and
carries out its effects: publish a lease, become the shepherd of a term (from
the checkpoint the lease names), follow another node's term, step down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from pcp_p2p.dht.records import MAX_TTL_S, sign_record
from pcp_p2p.diloco.admission import ALLOWLIST_KIND, Admission, AllowlistUpdate, owner_record_name
from pcp_p2p.diloco.audit import (
    AuditJob,
    AuditReport,
    AuditRequest,
    Evidence,
    StateOffer,
    check_request,
    check_submission,
    decode_evidence,
    encode_evidence,
    make_offer,
    state_to_export,
    verify_evidence,
)
from pcp_p2p.diloco.audit_desk import AuditDesk
from pcp_p2p.diloco.checkpoint import decode_checkpoint
from pcp_p2p.diloco.data import CharDataset
from pcp_p2p.diloco.effects import (
    Banned,
    CancelInner,
    Committed,
    Discarded,
    Effect,
    FetchBlob,
    Finished,
    LookupCommit,
    Rejected,
    RunInner,
    Send,
    StoreBlob,
)
from pcp_p2p.diloco.commits import commit_seq
from pcp_p2p.diloco.election import (
    LEASE_KIND,
    BecomeShepherd,
    Candidate,
    CommitChecked,
    Election,
    ElectionConfig,
    FollowShepherd,
    Lease,
    LookupLease,
    PublishLease,
    StepDown,
)
from pcp_p2p.diloco.lifecycle import (
    COMPILING,
    ENDED,
    SETUP_FAILED,
    STOP_FILE,
    STOP_KIND,
    STOP_LOOKUP_EVERY_S,
    STOPPED,
    PhaseInputs,
    StopLatch,
    StopOrder,
    run_phase,
)
from pcp_p2p.diloco.departures import Departures, make_leave
from pcp_p2p.diloco.messages import CommitRecord, Join, Leave, RoundAnnouncement, Submission, verify
from pcp_p2p.diloco.outer import OuterState
from pcp_p2p.diloco.pins import RunPins
from pcp_p2p.diloco.reputation import ReputationLedger
from pcp_p2p.diloco.runs import KnownRun
from pcp_p2p.diloco.shepherd import Phase as ShepherdPhase
from pcp_p2p.diloco.shepherd import Shepherd
from pcp_p2p.diloco.spec import RunSpec
from pcp_p2p.diloco.tensors import unpack_tensors
from pcp_p2p.diloco.worker import Worker
from pcp_p2p.errors import (
    BlobNotFound,
    HeldBack,
    LocalError,
    NotElected,
    OverBudget,
    OversizedMessage,
    PcpError,
    PeerError,
    StaleMessage,
    VerificationError,
)
from pcp_p2p.wire import Message, decode, encode

if TYPE_CHECKING:
    from pcp_p2p.blob.service import BlobService
    from pcp_p2p.diloco.engine import InnerEngine
    from pcp_p2p.node.node import Node

log = logging.getLogger("pcp.run")

FETCH_ATTEMPTS = 6
COMMIT_PUT_ATTEMPTS = 4  # DHT puts of a commit record (2, 4, 8 s apart)
FINISH_GRACE_S = 30.0
STOP_GRACE_S = 5.0  # a stopped run's in-flight work (sends, an inner run told to cancel) gets this long
KEEP_CHECKPOINTS = 2
PINS_FILE = "pins.json"
LEASE_FILE = "lease.bin"  # the latest lease this node accepted: its anchor for catching up after a restart
REPLICAS = 2  # workers asked to hold a checkpoint before its commit goes out (one ack suffices)
REPLICATE_TIMEOUT_S = 5.0  # then the commit goes out regardless; below the messenger's ack timeout
SETTLE_S = 3.0  # the longest the election waits for the DHT's lease and commit before claiming
HISTORY = 1000
ALLOWLIST_EVERY_S = 30.0  # how often the owner's allowlist amendments are looked up
CATCH_UP_EVERY_S = 10.0  # how often a node without a worker looks up the run's latest commit
AUDIT_GRACE_S = 30.0  # an audit must be reported within two round deadlines plus this
MAX_AUDIT_JOBS = 4  # replays (as auditor) and state exports (as audited worker) at once
MAX_TERM_S = 24 * 3600.0  # the longest a term may last when the run never rotates
MAX_VOCAB = 1 << 16  # bounds a blob's size before this node holds the dataset


def max_claim_age(spec: RunSpec) -> float:
    """How long a term may honestly last, so how far back a lease's claim may be dated.

    ``rotate_every`` rounds, each at most a round deadline plus the join grace,
    three times over for attempts retried without quorum, plus the claim's own
    wait; a holder steps down before its claim gets this old (``Election.tick``).
    """
    e, r = spec.election, spec.round
    if e.rotate_every == 0:
        return MAX_TERM_S
    return e.rotate_every * (r.deadline_s + 10.0) * 3 + e.claim_timeout_s + 2 * e.lease_s


@dataclass
class RunStats:
    history: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=HISTORY))
    rejected: dict[str, int] = field(default_factory=dict)
    held: int = 0  # leases and commits held back until their authority can be checked
    audits: dict[str, int] = field(default_factory=dict)  # replays this node ran, by verdict
    first_contribution_s: float | None = None
    contributed_rounds: list[int] = field(default_factory=list)  # rounds whose commit counted this node
    bytes_submitted: int = 0  # encoded submissions sent (what this worker puts on the wire per round)
    first_train_at: float | None = None  # wall clock: the first inner run started
    last_commit_at: float | None = None  # wall clock: the latest commit arrived


class RunRuntime:
    """Drives one run on one node until the run finishes or the node stops."""

    def __init__(self, node: Node, blobs: BlobService, run: KnownRun, work_dir: Path) -> None:
        self.node = node
        self.blobs = blobs
        self.run = run
        self.run_id = run.run_id
        self.spec = run.spec
        self.work_dir = work_dir
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.worker: Worker | None = None
        self.shepherd: Shepherd | None = None
        self.shepherd_peer: str | None = None
        self.engine: InnerEngine | None = None
        self.dataset: CharDataset | None = None
        self.stats = RunStats()
        self.phase = "starting"
        self.started_at = time.time()
        self._send, self._inbox = trio.open_memory_channel[tuple](1000)
        self._cancel: dict[tuple[int, int], threading.Event] = {}
        self._artifact_ready: dict[str, trio.Event] = {}
        self._nursery: trio.Nursery | None = None
        self._seen_commit: str | None = None
        self._early: list[tuple] = []
        self._storing: dict[str, trio.Event] = {}
        self.artifacts: list[dict[str, Any]] = []  # what this node compiled or loaded, for status
        self.election: Election | None = None
        self._becoming = False  # a BecomeShepherd is being set up (compiling)
        self._become_scope: trio.CancelScope | None = None  # cancels that set-up (the election went elsewhere)
        self._becoming_term: int | None = None
        self._evaluate: Any = None
        self._target: str | None = None
        self._tokens_per_s = 1.0
        self._lookups_pending = 0
        self._prewarmed = False
        self._standby: list[Any] = []  # artifacts built and signed ahead of a takeover
        self._replicas: list[str] = []  # checkpoints this node holds for a possible takeover
        self.pins = RunPins.load(work_dir / PINS_FILE)  # what this run keeps pinned, and until when
        self.ledger = ReputationLedger.open(work_dir, self.run_id)  # strikes and bans, kept on disk
        self.admission = Admission.for_run(run.signed, bans=self.ledger)  # who may contribute and lead
        self.departures = Departures(self.run_id)  # members that announced they left
        self._saved_term: int | None = None  # the term of the lease kept in LEASE_FILE
        self._held: list[list[Effect]] | None = None  # shepherd effects waiting on a replicating commit
        self._audit_jobs: dict[tuple[int, int, int, str], tuple[AuditJob, trio.Event]] = {}  # as auditor
        self._exports = 0  # inner-state exports in progress (as the audited worker)
        self.finished = trio.Event()
        self.stop_latch = StopLatch(self.run_id, run.owner)  # the owner's stop order, once accepted
        self._setup_error: str | None = None  # why this node, elected shepherd, could not set the run up

    # -- inputs from the network -------------------------------------------------------

    async def deliver(self, sender: str, msg: Message) -> None:
        """A round message from ``sender`` (called by the node's messenger).

        A commit from the shepherd that signed it is acknowledged, and accepted,
        only once this node holds its checkpoint (the messenger acks after this
        returns, and refuses when it raises): the shepherd waits for one such
        ack before the commit goes anywhere else, so a shepherd killed right
        after committing never takes the only copy of θ with it (see
        :meth:`_replicate_then_commit`).
        """
        if getattr(msg, "run_id", None) != self.run_id:
            return
        if isinstance(msg, StopOrder):
            self.stop(msg, time.time())  # refused (the messenger says why) unless the owner signed it
            return
        if isinstance(msg, CommitRecord) and msg.checkpoint_cid and sender == msg.shepherd:
            verify(msg, sender)  # BadSignature: the messenger refuses it, nothing is fetched
            try:  # the authority chain first: nothing a commit names is fetched before it
                if self.election is None:
                    raise HeldBack("this node's election has not started")
                self.election.check_commit(msg)  # refused outright (not acked) if it can never hold
            except HeldBack as exc:
                # Not checkable yet (its lease has not arrived): the election keeps it,
                # nothing it names is fetched, and no ack goes back.
                self._send.send_nowait(("msg", sender, msg))
                raise NotElected(f"commit of term {msg.term} round {msg.round + 1}: {exc}; not acknowledged") from exc
            with trio.move_on_after(REPLICATE_TIMEOUT_S):
                await self._replicate_checkpoint(msg.checkpoint_cid, hint=sender)
            if not self.blobs.store.has(msg.checkpoint_cid):
                # Neither acknowledged nor accepted: a shepherd killed while we
                # fetched took the only copy with it, and a commit nobody else
                # holds must not become the round the next term starts from.
                # A live shepherd sends the commit again (or we read it in the DHT).
                raise PeerError(f"commit of round {msg.round + 1}: its checkpoint could not be fetched "
                                f"from {sender}; not accepted")
        self._send.send_nowait(("msg", sender, msg))

    # -- main loop ----------------------------------------------------------------------

    async def run_forever(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self._stopped_before():
                return
            await self._start()
            while not self.finished.is_set():
                wake = self._next_wakeup()
                with trio.move_on_after(max(0.0, wake - time.time()) if wake is not None else 3600):
                    item = await self._inbox.receive()
                    self._dispatch(item)
                    continue
                now = time.time()
                if self.shepherd is not None:
                    self._carry_out("shepherd", self.shepherd.tick(now))
                if self.worker is not None:
                    self._carry_out("worker", self.worker.tick(now))
                if self.election is not None:
                    self._carry_out_election(self.election.tick(now))
            # Finished: let in-flight work (the final commit's sends, announcements)
            # complete, but not forever; a stopped run has nothing more to say.
            grace = STOP_GRACE_S if self.stop_latch.stopped else FINISH_GRACE_S
            nursery.cancel_scope.deadline = trio.current_time() + grace

    def _next_wakeup(self) -> float | None:
        wakes = [w for w in (
            self.shepherd.next_wakeup if self.shepherd else None,
            self.worker.next_wakeup if self.worker else None,
            self.election.next_wakeup if self.election else None,
        ) if w is not None]
        if not wakes:
            return None
        # A machine whose wakeup is already past (a worker fetching or training)
        # must not make this loop spin: look again in half a second.
        return max(min(wakes), time.time() + 0.5) if min(wakes) <= time.time() else min(wakes)

    async def _start(self) -> None:
        from pcp_p2p.node.capabilities import measure_gflops
        from pcp_p2p.node.cpu import best_cpu_target

        target = best_cpu_target().name
        if target in self.spec.targets:
            self._target = target
        else:
            self.phase = "idle: no allowed target for this machine"
            log.warning("run %s: this machine's best target %s is not allowed by the run", self.run_id[:16], target)
        # Measured now rather than at node start-up, when a local swarm's processes
        # all start at once and measure each other's load.
        gflops = max(self.node.capabilities.throughput_gflops, await trio.to_thread.run_sync(measure_gflops, 0.5))
        self._tokens_per_s = self._speed_estimate(gflops)
        e = self.spec.election
        self.election = Election(self.run_id, self.node.identity, ElectionConfig(
            lease_s=e.lease_s, renew_every_s=e.renew_every_s, grace_s=e.grace_s,
            min_uptime_s=e.min_uptime_s, rotate_every=e.rotate_every, claim_timeout_s=e.claim_timeout_s,
            settle_s=SETTLE_S, max_skew_s=e.max_skew_s, max_claim_age_s=max_claim_age(self.spec),
        ).validate())
        self._restore_lease()
        self.phase = "electing"
        self._carry_out_election(self.election.start(time.time()))
        assert self._nursery is not None
        self._nursery.start_soon(self._members_loop)

    async def _members_loop(self) -> None:
        """Feed the election the run's live members once a second, and look up the owner's
        allowlist amendments every ``ALLOWLIST_EVERY_S``, its stop order (one this node
        missed while it was down) every ``STOP_LOOKUP_EVERY_S``, the first time at once,
        and, while no worker asks for commits, the run's latest commit (catching up)."""
        last_lookup = last_stop_lookup = -max(ALLOWLIST_EVERY_S, STOP_LOOKUP_EVERY_S)
        last_catch_up = time.monotonic()
        while True:
            self._send.send_nowait(("members", None))
            if not self.stop_latch.stopped and time.monotonic() - last_stop_lookup >= STOP_LOOKUP_EVERY_S:
                # a stop this node missed (while it was down)
                last_stop_lookup = time.monotonic()
                assert self._nursery is not None
                self._nursery.start_soon(self._lookup_owner_record, STOP_KIND, StopOrder)
            if self.worker is None and not self._final_committed() \
                    and time.monotonic() - last_catch_up >= CATCH_UP_EVERY_S:
                # no worker asks for commits yet (no term followed since a restart): look
                # the latest one up now and then, so a run that ended meanwhile is caught up
                last_catch_up = time.monotonic()
                assert self._nursery is not None
                self._nursery.start_soon(self._lookup_and_post, False)
            if self.spec.admission.mode == "allowlist" and time.monotonic() - last_lookup >= ALLOWLIST_EVERY_S:
                last_lookup = time.monotonic()
                assert self._nursery is not None
                self._nursery.start_soon(self._lookup_owner_record, ALLOWLIST_KIND, AllowlistUpdate)
            await trio.sleep(1.0)

    async def _lookup_owner_record(self, kind: str, payload_type: type) -> None:
        """Fetch the owner's ``<run>.<owner>`` record of ``kind`` (an allowlist update, a
        stop) and hand it to the loop as if the owner had sent it: the same checks apply."""
        try:
            found = await self.node.get_record(kind, owner_record_name(self.run_id, self.run.owner))
        except PcpError as exc:
            log.debug("%s lookup failed: %s", kind, exc)
            return
        if isinstance(found, payload_type):
            self._send.send_nowait(("msg", self.run.owner, found))

    # -- the owner's stop (see pcp_p2p.diloco.lifecycle) ---------------------------------

    def stop(self, order: StopOrder, now: float) -> None:
        """End the run on the owner's signed order; raise (typed, nothing changes) unless it holds.

        The worker's inner run is told to cancel, no machine gets another input,
        the run's pins are released as on a normal end, and the order is kept in
        the run's folder so a restarted node does not take the run up again.
        """
        self.stop_latch.check(order, now)
        if self.finished.is_set():
            raise StaleMessage("the run has already finished here")
        self.stop_latch.apply(order, now)
        log.warning("run %s stopped by its owner%s", self.run_id[:16], f": {order.reason}" if order.reason else "")
        try:
            tmp = self.work_dir / (STOP_FILE + ".tmp")
            tmp.write_bytes(encode(order))
            tmp.replace(self.work_dir / STOP_FILE)
        except OSError as exc:  # the run still stops; a restart looks the order up in the DHT
            self.node.log_once("self", LocalError(str(exc)), "keeping the stop order failed")
        self._end_stopped()

    def _end_stopped(self) -> None:
        for cancel in self._cancel.values():
            cancel.set()
        self.shepherd = None
        self.phase = STOPPED
        w = self.worker
        final = (w.theta_cid if w is not None else None) or ""
        self._release_run_pins(final)
        self.node.leads.discard(self.run_id)
        self.finished.set()
        self._send.send_nowait(("stopped", None))  # wakes the main loop, which then ends

    def _stopped_before(self) -> bool:
        """Whether this node accepted the owner's stop before it restarted (the order kept here)."""
        try:
            order = decode((self.work_dir / STOP_FILE).read_bytes(), StopOrder)
            self.stop_latch.apply(order, time.time())
        except FileNotFoundError:
            return False
        except (OSError, PcpError) as exc:
            log.warning("run %s: ignoring the kept stop order: %s", self.run_id[:16], exc)
            return False
        self._end_stopped()
        return True

    def _candidates(self) -> list[Candidate]:
        now = time.time()
        return [
            Candidate(m.record.peer_id, max(0.0, now - m.record.started_at), m.record.capabilities.can_compile)
            for m in self.node.membership.live()
            # Bans are each node's own: filtering candidates on them would give nodes
            # different rankings. The owner's lists are the same everywhere.
            if m.record.role == "worker" and self.run_id in m.record.runs
            and self.admission.may_lead(m.record.peer_id, local_bans=False)
            # a member that announced its departure is gone, though the view may list it a while
            and not self.departures.gone(m.record.peer_id, m.record.started_at)
        ]

    def check_record(self, payload: Message, now: float) -> None:
        """The authority a DHT record of this run needs (``PcpRecordValidator.authorities``):
        a lease or commit this node's election would not act on is neither stored nor
        selected here, so a forged far-future term cannot shadow the honest record."""
        if self.election is None:
            return
        if isinstance(payload, Lease):
            self.election.check_lease(payload, now)
        elif isinstance(payload, CommitRecord):
            try:
                self.election.check_commit(payload)
            except HeldBack:
                # the last commit of a run that ended while this node was down: its
                # lease has expired, so the chain is checked from this node's anchor
                self._check_final(payload, now)

    def _speed_estimate(self, gflops: float) -> float:
        """Tokens/s this machine could claim: 6 FLOP per parameter per token at the measured rate.

        Deliberately generous (twice the matmul-rate figure): the aggregator
        refuses claims above it, and an IREE step never reaches the benchmark's
        rate, so an honest worker is never refused.
        """
        from pcp_p2p.compile.model import num_params, preset

        n = num_params(preset(self.spec.model, vocab_size=self.dataset.vocab_size if self.dataset else 128))  # an estimate
        return max(1.0, 2 * gflops * 1e9 / (6 * n))

    async def _become_shepherd(self, eff: BecomeShepherd) -> None:
        """Build the artifacts and the term's starting state (the lease names the checkpoint)."""
        from pcp_p2p.diloco import engine
        from pcp_p2p.diloco.data import encode_dataset

        self.phase = "compiling"
        # The shepherd reads and tokenises the corpus; workers get it as a blob.
        if self.dataset is None:
            self.dataset = await trio.to_thread.run_sync(CharDataset.load, self.spec.dataset)
        dataset_cid = await self._keep(await trio.to_thread.run_sync(encode_dataset, self.dataset), for_run=True)
        self.pins.for_dataset(dataset_cid)
        self.node.leads.add(self.run_id)
        wanted = self._wanted_targets()
        standby = self._standby if self._standby and sorted(a.manifest.target for a in self._standby) == wanted else None
        log.info("run %s: term %d: compiling the train program for %s", self.run_id[:16], eff.term, ", ".join(sorted(wanted)))
        arts = standby or await self._build_artifacts(sorted(wanted))
        artifacts: dict[str, str] = {}
        self.artifacts.clear()
        for art in arts:
            if art.cached:
                log.info("run %s: artifact for %s rebuilt byte-identically from the cache (%s)",
                         self.run_id[:16], art.manifest.target, art.cid)
            self.artifacts.append({"target": art.manifest.target, "cid": art.cid,
                                   "size": len(art.vmfb), "cache_hit": art.cached})
            await self._keep(art.vmfb, for_run=True)
            artifacts[art.manifest.target] = await self._keep(encode(art.manifest), for_run=True)
        if self._evaluate is None:
            self._evaluate = await trio.to_thread.run_sync(engine.Evaluator, self.spec, self.dataset)
        state = OuterState.initial(engine.initial_theta(self.spec, self.dataset.vocab_size))
        if eff.checkpoint_cid:
            state = await self._starting_state(eff)
        if self.election is None or self.election.current_term != eff.term or self.election.holder != self.node.peer_id:
            log.info("run %s: term %d ended while it was being set up", self.run_id[:16], eff.term)
            return
        self.shepherd = Shepherd(
            spec=self.spec, run_id=self.run_id, identity=self.node.identity, term=eff.term,
            state=state, artifacts=artifacts, evaluate=self._evaluate, dataset_cid=dataset_cid,
            end_round=eff.end_round, admit=self.admission.why_not, score=self._evaluate.score,
            audits=AuditDesk(self.run_id, self.node.identity, rate) if (rate := self.spec.aggregation.audit_rate) > 0
            else None,
        )
        # The term's starting θ must be fetchable by the workers.
        self._carry_out("shepherd", [StoreBlob(self.shepherd.theta_cid, self.shepherd.theta_bytes)])

    # -- dispatch -----------------------------------------------------------------------

    def _dispatch(self, item: tuple) -> None:
        kind = item[0]
        if log.isEnabledFor(logging.DEBUG):
            log.debug("input %s %s", kind, _describe(item[-1]))
        now = time.time()
        if kind == "msg":
            _, sender, msg = item
            if isinstance(msg, Lease):
                if self.election is not None:
                    self._carry_out_election(self.election.on_lease(msg, now))
                return
            if isinstance(msg, (AuditRequest, StateOffer)):
                self._on_audit_message(sender, msg)
                return
            if isinstance(msg, Leave):
                self._on_leave(sender, msg, now)
                return
            if isinstance(msg, Evidence):
                self._on_evidence(sender, msg, now)
                return
            if isinstance(msg, StopOrder):  # looked up in the DHT (a direct one is checked in deliver)
                try:
                    self.stop(msg, now)
                except StaleMessage:
                    pass  # already stopped
                except PcpError as exc:
                    self._reject(sender, exc)
                return
            if isinstance(msg, AllowlistUpdate):
                try:
                    self.admission.apply(msg, now)  # owner-signed, or refused
                except StaleMessage:
                    pass  # the one in force, again
                except PcpError as exc:
                    self._reject(sender, exc)
                return
            if isinstance(msg, (Join, Submission, AuditReport)):
                if self.shepherd is None and self._becoming:
                    self._early.append(item)  # still compiling: answer once the shepherd exists
                    return
                if self.shepherd is None:
                    self._reject(sender, VerificationError("this node is not the run's shepherd"))
                    return
                effects = self.shepherd.receive(msg, now)
                for e in effects:  # strike only the sender libp2p authenticated
                    if isinstance(e, Rejected) and e.peer == sender:
                        self.ledger.strike(sender, type(e.error).__name__, now)
                self._carry_out("shepherd", effects)
            elif isinstance(msg, CommitRecord):
                self._on_commit(msg, now)
            elif isinstance(msg, RoundAnnouncement) and self.worker is not None:
                self._carry_out("worker", self.worker.receive(msg, now))
                self._after_worker_input()
        elif kind == "blob":
            _, who, cid, data = item
            machine = self.shepherd if who == "shepherd" else self.worker
            if machine is not None:
                self._carry_out(who, machine.on_blob(cid, data, now))
        elif kind == "blob_failed":
            _, who, cid, err = item
            machine = self.shepherd if who == "shepherd" else self.worker
            if machine is not None:
                self._carry_out(who, machine.on_blob_failed(cid, err, now))
        elif kind == "inner_done" and self.worker is not None:
            result = item[1]
            self._carry_out("worker", self.worker.on_inner_done(result, now))
        elif kind == "inner_failed" and self.worker is not None:
            _, round_, attempt, err = item
            self._carry_out("worker", self.worker.on_inner_failed(round_, attempt, err, now))
        elif kind == "commit_lookup":
            _, rec, for_election = item
            if rec is not None:
                self._on_commit(rec, now)
            if for_election:  # a worker's own lookups must not end the election's wait
                self._lookup_done(now)
        elif kind == "lease_lookup":
            if item[1] is not None and self.election is not None:
                self._carry_out_election(self.election.on_lease(item[1], now))
            self._lookup_done(now)
        elif kind == "members" and self.election is not None:
            self._carry_out_election(self.election.on_members(self._candidates(), now))
        elif kind == "shepherd_ready":
            for early in self._early:
                self._dispatch(early)
            self._early.clear()
        if self.worker is not None and not self.finished.is_set():
            self.phase = self.worker.phase.value
            rec = self.worker.last_commit
            if rec is not None and rec.round + 1 >= self.spec.round.rounds and self.worker.theta_cid == rec.theta_cid:
                # The last round is committed and we hold its θ: nothing more to do here.
                self.phase = "finished"
                self._release_run_pins(rec.theta_cid)
                self.finished.set()

    def _on_leave(self, sender: str, msg: Leave, now: float) -> None:
        """A member announced its departure (see :mod:`pcp_p2p.diloco.departures`).

        Checked first (signed by the leaver, sent by it or relayed by the current
        term's holder, fresh, no replay); then the shepherd stops waiting for it
        and relays it to the run, and the election forgets it as a candidate (a
        leaving holder's term ends at once).
        """
        holder = self.election.holder if self.election is not None else None
        try:
            self.departures.check(msg, sender, now, relayer=holder)
        except PcpError as exc:
            self._reject(sender, exc)
            return
        log.info("run %s: %s left the run", self.run_id[:16], msg.peer)
        if self.shepherd is not None:
            self._carry_out("shepherd", self.shepherd.on_leave(msg, now))
            if sender == msg.peer:  # relay once, never a relayed one
                assert self._nursery is not None
                for peer in self._run_members():
                    if peer != msg.peer:
                        self._nursery.start_soon(self._send_to, peer, msg)
        if self.election is not None:
            self._carry_out_election(self.election.on_departure(msg.peer, msg.at, now))

    def _run_members(self) -> list[str]:
        """The live members taking part in this run, this node left out."""
        return [m.record.peer_id for m in self.node.membership.live()
                if self.run_id in m.record.runs and m.record.peer_id != self.node.peer_id]

    async def announce_departure(self) -> None:
        """This node leaves (a graceful stop): tell the shepherd, or, as the shepherd, the run.

        Unbounded here: the caller bounds it (a farewell, :func:`pcp_p2p.shutdown.add_farewell`).
        A finished run, or one this node never got as far as electing in, needs no notice.
        """
        if self.finished.is_set() or self.election is None:
            return
        leave = make_leave(self.run_id, self.node.identity, time.time())
        me = self.node.peer_id
        if self.shepherd is not None or self._becoming or self.election.holder == me:
            targets = self._run_members()
        else:
            targets = [self.shepherd_peer] if self.shepherd_peer not in (None, me) else []
        if not targets:
            return
        log.info("run %s: announcing this node's departure to %d peer(s)", self.run_id[:16], len(targets))
        async with trio.open_nursery() as nursery:
            for peer in targets:
                nursery.start_soon(self._send_to, peer, leave)

    def _on_commit(self, rec: CommitRecord, now: float) -> None:
        """A commit record (message or lookup): the election checks its authority first;
        the worker sees it only once the election answers ``CommitChecked``.

        The run's last commit that the election holds back (no live lease vouches
        for it: the run ended while this node was down) is adopted from this node's
        anchor instead (:meth:`Election.check_final`), so a node restarted after the
        run finished still ends on the run's final θ, in the finished state.
        """
        if self.election is None:
            return
        self._carry_out_election(self.election.on_commit(rec, now))
        if rec.round + 1 >= self.spec.round.rounds and not self._final_committed():
            try:
                self._check_final(rec, now)
                effects = self.election.adopt_final(rec, self.spec.round.rounds, now)
            except PcpError as exc:
                log.debug("run %s: the last commit cannot be adopted yet: %s", self.run_id[:16], exc)
                return
            log.info("run %s: the run ended at round %d while this node was away; catching up to θ %s",
                     self.run_id[:16], rec.round, rec.theta_cid)
            self._carry_out_election(effects)

    def _check_final(self, rec: CommitRecord, now: float) -> None:
        """``Election.check_final``, and its shepherd admitted to lead the run (the owner's lists)."""
        assert self.election is not None
        self.election.check_final(rec, self.spec.round.rounds, now)
        if not self.admission.may_lead(rec.shepherd, local_bans=False):
            raise NotElected(f"{rec.shepherd:.16}… may not lead this run")

    def _restore_lease(self) -> None:
        """Give the election the lease this node accepted last before it stopped (its anchor)."""
        assert self.election is not None
        try:
            lease = decode((self.work_dir / LEASE_FILE).read_bytes(), Lease)
            self.election.restore(lease)
        except FileNotFoundError:
            return
        except (OSError, PcpError) as exc:
            self.node.log_once("self", LocalError(f"{LEASE_FILE}: {exc}"), "reading the last lease failed")
            return
        self._saved_term = lease.term

    def _save_lease(self) -> None:
        """Keep the latest accepted lease on disk, once per term (see ``_restore_lease``)."""
        lease = self.election.lease if self.election is not None else None
        if lease is None or (self._saved_term is not None and lease.term <= self._saved_term):
            return
        self._saved_term = lease.term
        path = self.work_dir / LEASE_FILE
        try:
            path.with_suffix(".tmp").write_bytes(encode(lease))
            path.with_suffix(".tmp").replace(path)
        except OSError as exc:
            self.node.log_once("self", LocalError(str(exc)), "saving the last lease failed")

    def _commit_checked(self, rec: CommitRecord, now: float) -> None:
        if rec.round + 1 >= self.spec.round.rounds and self._target is not None:
            # the run's last commit: a node catching up after the end has no term to
            # follow, only this θ to fetch (no Join: nobody leads the run any more)
            if self.worker is None:
                self.worker = Worker(spec=self.spec, run_id=self.run_id, identity=self.node.identity,
                                     shepherds={rec.term: rec.shepherd}, target=self._target,
                                     tokens_per_s=self._tokens_per_s)
            self.worker.shepherds.setdefault(rec.term, rec.shepherd)
        if self.worker is not None:
            self._carry_out("worker", self.worker.on_commit(rec, now))
            self._after_worker_input()
            accepted = self.worker.last_commit  # (a stale record moves nothing)
            if accepted is not None:
                self._release_pins(accepted.round)

    # -- audits (the shepherd's side is AuditDesk, inside the Shepherd) -----------------

    def _holds_term(self, term: int, peer: str) -> bool:
        """Whether this node accepted ``peer``'s lease of ``term`` (audit requests need it)."""
        return self.election is not None and any(t.term == term and t.holder == peer
                                                 for t in self.election.history)

    def _on_audit_message(self, sender: str, msg: AuditRequest | StateOffer) -> None:
        assert self._nursery is not None
        if isinstance(msg, StateOffer):
            entry = self._audit_jobs.get((msg.term, msg.round, msg.attempt, msg.worker))
            if entry is None:
                self._reject(sender, VerificationError("a state offer for no audit of this node"))
                return
            try:
                entry[0].on_offer(msg)
            except PcpError as exc:
                self._reject(sender, exc)
                return
            entry[1].set()
            return
        try:
            check_request(msg, run_id=self.run_id, rate=self.spec.aggregation.audit_rate,
                          is_shepherd=self._holds_term)
        except PcpError as exc:
            self._reject(sender, exc)
            return
        me = self.node.peer_id
        if len(self._audit_jobs) + self._exports >= MAX_AUDIT_JOBS:
            # each costs a replay or an export: even the shepherd gets a bounded share
            self._reject(sender, OverBudget(f"{MAX_AUDIT_JOBS} audits in progress here", reason="audits"))
        elif msg.worker == me:
            self._nursery.start_soon(self._serve_audit_state, msg)
        elif msg.auditor == me and (msg.term, msg.round, msg.attempt, msg.worker) not in self._audit_jobs:
            self._nursery.start_soon(self._audit, msg)

    def _on_evidence(self, sender: str, ev: Evidence, now: float) -> None:
        """A ban another node's shepherd recorded: checked here in full before it counts."""
        from pcp_p2p.diloco.engine import CHUNK_STEPS

        try:
            offender = verify_evidence(ev, rate=self.spec.aggregation.audit_rate, is_shepherd=self._holds_term,
                                       chunk_steps=CHUNK_STEPS)
        except PcpError as exc:
            self._reject(sender, exc)
            return
        if not self.ledger.banned(offender):
            self.ledger.ban(offender, encode_evidence(ev), f"audit evidence from {sender:.16}", now)

    async def _serve_audit_state(self, req: AuditRequest) -> None:
        """The audited worker: serve the inner state its submission started from."""
        self._exports += 1
        try:
            sub = next((s for s in reversed(self.worker.submitted if self.worker else [])
                        if (s.term, s.round, s.attempt) == (req.term, req.round, req.attempt)), None)
            if sub is None:
                raise LocalError(f"no submission of round {req.round + 1} is kept here any more")
            check_submission(req, encode(sub))  # the request names exactly what we signed
            digest = state_to_export(req, sub, self.node.peer_id)
            if digest is None:
                return  # started fresh: the auditor needs nothing from us
            if self.engine is None:
                raise LocalError("no executor holds the inner state")
            blob = await trio.to_thread.run_sync(self.engine.export_state, digest)
            await self._keep(blob)
            await self._send_to(req.auditor, make_offer(req, digest, blob, self.node.identity))
        except PcpError as exc:
            self.node.log_once("self", exc, "serving an audited inner state failed")
        finally:
            self._exports -= 1

    async def _audit(self, req: AuditRequest) -> None:
        """The auditor: gather the inputs, replay the round exactly, report to the shepherd."""
        from pcp_p2p.diloco.engine import CHUNK_STEPS

        job = AuditJob(req, self.node.identity, chunk_steps=CHUNK_STEPS)
        key = (req.term, req.round, req.attempt, req.worker)
        offered = trio.Event()
        self._audit_jobs[key] = (job, offered)
        report: AuditReport | None = None
        try:
            with trio.move_on_after(2 * self.spec.round.deadline_s + AUDIT_GRACE_S):
                try:
                    if req.target != self._target or self.worker is None \
                            or req.artifact_cid not in self.worker.held_artifacts or self.engine is None:
                        raise LocalError("this node does not run the audited round's artifact")
                    while not job.ready():
                        wanted = job.wanted()
                        if not wanted:
                            await offered.wait()  # the worker's StateOffer
                            offered = trio.Event()
                            self._audit_jobs[key] = (job, offered)
                            continue
                        for cid in wanted:
                            public = cid == req.submission_cid or (job.sub is not None
                                                                   and cid == job.sub.base_theta_cid)
                            data = await self._fetch_bytes(cid, req.shepherd if public else req.worker,
                                                           keep=False, max_size=self._state_bound(2))
                            job.on_blob(cid, data)
                    if job.impossible_steps():
                        report = job.finish_impossible()
                    else:
                        rep = await trio.to_thread.run_sync(self.engine.replay, *job.replay_input())
                        report = job.finish(rep.theta, rep.state_out, rep.losses)
                except PcpError as exc:
                    report = job.give_up(f"{type(exc).__name__}: {exc}")
            if report is None:
                report = job.give_up("the audit's deadline passed")
            log.info("run %s: audit of %s round %d: %s %s", self.run_id[:16], req.worker, req.round + 1,
                     report.verdict, ",".join(report.differs))
            self.stats.audits[report.verdict] = self.stats.audits.get(report.verdict, 0) + 1
            await self._send_to(req.shepherd, report)
        finally:
            self._audit_jobs.pop(key, None)

    def _lookup_done(self, now: float) -> None:
        if self._lookups_pending > 0:
            self._lookups_pending -= 1
            if self._lookups_pending == 0 and self.election is not None:
                self._carry_out_election(self.election.on_lookups_done(now))

    def _final_committed(self) -> bool:
        best = self.election.best_commit if self.election is not None else None
        return best is not None and best.round + 1 >= self.spec.round.rounds

    def _carry_out_election(self, effects: list) -> None:
        assert self._nursery is not None
        now = time.time()
        if self._final_committed():
            # The run is over: no new terms (a lapsed lease now means nothing).
            effects = [e for e in effects if not isinstance(e, (PublishLease, BecomeShepherd))]
        for e in effects:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("election effect %s", _describe(e))
            if isinstance(e, PublishLease):
                self._nursery.start_soon(self._publish_lease, e.lease)
                if not e.renewal:
                    log.info("run %s: this node claims term %d", self.run_id[:16], e.lease.term)
            elif isinstance(e, BecomeShepherd):
                self._becoming = True
                self.node.leads.add(self.run_id)
                self._nursery.start_soon(self._run_become_shepherd, e)
            elif isinstance(e, FollowShepherd):
                if e.peer != self.node.peer_id and self._becoming_term is not None and e.term >= self._becoming_term:
                    self._cancel_become(f"term {e.term} is held by {e.peer}")
                self._follow(e, now)
            elif isinstance(e, StepDown):
                if e.term == self._becoming_term:
                    self._cancel_become(f"stepped down from term {e.term} ({e.reason})")
                if self.shepherd is not None and self.shepherd.term == e.term:
                    self.shepherd = None
                self._becoming = False
                self.node.leads.discard(self.run_id)
                log.info("run %s: stepping down from term %d (%s)", self.run_id[:16], e.term, e.reason)
            elif isinstance(e, LookupLease):
                self._lookups_pending += 1  # on_lookups_done once every asked lookup answered
                self._nursery.start_soon(self._lookup_lease)
            elif isinstance(e, LookupCommit):
                self._lookups_pending += 1
                self._nursery.start_soon(self._lookup_and_post, True)
            elif isinstance(e, CommitChecked):
                self._commit_checked(e.record, now)
            elif isinstance(e, Rejected):
                if isinstance(e.error, HeldBack):
                    self.stats.held += 1  # not refused: kept until it can be checked
                else:
                    self._reject(e.peer or "?", e.error)
        self._save_lease()

    def _follow(self, e: FollowShepherd, now: float) -> None:
        """The shepherd of ``e.term`` is ``e.peer``: our worker joins it."""
        if e.peer != self.node.peer_id or self.shepherd_peer != e.peer:
            log.info("run %s: term %d is led by %s%s", self.run_id[:16], e.term, e.peer,
                     " (this node)" if e.peer == self.node.peer_id else "")
        self.shepherd_peer = e.peer
        if self._target is None:
            return
        if self.worker is None:
            self.worker = Worker(
                spec=self.spec, run_id=self.run_id, identity=self.node.identity,
                shepherds={e.term: e.peer}, target=self._target, tokens_per_s=self._tokens_per_s,
            )
            if e.base is not None:
                self.worker.term_base[e.term] = e.base
            self.phase = "joining"
            self._carry_out("worker", self.worker.start(now))
        else:
            self._carry_out("worker", self.worker.set_shepherd(e.term, e.peer, now, base=e.base))

    def _wanted_targets(self) -> list[str]:
        """The best allowed CPU target of each member taking part in the run."""
        from pcp_p2p.node.cpu import cpu_of, runnable_cpu_targets

        wanted: set[str] = set()
        for m in self.node.membership.live():
            if self.run_id not in m.record.runs:
                continue
            caps = m.record.capabilities
            runnable = [t.name for t in runnable_cpu_targets(cpu_of(caps.cpu_arch, caps.cpu_flags))]
            allowed = [t for t in runnable if t in self.spec.targets]
            if allowed:
                wanted.add(allowed[0])
        return sorted(wanted)

    async def _build_artifacts(self, targets: list[str]) -> list[Any]:
        """The train artifacts for ``targets`` (compiled, or from the cache), in a thread that
        this task's cancellation stops at once: the thread is abandoned and the compiler
        process it runs is killed (``CompileCancelled`` there), so neither a lost election
        nor a node stopping waits for a compile to finish."""
        from pcp_p2p.diloco import engine

        assert self.dataset is not None
        cancel = threading.Event()
        try:
            return await trio.to_thread.run_sync(
                lambda: engine.build_train_artifacts(
                    self.spec, self.dataset.vocab_size, targets, self.node.identity,  # type: ignore[union-attr]
                    self.node.config.data_dir / "artifact-cache", cancel=cancel),
                abandon_on_cancel=True,
            )
        finally:
            cancel.set()  # a no-op once the build is done; else the thread kills iree-compile and ends

    def _cancel_become(self, why: str) -> None:
        """Another node holds the term this node was setting up: stop compiling for it now."""
        scope = self._become_scope
        if scope is not None and not scope.cancel_called:
            log.info("run %s: %s; the shepherd's set-up (compile) is cancelled", self.run_id[:16], why)
            scope.cancel()

    async def _prewarm(self) -> None:
        """Hot standby: build the artifacts into the cache and the evaluator now, off the
        critical path, so that taking over a term (failover, rotation) costs a cache hit."""
        from pcp_p2p.diloco import engine

        assert self.dataset is not None
        try:
            self._standby = await self._build_artifacts(self._wanted_targets())
            if self._evaluate is None:
                self._evaluate = await trio.to_thread.run_sync(engine.Evaluator, self.spec, self.dataset)
            log.info("run %s: standby ready (artifacts cached, evaluator built)", self.run_id[:16])
        except PcpError as exc:
            self.node.log_once("self", exc, "standby build failed")

    async def _starting_state(self, eff: BecomeShepherd) -> OuterState:
        """The checkpoint the lease names; failing that, the committed θ with fresh momentum.

        Workers replicate every committed checkpoint, so the first path is the
        normal one; the second loses only the outer momentum, never a round.
        """
        try:
            ckpt = decode_checkpoint(await self._fetch_bytes(eff.checkpoint_cid, max_size=self._state_bound(2)))
            if ckpt.run_id != self.run_id:
                raise VerificationError("the lease names a checkpoint of another run")
            log.info("run %s: term %d continues from round %d (checkpoint %s)", self.run_id[:16], eff.term,
                     ckpt.state.round + 1, eff.checkpoint_cid[-12:])
            return ckpt.state
        except PcpError as exc:
            lease = self.election.lease if self.election is not None else None
            if lease is None or not lease.from_theta_cid:
                raise
            log.warning("run %s: checkpoint %s unavailable (%s); continuing from the committed θ with "
                        "zero outer momentum", self.run_id[:16], eff.checkpoint_cid, exc)
            theta = unpack_tensors(await self._fetch_bytes(lease.from_theta_cid, max_size=self._state_bound(1)))
            fresh = OuterState.initial(theta)
            return OuterState(theta=fresh.theta, momentum=fresh.momentum, round=eff.from_round)

    async def _run_become_shepherd(self, eff: BecomeShepherd) -> None:
        self.node.state = COMPILING  # what the workers show until the first round is announced
        scope = trio.CancelScope()
        self._become_scope, self._becoming_term = scope, eff.term
        try:
            with scope:
                await self._become_with_retries(eff)
        finally:
            if self._become_scope is scope:
                self._become_scope = self._becoming_term = None
            self._becoming = False
            self.node.state = f"{SETUP_FAILED}: {self._setup_error}" if self._setup_error else "training"
            self._send.send_nowait(("shepherd_ready", None))

    async def _become_with_retries(self, eff: BecomeShepherd) -> None:
        """Set up the term, up to three times while the term is still ours."""
        for attempt in range(3):
            try:
                await self._become_shepherd(eff)
                self._setup_error = None
                break
            except PcpError as exc:
                still_mine = self.election is not None and self.election.current_term == eff.term \
                    and self.election.holder == self.node.peer_id
                log.error("run %s: could not take up term %d (attempt %d): %s",
                          self.run_id[:16], eff.term, attempt + 1, exc)
                # Shown as the run's phase here and, through the member record, on every worker.
                self._setup_error = " ".join(str(exc).split())[:160] or type(exc).__name__
                self.node.state = f"{SETUP_FAILED}: {self._setup_error}"
                if not still_mine:
                    break
                await trio.sleep(2.0 * (attempt + 1))

    async def _replicate_checkpoint(self, cid: str, hint: str | None = None) -> None:
        """Hold the latest committed checkpoints so any candidate can take over the run."""
        if cid in self._replicas:
            return
        try:
            await self._fetch_bytes(cid, hint, max_size=self._state_bound(2))
        except PcpError as exc:
            self.node.log_once("self", exc, "replicating a checkpoint failed")
            return
        if cid in self._replicas:  # replicated meanwhile by the commit's own delivery
            return
        self._replicas.append(cid)  # (unpinned with its round, by self.pins)
        del self._replicas[:-KEEP_CHECKPOINTS]

    async def _publish_lease(self, lease: Lease) -> None:
        members = [m.record.peer_id for m in self.node.membership.live()
                   if self.run_id in m.record.runs and m.record.peer_id != self.node.peer_id]
        async with trio.open_nursery() as n:
            for peer in members:
                n.start_soon(self._send_to, peer, lease)
        signed = sign_record(self.node.identity, LEASE_KIND, self.run_id, lease,
                             ttl_s=max(60.0, 10 * self.spec.election.lease_s), seq=lease.term)
        try:
            await self.node.put_record(signed, timeout=3 * self.node.config.op_timeout)
        except PcpError as exc:
            self.node.log_once("self", exc, "storing the lease failed")

    async def _lookup_lease(self) -> None:
        try:
            lease = await self.node.get_record(LEASE_KIND, self.run_id)
        except PcpError as exc:
            log.debug("lease lookup failed: %s", exc)
            lease = None
        self._send.send_nowait(("lease_lookup", lease if isinstance(lease, Lease) else None))

    def _after_worker_input(self) -> None:
        assert self.worker is not None
        rec = self.worker.last_commit
        if rec is not None and rec.theta_cid != self._seen_commit:
            self._seen_commit = rec.theta_cid
            self.stats.last_commit_at = time.time()
            if rec.checkpoint_cid and self._nursery is not None:
                self._nursery.start_soon(self._replicate_checkpoint, rec.checkpoint_cid)
            if (not self._prewarmed and self.dataset is not None and self.shepherd is None
                    and self.node.capabilities.can_compile and self._nursery is not None):
                self._prewarmed = True  # after the first commit: training is under way
                self._nursery.start_soon(self._prewarm)
            if self.node.peer_id in rec.participants:
                self.stats.contributed_rounds.append(rec.round + 1)  # 1-based, as people count
                if self.stats.first_contribution_s is None:
                    # From taking up the run to the first commit that counts this node.
                    self.stats.first_contribution_s = round(time.time() - self.started_at, 2)
            self.stats.history.append({
                "round": rec.round + 1, "theta": rec.theta_cid, "loss": rec.mean_loss,  # 1-based
                "val_loss": rec.val_loss, "participants": len(rec.participants), "tokens": rec.tokens,
                "term": rec.term, "shepherd": rec.shepherd,
            })
            log.info("run %s: round %d committed, loss %.4f, val %.4s, %d workers",
                     self.run_id[:16], rec.round + 1, rec.mean_loss,
                     f"{rec.val_loss:.4f}" if rec.val_loss is not None else "-", len(rec.participants))

    def _carry_out(self, who: str, effects: list[Effect]) -> None:
        assert self._nursery is not None
        if who == "shepherd":
            if self._held is not None:  # a commit is replicating: keep the shepherd's order
                self._held.append(effects)
                return
            first = next((i for i, e in enumerate(effects) if isinstance(e, Send)
                          and isinstance(e.message, CommitRecord) and e.to != self.node.peer_id), None)
            if first is not None:
                self._carry_out_now(who, effects[:first])
                self._held = [effects[first:]]
                self._nursery.start_soon(self._replicate_then_commit, effects[first].message)
                return
        self._carry_out_now(who, effects)

    async def _replicate_then_commit(self, commit: CommitRecord) -> None:
        """Make one other node hold the checkpoint, then let the commit out.

        Until this returns, the commit is nowhere: not in the DHT, not with
        our own worker, not with any other. The commit message itself is the
        request: a worker acknowledges it only once it holds the checkpoint
        (:meth:`deliver`). Two workers are asked at once and the first ack
        wins; with none reachable in ``REPLICATE_TIMEOUT_S`` the commit goes
        out anyway (a swarm of one must still make progress) and the risk is
        logged.
        """
        assert self._held is not None
        peers = [e.to for e in self._held[0] if isinstance(e, Send)
                 and e.message is commit and e.to != self.node.peer_id]
        # Workers that just submitted to this round are the likeliest to be alive.
        targets = sorted(peers, key=lambda p: p not in commit.participants)[:REPLICAS]
        acked: list[str] = []
        done = trio.Event()

        async def ask(peer: str) -> None:
            if await self._send_to(peer, commit):
                acked.append(peer)
                done.set()

        async with trio.open_nursery() as n:
            for peer in targets:
                n.start_soon(ask, peer)
            with trio.move_on_after(REPLICATE_TIMEOUT_S):
                await done.wait()
            n.cancel_scope.cancel()  # one replica suffices; the others get the commit below
        if not acked:
            log.warning("run %s: round %d commit goes out with its checkpoint on this node only",
                        self.run_id[:16], commit.round + 1)
        held, self._held = self._held, None
        first, rest = held[0], held[1:]
        self._carry_out_now("shepherd", [e for e in first if not (
            isinstance(e, Send) and e.message is commit and e.to in acked)])
        for i, batch in enumerate(rest):
            if self._held is not None:  # another commit started replicating: it keeps the rest
                self._held.extend(rest[i:])
                break
            self._carry_out("shepherd", batch)

    def _carry_out_now(self, who: str, effects: list[Effect]) -> None:
        assert self._nursery is not None
        for e in effects:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s effect %s", who, _describe(e))
            if isinstance(e, Send):
                if e.to == self.node.peer_id:
                    self._send.send_nowait(("msg", self.node.peer_id, e.message))
                else:
                    self._nursery.start_soon(self._send_to, e.to, e.message)
            elif isinstance(e, StoreBlob):
                # Registered now, not when the task starts: our own worker may ask
                # for this blob (local delivery) before the store task has run.
                self._storing.setdefault(e.cid, trio.Event())
                self._nursery.start_soon(self._store, e.cid, e.data)
            elif isinstance(e, FetchBlob):
                self._nursery.start_soon(self._fetch, who, e.cid, e.hint)
            elif isinstance(e, RunInner):
                if self.stats.first_train_at is None:
                    self.stats.first_train_at = time.time()
                cancel = threading.Event()
                self._cancel[(e.round, e.attempt)] = cancel
                self._nursery.start_soon(self._inner, e, cancel)
            elif isinstance(e, CancelInner):
                ev = self._cancel.pop((e.round, e.attempt), None)
                if ev is not None:
                    ev.set()
            elif isinstance(e, LookupCommit):
                self._nursery.start_soon(self._lookup_and_post, False)
            elif isinstance(e, Rejected):
                self._reject(e.peer or "?", e.error)
            elif isinstance(e, Committed):
                for p in e.record.participants:
                    self.ledger.credit(p, time.time())
                self.ledger.flush(time.time())
                self._nursery.start_soon(self._publish_commit, e.record)
                self._release_pins(e.record.round)
                if self.election is not None:
                    self._carry_out_election(self.election.on_commit(e.record, time.time()))
            elif isinstance(e, Banned):
                self.ledger.ban(e.peer, e.evidence, e.reason, time.time())
                log.warning("run %s: %s banned: %s", self.run_id[:16], e.peer, e.reason)
                # The evidence proves itself: every member records the ban, so the
                # next term's shepherd refuses the offender too.
                evidence = decode_evidence(e.evidence)
                for m in self.node.membership.live():
                    if self.run_id in m.record.runs and m.record.peer_id not in (self.node.peer_id, e.peer):
                        self._nursery.start_soon(self._send_to, m.record.peer_id, evidence)
            elif isinstance(e, Discarded):
                log.warning("run %s: round %d attempt %d discarded: %s", self.run_id[:16], e.round + 1, e.attempt, e.error)
            elif isinstance(e, Finished):
                log.info("run %s finished at round %d (θ %s)", self.run_id[:16], e.round, e.theta_cid)
                if self.worker is None:
                    self.phase = "finished"
                    self.finished.set()

    def _reject(self, peer: str, exc: PcpError) -> None:
        key = type(exc).__name__
        self.stats.rejected[key] = self.stats.rejected.get(key, 0) + 1
        self.node._reject(peer, exc, "round")

    # -- effect workers -----------------------------------------------------------------

    async def _send_to(self, peer: str, msg: Message) -> bool:
        """Send and wait for the ack; False (logged once) if it did not arrive."""
        if isinstance(msg, Submission):
            self.stats.bytes_submitted += len(encode(msg))
        if isinstance(msg, (RoundAnnouncement, CommitRecord)):
            # Never name a blob before we hold it: wait for the stores in flight.
            for stored in list(self._storing.values()):
                await stored.wait()
        try:
            await self.node.messenger.send(peer, msg)
        except PcpError as exc:
            self.node.log_once(peer, exc, f"sending {msg.TAG} failed")
            return False
        return True

    async def _store(self, cid: str, data: bytes) -> None:
        try:
            got = await self._keep(data)
            if got != cid:
                log.error("stored blob hashes to %s, expected %s", got, cid)
        finally:
            done = self._storing.pop(cid, None)
            if done is not None:
                done.set()

    async def _keep(self, data: bytes, *, for_run: bool = False) -> str:
        """Store and pin a blob now (for the run's life, or for its round: see
        :mod:`pcp_p2p.diloco.pins`); announce it in the background.

        Peers that need it get the hint of who holds it (the shepherd), so they
        need not wait for a provider record, and a DHT announcement on a busy
        swarm can take tens of seconds.
        """
        cid = await trio.to_thread.run_sync(lambda: self.blobs.store.put_bytes(data, pin=True))
        self._pin(cid, for_run)
        self._announce_later(cid)
        return cid

    def _pin(self, cid: str, for_run: bool) -> None:
        if self.pins.finished:
            return  # the run is over: nothing more is kept for it
        (self.pins.for_run if for_run else self.pins.for_round)(cid)
        self.blobs.store.pin(cid)
        self._save_pins()

    def _release_run_pins(self, final_theta_cid: str) -> None:
        """The run is over on this node: keep the final θ and the dataset, release the rest."""
        for cid in self.pins.on_finish(final_theta_cid):
            self.blobs.store.unpin(cid)
        self._save_pins()

    def _release_pins(self, round_: int) -> None:
        """Round ``round_``'s commit was accepted: let the old rounds' blobs go."""
        before = self.pins.committed
        for cid in self.pins.on_commit(round_):
            self.blobs.store.unpin(cid)
        if self.pins.committed != before:
            self._save_pins()

    def _save_pins(self) -> None:
        try:
            self.pins.save(self.work_dir / PINS_FILE)
        except OSError as exc:  # a full disk: the pins stay, only their release may be late
            self.node.log_once("self", LocalError(str(exc)), "saving the pin ledger failed")

    def _announce_later(self, cid: str) -> None:
        async def announce() -> None:
            try:
                await self.blobs.announce(cid)
            except PcpError as exc:
                self.node.log_once("self", exc, "announcing a blob failed")

        assert self._nursery is not None
        self._nursery.start_soon(announce)

    def _state_bound(self, copies: int) -> int:
        """The most bytes ``copies`` fp32 copies of θ can weigh (θ or a Δ: 1; a checkpoint,
        θ and momentum: 2), plus framing: a blob named as one and declaring more is refused
        before any chunk moves."""
        from pcp_p2p.compile.model import num_params, preset

        vocab = self.dataset.vocab_size if self.dataset is not None else MAX_VOCAB
        return copies * 4 * num_params(preset(self.spec.model, vocab_size=vocab)) + (1 << 20)

    async def _fetch_bytes(
        self, cid: str, hint: str | None = None, *, keep: bool = True, for_run: bool = False,
        max_size: int | None = None,
    ) -> bytes:
        """A blob, from the hinted peer first (a blob just published may not have a
        provider record in the DHT yet), then from any provider, retrying a few
        times while provider records propagate.

        ``keep=False`` is for a Δ the shepherd averages once and nobody asks it
        for again: it is fetched into memory only (``fetch_into``), not written
        to disk, pinned or announced, so a shepherd's store does not fill up
        with every worker's Δ of every round. A blob above the in-memory limit
        goes through the store after all. A kept blob is pinned for the run's
        life (``for_run``: dataset, artifacts) or for its round.
        """
        storing = self._storing.get(cid)
        if storing is not None:
            await storing.wait()
        if not self.blobs.store.has(cid):
            hinted = self._peer_info(hint or self.shepherd_peer)
            delay = 0.5
            for attempt in range(FETCH_ATTEMPTS):
                providers = [hinted] if hinted and attempt % 2 == 0 else None
                try:
                    if not keep:
                        try:
                            return bytes(await self.blobs.fetch_into(cid, providers=providers, max_size=max_size))
                        except OversizedMessage:
                            keep = True
                    await self.blobs.fetch(cid, pin=True, providers=providers, announce=False, max_size=max_size)
                    self._announce_later(cid)
                    break
                except (PeerError, BlobNotFound) as exc:  # not provided yet, or provider gone
                    if attempt == FETCH_ATTEMPTS - 1:
                        raise
                    log.debug("fetch of %s failed (%s); retrying in %.1f s", cid, exc, delay)
                    await trio.sleep(delay)
                    delay = min(delay * 2, 8.0)
        if keep:
            self._pin(cid, for_run)
        return await trio.to_thread.run_sync(self.blobs.store.read, cid)

    def _peer_info(self, peer_id: str | None) -> PeerInfo | None:
        from pcp_p2p.node.node import transport_addrs

        member = self.node.membership.get(peer_id) if peer_id else None
        if member is None or peer_id == self.node.peer_id:
            return None
        return PeerInfo(ID.from_base58(peer_id), transport_addrs(member.record.addrs))

    async def _fetch(self, who: str, cid: str, hint: str | None) -> None:
        try:
            # The shepherd fetches only Δs (pseudo-gradients): used once, not kept.
            artifact = who == "worker" and self._is_artifact(cid)
            # θ and Δs weigh one copy of the model; a manifest a few KiB
            bound = (1 << 20) if artifact else self._state_bound(1)
            data = await self._fetch_bytes(cid, hint, keep=who != "shepherd", for_run=artifact, max_size=bound)
            if artifact:
                await self._prepare_artifact(data)
        except PcpError as exc:
            self._send.send_nowait(("blob_failed", who, cid, exc))
            return
        self._send.send_nowait(("blob", who, cid, data))

    def _is_artifact(self, cid: str) -> bool:
        ann = self.worker.current if self.worker is not None else None
        return ann is not None and cid in ann.artifacts.values()

    async def _prepare_artifact(self, manifest_bytes: bytes) -> None:
        """Verify a train manifest against the shepherd, fetch its vmfb, start the executor."""
        from pcp_p2p.compile.manifest import Manifest
        from pcp_p2p.diloco import engine

        from pcp_p2p.diloco.data import decode_dataset

        assert self.shepherd_peer is not None and self.worker is not None
        manifest = decode(manifest_bytes, Manifest)
        if self.engine is not None:
            return
        if self.dataset is None:
            ann = self.worker.current
            if ann is None or not ann.dataset_cid:
                raise VerificationError("the announcement names no dataset blob")
            data = await self._fetch_bytes(ann.dataset_cid, ann.shepherd, for_run=True)
            self.pins.for_dataset(ann.dataset_cid)
            self.dataset = await trio.to_thread.run_sync(decode_dataset, data)
        await self._fetch_bytes(manifest.artifact_cid, for_run=True, max_size=manifest.artifact_size)
        vmfb_path = self.blobs.store.path(manifest.artifact_cid)
        executor = await trio.to_thread.run_sync(engine.start_executor, vmfb_path, manifest, self.shepherd_peer)
        self.engine = engine.InnerEngine(executor, self.spec, self.dataset)
        self.artifacts.append({"target": manifest.target, "cid": manifest.artifact_cid,
                               "size": manifest.artifact_size, "cache_hit": None})
        log.info("run %s: executor started for %s (artifact %s)", self.run_id[:16], manifest.target, manifest.artifact_cid[:20])

    async def _inner(self, eff: RunInner, cancel: threading.Event) -> None:
        try:
            if self.engine is None:
                raise VerificationError("no verified artifact is loaded")
            result = await trio.to_thread.run_sync(self.engine.run, eff, cancel)
        except PcpError as exc:
            self._send.send_nowait(("inner_failed", eff.round, eff.attempt, exc))
            return
        finally:
            self._cancel.pop((eff.round, eff.attempt), None)
        self._send.send_nowait(("inner_done", result))

    async def _lookup_commit(self) -> CommitRecord | None:
        try:
            rec = await self.node.get_record("commit", self.run_id)
        except PcpError as exc:
            log.debug("commit lookup failed: %s", exc)
            return None
        return rec if isinstance(rec, CommitRecord) else None

    async def _lookup_and_post(self, for_election: bool) -> None:
        self._send.send_nowait(("commit_lookup", await self._lookup_commit(), for_election))

    async def _publish_commit(self, rec: CommitRecord) -> None:
        """Store the commit record in the DHT, retrying a few times.

        Why retry: the record is how a node that was down when the commit went
        out (restarted after churn, joining late) learns it. A put that timed
        out on a busy swarm, never retried, left such a node waiting for a
        commit it could not see; after the last round nobody sends it again.
        """
        signed = sign_record(self.node.identity, "commit", self.run_id, rec, ttl_s=MAX_TTL_S, seq=commit_seq(rec))
        delay = 2.0
        for attempt in range(COMMIT_PUT_ATTEMPTS):
            try:
                # Generous deadline: a swarm busy training answers DHT requests slowly.
                await self.node.put_record(signed, timeout=3 * self.node.config.op_timeout)
                return
            except PcpError as exc:
                if attempt == COMMIT_PUT_ATTEMPTS - 1:
                    self.node.log_once("self", exc, "storing the commit record failed")
                    return
                log.info("run %s: storing the commit of round %d failed (%s); again in %.0f s",
                         self.run_id[:16], rec.round + 1, exc, delay)
                await trio.sleep(delay)
                delay *= 2

    # -- status -------------------------------------------------------------------------

    def _election_status(self) -> dict[str, Any]:
        if self.election is None:
            return {"term": None, "lease_expires_s": None, "shepherd_history": []}
        st = self.election.status(time.time())
        le = st.get("lease_expires_s")
        return {"term": st.get("term"), "lease_expires_s": None if le is None else round(le, 1),
                "election_role": st.get("role"), "shepherd_history": st.get("shepherd_history", [])}

    def _deadline_left(self) -> float | None:
        ann = self.worker.current if self.worker is not None else None
        return round(max(0.0, ann.deadline - time.time()), 1) if ann is not None else None

    def _utilisation(self, busy: float) -> float | None:
        return _utilisation_of(busy, self.stats.first_train_at, self.stats.last_commit_at)

    def _members(self) -> int:
        """Nodes taking part in the run: the shepherd's roster here, else the members that list the run."""
        if self.shepherd is not None:
            return len(self.shepherd.roster)
        return sum(1 for m in self.node.membership.live()
                   if m.record.role == "worker" and self.run_id in m.record.runs)

    def _phase(self, shepherd_live: bool) -> str:
        """The phase to show (:func:`~pcp_p2p.diloco.lifecycle.run_phase`): compiling, waiting
        for quorum and set-up failures rather than the idle worker's ``idle``."""
        w = self.worker
        sm = self.shepherd
        if w is None and self._target is None and self.election is not None:
            return self.phase  # this machine runs none of the run's targets: that is what it shows
        member = self.node.membership.get(self.shepherd_peer) if self.shepherd_peer else None
        started = w is not None and (w.current is not None or w.last_commit is not None)
        if sm is not None and sm.phase is ShepherdPhase.WAITING and len(sm.roster) < self.spec.round.min_quorum:
            started = False  # leading, and the round waits for joins: the quorum is what is missing
        phase = run_phase(PhaseInputs(
            base=self.phase, ended=self.finished.is_set() or self.phase in ENDED,
            setup_error=self._setup_error if self.shepherd is None else None,
            compiling=self._becoming,
            shepherd_state=member.record.state if member is not None else None,
            started=started, members=self._members(), quorum=self.spec.round.min_quorum,
        ))
        if shepherd_live or self.shepherd_peer is None or phase in ENDED:
            return phase
        return f"{phase} (shepherd lost)"

    def status(self) -> dict[str, Any]:
        w = self.worker
        rec = w.last_commit if w is not None else None
        shepherd_live = self.shepherd_peer is not None and self.shepherd_peer in self.node.membership
        busy = self.engine.busy_s if self.engine else 0.0
        tokens = self.engine.tokens if self.engine else 0
        return {
            "run_id": self.run_id,
            "owner": self.run.owner,
            "name": self.spec.name,
            "round": (rec.round + 1) if rec is not None else 0,
            "rounds": self.spec.round.rounds,
            "phase": self._phase(shepherd_live),
            "members": self._members(),
            "shepherd": self.shepherd_peer,
            **self._election_status(),
            "is_shepherd": self.shepherd is not None,
            "theta": w.theta_cid if w is not None else None,
            "participants": len(rec.participants) if rec is not None else 0,
            "deadline_s": self._deadline_left(),
            "quorum": self.spec.round.min_quorum,
            "loss": rec.mean_loss if rec is not None else None,
            "val_loss": rec.val_loss if rec is not None else None,
            "tokens_per_s": round(tokens / busy, 1) if busy else None,
            "busy_s": round(busy, 2),
            "tokens_trained": tokens,
            "bytes_submitted": self.stats.bytes_submitted,
            # Compute utilisation: time inside inner steps over the wall time from
            # the first inner run to the latest commit.
            "utilisation": self._utilisation(busy),
            "outer_lr": self.spec.outer.lr,
            "first_contribution_s": self.stats.first_contribution_s,
            "contributed_rounds": self.stats.contributed_rounds[-100:],
            "rejected": dict(self.stats.rejected),
            "held": self.stats.held,  # leases/commits kept until their authority can be checked
            "audits": dict(self.stats.audits),
            "admission": self.spec.admission.mode,
            "banned": len(self.ledger.bans()),
            "history": list(self.stats.history),
        }


def _utilisation_of(busy: float, start: float | None, end: float | None) -> float | None:
    if start is None or end is None or end <= start:
        return None
    return round(min(1.0, busy / (end - start)), 4)


def _describe(x: Any) -> str:
    """A short one-line description of an effect or input, for debug logs."""
    name = type(x).__name__
    fields = []
    for attr in ("to", "cid", "round", "attempt", "worker", "theta_cid", "hint"):
        v = getattr(x, attr, None)
        if v is not None:
            fields.append(f"{attr}={str(v)[-12:]}")
    msg = getattr(x, "message", None)
    if msg is not None:
        fields.append(f"msg={type(msg).__name__}")
    return f"{name}({', '.join(fields)})"

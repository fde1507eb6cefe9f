"""One run on one node, over the real network: the pump around the run machine.

Every rule of the run (who leads, when a commit may go out, when joins wait,
when the run is over) is :class:`~pcp_p2p.diloco.run.run_machine.RunMachine`'s.
This module only moves bytes and time: it feeds the machine one input at a
time from an inbox (messages, fetched blobs, finished inner runs, lookups, the
membership view once a second, its deadlines) and carries out the effects it
returns; slow effects run in tasks of their own and post their results to the
inbox, so the machine never sees two inputs at once.

=====================  ===============================================================
effect                 carried out by
=====================  ===============================================================
Send                   ``/pcp/msg/1.0.0`` (direct, acknowledged); to ourselves: the inbox
StoreBlob, Fetch       :class:`~pcp_p2p.diloco.run.run_blobs.RunBlobs`; a train manifest
                       is checked, its vmfb fetched and the IREE executor started
RunInner, CancelInner  :class:`~pcp_p2p.diloco.run.engine.InnerEngine` in a thread
ShiftInner             the early run's :class:`~pcp_p2p.diloco.run.engine.ShiftSlot`
LookUp*, Publish*      :class:`~pcp_p2p.diloco.run.run_dht.RunRecords` (the DHT)
ReplicateCommit        the commit sent to all its targets at once; the first ack (or a timeout)
                       answers, the other sends go on (the batch after joins them)
SetUpShepherd          dataset, artifacts (compiled, or the standby's), evaluator,
                       starting state; ``CancelSetUp`` cancels it (the compiler is killed)
Audit                  :class:`~pcp_p2p.diloco.run.run_audits.AuditClerk`
SaveLease, Stopped     files in the run's folder (a restart's anchor, the owner's stop)
=====================  ===============================================================

Time is the injected ``clock`` (the wall clock on a node: round deadlines are
compared across nodes). Status: :mod:`pcp_p2p.diloco.run.run_status`.

**The machine runs off the event loop.** A shepherd's inputs carry the heavy work
(decoding Δs, scoring them and evaluating θ with JAX, the robust rule, hashing
and serialising the checkpoint): up to a second or more per input on a loaded
machine, during which an event loop that ran them would send nothing, no
heartbeat and no ack, and its followers would depose a shepherd that is only
busy. So each input (and each tick) is fed to the machine in a worker thread
(``trio.to_thread.run_sync``, one at a time: the pump waits for it, so the
machine still takes one input at a time), its effects are carried out back
here, and the event loop stays free for the network meanwhile. Heartbeats go
from a task of their own (``_heartbeats``) whenever the machine's own have
not gone out for a beat: a busy shepherd keeps beating, a dead or hung process
does not, and a machine that stopped making progress stops renewing its lease,
which bounds how long it can hold a term anyway. Other tasks that change the
machine or vouch for a commit take ``_machine_lock`` (a commit's vouching in a
thread, in the machine's turn); status never waits for it (it shows the last
status computed while the machine was idle), nor do the DHT's record checks
(``check_record``): nothing on the event loop waits for a machine step.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from pcp_p2p.blob.swarm import worth_a_tree
from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import (
    BlobError,
    HashMismatch,
    HeldBack,
    LocalError,
    MalformedMessage,
    NotElected,
    PcpError,
    PeerError,
    VerificationError,
)
from pcp_p2p.diloco.algorithm.checkpoint import THETA_HEAD, checkpoint_theta_span
from pcp_p2p.diloco.algorithm.data import SHAKESPEARE, CharDataset, decode_dataset, encode_dataset
from pcp_p2p.diloco.algorithm.update import update_size
from pcp_p2p.diloco.protocol.admission import ALLOWLIST_KIND, Admission, AllowlistUpdate
from pcp_p2p.diloco.protocol.commits import RebuiltTheta, rebuild_theta, start_checkpoint
from pcp_p2p.diloco.protocol.departures import make_leave
from pcp_p2p.diloco.protocol.effects import EARLY, CancelInner, Rejected, RunInner, Send, ShiftInner, StoreBlob
from pcp_p2p.diloco.protocol.election import Election, Heartbeat, Lease, PublishLease
from pcp_p2p.diloco.protocol.lifecycle import STOP_FILE, STOP_KIND, STOPPED, StopOrder
from pcp_p2p.diloco.protocol.messages import CommitRecord, CommitWithUpdate, RoundAnnouncement, verify
from pcp_p2p.diloco.protocol.runs import KnownRun
from pcp_p2p.diloco.run.engine import ShiftSlot
from pcp_p2p.diloco.run.reputation import ReputationLedger
from pcp_p2p.diloco.run.run_audits import AuditClerk
from pcp_p2p.diloco.run.run_blobs import PINS_FILE, RunBlobs
from pcp_p2p.diloco.run.run_dht import COMMIT_PUT_ATTEMPTS, RunRecords
from pcp_p2p.diloco.run.run_effects import (
    Audit,
    BlobFailed,
    BlobIn,
    CancelSetUp,
    CommitAccepted,
    CommitLookedUp,
    Event,
    Fetch,
    InnerDone,
    InnerFailed,
    Leads,
    LeaseLookedUp,
    LookUpCommit,
    LookUpLease,
    LookUpOwnerRecord,
    MembersSeen,
    MessageIn,
    PublishCommit,
    ReleasePins,
    ReplicateCheckpoint,
    ReplicateCommit,
    Replicated,
    RunEffect,
    RunEnded,
    SaveLease,
    SetUpShepherd,
    Stopped,
    Wake,
)
from pcp_p2p.diloco.run.run_machine import REPLICATE_TIMEOUT_S, Member, RunMachine, election_config
from pcp_p2p.diloco.run.run_setup import TermSetUp
from pcp_p2p.diloco.run.run_status import run_status
from pcp_p2p.net.reachability import known
from pcp_p2p.wire import Message, decode, encode

if TYPE_CHECKING:
    from pcp_p2p.blob.service import BlobService
    from pcp_p2p.diloco.protocol.shepherd import Shepherd
    from pcp_p2p.diloco.protocol.worker import Worker
    from pcp_p2p.diloco.run.engine import InnerEngine
    from pcp_p2p.diloco.run.pins import RunPins
    from pcp_p2p.node.node import Node

__all__ = ["COMMIT_PUT_ATTEMPTS", "PINS_FILE", "RunRuntime"]

log = logging.getLogger("pcp.run")

FINISH_GRACE_S = 30.0
STOP_GRACE_S = 5.0  # a stopped run's in-flight work (sends, an inner run told to cancel) gets this long
KEEP_CHECKPOINTS = 2
KEEP_IN_MEMORY_BYTES = 256 << 20  # up to this size, the last checkpoint built stays in memory (and one spare)
COMMIT_BEHIND_S = 1.0  # an announcement that overtook its commit waits this long for it to arrive
MAX_LATE_COMMITS = 2  # refused commits whose checkpoint is still fetched, to accept once held
LEASE_FILE = "lease.bin"  # the latest lease this node accepted: its anchor for catching up after a restart
MAX_VOCAB = 1 << 16  # bounds a blob's size before this node holds the dataset
OWNER_RECORDS: dict[str, type[Message]] = {STOP_KIND: StopOrder, ALLOWLIST_KIND: AllowlistUpdate}


SLOW_INPUT_S = 0.5  # a machine step longer than this is logged (the event loop goes on meanwhile)
MAX_BEATS_QUEUED = 64  # heartbeats kept between two machine steps (more are dropped: liveness hints only)
TICK_FLOOR_S = 0.25  # while messages keep arriving, deadlines are still looked at this often


class RunRuntime:
    """Drives one run on one node until the run finishes or the node stops."""

    def __init__(self, node: Node, blobs: BlobService, run: KnownRun, work_dir: Path,
                 clock: Callable[[], float] = time.time) -> None:
        self.node, self.run, self.run_id, self.spec = node, run, run.run_id, run.spec
        self.work_dir = work_dir
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self.io = RunBlobs(node, blobs, work_dir, hint=lambda: self.machine.shepherd_peer)
        self.records = RunRecords(node, self.run_id, run.owner)
        self.audits = AuditClerk(self)
        ledger = ReputationLedger.open(work_dir, self.run_id)  # strikes and bans, kept on disk
        self.machine = RunMachine(
            spec=self.spec, run_id=self.run_id, owner=run.owner, identity=node.identity,
            election=Election(self.run_id, node.identity, election_config(self.spec)),
            admission=Admission.for_run(run.signed, bans=ledger), ledger=ledger,
            target=None, tokens_per_s=1.0, started_at=clock(),
        )
        self.started = False  # the election started (deliveries before are held back)
        self.engine: InnerEngine | None = None
        self.dataset: CharDataset | None = None
        # The bundled corpus encoded here (CID, blob, dataset), while the term's shepherd compiles
        # (:meth:`_encode_bundled`); set once that is done or failed, None when not started.
        self._bundled: tuple[str, bytes, CharDataset] | None = None
        self._bundled_ready: trio.Event | None = None
        self.artifacts: list[dict[str, Any]] = []  # what this node compiled or loaded, for status
        self.finished = trio.Event()
        self._send, self._inbox = trio.open_memory_channel[Event](1000)
        self._nursery: trio.Nursery | None = None
        # (round, attempt) -> the inner run's cancel event and shift slot (EARLY: an early run)
        self._inner_jobs: dict[tuple[int, int], tuple[threading.Event, ShiftSlot]] = {}
        self.setup = TermSetUp(self)  # compiling, when this node wins a term
        self._prewarmed = False
        # checkpoints this node holds for a possible takeover (CID -> its θ's CID), oldest first
        self._replicas: dict[str, str] = {}
        self._holding: dict[str, trio.Event] = {}  # checkpoints being built or fetched: once each
        # The last checkpoint this node built, in memory (the next is built from it), and the buffer of
        # the one before, which the next is built in: no disk read, no fresh memory (_rebuild_checkpoint).
        self._built: tuple[str, bytearray] | None = None
        self._spare: tuple[str, bytearray] | None = None
        self._building = trio.Lock()
        # θ of the checkpoint being built, checked ahead of the rest (_rebuild_checkpoint), until the
        # worker takes it (_theta_from_checkpoint): (θ CID, θ's bytes); one at a time
        self._early_theta: tuple[str, bytes] | None = None
        self._late: set[str] = set()  # checkpoints of refused commits still being fetched (_accept_late)
        # θ CID -> vouched commits being taken (their checkpoint held) in deliver, and the event set
        # once each is in the machine or refused: the announcement that starts from it waits for it
        self._taking: dict[str, tuple[trio.Event, CommitRecord]] = {}
        self._arriving: dict[str, trio.Event] = {}  # θ CID -> an announcement awaiting its commit
        # The machine takes its inputs in a worker thread (see the module's essay); what
        # other tasks change of it waits for the input in progress (``_machine_lock``).
        self._machine_lock = threading.Lock()
        self._machine_thread = trio.CapacityLimiter(1)
        self._status: dict[str, Any] | None = None  # the last status computed (shown while the machine is busy)
        self._beat_at = float("-inf")  # when this node last sent its heartbeat (its clock)
        self._beating: set[str] = set()  # peers a heartbeat is on its way to (one at a time each)
        self._beats_in: list[tuple[str, Heartbeat]] = []  # heartbeats received, for the next step
        # Commits on their way to a peer (``send_to``): a second send of the same one joins it.
        self._commits_out: dict[tuple[str, int, int, int, str], _InFlight] = {}

    # -- what others read -----------------------------------------------------------------

    @property
    def phase(self) -> str:
        return self.machine.phase

    @phase.setter
    def phase(self, value: str) -> None:
        self.machine.phase = value

    @property
    def pins(self) -> RunPins:
        return self.io.pins

    @property
    def worker(self) -> Worker | None:
        return self.machine.worker

    @property
    def shepherd(self) -> Shepherd | None:
        return self.machine.shepherd

    def status(self) -> dict[str, Any]:
        """The run's status; while the machine is busy with an input, the last one computed
        (a status request must not stall the event loop behind a commit)."""
        if self._machine_lock.acquire(blocking=self._status is None):
            try:
                self._status = run_status(self)
            finally:
                self._machine_lock.release()
        assert self._status is not None
        return self._status

    def check_record(self, payload: Message, now: float) -> None:
        """The authority a DHT record of this run needs (``PcpRecordValidator.authorities``).

        Without ``_machine_lock``: the DHT validates on the event loop, every lease renewal
        at every node, and waiting here for a machine step would stall the loop (heartbeats
        included) for as long as the step takes. The check only reads the election, which
        may be mid-input in the machine's thread; it decides what this node's DHT stores or
        selects, never what the node acts on (the election checks every lease and commit
        itself, whole, before anything follows from it)."""
        if self.started:
            self.machine.check_record(payload, now)

    # -- inputs from the network ----------------------------------------------------------

    async def deliver(self, sender: str, msg: Message) -> None:
        """A round message from ``sender`` (called by the node's messenger).

        A commit from the shepherd that signed it is acknowledged, and accepted,
        only once this node holds its checkpoint (the messenger acks after this
        returns, and refuses when it raises): the shepherd waits for one such ack
        before the commit goes anywhere else (the machine's ``ReplicateCommit``).
        """
        if getattr(msg, "run_id", None) != self.run_id:
            return
        if isinstance(msg, Heartbeat):
            # Not behind the inbox: fed to the machine ahead of its next step (``_feed``), so a
            # follower whose inbox is busy never suspects a holder whose beats are waiting there.
            # Only the lease holder's own count (``Election.on_heartbeat``), so only they are kept:
            # anyone else's would crowd the holder's out of the queue and get it suspected.
            lease = self.machine.election.lease  # (one reference read: no lock needed)
            if lease is not None and sender == lease.holder == msg.holder and len(self._beats_in) < MAX_BEATS_QUEUED:
                self._beats_in.append((sender, msg))
            return
        if isinstance(msg, StopOrder):
            self.stop(msg, self.clock())  # refused (the messenger says why) unless the owner signed it
            return
        carried = b""
        if isinstance(msg, CommitWithUpdate):  # (the update counts only as the vouched commit's: below)
            carried, msg = msg.update, msg.commit
        if isinstance(msg, CommitRecord) and msg.checkpoint_cid and sender == msg.shepherd:
            verify(msg, sender)  # BadSignature: the messenger refuses it, nothing is fetched
            # (from here, before any wait: the announcement right behind it must find it)
            taking = self._taking.setdefault(msg.theta_cid, (trio.Event(), msg))
            if (early := self._arriving.get(msg.theta_cid)) is not None:
                early.set()  # an announcement that came first waits for this commit now

            def taken() -> None:  # in the machine (or refused): the announcement behind it may go
                if taking[1] is msg and self._taking.get(msg.theta_cid) is taking:
                    del self._taking[msg.theta_cid]
                    taking[0].set()
            try:
                await self._take_commit(sender, msg, carried, taken)
            finally:
                taken()
            return
        if isinstance(msg, RoundAnnouncement):
            await self._after_its_commit(msg)
        self.post(MessageIn(sender, msg))

    async def _after_its_commit(self, ann: RoundAnnouncement) -> None:
        """Wait while the commit ``ann`` starts from is taken here, so the machine sees the two in
        order. The shepherd sends the announcement right behind the commit (``ReplicateCommit.then``):
        seen first, a worker with a pending submission would hold the round and fetch θ on its own
        rather than out of the checkpoint it is building. The two travel on streams of their own, so
        the announcement may even come first: for the round after the next one this node expects
        (its commit not seen yet; round 1 before any commit), it waits up to ``COMMIT_BEHIND_S``
        for that commit to arrive."""
        w = self.machine.worker
        last = w.last_commit if w is not None else None
        after_next = ann.round == 1 if last is None else (ann.term == last.term and ann.round == last.round + 2)
        if (w is not None and after_next and ann.theta_cid not in self._taking
                and ann.theta_cid not in self._arriving):
            arriving = self._arriving[ann.theta_cid] = trio.Event()
            try:
                with trio.move_on_after(COMMIT_BEHIND_S):
                    await arriving.wait()
            finally:
                del self._arriving[ann.theta_cid]
        if (before := self._taking.get(ann.theta_cid)) is not None:
            await before[0].wait()  # (bounded: the commit's hold is, REPLICATE_TIMEOUT_S)

    async def _take_commit(self, sender: str, msg: CommitRecord, update: bytes = b"",
                           taken: Callable[[], None] = lambda: None) -> None:
        """Vouch for a commit its shepherd signed, hold its checkpoint, then hand the commit to
        the machine; raise (no ack) when it is not vouched for, or its checkpoint could not be
        held within ``REPLICATE_TIMEOUT_S``. ``update``: the update blob that came with it
        (used only if its CID is the commit's ``update_cid``).

        A checkpoint built from the update goes to the machine as soon as its θ is built and
        checked against the commit's θ CID, before its momentum is written and its own CID
        checked (:meth:`_rebuild_checkpoint`): θ is all the next round trains from, and the
        rest cost four workers on two cores 0.1 s of every round (``bench/round.py``). Should
        the rest fail (only a shepherd that signed a θ and a checkpoint that do not belong
        together can make it), the checkpoint is fetched, and the commit is not acked.

        A checkpoint built here is held in memory while it is written to disk: the machine
        gets the commit (θ, and the round after it) then, ``taken`` is called, and the ack
        (this returning) waits for the write, since it tells the shepherd the commit has a
        copy on this node's disk. Four workers writing 80 MB each at once took 0.2 s of the
        round on these machines (``bench/round.py``)."""
        try:  # the authority chain first: nothing a commit names is fetched before it
            if not self.started:
                raise HeldBack("this node's election has not started")
            # refused outright (not acked) if it can never hold; in the machine's turn, off the loop
            await trio.to_thread.run_sync(self._vouch, msg, limiter=self._machine_thread)
        except HeldBack as exc:
            # Not checkable yet: the election keeps it, nothing it names is fetched, no ack.
            self.post(MessageIn(sender, msg))
            raise NotElected(f"commit of term {msg.term} round {msg.round + 1}: {exc}; not acknowledged") from exc
        if update and (not msg.update_cid or await trio.to_thread.run_sync(cid_of, update) != msg.update_cid):
            self.node.log_once(sender, HashMismatch(f"the update sent with commit {msg.round + 1} is not the one "
                                                    "it names"), "taking a commit's update")
            update = b""  # (fetched instead, from whoever holds the named one)
        posted = False

        def theta_ready() -> None:  # built from the update, θ checked: the machine may go on
            nonlocal posted
            posted = True
            self.post(MessageIn(sender, msg))
            taken()
        with trio.move_on_after(REPLICATE_TIMEOUT_S):  # by swarming: every participant fetches it now
            await self._hold_checkpoint(msg, hint=sender, update=update, theta_ready=theta_ready)
        if not self.io.holds(msg.checkpoint_cid):
            # A shepherd killed while we fetched took the only copy with it; a commit
            # nobody else holds must not become the round the next term starts from.
            # A fetch that was only slow goes on, and its commit is accepted once held.
            # (One whose θ was built and checked here is in the machine already: its θ holds,
            # and a term that cannot have its checkpoint starts from θ, losing only the momentum.)
            if self._nursery is not None and len(self._late) < MAX_LATE_COMMITS \
                    and msg.checkpoint_cid not in self._late:
                self._late.add(msg.checkpoint_cid)
                self._nursery.start_soon(self._accept_late, sender, msg, not posted)
            raise PeerError(f"commit of round {msg.round + 1}: its checkpoint could not be fetched "
                            f"from {sender} within {REPLICATE_TIMEOUT_S:.0f} s; not acknowledged")
        if not posted:
            self.post(MessageIn(sender, msg))
            taken()
        if not await self.io.stored(msg.checkpoint_cid):
            raise BlobError(f"commit of round {msg.round + 1}: its checkpoint could not be written to this "
                            "node's store; not acknowledged")

    async def _accept_late(self, sender: str, msg: CommitRecord, post: bool = True) -> None:
        """A commit refused because its checkpoint came too slowly for the shepherd's wait: once
        this node holds the checkpoint after all, the commit is accepted (not acknowledged: the
        shepherd stopped waiting). Before, the node never took it: a relay-only home that
        contributed to rounds 4 and 5 showed neither as committed (network lab, 2026-11-24)."""
        try:
            await self._hold_checkpoint(msg, hint=sender)
            if post and self.io.holds(msg.checkpoint_cid):
                self.post(MessageIn(sender, msg))
        finally:
            self._late.discard(msg.checkpoint_cid)

    def _vouch(self, msg: CommitRecord) -> None:
        with self._machine_lock:
            self.machine.vouch_commit(msg)

    def stop(self, order: StopOrder, now: float) -> None:
        """End the run on the owner's signed order; raise (typed, nothing changes) unless it holds."""
        with self._machine_lock:
            effects = self.machine.stop(order, now)
        self._carry_out(effects)

    async def announce_departure(self) -> None:
        """This node leaves (a graceful stop): tell the shepherd, or, as the shepherd, the run.
        Unbounded here: the caller bounds it (:func:`pcp_p2p.core.shutdown.add_farewell`)."""
        if self.finished.is_set() or not self.started:
            return
        with self._machine_lock:
            self.machine.members = self._members()
            targets = self.machine.departure_targets()
        if not targets:
            return
        leave = make_leave(self.run_id, self.node.identity, self.clock())
        log.info("run %s: announcing this node's departure to %d peer(s)", self.run_id[:16], len(targets))
        async with trio.open_nursery() as nursery:
            for peer in targets:
                nursery.start_soon(self.send_to, peer, leave)

    # -- the loop -------------------------------------------------------------------------

    async def run_forever(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = self.io.nursery = nursery
            if self._stopped_before():
                return
            try:
                await self._loop()
            finally:
                # Inner runs are moot once the run is over, and an early one would wait for its
                # shift forever: the nursery waits for their threads (they are not abandoned).
                self._cancel_inner_runs()
            # Finished: let in-flight work (the final commit's sends, announcements)
            # complete, but not forever; a stopped run has nothing more to say.
            grace = STOP_GRACE_S if self.machine.stop_latch.stopped else FINISH_GRACE_S
            nursery.cancel_scope.deadline = trio.current_time() + grace

    def _cancel_inner_runs(self) -> None:
        for cancel, slot in self._inner_jobs.values():
            cancel.set()
            slot.wake()

    async def _loop(self) -> None:
        """Feed the machine its inputs and ticks until the run is over."""
        await self._start()
        last_tick = float("-inf")
        while not self.finished.is_set():
            now = self.clock()
            wake = self.machine.next_wakeup
            # A wakeup already past (a worker fetching or training) must not make this
            # loop spin: look again in half a second.
            wait = 3600.0 if wake is None else max(wake - now, 0.5 if wake <= now else 0.0)
            ev: Event | None = None
            with trio.move_on_after(wait):
                ev = await self._inbox.receive()
            if ev is not None:
                await self._dispatch(ev)
                # A steady flow of messages must not starve the deadlines (a shepherd's
                # heartbeats): tick once one is due, at most every TICK_FLOOR_S.
                due = self.machine.next_wakeup
                if due is None or self.clock() < due or self.clock() - last_tick < TICK_FLOOR_S:
                    continue
            last_tick = self.clock()
            await self._feed(functools.partial(self.machine.tick, last_tick), "tick")

    async def _start(self) -> None:
        from pcp_p2p.executor.cpu import best_cpu_target
        from pcp_p2p.net.capabilities import measure_gflops

        target = best_cpu_target().name
        if target in self.spec.targets:
            self.machine.target = target
        else:
            log.warning("run %s: this machine's best target %s is not allowed by the run", self.run_id[:16], target)
        # Measured now rather than at node start-up, when a local swarm's processes
        # all start at once and measure each other's load.
        gflops = max(self.node.capabilities.throughput_gflops, await trio.to_thread.run_sync(measure_gflops, 0.5))
        self.machine.tokens_per_s = self._speed_estimate(gflops)
        group = self.node.config.worker_group
        if group is not None:  # an MPI worker group claims its live ranks' speed together (pcp_p2p.cluster)
            self.machine.tokens_per_s = group.throughput(self.machine.tokens_per_s)
        self._restore_lease()
        if self.spec.dataset == SHAKESPEARE:
            self._bundled_ready = trio.Event()
            assert self._nursery is not None
            self._nursery.start_soon(self._encode_bundled)
        self.started = True
        self._carry_out(self.machine.start(self.clock()))
        assert self._nursery is not None
        self._nursery.start_soon(self._members_loop)
        self._nursery.start_soon(self._heartbeats)

    async def _heartbeats(self) -> None:
        """While this node holds the term, a heartbeat to every run member each ``beat_every``,
        busy machine or not: whenever the machine's own (from its ticks) have not gone out."""
        election = self.machine.election
        if not election.config.heartbeats:
            return
        while True:
            beat = election.beat_every  # (reads two fields: no lock needed)
            await trio.sleep(max(0.0, self._beat_at + beat - self.clock()))
            now = self.clock()
            if now < self._beat_at + beat:
                continue  # the machine's own went out meanwhile
            hb = self.machine.election.heartbeat(now)  # (reads two fields: no lock needed)
            self._beat_at = now
            if hb is not None:
                self._carry_out([Send(peer, hb) for peer in self.machine.run_members()])

    async def _members_loop(self) -> None:
        """The membership view, once a second: the machine decides what follows from it."""
        while True:
            self.post(MembersSeen(self._members()))
            await trio.sleep(1.0)

    def _members(self) -> list[Member]:
        return [Member(m.record.peer_id, m.record.started_at, m.record.capabilities.can_compile,
                       m.record.role == "worker", self.run_id in m.record.runs,
                       known(m.record.reachability))
                for m in self.node.membership.live()]

    def post(self, ev: Event) -> None:
        """Queue an input for the machine (from an effect's task, or the network)."""
        self._send.send_nowait(ev)

    async def _dispatch(self, ev: Event) -> None:
        try:
            await self._feed(lambda: self.machine.handle(ev, self.clock()), type(ev).__name__)
        except Exception as exc:  # the boundary (pcp_p2p.core.faults): a bug drops this input (its effects
            # not yet carried out with it), not the run, which a stranger's input must never stop
            self.node._reject(ev.sender if isinstance(ev, MessageIn) else "self", exc, "round")

    async def _feed(self, step: Callable[[], list[Any]], what: str) -> None:
        """Run one machine step in a worker thread, then carry its effects out here.

        Not abandoned on cancellation (a step is never half-applied), and one at a
        time (the pump waits; ``_machine_lock`` keeps other tasks out meanwhile)."""
        beats, self._beats_in = self._beats_in, []

        def locked() -> list[Any]:
            with self._machine_lock:
                effects: list[Any] = []
                for sender, hb in beats:  # they arrived before this step: the holder was alive then
                    effects += self.machine.handle(MessageIn(sender, hb), self.clock())
                return effects + step()

        t0 = self.clock()
        effects = await trio.to_thread.run_sync(locked, limiter=self._machine_thread)
        took = self.clock() - t0
        if took > SLOW_INPUT_S:
            log.info("run %s: %s took the machine %.2f s", self.run_id[:16], what, took)
        self._carry_out(effects)

    # -- effects --------------------------------------------------------------------------

    def _spawn(self, async_fn: Callable[..., Awaitable[object]], *args: object) -> None:
        """Start an effect's task in the run's nursery (which run_forever opens before any such effect)."""
        assert self._nursery is not None, "an effect that starts a task came before run_forever"
        self._nursery.start_soon(async_fn, *args)

    def _carry_out(self, effects: list[RunEffect]) -> None:
        n = self._nursery
        outbox: dict[str, list[Message]] = {}  # the batch's messages, per peer in the machine's order
        for e in effects:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("effect %s", _describe(e))
            if isinstance(e, Send):
                if isinstance(e.message, Heartbeat):
                    self._beat_at = self.clock()
                    if e.to not in self._beating:  # (else the one in flight will do)
                        self._beating.add(e.to)
                        n.start_soon(self._beat, e.to, e.message)  # type: ignore[union-attr]
                    continue
                if e.to == self.node.peer_id:
                    self.post(MessageIn(self.node.peer_id, e.message))
                else:
                    outbox.setdefault(e.to, []).append(e.message)
            elif isinstance(e, StoreBlob):
                self.io.store_later(e.cid, e.data)
            elif isinstance(e, Fetch):
                self._spawn(self._fetch, e.who, e.cid, e.hint)
            elif isinstance(e, RunInner):
                job = (threading.Event(), ShiftSlot())
                self._inner_jobs[(e.round, e.attempt)] = job
                self._spawn(self._inner, e, job)
            elif isinstance(e, CancelInner):
                found = self._inner_jobs.pop((e.round, e.attempt), None)
                if found is not None:
                    found[0].set()
                    found[1].wake()
            elif isinstance(e, ShiftInner):
                found = self._inner_jobs.get((e.round, EARLY))
                if found is not None:
                    found[1].shift(e)
            elif isinstance(e, LookUpCommit):
                self._spawn(self._lookup_commit, e.for_election)
            elif isinstance(e, LookUpLease):
                self._spawn(self._lookup_lease)
            elif isinstance(e, LookUpOwnerRecord):
                self._spawn(self._lookup_owner_record, e.kind)
            elif isinstance(e, PublishLease):
                self._spawn(self._publish_lease, e.lease, e.renewal, e.store)
            elif isinstance(e, PublishCommit):
                self._spawn(functools.partial(self.records.publish_commit, e.record,
                                              final=e.record.round + 1 >= self.spec.round.rounds))
            elif isinstance(e, ReplicateCommit):
                self._spawn(self._replicate_commit, e)
            elif isinstance(e, ReplicateCheckpoint):
                self._spawn(self._hold_checkpoint, e.record)
            elif isinstance(e, SetUpShepherd):
                self._spawn(self.setup.run, e.become)
            elif isinstance(e, CancelSetUp):
                self.setup.cancel(e.why)
            elif isinstance(e, Leads):
                (self.node.leads.add if e.leading else self.node.leads.discard)(self.run_id)
            elif isinstance(e, SaveLease):
                self._save(LEASE_FILE, e.lease, "saving the last lease failed")
            elif isinstance(e, ReleasePins):
                self.io.release_pins(e.round)
            elif isinstance(e, CommitAccepted):
                if (e.standby and not self._prewarmed and self.dataset is not None and self.machine.shepherd is None
                        and self.node.capabilities.can_compile and n is not None):
                    self._prewarmed = True  # after the first commit: training is under way
                    n.start_soon(self.setup.prewarm)
            elif isinstance(e, Audit):
                assert n is not None, "an audit message came before run_forever"
                self.audits.on_message(e.sender, e.message, n)
            elif isinstance(e, Rejected):
                self.reject(e.peer or "?", e.error, counted=True)
            elif isinstance(e, Stopped):
                # the run still stops if this fails; a restart looks the order up in the DHT
                self._save(STOP_FILE, e.order, "keeping the stop order failed")
            elif isinstance(e, RunEnded):
                self._end(e)
        for peer, messages in outbox.items():
            self._spawn(self._send_in_order, peer, messages)

    def _end(self, e: RunEnded) -> None:
        if e.phase == STOPPED:  # at once (the loop's end cancels them too: run_forever)
            self._cancel_inner_runs()
        if e.final_theta_cid is not None:
            self.io.release_run_pins(e.final_theta_cid)
        self.finished.set()
        self.post(Wake())  # wakes the main loop, which then ends

    def reject(self, peer: str, exc: PcpError, counted: bool = False) -> None:
        if not counted:
            key = type(exc).__name__
            self.machine.stats.rejected[key] = self.machine.stats.rejected.get(key, 0) + 1
        self.node._reject(peer, exc, "round")

    def _save(self, name: str, msg: Message, what: str) -> None:
        path = self.work_dir / name
        try:
            path.with_name(name + ".tmp").write_bytes(encode(msg))
            path.with_name(name + ".tmp").replace(path)
        except OSError as exc:
            self.node.log_once("self", LocalError(str(exc)), what)

    def _stopped_before(self) -> bool:
        """Whether this node accepted the owner's stop before it restarted (the order kept here)."""
        try:
            order = decode((self.work_dir / STOP_FILE).read_bytes(), StopOrder)
            out = self.machine.stopped_before(order, self.clock())
        except FileNotFoundError:
            return False
        except (OSError, PcpError) as exc:
            log.warning("run %s: ignoring the kept stop order: %s", self.run_id[:16], exc)
            return False
        self._carry_out(out)
        return True

    def _restore_lease(self) -> None:
        """Give the election the lease this node accepted last before it stopped (its anchor)."""
        try:
            self.machine.restore(decode((self.work_dir / LEASE_FILE).read_bytes(), Lease))
        except FileNotFoundError:
            return
        except (OSError, PcpError) as exc:
            self.node.log_once("self", LocalError(f"{LEASE_FILE}: {exc}"), "reading the last lease failed")

    # -- effect workers ---------------------------------------------------------------------

    async def _send_in_order(self, peer: str, messages: list[Message]) -> None:
        """One batch's messages to ``peer``, each after the previous one's ack.

        Why in order: a round's commit and the next announcement leave in one batch. Sent
        side by side, the announcement often overtook the commit, and a worker that had no
        commit naming the announced θ fetched θ on its own relay tree instead of out of the
        commit's checkpoint, which it fetches anyway: one more θ a round through the
        shepherd's uplink (``bench/shepherd_bytes.py``). What it costs: the announcement waits
        for the commit's ack, which a worker gives once it holds the checkpoint, that is once it
        holds the θ it will train on. Peers still get their batches side by side."""
        for msg in messages:
            await self.send_to(peer, msg)

    async def send_to(self, peer: str, msg: Message) -> bool:
        """Send and wait for the ack; False (logged once) if it did not arrive.

        A commit already on its way to ``peer`` (with its update or without) is not sent
        twice: this waits for that send and answers as it does. The replication
        (:meth:`_replicate_commit`) sends a commit to every node at once and lets the machine
        go on after the first ack; the batch that follows names the commit again for each
        node that has not acked, and joins the send still in flight."""
        if not isinstance(msg, (CommitRecord, CommitWithUpdate)):
            return await self._send_once(peer, msg)
        rec = msg.commit if isinstance(msg, CommitWithUpdate) else msg
        key = (peer, rec.term, rec.round, rec.attempt, rec.theta_cid)  # (with its update or without: one commit)
        flight = self._commits_out.get(key)
        if flight is not None:
            await flight.done.wait()
            return flight.ok
        flight = self._commits_out[key] = _InFlight()
        try:
            flight.ok = await self._send_once(peer, msg)
            return flight.ok
        finally:
            del self._commits_out[key]
            flight.done.set()

    async def _send_once(self, peer: str, msg: Message) -> bool:
        if isinstance(msg, (RoundAnnouncement, CommitRecord, CommitWithUpdate)):
            await self.io.stores_done()  # never name a blob before we hold it
        try:
            await self.node.messenger.send(peer, msg)
        except PcpError as exc:
            self.node.log_once(peer, exc, f"sending {msg.TAG} failed")
            return False
        return True

    async def _beat(self, peer: str, hb: Heartbeat | Lease) -> None:
        """One heartbeat (or lease renewal) to ``peer``, posted on this node's line to it (one kept stream per
        follower, no ack: less than half of a beat's bytes on a stream of its own, docs/diloco.md).
        At most one is in flight per peer: a slow peer's must not queue beats behind it."""
        try:
            # Given up after a suspicion window (a beat that late is no use; the line is dropped
            # and the next beat opens a new one). Not sooner: on a loaded machine opening a stream
            # can take most of a second, and a beat cut off before its frame went out is no beat.
            with trio.move_on_after(self.machine.election.config.suspect_window_s):
                await self.node.messenger.post(peer, hb)
        except PcpError as exc:
            self.node.log_once(peer, exc, f"posting {hb.TAG} failed")
        finally:
            self._beating.discard(peer)

    async def _replicate_commit(self, e: ReplicateCommit) -> None:
        """Make one other node hold the checkpoint: the commit message is the request (a worker
        acks it only once it holds the checkpoint, :meth:`deliver`), sent to every target at
        once; the first ack lets the machine go on, and with none in ``e.timeout_s`` the commit
        goes out anyway (a swarm of one must still make progress). The other sends go on: the
        machine's batch that follows joins them (:meth:`send_to`) rather than sending again.
        Each target's ``e.then`` message (its next announcement) leaves right behind its commit;
        the receiver holds it until it took the commit (:meth:`deliver`), so it is there the
        moment the checkpoint is: after the ack it came 0.5-0.7 s later on the network lab."""
        commit = e.commit
        acked: list[str] = []
        first = trio.Event()
        then = dict(e.then)
        with_update = CommitWithUpdate(commit, e.update) if e.update else None

        async def ask(peer: str) -> None:
            # (the update only where the message goes direct: relays carry control traffic only,
            # and a peer reached through one fetches the update itself, over a connection it opens)
            if await self.send_to(peer, with_update if with_update and self.io.direct_to(peer) else commit):
                acked.append(peer)
                first.set()

        async with trio.open_nursery() as n:
            for peer in e.targets:
                n.start_soon(ask, peer)
            for peer in e.targets:  # behind each commit: the receiver holds it until the commit is in
                if (msg := then.get(peer)) is not None:
                    n.start_soon(self.send_to, peer, msg)
            with trio.move_on_after(e.timeout_s):
                await first.wait()
            self.post(Replicated(commit, list(acked)))

    async def _hold_checkpoint(self, rec: CommitRecord, hint: str | None = None, update: bytes = b"",
                               theta_ready: Callable[[], None] | None = None) -> None:
        """Hold ``rec``'s checkpoint, so any candidate can take the run over.

        Built from the checkpoint its step started from and the commit's update
        when this node holds that one (:meth:`_rebuild_checkpoint`: an eighth of
        the bytes with the int8 update), else fetched. Either way from the relay
        tree of the commit's participants, who all want it at once
        (:mod:`pcp_p2p.blob.swarm`). Once per checkpoint: a second caller waits.
        ``theta_ready``: see :meth:`_rebuild_checkpoint` (not called when it is fetched)."""
        cid = rec.checkpoint_cid
        while (busy := self._holding.get(cid)) is not None:
            await busy.wait()
        if cid in self._replicas:
            return
        self._holding[cid] = trio.Event()
        try:
            # (ours, or a store in flight: the shepherd's own commit is held by its StoreBlob)
            ours = self.io.holds(cid)
            if ours or not await self._rebuild_checkpoint(rec, hint, update, theta_ready):
                try:
                    await self.io.hold(cid, hint, max_size=self.state_bound(2), swarm=rec.participants)
                except PcpError as exc:
                    self.node.log_once("self", exc, "replicating a checkpoint failed")
                    return
                if not ours:
                    self.machine.stats.checkpoints["fetched"] += 1
            self._replicas[cid] = rec.theta_cid  # (unpinned with its round, by the pins)
            while len(self._replicas) > KEEP_CHECKPOINTS:
                del self._replicas[next(iter(self._replicas))]
        finally:
            self._holding.pop(cid).set()

    async def _rebuild_checkpoint(self, rec: CommitRecord, hint: str | None, update: bytes = b"",
                                  theta_ready: Callable[[], None] | None = None) -> bool:
        """``rec``'s checkpoint from the one its step started from (held here) and its update
        blob (``update``: come with the commit, its CID checked; else fetched), checked against
        both of ``rec``'s CIDs (:func:`~pcp_p2p.diloco.protocol.commits.rebuild_theta`, then the
        rest), then stored (in the background: held in memory until then, see :meth:`_take_commit`),
        pinned and announced like a fetched one. ``False`` (and nothing kept) when
        this node does not hold that base, or the update cannot be had or does not give the
        named checkpoint: the caller fetches the checkpoint then.

        ``theta_ready`` is called once θ is built and checked, before the momentum and the
        checkpoint's CID (θ is kept for :meth:`_theta_from_checkpoint`): the commit goes to the
        machine then, and the next round's inner steps start that much sooner."""
        outer, store = self.spec.outer, self.io.store
        base = next((c for c, theta in self._replicas.items() if theta == rec.prev_theta_cid), None)
        # (the run's first commit: from its starting θ, which this node trained round 0 from)
        first = base is None and rec.round == 0 and store.has(rec.prev_theta_cid)
        if not rec.update_cid or not (first or (base is not None and self.io.holds(base))):
            return False
        try:
            if not update:
                size = update_size(self.num_params(), outer.update_codec)
                update = await self.io.fetch_bytes(rec.update_cid, hint, max_size=self.state_bound(1),
                                                   swarm=rec.participants if worth_a_tree(len(rec.participants), size)
                                                   else None)
            async with self._building:  # (one at a time: they share the spare buffer)
                cached = self._built if self._built is not None and self._built[0] == base else None
                if cached is None and base is not None and not await self.io.stored(base):
                    return False
                if self._spare is not None:
                    await self.io.stored(self._spare[0])  # its bytes are on disk before they are overwritten
                spare = self._spare[1] if self._spare is not None else None

                def build() -> RebuiltTheta:
                    held: bytes | bytearray
                    if cached is not None:
                        held = cached[1]
                    elif base is not None:
                        held = store.read(base)
                    elif (start := start_checkpoint(rec, store.read(rec.prev_theta_cid))) is not None:
                        held = start
                    else:  # (not reached: ``first`` is round 0's)
                        raise MalformedMessage("no checkpoint to build the commit from")
                    return rebuild_theta(rec, held, update, outer, reuse=spare)

                half = await trio.to_thread.run_sync(build)
                if theta_ready is not None:  # θ is checked: the next round need not wait for the rest
                    self._early_theta = (rec.theta_cid, await trio.to_thread.run_sync(half.theta_bytes))
                    theta_ready()
                data = await trio.to_thread.run_sync(half.finish)
                if len(data) <= KEEP_IN_MEMORY_BYTES:
                    self.io.store_later(rec.checkpoint_cid, data)
                    # the last one built (the base, or one older when built from the store) is the
                    # next one's buffer
                    self._built, self._spare = (rec.checkpoint_cid, data), self._built
                else:  # (not kept in memory: in the store before anyone is told it is held)
                    await self.io.keep(data)
        except PcpError as exc:
            self.node.log_once("self", exc, "building a checkpoint from its commit's update failed (fetching it)")
            return False
        self.machine.stats.checkpoints["rebuilt"] += 1
        return True

    async def _publish_lease(self, lease: Lease, renewal: bool, store: bool) -> None:
        """A claim goes to every member on a stream of its own, acknowledged; a renewal is posted
        on the line the beats use (a renewal is a beat too, and the next one comes
        ``renew_every_s`` later: half the bytes of a stream and its ack, times every member, every
        renewal: issue #15), or sent when a beat holds that line."""
        if renewal:
            self._beat_at = self.clock()
        async with trio.open_nursery() as n:
            for peer in self.machine.run_members():
                if renewal and peer not in self._beating:
                    self._beating.add(peer)
                    n.start_soon(self._beat, peer, lease)
                else:
                    n.start_soon(self.send_to, peer, lease)
        if store:
            await self.records.publish_lease(lease, self.spec.election.lease_s, renewal=renewal)

    async def _lookup_commit(self, for_election: bool) -> None:
        self.post(CommitLookedUp(await self.records.lookup_commit(), for_election))

    async def _lookup_lease(self) -> None:
        self.post(LeaseLookedUp(await self.records.lookup_lease()))

    async def _lookup_owner_record(self, kind: str) -> None:
        found = await self.records.lookup_owner_record(kind)
        if isinstance(found, OWNER_RECORDS[kind]):
            self.post(MessageIn(self.run.owner, found))

    def num_params(self) -> int:
        """θ's values (with ``MAX_VOCAB`` for the embedding before this node holds the dataset)."""
        from pcp_p2p.compile.model import num_params, preset

        vocab = self.dataset.vocab_size if self.dataset is not None else MAX_VOCAB
        return num_params(preset(self.spec.model, vocab_size=vocab))

    def state_bound(self, copies: int) -> int:
        """The most bytes ``copies`` fp32 copies of θ can weigh (θ or a Δ: 1; a checkpoint,
        θ and momentum: 2), plus framing: a blob named as one and declaring more is refused
        before any chunk moves."""
        return copies * 4 * self.num_params() + (1 << 20)

    async def _fetch(self, who: str, cid: str, hint: str | None) -> None:
        try:
            # The shepherd and an aggregator fetch only Δs (pseudo-gradients): used once, not kept.
            artifact = who == "worker" and self._is_artifact(cid)
            bound = (1 << 20) if artifact else self.state_bound(1)  # a manifest weighs a few KiB
            theta = who == "worker" and not artifact
            data = await self._theta_from_checkpoint(cid) if theta else None
            if data is None:
                data = await self.io.fetch_bytes(cid, hint, keep=who == "worker", for_run=artifact, max_size=bound,
                                                 swarm=self._swarm_for(cid) if who == "worker" else None)
            if artifact:
                await self._prepare_artifact(data)
        except PcpError as exc:
            self.post(BlobFailed(who, cid, exc))
            return
        self.post(BlobIn(who, cid, data))

    def _swarm_for(self, cid: str) -> tuple[str, ...] | None:
        """Who fetches ``cid`` at the same moment, as a signed record says: for a commit's θ its
        participants; for the announcement's θ, dataset or artifacts its workers (``None``: none)."""
        w = self.machine.worker
        if w is None:
            return None
        rec, ann = w.last_commit, w.current
        if rec is not None and rec.theta_cid == cid:
            return rec.participants
        if ann is not None and cid in (ann.theta_cid, ann.dataset_cid, *ann.artifacts.values()):
            return tuple(a.worker for a in ann.assignments)
        return None

    async def _theta_from_checkpoint(self, cid: str) -> bytes | None:
        """θ ``cid`` out of the last commit's checkpoint, when that commit names it.

        The checkpoint (θ and the outer momentum) is replicated by every participant anyway,
        and its θ bundle is byte-identical to the θ blob: taking θ from it saves every worker
        a second download of the same bytes, and the origin a second swarm's root. ``None``
        when there is no such checkpoint or it cannot be had (θ is then fetched itself)."""
        w = self.machine.worker
        rec = w.last_commit if w is not None else None
        if rec is None or rec.theta_cid != cid or not rec.checkpoint_cid or self.io.store.has(cid):
            return None  # (held already: the shepherd's own worker, say)
        if self._early_theta is not None and self._early_theta[0] == cid:  # built and checked here
            theta = self._early_theta[1]
            self._early_theta = None
            self.io.store_later(cid, theta)
            return theta
        await self._hold_checkpoint(rec, hint=rec.shepherd)
        store, ckpt = self.io.store, rec.checkpoint_cid
        built = self._built[1] if self._built is not None and self._built[0] == ckpt else None
        if built is None and not await self.io.stored(ckpt):  # (one built here is read in memory)
            return None

        def extract() -> bytes:  # only θ's range: the momentum, half the checkpoint, is not read
            if built is not None:  # built here: in memory (copied out: its buffer is reused)
                off, length = checkpoint_theta_span(bytes(built[:THETA_HEAD]))
                return bytes(memoryview(built)[off : off + length])
            off, length = checkpoint_theta_span(store.read(ckpt, 0, min(THETA_HEAD, store.size(ckpt))))
            return store.read(ckpt, off, length)

        try:
            async with self._building:  # (the built buffer is not reused while θ is copied out of it)
                theta = await trio.to_thread.run_sync(extract)
        except PcpError as exc:
            self.node.log_once("self", exc, "reading θ out of a checkpoint failed")
            return None
        # One built here was checked against the commit's θ CID as it was built (rebuild_theta);
        # a stored one only against its own CID, not that it holds this θ
        if built is None and await trio.to_thread.run_sync(cid_of, theta) != cid:
            return None
        self.io.store_later(cid, theta)  # stored, pinned and announced behind the machine's back: it trains now
        return theta

    async def _encode_bundled(self) -> None:
        """Encode the bundled corpus here, as a shepherd does (half a second of CPU).

        Every node ships it, so a worker whose encoding has the announced CID fetches
        nothing: on the network lab the 5 MB blob, fetched by every worker through the
        shepherd's 20 Mbit/s uplink first, put up to 10 s between the shepherd's first
        inner run and the last worker's (docs/connectivity.md, run 12)."""
        def build() -> tuple[str, bytes, CharDataset]:
            ds = CharDataset.load(SHAKESPEARE)
            data = encode_dataset(ds)
            return cid_of(data), data, ds

        assert self._bundled_ready is not None
        try:
            self._bundled = await trio.to_thread.run_sync(build)
        except PcpError as exc:  # (a damaged install: the blob is fetched as for any other corpus)
            self.node.log_once("self", exc, "encoding the bundled dataset failed (fetching it)")
        finally:
            self._bundled_ready.set()

    async def _announced_dataset(self, ann: RoundAnnouncement | None) -> CharDataset:
        """The dataset ``ann`` names: the bundled corpus encoded here when its CID is the
        announced one (stored and served like a fetched blob), else fetched and decoded."""
        if ann is None or not ann.dataset_cid:
            raise VerificationError("the announcement names no dataset blob")
        if self._bundled_ready is not None:
            await self._bundled_ready.wait()
        bundled, self._bundled = self._bundled, None  # (once: the dataset is kept from here on)
        if bundled is not None and bundled[0] == ann.dataset_cid:
            await self.io.keep(bundled[1], for_run=True)
            self.io.pins.for_dataset(ann.dataset_cid)
            return bundled[2]
        data = await self.io.fetch_bytes(ann.dataset_cid, ann.shepherd, for_run=True,
                                         swarm=self._swarm_for(ann.dataset_cid))
        self.io.pins.for_dataset(ann.dataset_cid)
        return await trio.to_thread.run_sync(decode_dataset, data)

    def _is_artifact(self, cid: str) -> bool:
        w = self.machine.worker
        ann = w.current if w is not None else None
        return ann is not None and cid in ann.artifacts.values()

    async def _prepare_artifact(self, manifest_bytes: bytes) -> None:
        """Verify a train manifest against the shepherd, fetch its vmfb, start the executor."""
        from pcp_p2p.compile.manifest import Manifest
        from pcp_p2p.diloco.run import engine

        shepherd, w = self.machine.shepherd_peer, self.machine.worker
        assert shepherd is not None and w is not None
        manifest = decode(manifest_bytes, Manifest)
        if self.engine is not None:
            return
        if self.dataset is None:
            self.dataset = await self._announced_dataset(w.current)
        ann = w.current
        workers = tuple(a.worker for a in ann.assignments) if ann is not None else ()
        await self.io.fetch_bytes(manifest.artifact_cid, for_run=True, max_size=manifest.artifact_size,
                                  swarm=workers if worth_a_tree(len(workers), manifest.artifact_size) else None)
        vmfb_path = self.io.store.path(manifest.artifact_cid)
        executor = await trio.to_thread.run_sync(engine.start_executor, vmfb_path, manifest, shepherd)
        inner = engine.InnerEngine(executor, self.spec, self.dataset)
        group = self.node.config.worker_group
        if group is not None:  # an MPI worker group: every rank trains its piece (pcp_p2p.cluster)
            try:
                inner = await trio.to_thread.run_sync(
                    group.engine_for, inner, self.run.signed, manifest_bytes, vmfb_path, shepherd)
            except PcpError:
                executor.close()
                raise
        self.engine = inner
        self.artifacts.append({"target": manifest.target, "cid": manifest.artifact_cid,
                               "size": manifest.artifact_size, "cache_hit": None})
        log.info("run %s: executor started for %s (artifact %s)", self.run_id[:16], manifest.target,
                 manifest.artifact_cid[:20])

    async def _inner(self, eff: RunInner, job: tuple[threading.Event, ShiftSlot]) -> None:
        try:
            if self.engine is None:
                raise VerificationError("no verified artifact is loaded")
            result = await trio.to_thread.run_sync(self.engine.run, eff, *job)
        except PcpError as exc:
            self.post(InnerFailed(eff.round, eff.attempt, exc))
            return
        finally:
            key = (eff.round, eff.attempt)
            if self._inner_jobs.get(key) is job:  # (a cancelled job's key may name its successor by now)
                del self._inner_jobs[key]
        self.post(InnerDone(result))

    # -- the executor -----------------------------------------------------------------------

    def _speed_estimate(self, gflops: float) -> float:
        """Tokens/s this machine could claim: 6 FLOP per parameter per token at the measured rate.

        Deliberately generous (twice the matmul-rate figure): the aggregator refuses claims
        above it, and an IREE step never reaches the benchmark's rate, so an honest worker is
        never refused.
        """
        from pcp_p2p.compile.model import num_params, preset

        n = num_params(preset(self.spec.model, vocab_size=self.dataset.vocab_size if self.dataset else 128))
        return max(1.0, 2 * gflops * 1e9 / (6 * n))

def _describe(x: Any) -> str:
    """A short one-line description of an effect, for debug logs."""
    fields = []
    for attr in ("to", "cid", "round", "attempt", "worker", "theta_cid", "hint", "who"):
        v = getattr(x, attr, None)
        if v is not None:
            fields.append(f"{attr}={str(v)[-12:]}")
    msg = getattr(x, "message", None)
    if msg is not None:
        fields.append(f"msg={type(msg).__name__}")
    return f"{type(x).__name__}({', '.join(fields)})"


class _InFlight:
    """A commit's send to one peer (``RunRuntime.send_to``): done, and whether it was acked."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.ok = False

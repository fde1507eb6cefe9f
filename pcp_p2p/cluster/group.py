"""A worker group under MPI: rank 0's side (:class:`WorkerGroup`, :class:`GroupEngine`) and the other ranks' loop.

Rank 0 runs the node. When its runtime starts an IREE executor for a run it
hands its :class:`~pcp_p2p.diloco.run.engine.InnerEngine` to :meth:`WorkerGroup.engine_for`,
which sends the verified artifact, the signed spec and the dataset to every
live rank (each verifies the manifest's signature itself and starts its own
executor) and returns a :class:`GroupEngine`: the same interface, but its
:meth:`~GroupEngine.run` spreads the round over the ranks::

    rank 0                                   rank k
    ------                                   ------
    split the assignment (group_split.py)
    Train(θ, sub-shard k)  ─────────────▶    train for the time budget
    train sub-shard 0                        Done(steps, losses, states)
    collect Done ◀───── deadline ────────    keep t_k·Δ_k
    Reduce(members) ────────────────────▶
    Iallreduce(Σ t_k·Δ_k, Σ t_k) ◀─────▶     Iallreduce
    θ_group = θ − Σ t_k·Δ_k / Σ t_k
    → InnerResult(steps = Σ steps_k)  (the worker signs one Δ; tokens = Σ tokens_k)

Failures. Every exchange has a deadline (:mod:`~pcp_p2p.cluster.comm`). A rank
whose ``Done`` does not arrive by the round's time budget plus the group's
``timeout_s`` is dropped for good (its sub-shard's work is lost, the group
submits what the others trained); a rank whose executor failed sits the round
out. If the allreduce itself times out (a rank died between its ``Done`` and
the reduction) rank 0 submits its own part alone and every other member is
dropped, since which one failed cannot be told. Ranks keep a watchdog too:
rank 0 pings every ``heartbeat_s``; a rank that hears nothing from rank 0 for
``silence_s`` leaves (exit 3), so a dead node never leaves orphans spinning.
Dropped ranks are not taken back in: restart the job to regrow the group.

States. Each rank keeps its own AdamW state (as DiLoCo wants); the group's
state is named by the digests of its ranks' states (:func:`~pcp_p2p.diloco.protocol.group_split.group_state`),
and rank 0 remembers which rank state each group name stands for, so the
worker's state chain (and the shepherd's :class:`~pcp_p2p.diloco.protocol.audit.StateChain`)
works unchanged.

Audits. The group signs its split with its Δ (``Submission.group``: per rank,
the sub-shard's step cap, the steps trained, its state digests), so any worker
of the same target can replay every part and recombine them exactly as the
allreduce did (:mod:`pcp_p2p.diloco.protocol.group_replay`). When the group's round is
audited, :meth:`GroupEngine.export_state` gathers each rank's starting state
over MPI into one bundle for the auditor.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from pcp_p2p.cluster.comm import Cancelled, DeadlineComm
from pcp_p2p.cluster.rank_messages import (
    Done,
    Export,
    Hello,
    Ping,
    Ready,
    Reduce,
    Setup,
    StateBlob,
    Stop,
    Train,
    frame,
    unframe,
)
from pcp_p2p.core.errors import ConfigError, ExecutorError, PcpError, PeerTimeout
from pcp_p2p.core.launch import Launch
from pcp_p2p.diloco.algorithm.params import pack_tensors, unpack_tensors
from pcp_p2p.diloco.protocol.effects import EARLY, RunInner
from pcp_p2p.diloco.protocol.group_replay import encode_group_state
from pcp_p2p.diloco.protocol.group_split import (
    GROUP_STATE_PREFIX,
    group_state,
    mean_losses,
    rank_steps,
    sub_assignments,
    theta_from_sum,
    weighted_flat,
)
from pcp_p2p.diloco.protocol.messages import FRESH_STATE, GroupPart
from pcp_p2p.diloco.protocol.worker import InnerResult
from pcp_p2p.wire import Message

if TYPE_CHECKING:
    from pcp_p2p.diloco.protocol.audit import InnerState
    from pcp_p2p.diloco.protocol.messages import DataAssignment
    from pcp_p2p.diloco.protocol.spec import SignedRunSpec
    from pcp_p2p.diloco.run.engine import InnerEngine, Replay, ShiftSlot

R = TypeVar("R", bound=Message)

log = logging.getLogger("pcp.cluster")

TAG_ORDER = 11  # rank 0 -> rank k
TAG_REPLY = 12  # rank k -> rank 0
TAG_ALIVE = 13  # rank k -> rank 0, every heartbeat
HELLO_TIMEOUT_S = 120.0  # ranks import numpy and IREE and measure their speed before they say hello
SETUP_TIMEOUT_S = 120.0  # a rank starts its executor (a child process) and loads the artifact
KEEP_GROUP_STATES = 8  # two names a round (state_in, state_out): as many rounds as each rank keeps (KEEP_STATES)


@dataclass
class RankInfo:
    rank: int
    host: str
    pid: int
    target: str
    gflops: float
    alive: bool = True
    why: str = ""  # why it was dropped
    steps: int = 0  # in the last round
    tokens_per_s: float = 0.0  # measured in the last round


def own_hello(rank: int) -> Hello:
    """This rank's :class:`Hello`: host, pid, best CPU target and measured matmul rate."""
    from pcp_p2p.executor.cpu import best_cpu_target
    from pcp_p2p.net.capabilities import measure_gflops

    return Hello(rank=rank, host=socket.gethostname(), pid=os.getpid(), target=best_cpu_target().name,
                 gflops=float(measure_gflops(0.3)))


class WorkerGroup:
    """Rank 0's handle on the group: who is alive, how fast they are, the heartbeat."""

    def __init__(self, dc: DeadlineComm, launch: Launch, *, timeout_s: float = 30.0, heartbeat_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.dc = dc
        self.launch = launch
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.clock = clock
        self.ranks: dict[int, RankInfo] = {}
        self.rounds = 0
        self.last_round: dict[str, Any] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one exchange (setup, round) at a time
        self._thread: threading.Thread | None = None
        self.last_heard: dict[int, float] = {}
        self.failure_at: float | None = None  # the launcher said a rank died; nobody is sent to until settled
        self.census_s = 3.0 * heartbeat_s

    @classmethod
    def open(cls, launch: Launch, *, timeout_s: float = 30.0, heartbeat_s: float = 1.0,
             hello_timeout_s: float = HELLO_TIMEOUT_S) -> WorkerGroup:
        """Initialise MPI, hear every rank's hello (those silent by the deadline are dropped), start the heartbeat."""
        dc = _world()
        if dc.size != launch.size:
            raise ConfigError(f"the {launch.launcher} launcher says {launch.size} ranks, MPI says {dc.size}")
        group = cls(dc, launch, timeout_s=timeout_s, heartbeat_s=heartbeat_s)
        _ON_RANK_DIED.append(group.rank_died)
        group._hello(hello_timeout_s)
        group._thread = threading.Thread(target=group._beat, name="pcp-group-heartbeat", daemon=True)
        group._thread.start()
        return group

    # -- membership -------------------------------------------------------------------------------

    def _hello(self, timeout_s: float) -> None:
        me = own_hello(0)
        self.ranks[0] = RankInfo(0, me.host, me.pid, me.target, me.gflops)
        deadline = self.clock() + timeout_s
        waiting = set(range(1, self.dc.size))
        while waiting:
            try:
                src, _, data = self.dc.recv(self.dc.MPI.ANY_SOURCE, TAG_REPLY, deadline)
                hello, _ = unframe(data, Hello)
            except PeerTimeout:
                break
            except PcpError as exc:
                log.warning("group: a malformed hello: %s", exc)
                continue
            assert isinstance(hello, Hello)
            if src in waiting:
                waiting.discard(src)
                self.ranks[src] = RankInfo(src, hello.host, hello.pid, hello.target, hello.gflops)
        for r in sorted(waiting):
            self.ranks[r] = RankInfo(r, "?", 0, "?", 0.0, alive=False, why="no hello")
            log.warning("group: rank %d never said hello; the group goes on without it", r)
        log.info("group of %d rank(s) via %s: %s", len(self.live), self.launch.launcher,
                 ", ".join(f"{i.rank}@{i.host}:{i.gflops:.0f}GF" for i in self.ranks.values() if i.alive))

    @property
    def live(self) -> tuple[int, ...]:
        return tuple(sorted(r for r, i in self.ranks.items() if i.alive))

    def rank_died(self) -> None:
        """The launcher says some rank died (SIGUSR1; it does not say which)."""
        self.failure_at = self.clock()

    def settle(self) -> None:
        """Before rank 0 sends anything: if a rank died, find out which ranks are still alive.

        A send to a dead rank aborts the whole process with MPICH (no ULFM), so after the
        launcher's word rank 0 sends nothing until a census is over: every live rank's
        own heartbeat (rank k -> 0, safe to receive from anyone) must arrive after the
        failure; a rank not heard from for ``census_s`` is dropped.
        """
        while self.failure_at is not None:
            since = self.failure_at
            end = since + self.census_s
            while self.clock() < end:
                time.sleep(0.05)
                self._hear()
            for r in self.live:
                if r and self.last_heard.get(r, -1.0) <= since:
                    self.drop(r, "the launcher reported a dead rank and this one fell silent")
            if self.failure_at == since:
                self.failure_at = None

    def _hear(self) -> None:
        for src, _ in self.dc.drain(TAG_ALIVE):
            self.last_heard[src] = self.clock()

    def drop(self, rank: int, why: str) -> None:
        info = self.ranks[rank]
        if info.alive:
            info.alive, info.why = False, why
            log.warning("group: rank %d dropped (%s); %d rank(s) left", rank, why, len(self.live))

    def throughput(self, tokens_per_s: float) -> float:
        """The group's tokens/s from rank 0's own estimate, scaled by the live ranks' matmul rates."""
        own = self.ranks[0].gflops or 1.0
        return tokens_per_s * sum(self.ranks[r].gflops for r in self.live) / own

    def status(self) -> dict[str, Any]:
        """What the node's status and member record say about the group."""
        return {
            "launcher": self.launch.launcher,
            "size": self.launch.size,
            "live": len(self.live),
            "gflops": round(sum(self.ranks[r].gflops for r in self.live), 1),
            "ranks": [{"rank": i.rank, "host": i.host, "target": i.target, "gflops": round(i.gflops, 1),
                       "alive": i.alive, "why": i.why, "steps": i.steps,
                       "tokens_per_s": round(i.tokens_per_s, 1)} for i in self.ranks.values()],
            "rounds": self.rounds,
            "last_round": dict(self.last_round),
        }

    # -- the heartbeat and the end ----------------------------------------------------------------

    def _beat(self) -> None:
        seq, next_ping = 0, self.clock()
        while not self._stop.wait(0.05):
            self._hear()
            if self.failure_at is not None or self.clock() < next_ping:
                continue  # never send while a dead rank may still be on the list (settle())
            seq += 1
            next_ping = self.clock() + self.heartbeat_s
            for r in self.live:
                if r:
                    self.dc.post(r, TAG_ORDER, frame(Ping(seq)))

    def close(self, reason: str = "the node stopped") -> None:
        """Tell every live rank to leave (best effort: never waits on a dead one)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        self.settle()
        for r in self.live:
            if r:
                try:
                    self.dc.send(r, TAG_ORDER, frame(Stop(reason)), self.clock() + 2.0)
                except PeerTimeout:
                    pass
        self.dc.stop()
        _quiet_exit()

    # -- runs ---------------------------------------------------------------------------------------

    def engine_for(self, local: InnerEngine, signed_spec: SignedRunSpec, manifest: bytes, vmfb_path: Path,
                   shepherd: str) -> GroupEngine:
        """Start every live rank's executor for this run and return the engine that spreads rounds over them."""
        from pcp_p2p.diloco.algorithm.data import encode_dataset
        from pcp_p2p.diloco.protocol.spec import run_id_of
        from pcp_p2p.wire import encode

        run_id = run_id_of(signed_spec)
        setup = frame(Setup(run_id, encode(signed_spec), manifest, shepherd),
                      Path(vmfb_path).read_bytes(), encode_dataset(local.dataset))
        with self._lock:
            self.settle()
            followers = [r for r in self.live if r]
            deadline = self.clock() + SETUP_TIMEOUT_S
            for r in followers:
                try:
                    self.dc.send(r, TAG_ORDER, setup, deadline)
                except PeerTimeout as exc:
                    self.drop(r, f"setup not taken: {exc}")
            ready: list[int] = [0]
            for r in followers:
                if not self.ranks[r].alive:
                    continue
                try:
                    reply = self._reply(r, Ready, deadline, lambda m: m.run_id == run_id)
                except PeerTimeout as exc:
                    self.drop(r, f"no executor: {exc}")
                    continue
                if reply.error:
                    log.warning("group: rank %d cannot run %s: %s", r, run_id[:16], reply.error)
                else:
                    ready.append(r)
        return GroupEngine(self, local, run_id, tuple(ready))

    def _reply(self, rank: int, kind: type[R], deadline: float, wanted: Callable[[R], bool],
               cancel: threading.Event | None = None) -> R:
        """The next reply of ``kind`` from ``rank`` that ``wanted`` accepts (see :meth:`_reply_framed`)."""
        return self._reply_framed(rank, kind, deadline, wanted, cancel)[0]

    def _reply_framed(self, rank: int, kind: type[R], deadline: float, wanted: Callable[[R], bool],
                      cancel: threading.Event | None = None) -> tuple[R, list[memoryview]]:
        """The next reply of ``kind`` from ``rank`` that ``wanted`` accepts (stale ones are skipped).

        Waits in short slices: when the launcher reports a death meanwhile, the census
        (:meth:`settle`) runs, and if ``rank`` is the one that died the wait ends at once.
        """
        while True:
            try:
                _, _, data = self.dc.recv(rank, TAG_REPLY, min(deadline, self.clock() + 0.25), cancel)
            except PeerTimeout:
                if self.failure_at is not None:
                    self.settle()
                if not self.ranks[rank].alive:
                    raise PeerTimeout(f"rank {rank} died") from None
                if self.clock() >= deadline:
                    raise
                continue
            try:
                msg, parts = unframe(data, Hello, Ready, Done, StateBlob)
            except PcpError as exc:
                log.warning("group: rank %d sent a malformed reply: %s", rank, exc)
                continue
            if isinstance(msg, kind) and wanted(msg):
                return msg, parts


class GroupEngine:
    """The node's inner engine when the node is a worker group: one round, every rank's share of it."""

    def __init__(self, group: WorkerGroup, local: InnerEngine, run_id: str, ranks: tuple[int, ...]) -> None:
        self.group = group
        self.local = local
        self.run_id = run_id
        self.ranks = ranks  # ranks with an executor for this run
        self.spec = local.spec
        self.dataset = local.dataset
        self.tokens = 0
        self.epoch = 0
        self._states: OrderedDict[str, dict[int, str]] = OrderedDict()

    # what the runtime's status and audits read
    @property
    def busy_s(self) -> float:
        return self.local.busy_s

    @property
    def state_s(self) -> float:
        return self.local.state_s

    @property
    def replay_s(self) -> float:
        return self.local.replay_s

    @property
    def kept_states(self) -> tuple[str, ...]:
        return tuple(self._states)

    def replay(self, theta: dict[str, np.ndarray], state: InnerState | None,
               assignment: DataAssignment, steps: int) -> Replay:
        """Replays of OTHER workers' rounds run on rank 0 alone (same target, same artifact)."""
        return self.local.replay(theta, state, assignment, steps)

    def export_state(self, digest: str) -> bytes:
        """The group state ``digest`` for an auditor: every stateful rank's blob, gathered over MPI.

        The bundle is :func:`~pcp_p2p.diloco.protocol.group_replay.encode_group_state`; fresh ranks are left
        out (the auditor starts them fresh). A rank that died since cannot serve its part, so the
        export fails (the audit says ``unavailable``).
        """
        per_rank = self._states.get(digest)
        if per_rank is None:
            raise ExecutorError(f"group inner state {digest:.16} is no longer kept")
        with self.group._lock:
            return self._export(per_rank)

    def _export(self, per_rank: dict[int, str]) -> bytes:
        g = self.group
        g.settle()
        self.epoch += 1
        epoch = self.epoch
        blobs: dict[int, bytes] = {}
        deadline = g.clock() + g.timeout_s
        for r, d in sorted(per_rank.items()):
            if d == FRESH_STATE:
                continue
            if r == 0:
                blobs[0] = self.local.export_state(d)
                continue
            if not g.ranks[r].alive:
                raise ExecutorError(f"rank {r}, which holds part of this state, has left the group")
            try:
                g.dc.send(r, TAG_ORDER, frame(Export(epoch, self.run_id, d)), deadline)
                reply, parts = g._reply_framed(r, StateBlob, deadline, lambda m: m.epoch == epoch)
            except PeerTimeout as exc:
                raise ExecutorError(f"rank {r} did not serve its inner state: {exc}") from exc
            if reply.error or reply.digest != d or len(parts) != 1:
                raise ExecutorError(f"rank {r} cannot serve its inner state {d:.16}: {reply.error}")
            blobs[r] = bytes(parts[0])
        return encode_group_state(blobs)

    def run(self, eff: RunInner, cancelled: threading.Event, shift: ShiftSlot | None = None) -> InnerResult:
        if eff.attempt == EARLY:  # (the worker then trains the round when it is announced, not early)
            raise ExecutorError("a worker group does not run rounds early (round.overlap) yet")
        with self.group._lock:
            return self._run(eff, cancelled)

    def _run(self, eff: RunInner, cancelled: threading.Event) -> InnerResult:
        from pcp_p2p.diloco.protocol.audit import CHUNK_STEPS

        g = self.group
        t0 = g.clock()
        self.epoch += 1
        epoch = self.epoch
        g.settle()
        members = [r for r in self.ranks if g.ranks[r].alive]
        steps = rank_steps(eff.assignment.max_steps, [g.ranks[r].gflops for r in members], CHUNK_STEPS)
        subs = dict(zip(members, sub_assignments(eff.assignment, steps)))
        starts = self._states.get(eff.inner_state, {}) if isinstance(eff.inner_state, str) else {}
        theta_bytes = pack_tensors(eff.theta)
        send_deadline = t0 + g.timeout_s
        for r in members[1:]:
            if subs[r].max_steps == 0:
                continue
            order = Train(epoch, self.run_id, eff.round, eff.attempt, subs[r], eff.time_budget_s,
                          starts.get(r, ""))
            try:
                g.dc.send(r, TAG_ORDER, frame(order, theta_bytes), send_deadline, cancelled)
            except PeerTimeout as exc:
                g.drop(r, str(exc))
            except Cancelled:
                break
        results: dict[int, Done] = {}
        bufs: dict[int, np.ndarray] = {}
        if subs[0].max_steps > 0:
            mine = self.local.run(replace(eff, assignment=subs[0], inner_state=starts.get(0)), cancelled)
            tokens0 = mine.steps * self.spec.tokens_per_step
            results[0] = Done(epoch, 0, mine.steps, mine.losses, mine.state_in, mine.state_out)
            bufs[0] = weighted_flat(eff.theta, mine.theta, tokens0)
        done_deadline = t0 + eff.time_budget_s + g.timeout_s
        for r in members[1:]:
            if cancelled.is_set():  # superseded: the worker drops the result anyway; late Dones are skipped as stale
                break
            if subs[r].max_steps == 0 or not g.ranks[r].alive:
                continue
            try:
                d = g._reply(r, Done, done_deadline, lambda m: m.epoch == epoch, cancelled)
            except PeerTimeout as exc:
                g.drop(r, f"round {eff.round + 1}: {exc}")
                continue
            except Cancelled:
                break
            if d.error:
                log.warning("group: rank %d failed round %d: %s", r, eff.round + 1, d.error)
            elif d.steps > 0:
                results[r] = d
        if cancelled.is_set():
            results = {r: d for r, d in results.items() if r == 0}
        contributing = tuple(sorted(results))
        if not contributing:
            raise ExecutorError("no rank of the group trained this round")
        t_reduce = g.clock()
        summed = self._reduce(contributing, bufs.get(0), eff, epoch)
        t_end = g.clock()
        if summed is None:  # the allreduce failed: what survives is rank 0's own part
            contributing = (0,) if 0 in results else ()
            if not contributing:
                raise ExecutorError("the group's allreduce failed and rank 0 trained nothing")
            summed = bufs[0]
        theta = theta_from_sum(eff.theta, summed)
        total_steps = sum(results[r].steps for r in contributing)
        state_in = group_state({r: results[r].state_in for r in contributing})
        state_out = group_state({r: results[r].state_out for r in contributing})
        # both names are kept: state_out to start the next round from, state_in to serve an audit of this one
        for name, which in ((state_in, "state_in"), (state_out, "state_out")):
            if name != FRESH_STATE:
                self._states[name] = {r: getattr(results[r], which) for r in contributing}
                self._states.move_to_end(name)
        while len(self._states) > KEEP_GROUP_STATES:
            self._states.popitem(last=False)
        split = tuple(
            GroupPart(r, subs[r].max_steps, results[r].steps if r in contributing else 0,
                      results[r].state_in if r in contributing else "",
                      results[r].state_out if r in contributing else "")
            for r in members
        )
        train_s = max(t_reduce - t0, 1e-9)
        for r in contributing:
            g.ranks[r].steps = results[r].steps
            g.ranks[r].tokens_per_s = results[r].steps * self.spec.tokens_per_step / train_s
        self.tokens += total_steps * self.spec.tokens_per_step
        g.rounds += 1
        g.last_round = {"round": eff.round + 1, "attempt": eff.attempt, "ranks": list(contributing),
                        "steps": total_steps, "tokens": total_steps * self.spec.tokens_per_step,
                        "train_s": round(t_reduce - t0, 3), "allreduce_s": round(t_end - t_reduce, 4)}
        return InnerResult(eff.round, eff.attempt, theta, total_steps,
                           mean_losses([results[r].losses for r in contributing]), state_out,
                           state_in=state_in, state_out=state_out, group=split)

    def _reduce(self, members: tuple[int, ...], own: np.ndarray | None, eff: RunInner, epoch: int) -> np.ndarray | None:
        """Σ t_k·Δ_k over ``members``; None if the allreduce timed out (every other member is then dropped)."""
        g = self.group
        if members == (0,):
            assert own is not None
            return own
        if own is None:  # rank 0 sat the round out; it still takes part with zeros
            own = np.zeros(sum(np.asarray(v).size for v in eff.theta.values()) + 1)
        g.settle()
        members = tuple(sorted(r for r in set(members) | {0} if g.ranks[r].alive))
        if members == (0,):
            return own if own.any() else None
        deadline = g.clock() + g.timeout_s
        for r in members[1:]:
            try:  # a few bytes: sent eagerly, so this fails only if MPI itself gave up on the rank
                g.dc.send(r, TAG_ORDER, frame(Reduce(epoch, members)), deadline)
            except PeerTimeout as exc:
                g.drop(r, f"no reduce order taken: {exc}")
                return None
        try:
            return g.dc.allreduce_sum(members, own, deadline)
        except PeerTimeout as exc:
            for r in members[1:]:
                g.drop(r, f"the allreduce of round {eff.round + 1} timed out: {exc}")
            return None


# -- the other ranks ---------------------------------------------------------------------------------


def _world() -> DeadlineComm:
    """COMM_WORLD with errors raised as exceptions (mpi4py's default), at MPI_THREAD_MULTIPLE."""
    try:
        import mpi4py

        # Never MPI_Finalize: it waits for every rank, so a group that lost one would hang at exit;
        # MPICH's Hydra takes an exit without it as a normal one (measured: exit code 0).
        mpi4py.rc.finalize = False
        from mpi4py import MPI
    except ImportError as exc:
        raise ConfigError(f"a worker group needs mpi4py and an MPI library (pip install mpich mpi4py): {exc}") from exc
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise ConfigError("the MPI library does not offer MPI_THREAD_MULTIPLE, which a worker group needs")
    if threading.current_thread() is threading.main_thread():
        # MPICH's Hydra (with -disable-auto-cleanup) signals the surviving ranks with SIGUSR1 when
        # one dies; its default action would kill them. The deadlines notice the dead rank anyway.
        signal.signal(signal.SIGUSR1, _rank_died)
    return DeadlineComm(MPI.COMM_WORLD)


def _quiet_exit() -> None:
    """This rank is done with MPI: the launcher's SIGUSR1 for the others' exits must not kill it
    while Python shuts down (which puts the default, fatal action back on handled signals)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def _ignored(signum: int, frame: FrameType | None) -> None:
    log.info("rank: %s ignored; rank 0 stops this rank", signal.Signals(signum).name)


_ON_RANK_DIED: list[Callable[[], None]] = []


def _rank_died(signum: int, frame: FrameType | None) -> None:
    log.warning("group: the launcher reports that a rank died (SIGUSR1)")
    for hook in _ON_RANK_DIED:
        hook()


def serve_follower(launch: Launch, *, silence_s: float = 60.0, heartbeat_s: float = 1.0,
                   work_dir: Path | None = None) -> int:
    """Rank k > 0: say hello, then carry out rank 0's orders until told to stop or rank 0 falls silent.

    Returns the process's exit code: 0 on a stop order, 3 when the watchdog fired.
    """
    dc = _world()
    # A follower's life is rank 0's to end (Stop), or its watchdog's: a SIGTERM from the launcher
    # reaches rank 0 too, which then stops this rank in order. Dying on it instead would look
    # like a crash to rank 0, which may be about to send to this rank.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _ignored)
    follower = _Follower(dc, launch, work_dir or Path(tempfile.mkdtemp(prefix=f"pcp-rank{launch.rank}-")))
    dc.send(0, TAG_REPLY, frame(own_hello(launch.rank)), dc.clock() + HELLO_TIMEOUT_S)
    follower.beat_thread = threading.Thread(target=follower.beat, args=(heartbeat_s,), name="pcp-group-alive",
                                            daemon=True)
    follower.beat_thread.start()
    try:
        return follower.loop(silence_s)
    finally:
        follower.close()
        dc.stop()
        _quiet_exit()


class _Follower:
    def __init__(self, dc: DeadlineComm, launch: Launch, work_dir: Path) -> None:
        self.dc = dc
        self.launch = launch
        self.work_dir = work_dir
        self.engines: dict[str, InnerEngine] = {}
        self.pending: tuple[int, np.ndarray] | None = None  # (epoch, t·Δ buffer) awaiting the allreduce
        self.stopped = threading.Event()
        self.beat_thread: threading.Thread | None = None

    def beat(self, heartbeat_s: float) -> None:
        """Tell rank 0 this rank is alive, every ``heartbeat_s`` (its census after a death counts these)."""
        seq = 0
        while not self.stopped.wait(heartbeat_s):
            seq += 1
            self.dc.post(0, TAG_ALIVE, frame(Ping(seq)))

    def loop(self, silence_s: float) -> int:
        while True:
            try:
                _, _, data = self.dc.recv(0, TAG_ORDER, self.dc.clock() + silence_s)
            except PeerTimeout:
                log.error("rank %d: nothing from rank 0 for %.0f s; leaving the group", self.launch.rank, silence_s)
                return 3
            try:
                msg, parts = unframe(data, Setup, Train, Reduce, Export, Ping, Stop)
            except PcpError as exc:
                log.warning("rank %d: a malformed order: %s", self.launch.rank, exc)
                continue
            if isinstance(msg, Stop):
                log.info("rank %d: stopping (%s)", self.launch.rank, msg.reason)
                return 0
            if isinstance(msg, Setup):
                self._reply(Ready(msg.run_id, self._setup(msg, parts)))
            elif isinstance(msg, Train):
                self._reply(self._train(msg, parts))
            elif isinstance(msg, Reduce):
                self._reduce(msg)
            elif isinstance(msg, Export):
                self._export(msg)

    def _export(self, msg: Export) -> None:
        """Serve a kept inner state to rank 0 (an auditor replays the group's round from it)."""
        engine = self.engines.get(msg.run_id)
        try:
            if engine is None:
                raise ExecutorError("no executor for this run on this rank")
            blob = engine.export_state(msg.digest)
        except PcpError as exc:
            self._reply(StateBlob(msg.epoch, msg.digest, error=f"{type(exc).__name__}: {exc}"))
            return
        self._reply(StateBlob(msg.epoch, msg.digest), blob)

    def _reply(self, msg: Message, *parts: bytes) -> None:
        try:
            self.dc.send(0, TAG_REPLY, frame(msg, *parts), self.dc.clock() + 30.0)
        except PeerTimeout as exc:
            log.warning("rank %d: a reply to rank 0 was not taken: %s", self.launch.rank, exc)

    def _setup(self, msg: Setup, parts: list[memoryview]) -> str:
        """Start an executor for the run; "" or why not."""
        from pcp_p2p.compile.manifest import Manifest
        from pcp_p2p.diloco.algorithm.data import decode_dataset
        from pcp_p2p.diloco.protocol.spec import SignedRunSpec, run_id_of, verify_spec
        from pcp_p2p.diloco.run.engine import InnerEngine, start_executor
        from pcp_p2p.wire import decode

        if msg.run_id in self.engines:
            return ""
        try:
            signed = decode(msg.signed_spec, SignedRunSpec)
            spec = verify_spec(signed)
            if run_id_of(signed) != msg.run_id or len(parts) != 2:
                raise ConfigError("a setup order whose spec is not its run's")
            manifest = decode(msg.manifest, Manifest)
            path = self.work_dir / f"{msg.run_id[:24]}.vmfb"
            path.write_bytes(parts[0])
            executor = start_executor(path, manifest, msg.shepherd)  # verifies the signature itself
            self.engines[msg.run_id] = InnerEngine(executor, spec, decode_dataset(bytes(parts[1])))
        except (PcpError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"
        log.info("rank %d: executor started for run %s", self.launch.rank, msg.run_id[:16])
        return ""

    def _train(self, msg: Train, parts: list[memoryview]) -> Done:
        engine = self.engines.get(msg.run_id)
        self.pending = None
        try:
            if engine is None or len(parts) != 1:
                raise ExecutorError("no executor for this run on this rank")
            theta = unpack_tensors(bytes(parts[0]))
            eff = RunInner(round=msg.round, attempt=msg.attempt, theta=theta, theta_cid="", artifact_cid=None,
                           assignment=msg.assignment, time_budget_s=msg.time_budget_s,
                           inner_state=msg.inner_state or None)
            res = engine.run(eff, threading.Event())
        except PcpError as exc:
            return Done(msg.epoch, self.launch.rank, 0, (), "", "", error=f"{type(exc).__name__}: {exc}")
        tokens = res.steps * engine.spec.tokens_per_step
        self.pending = (msg.epoch, weighted_flat(theta, res.theta, tokens))
        return Done(msg.epoch, self.launch.rank, res.steps, res.losses, res.state_in, res.state_out)

    def _reduce(self, msg: Reduce) -> None:
        if self.pending is None or self.pending[0] != msg.epoch or self.launch.rank not in msg.members:
            log.warning("rank %d: a reduce order for epoch %d it has no part in", self.launch.rank, msg.epoch)
            return
        _, buf = self.pending
        self.pending = None
        try:
            self.dc.allreduce_sum(tuple(msg.members), buf, self.dc.clock() + 60.0)
        except PeerTimeout as exc:
            log.warning("rank %d: the allreduce of epoch %d timed out: %s", self.launch.rank, msg.epoch, exc)

    def close(self) -> None:
        self.stopped.set()
        if self.beat_thread is not None:
            self.beat_thread.join(timeout=2.0)
        for e in self.engines.values():
            e.executor.close()


__all__ = ["GROUP_STATE_PREFIX", "GroupEngine", "RankInfo", "WorkerGroup", "serve_follower"]

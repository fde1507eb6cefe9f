"""A DiLoCo run in one process: the real round machines, pumped synchronously.

Benchmarks that want the protocol's own numbers (admission checks, aggregation,
outer Nesterov, θ hash checks, signatures, the int8 codec) without the network
drive a :class:`~pcp_p2p.diloco.protocol.shepherd.Shepherd` and its
:class:`~pcp_p2p.diloco.protocol.worker.Worker` machines here: every message goes through
the wire codec both ways, blobs through a dict, and each ``RunInner`` through a
caller-supplied inner loop — :class:`JaxTrainer` (the compile engineer's
``train`` program under ``jax.jit`` on the run's real data) for figures, or any
cheap function for tests. Delivery is in order, one message at a time, on a
mock clock that advances one second per delivery, so a run is deterministic.
An early run (``round.overlap``) is run when its ``ShiftInner`` comes, from the
shifted start: here the exchange takes no time (the shift lands before the first
step), so an overlapped run's rounds are the synchronous ones bit for bit.

Nothing here changes what the machines decide: a harness that bent the
protocol would measure itself. Byzantine behaviour lives in the workers
(:mod:`pcp_p2p.testing.byzantine`), never in the pump.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from pcp_p2p.core.errors import LocalError
from pcp_p2p.diloco.algorithm.data import CharDataset, batches_for, batches_for_assignment, validation_batches
from pcp_p2p.diloco.algorithm.params import Params
from pcp_p2p.diloco.protocol.audit import InnerState, inner_state_digest
from pcp_p2p.diloco.protocol.effects import (
    EARLY,
    CancelInner,
    Committed,
    Discarded,
    Effect,
    FetchBlob,
    LookupCommit,
    Rejected,
    RunInner,
    Send,
    ShiftInner,
    StoreBlob,
)
from pcp_p2p.diloco.protocol.messages import (
    FRESH_STATE,
    CommitRecord,
    DataAssignment,
    Join,
    RoundAnnouncement,
    Submission,
)
from pcp_p2p.diloco.protocol.shepherd import Phase, Shepherd
from pcp_p2p.diloco.protocol.spec import RunSpec
from pcp_p2p.diloco.protocol.worker import InnerResult, Worker
from pcp_p2p.wire import decode, encode

if TYPE_CHECKING:
    from pcp_p2p.compile.programs import Program

InnerFn = Callable[[str, RunInner], InnerResult]
"""``(worker peer id, RunInner) -> InnerResult``: the executor of an in-process run."""

AdamState = tuple[Params, Params, "np.ndarray | np.int32"]
"""A :class:`Trainer`'s optimiser state: AdamW's moments ``m`` and ``v`` and its step count."""


@dataclass
class RunLog:
    """What an in-process run did, as its machines reported it."""

    commits: list[CommitRecord] = field(default_factory=list)
    announcements: dict[tuple[int, int, int], RoundAnnouncement] = field(default_factory=dict)  # (term, round, attempt)
    rejected: list[tuple[str | None, str, str]] = field(default_factory=list)  # (peer, error type, text)
    discarded: int = 0
    submission_bytes: list[int] = field(default_factory=list)
    inner_runs: int = 0
    early_runs: int = 0  # of inner_runs: early runs (round.overlap) that were adopted and shifted
    deliveries: int = 0

    def rejected_from(self, peer: str) -> list[str]:
        """Error types of the refusals of ``peer``'s inputs."""
        return [kind for p, kind, _ in self.rejected if p == peer]


def pump_run(
    shepherd: Shepherd,
    workers: Mapping[str, Worker],
    run_inner: InnerFn,
    *,
    max_deliveries: int = 1_000_000,
    max_discards: int | None = None,
    log: RunLog | None = None,
) -> RunLog:
    """Run ``shepherd`` and ``workers`` until the shepherd finishes (or nothing is left to do).

    Workers start and join; the shepherd opens the first round after its join
    grace; then every effect is carried out in order (a worker's
    ``LookupCommit`` is answered with the latest commit, as the DHT would).
    When the queue runs dry before the run is finished (a round waiting for
    its deadline, evicted workers), the clock jumps to the next wakeup of the
    shepherd or a worker, which is ticked. Raises :class:`LocalError` if the run
    neither finishes nor has anything left to wait for, takes more than
    ``max_deliveries`` deliveries, or discards more than ``max_discards``
    attempts (a run whose honest workers diverged retries forever otherwise).
    ``log``, when given, is filled in place, so a caller still has it after an error.
    """
    log = RunLog() if log is None else log
    blobs: dict[str, bytes] = {}
    queue: list[tuple[str, tuple[Any, ...]]] = []  # (node, input) in delivery order
    early: dict[str, RunInner] = {}  # a worker's early run (round.overlap), waiting for its shift
    me = shepherd.peer_id
    now = 0.0

    def carry_out(node: str, effects: list[Effect]) -> None:
        for e in effects:
            if isinstance(e, Send):
                data = encode(e.message)  # through the real codec, both ways
                if isinstance(e.message, Submission):
                    log.submission_bytes.append(len(data))
                elif isinstance(e.message, RoundAnnouncement):
                    a = e.message
                    log.announcements[(a.term, a.round, a.attempt)] = a
                queue.append((e.to, ("msg", data)))
            elif isinstance(e, StoreBlob):
                blobs[e.cid] = e.data
            elif isinstance(e, FetchBlob):
                queue.append((node, ("blob", e.cid, blobs[e.cid])))
            elif isinstance(e, RunInner) and e.attempt == EARLY:
                early[node] = e  # runs when its shift comes (below), or never (cancelled)
            elif isinstance(e, RunInner):
                log.inner_runs += 1
                queue.append((node, ("inner", run_inner(node, e))))
            elif isinstance(e, ShiftInner):
                run = early.pop(node, None)
                if run is not None and run.round == e.round:
                    # The exchange took no time here: the shift lands before the first step.
                    log.inner_runs += 1
                    log.early_runs += 1
                    res = run_inner(node, replace(run, theta=e.to, assignment=e.assignment))
                    queue.append((node, ("inner", replace(res, attempt=EARLY, shifted_at=0))))
            elif isinstance(e, CancelInner) and e.attempt == EARLY:
                if node in early and early[node].round == e.round:
                    del early[node]
            elif isinstance(e, Rejected):
                log.rejected.append((e.peer, type(e.error).__name__, str(e.error)))
            elif isinstance(e, Committed):
                log.commits.append(e.record)
            elif isinstance(e, Discarded):
                log.discarded += 1
            elif isinstance(e, LookupCommit) and log.commits:  # the DHT's latest-commit record
                queue.append((node, ("msg", encode(log.commits[-1]))))

    def deliver(node: str, item: tuple[Any, ...]) -> None:
        if node == me:
            if item[0] == "msg":
                carry_out(node, shepherd.receive(decode(item[1], Join, Submission), now))
            else:
                carry_out(node, shepherd.on_blob(item[1], item[2], now))
            return
        w = workers.get(node)
        if w is None:
            return  # addressed to a peer that is not in this run: dropped, as a network would
        if item[0] == "msg":
            carry_out(node, w.receive(decode(item[1], RoundAnnouncement, CommitRecord), now))
        elif item[0] == "blob":
            carry_out(node, w.on_blob(item[1], item[2], now))
        else:
            carry_out(node, w.on_inner_done(item[1], now))

    for w in workers.values():
        carry_out(w.peer_id, w.start(now))
    idle_ticks = 0
    while shepherd.phase is not Phase.FINISHED:
        if not queue:
            # Nothing in flight: time passes to the next wakeup, the shepherd's
            # (a deadline, the join grace) or a worker's (a deadline of silence:
            # it looks up the latest commit and joins again, as an evicted one must).
            wakes = [t for t in (shepherd.next_wakeup, *(w.next_wakeup for w in workers.values())) if t is not None]
            idle_ticks += 1
            if not wakes or idle_ticks > 1000:
                raise LocalError(f"in-process run stalled in {shepherd.phase}: {log.rejected[-3:]}")
            now = max(now, min(wakes))
            wake = shepherd.next_wakeup
            if wake is not None and wake <= now:
                carry_out(me, shepherd.tick(now))
            for w in workers.values():
                if w.next_wakeup <= now:
                    carry_out(w.peer_id, w.tick(now))
            continue
        node, item = queue.pop(0)
        now += 1.0
        log.deliveries += 1
        if log.deliveries > max_deliveries:
            raise LocalError(f"in-process run did not finish in {max_deliveries} deliveries")
        if max_discards is not None and log.discarded > max_discards:
            raise LocalError(f"in-process run discarded {log.discarded} attempts: {log.rejected[-3:]}")
        deliver(node, item)
    while queue:  # the final commit records still reach the workers
        node, item = queue.pop(0)
        now += 1.0
        deliver(node, item)
    return log


class JaxTrainer:
    """The run's model under ``jax.jit``: AdamW inner steps and validation loss, on the run's data.

    One compiled ``train`` program per batch size (the workers' ``B`` and, for
    baselines, a data-parallel ``n·B``), and one ``eval`` program. Inner runs
    always do exactly ``steps`` steps (the program's unrolled length); an
    assignment capping a worker below that is an error here, not a silent
    shortcut. Like the executor, each run names its start and end optimiser
    states by :func:`~pcp_p2p.diloco.protocol.audit.inner_state_digest` (``state_in`` /
    ``state_out``), so submissions commit to them and a round can be audited.
    ``inner_cpu_s`` collects the CPU seconds (this process, all threads) of
    each inner run and ``state_cpu_s`` those of naming its end state: compute
    figures (the cost of auditability, of a replay) use them, CPU rather than
    wall time so that other jobs on a shared machine do not skew them.
    """

    def __init__(
        self, spec: RunSpec, *, steps: int, val_batches: int = 16, val_batch_size: int = 64, score_batches: int = 2
    ) -> None:
        import jax  # only a trainer needs JAX; the pump does not

        from pcp_p2p.compile.model import param_shapes, preset

        self._jax = jax
        self.spec = spec
        self.steps = steps
        self.ds = CharDataset.load(spec.dataset)
        self.cfg = preset(spec.model, vocab_size=self.ds.vocab_size)
        self.names = tuple(param_shapes(self.cfg))
        self._train: dict[int, Callable[..., Any]] = {}
        self.val_x, self.val_y = validation_batches(
            self.ds.val, n_batches=val_batches, batch_size=val_batch_size, seq_len=spec.inner.seq_len
        )
        # The shepherd's held-out score windows, as the runtime's Evaluator.score
        # draws them (pcp_p2p.diloco.run.engine: 2 batches of the spec's shape, seed 1):
        # the validation split, but not the windows the validation loss reports on.
        self.score_x, self.score_y = validation_batches(
            self.ds.val, n_batches=score_batches, batch_size=spec.inner.batch_size, seq_len=spec.inner.seq_len,
            seed=1,
        )
        self._eval = jax.jit(self._program("eval", val_batch_size).fn)
        self.inner_cpu_s: list[float] = []
        self.state_cpu_s: list[float] = []

    def _program(self, kind: str, batch: int) -> Program:
        from pcp_p2p.compile.programs import ProgramOptions, build_program

        i = self.spec.inner
        opts = ProgramOptions(
            inner_steps=self.steps, batch=batch, seq=i.seq_len, beta1=i.beta1, beta2=i.beta2,
            weight_decay=i.weight_decay, grad_clip=i.grad_clip,
        )
        return build_program(kind, self.cfg, opts)

    def initial_theta(self) -> Params:
        from pcp_p2p.compile.model import init_params

        return init_params(self.cfg, seed=self.spec.seed)

    def train(
        self, theta: Params, state: AdamState | None, xs: np.ndarray, ys: np.ndarray, lr: float | None = None
    ) -> tuple[Params, AdamState, np.ndarray]:
        """``steps`` AdamW steps on ``xs, ys`` (``(steps, B, T)``): (θ, optimiser state, losses)."""
        batch = int(xs.shape[1])
        fn = self._train.get(batch)
        if fn is None:
            fn = self._train[batch] = self._jax.jit(self._program("train", batch).fn)
        if state is None:
            state = ({k: np.zeros_like(v) for k, v in theta.items()},
                     {k: np.zeros_like(v) for k, v in theta.items()}, np.int32(0))
        m, v, step = state
        names = self.names
        out = fn(*(theta[k] for k in names), *(m[k] for k in names), *(v[k] for k in names),
                 step, np.float32(self.spec.inner.lr if lr is None else lr), xs, ys)
        out = [np.asarray(o) for o in out]
        n = len(names)
        new_theta = dict(zip(names, out[:n]))
        new_state: AdamState = (dict(zip(names, out[n:2 * n])), dict(zip(names, out[2 * n:3 * n])), out[3 * n])
        return new_theta, new_state, out[3 * n + 1]

    def run_inner(self, worker: str, e: RunInner) -> InnerResult:
        """The executor for :func:`pump_run`: train on the assignment's batches from ``e.theta``."""
        a = e.assignment
        if a.max_steps < self.steps:
            raise LocalError(f"assignment caps {worker:.16}… at {a.max_steps} steps, the program runs {self.steps}")
        i = self.spec.inner
        xs, ys = batches_for_assignment(self.ds.train, a, steps=self.steps, batch_size=i.batch_size, seq_len=i.seq_len)
        t0 = time.process_time()
        theta, state, losses = self.train(e.theta, e.inner_state, xs, ys)
        self.inner_cpu_s.append(time.process_time() - t0)
        state_in = FRESH_STATE if e.inner_state is None else inner_state_digest(as_inner_state(e.inner_state))
        t0 = time.process_time()
        state_out = inner_state_digest(as_inner_state(state))
        self.state_cpu_s.append(time.process_time() - t0)
        return InnerResult(e.round, e.attempt, theta, self.steps, tuple(float(x) for x in losses), state,
                           state_in, state_out)

    def replay(self, theta: Params, state: InnerState | None, assignment: DataAssignment) -> InnerResult:
        """An auditor's re-execution of a round from its public inputs and its start state."""
        e = RunInner(round=-1, attempt=0, theta=theta, theta_cid="", artifact_cid=None, assignment=assignment,
                     time_budget_s=0.0, inner_state=None if state is None else (state.m, state.v, np.int32(state.step)))
        result = self.run_inner("auditor", e)
        self.inner_cpu_s.pop()  # an audit's compute, not training's
        self.state_cpu_s.pop()
        return result

    def warm_start(
        self, theta: Params, *, steps: int, batch: int, seed: int = 20_000
    ) -> tuple[Params, AdamState | None]:
        """``steps`` synchronous AdamW steps at batch ``batch`` from ``theta``: (θ, AdamW state)."""
        state: AdamState | None = None
        for c in range(steps // self.steps):
            xs, ys = self.dp_batches(seed + c, batch)
            theta, state, _ = self.train(theta, state, xs, ys)
        return theta, state

    def dp_batches(self, seed: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, batch, T)`` windows from the whole training split (data-parallel baselines)."""
        return batches_for(self.ds.train, shard=0, num_shards=1, seed=seed, steps=self.steps,
                           batch_size=batch, seq_len=self.spec.inner.seq_len)

    def val_loss(self, theta: Params) -> float:
        """Mean loss over the fixed validation batches."""
        return self._loss(theta, self.val_x, self.val_y)

    def score(self, theta: Params) -> float:
        """Loss on the small held-out batch: the shepherd's ``score`` of a submission."""
        return self._loss(theta, self.score_x, self.score_y)

    def _loss(self, theta: Params, xs: np.ndarray, ys: np.ndarray) -> float:
        import jax.numpy as jnp

        args = [jnp.asarray(theta[k]) for k in self.names]
        return float(np.mean([float(self._eval(*args, xs[i], ys[i])[0]) for i in range(len(xs))]))


def as_inner_state(state: AdamState) -> InnerState:
    """The trainer's optimiser state ``(m, v, step)`` as the audit module names it."""
    m, v, step = state
    return InnerState(m, v, int(step))

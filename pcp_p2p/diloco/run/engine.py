"""The heavy work behind the round machines' effects: build, train, evaluate.

The round machines (:mod:`~pcp_p2p.diloco.protocol.shepherd`, :mod:`~pcp_p2p.diloco.protocol.worker`)
only *ask* for work. This module does it:

- :func:`build_train_artifacts` (shepherd): the run's ``train`` program lowered
  from JAX and compiled by IREE for each target the workers need, with signed
  manifests. A compiled call does :data:`~pcp_p2p.diloco.protocol.audit.CHUNK_STEPS` AdamW steps; a round is as
  many calls as the worker's time budget allows, so one artifact serves fast and
  slow hardware alike.
- :class:`InnerEngine` (worker): runs a ``RunInner`` on the IREE executor. θ is
  uploaded each round; the AdamW moments and step stay on the device across
  rounds (DiLoCo keeps inner optimiser state local) and come back only when asked.
  For audits (:mod:`~pcp_p2p.diloco.protocol.audit`) each run ends by naming its inner
  state with a digest computed on the device side and keeping a snapshot of it
  under that name (references, no copy); the next run starts from the snapshot
  the worker names (``inner_state``), so a run whose result was never submitted
  or committed cannot leak into the next. An *early* run (overlap: ``attempt``
  :data:`~pcp_p2p.diloco.protocol.effects.EARLY`) takes its real start through a
  :class:`ShiftSlot` between chunks and does not end without it.
  :meth:`InnerEngine.replay` re-executes
  an exact step count from a given θ and inner state, and
  :meth:`InnerEngine.export_state` serves a kept state to an auditor.
- :class:`Evaluator` (shepherd): validation loss of a θ with ``jax.jit``, and a
  cheaper held-out :meth:`~Evaluator.score` the shepherd runs on every submission.

Only the shepherd side imports JAX and the compiler (lazily); a worker runs
with the IREE runtime and numpy alone.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pcp_p2p.core.errors import ConfigError, ExecutorError, InvalidInput
from pcp_p2p.diloco.algorithm.data import CharDataset, batches_for_assignment, validation_batches
from pcp_p2p.diloco.protocol.audit import CHUNK_STEPS, InnerState, encode_inner_state
from pcp_p2p.diloco.protocol.effects import EARLY, EARLY_SHARE, RunInner, ShiftInner
from pcp_p2p.diloco.protocol.messages import FRESH_STATE, DataAssignment
from pcp_p2p.diloco.protocol.spec import RunSpec
from pcp_p2p.diloco.protocol.worker import InnerResult

if TYPE_CHECKING:
    from pcp_p2p.compile.manifest import Manifest
    from pcp_p2p.compile.model import GPTConfig
    from pcp_p2p.compile.pipeline import Artifact
    from pcp_p2p.compile.programs import ProgramOptions
    from pcp_p2p.core.identity import Identity
    from pcp_p2p.executor.executor import Executor


KEEP_STATES = 4
"""Inner states an engine keeps on the device (LRU): the one the worker will
start from next, the one it submitted but has not seen committed, the start
state of its last committed round (an audit of that round arrives after the
commit) and one spare for a retried attempt. Each costs 2 × |θ| fp32 of memory
(86 MB for the medium model) beyond the state in use, which it shares."""


@dataclass(frozen=True)
class Replay:
    """What an exact-step replay produced (see :meth:`InnerEngine.replay`)."""

    theta: dict[str, np.ndarray]  # θ_local after the steps
    state_out: str  # digest of the moments and step after them
    losses: tuple[float, ...]


def program_options(spec: RunSpec, micro_batch: int = 0) -> ProgramOptions:
    """The compiled programs' options; ``micro_batch`` is the term's memory plan
    (:mod:`~pcp_p2p.diloco.protocol.sizing`; 0 = the whole batch in one pass)."""
    from pcp_p2p.compile.programs import ProgramOptions

    i = spec.inner
    return ProgramOptions(
        inner_steps=CHUNK_STEPS, batch=i.batch_size, seq=i.seq_len,
        beta1=i.beta1, beta2=i.beta2, weight_decay=i.weight_decay, grad_clip=i.grad_clip,
        micro_batch=0 if micro_batch == i.batch_size else micro_batch,
    )


def model_config(spec: RunSpec, vocab_size: int) -> GPTConfig:
    from pcp_p2p.compile.model import preset

    cfg = preset(spec.model, vocab_size=vocab_size)
    if spec.inner.seq_len > cfg.block_size:
        raise ConfigError(
            f"inner.seq_len {spec.inner.seq_len} exceeds the {spec.model} model's context {cfg.block_size}")
    return cfg


def initial_theta(spec: RunSpec, vocab_size: int) -> dict[str, np.ndarray]:
    from pcp_p2p.compile.model import init_params

    return init_params(model_config(spec, vocab_size), seed=spec.seed)


def build_train_artifacts(
    spec: RunSpec, vocab_size: int, targets: Sequence[str], identity: Identity, cache_dir: Path,
    cancel: threading.Event | None = None, micro_batch: int = 0,
) -> list[Artifact]:
    """Compile (or take from the on-disk cache) the train program for ``targets`` at ``micro_batch``
    sequences per pass (0: the whole batch); ``cancel`` stops it
    (:class:`~pcp_p2p.core.errors.CompileCancelled`, the compiler process killed)."""
    from pcp_p2p.compile.cache import ArtifactCache
    from pcp_p2p.compile.pipeline import build_artifacts
    from pcp_p2p.compile.targets import get_target

    return build_artifacts(
        spec.model, model_config(spec, vocab_size), program_options(spec, micro_batch), ["train"],
        [get_target(t) for t in targets], identity, cache=ArtifactCache(cache_dir), cancel=cancel,
    )


SCORE_BATCHES = 2
"""Held-out batches per submission score: each costs one forward pass, and a few
nats of damage (random, flipped or blown-up Δ) shows on two batches already."""

SCORE_SEED = 1
"""Seed of the score's windows: not the validation windows (seed 0), so the guard
that checks commits (val loss) and the one that checks submissions do not share data."""


class Evaluator:
    """Validation loss of θ on a fixed set of held-out batches (shepherd side, JAX).

    Calling it gives the validation loss (``n_batches`` windows: commit records
    and the val-jump guard); :meth:`score` is the cheap per-submission check
    (``score_batches`` other windows of the validation split), with the same
    jitted program.
    """

    def __init__(
        self, spec: RunSpec, dataset: CharDataset, n_batches: int = 4, score_batches: int = SCORE_BATCHES
    ) -> None:
        import jax

        from pcp_p2p.compile.model import param_names
        from pcp_p2p.compile.programs import build_program

        cfg = model_config(spec, dataset.vocab_size)
        opts = program_options(spec)
        self._names = param_names(cfg)
        self._fn = jax.jit(build_program("eval", cfg, opts).fn)
        self._vx, self._vy = validation_batches(
            dataset.val, n_batches=n_batches, batch_size=spec.inner.batch_size, seq_len=spec.inner.seq_len
        )
        self._sx, self._sy = validation_batches(
            dataset.val, n_batches=score_batches, batch_size=spec.inner.batch_size, seq_len=spec.inner.seq_len,
            seed=SCORE_SEED,
        )

    def _loss(self, theta: dict[str, np.ndarray], xs: np.ndarray, ys: np.ndarray) -> float:
        args = [theta[k] for k in self._names]
        return float(np.mean([float(np.asarray(self._fn(*args, xs[i], ys[i])[0])) for i in range(len(xs))]))

    def __call__(self, theta: dict[str, np.ndarray]) -> float:
        """Validation loss of θ (mean over the fixed validation batches)."""
        return self._loss(theta, self._vx, self._vy)

    def score(self, theta: dict[str, np.ndarray]) -> float:
        """Held-out loss of θ on the few score batches: the shepherd's per-submission check."""
        return self._loss(theta, self._sx, self._sy)


class ShiftSlot:
    """How an early inner run learns its real start from another thread (a ``ShiftInner``).

    The event loop calls :meth:`shift` (or :meth:`wake`, with the run's cancel event set);
    the run takes the shift at its next chunk boundary, or waits for it once it has trained
    its early share (``EARLY_SHARE``) or its steps: an early run's Δ means nothing until it
    is measured from the announced θ.
    """

    def __init__(self) -> None:
        self._shift: ShiftInner | None = None
        self._woken = threading.Event()
        self.waiting = threading.Event()  # the run has trained what it may before its shift

    def shift(self, e: ShiftInner) -> None:
        self._shift = e
        self._woken.set()

    def wake(self) -> None:
        """Stop a wait for the shift (the run was cancelled)."""
        self._woken.set()

    def take(self) -> ShiftInner | None:
        e, self._shift = self._shift, None
        return e

    def wait(self) -> None:
        self.waiting.set()
        self._woken.wait()


class InnerEngine:
    """Runs a worker's inner steps on the IREE executor (call from a thread)."""

    def __init__(self, executor: Executor, spec: RunSpec, dataset: CharDataset) -> None:
        self.executor = executor
        self.spec = spec
        self.dataset = dataset
        self.busy_s = 0.0  # time spent inside train calls (compute utilisation)
        self.state_s = 0.0  # time spent naming and keeping inner states (the audit's cost per round)
        self.replay_s = 0.0  # time spent replaying other workers' rounds
        self.tokens = 0
        # One run or replay at a time: both own the device state while they train.
        self._lock = threading.Lock()
        self._states: OrderedDict[str, None] = OrderedDict()

    def run(self, eff: RunInner, cancelled: threading.Event, shift: ShiftSlot | None = None) -> InnerResult:
        """Train from ``eff.theta`` for the round's time budget (whole chunks, up to max_steps).

        An early run (``eff.attempt == EARLY``) needs ``shift``: it moves its parameters by
        ``to − eff.theta`` when the shift comes, trains on the announced assignment's batches
        from there, and ends only after it (or when cancelled).
        """
        if eff.attempt == EARLY and shift is None:
            raise ExecutorError("an early inner run needs a shift slot")
        with self._lock:
            return self._run(eff, cancelled, shift if eff.attempt == EARLY else None)

    def _shift(self, start: dict[str, np.ndarray], e: ShiftInner) -> None:
        """Move the device's parameters by ``e.to − start``; the moments and step stay.

        ``e.to`` is the announced θ (hash-checked against the CID its shepherd signed, not
        against the model): tensors that do not fit are refused here, before any arithmetic.
        """
        if e.to.keys() != start.keys() or any(np.shape(e.to[k]) != np.shape(start[k]) for k in start):
            raise InvalidInput("the announced θ does not have this model's tensors")
        now = self.executor.read_params()
        self.executor.load_params({k: now[k] + (e.to[k] - start[k]) for k in now})

    def _run(self, eff: RunInner, cancelled: threading.Event, shift: ShiftSlot | None) -> InnerResult:
        state_in = self._start(eff.theta, eff.inner_state)
        xs, ys = self._batches(eff.assignment)
        max_steps = len(xs)
        lr = self.spec.inner.lr
        t_end = time.monotonic() + eff.time_budget_s
        losses: list[float] = []
        steps = 0
        shifted_at: int | None = None
        per_chunk = 0.0
        # An early run trains at most EARLY_SHARE of its budget and steps before its shift, then waits.
        early_end = time.monotonic() + EARLY_SHARE * eff.time_budget_s
        early_steps = max(CHUNK_STEPS, int(EARLY_SHARE * max_steps))
        while not cancelled.is_set():
            if shift is not None and (moved := shift.take()) is not None:
                self._shift(eff.theta, moved)
                shift, shifted_at = None, steps
                # A late shift still gets the rest of a round after it: otherwise a round that waited
                # for a straggler ends at the shift, all its steps from the estimate.
                t_end = max(t_end, time.monotonic() + (1 - EARLY_SHARE) * eff.time_budget_s)
                if moved.assignment != eff.assignment:  # the roster changed: the announced data from here on
                    xs, ys = self._batches(moved.assignment)
                    max_steps = len(xs)
            room = steps + CHUNK_STEPS <= max_steps
            # Another chunk would overrun the budget? (The first chunk always runs, and the first
            # after a shift: an early run's Δ always holds steps from the announced θ.)
            over = bool(steps) and steps != shifted_at and time.monotonic() + per_chunk > t_end
            if shift is not None and (not room or over or steps + CHUNK_STEPS > early_steps
                                      or (steps and time.monotonic() + per_chunk > early_end)):
                shift.wait()  # an early run past its share (or its budget): its start first
                continue
            if not room or over:
                break
            t0 = time.monotonic()
            out = self.executor.train(lr, xs[steps : steps + CHUNK_STEPS], ys[steps : steps + CHUNK_STEPS])
            dt = time.monotonic() - t0
            per_chunk = dt if not per_chunk else 0.5 * (per_chunk + dt)
            self.busy_s += dt
            losses.extend(float(x) for x in out)
            steps += CHUNK_STEPS
        if not np.all(np.isfinite(losses)):
            raise ExecutorError("inner training diverged (non-finite loss)")
        self.tokens += steps * self.spec.tokens_per_step
        theta = self.executor.read_params()
        state_out = self._keep()
        return InnerResult(eff.round, eff.attempt, theta, steps, tuple(losses), state_out,
                           state_in=state_in, state_out=state_out, shifted_at=shifted_at)

    def replay(self, theta: dict[str, np.ndarray], state: InnerState | None,
               assignment: DataAssignment, steps: int) -> Replay:
        """Exactly ``steps`` inner steps from ``theta`` and ``state`` (None: fresh moments).

        The batches are drawn exactly as :meth:`run` draws them for the same
        assignment, so an honest round replays bit for bit (docs/diloco.md). The
        device's current state is overwritten; the worker's own states are kept
        as snapshots, and every :meth:`run` starts from one (or fresh).
        """
        if steps <= 0 or steps % CHUNK_STEPS:
            raise ExecutorError(f"a replay runs whole chunks of {CHUNK_STEPS} steps, not {steps}")
        with self._lock:
            t0 = time.monotonic()
            if state is None:
                self.executor.load_state(theta)
            else:
                self.executor.load_state(theta, state.m, state.v, state.step)
            xs, ys = self._batches(assignment)
            if steps > len(xs):
                raise ExecutorError(f"a replay of {steps} steps, the assignment allows {len(xs)}")
            lr = self.spec.inner.lr
            losses: list[float] = []
            for i in range(0, steps, CHUNK_STEPS):
                out = self.executor.train(lr, xs[i : i + CHUNK_STEPS], ys[i : i + CHUNK_STEPS])
                losses.extend(float(x) for x in out)
            result = Replay(self.executor.read_params(), self.executor.inner_digest(), tuple(losses))
            self.replay_s += time.monotonic() - t0
            return result

    def export_state(self, digest: str) -> bytes:
        """The state blob (:func:`~pcp_p2p.diloco.protocol.audit.encode_inner_state`) of a kept state."""
        if digest not in self._states:
            raise ExecutorError(f"inner state {digest:.16} is no longer kept")
        st = self.executor.read_inner(tag=digest)
        return encode_inner_state(InnerState(st.m, st.v, st.step))

    @property
    def kept_states(self) -> tuple[str, ...]:
        return tuple(self._states)

    # --- internals -----------------------------------------------------------------

    def _batches(self, assignment: DataAssignment) -> tuple[np.ndarray, np.ndarray]:
        # Whole chunks only, and never more steps than the assignment allows: the
        # shepherd refuses a claim above what this worker's announced speed permits.
        max_steps = (assignment.max_steps // CHUNK_STEPS) * CHUNK_STEPS
        if max_steps == 0:
            raise ExecutorError(
                f"the round allows {assignment.max_steps} steps, less than one compiled chunk of {CHUNK_STEPS}"
            )
        return batches_for_assignment(
            self.dataset.train, assignment, steps=max_steps,
            batch_size=self.spec.inner.batch_size, seq_len=self.spec.inner.seq_len,
        )

    def _start(self, theta: dict[str, np.ndarray], inner_state: Any) -> str:
        """Load θ and the inner state the worker names; the digest started from, or FRESH_STATE."""
        if isinstance(inner_state, str) and inner_state in self._states:
            self.executor.restore(inner_state)
            self.executor.load_params(theta)
            self._states.move_to_end(inner_state)
            return inner_state
        # First round on this node, or a state this engine no longer holds: fresh moments.
        self.executor.load_state(theta)
        return FRESH_STATE

    def _keep(self) -> str:
        """Name the device's inner state by its digest and keep a snapshot of it."""
        t0 = time.monotonic()
        digest = self.executor.inner_digest()
        if digest in self._states:
            self._states.move_to_end(digest)
        else:
            self.executor.snapshot(digest)
            self._states[digest] = None
        while len(self._states) > KEEP_STATES:
            old, _ = self._states.popitem(last=False)
            self.executor.drop_snapshot(old)
        self.state_s += time.monotonic() - t0
        return digest


def start_executor(vmfb_path: Path, manifest: Manifest, shepherd: str) -> Executor:
    """An executor for a train artifact whose manifest the run's shepherd signed."""
    from pcp_p2p.executor.executor import Executor

    return Executor.start(vmfb_path, manifest, expected_signer=shepherd)

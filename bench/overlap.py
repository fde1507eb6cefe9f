"""Does DiLoCo still converge when the next round trains while this one's exchange is in flight?

Run: ``.venv/bin/python bench/overlap.py`` (about 15 minutes on 2 CPU cores).

Issue #15 item 2 asks for overlap (a worker starts round r+1 while its Δ of
round r is in flight) and to make it the default if it wins. Every way of doing
that trains (part of) round r+1 from a θ that does not yet hold round r's
update: staleness one round, or the part τ of a round the exchange takes in
the ``corrected`` arms (``docs/diloco.md``, "Overlap"). Before any
protocol is built for it, this bench asks the numerical question on the real
model and data: the ``tiny`` GPT on Shakespeare, 4 workers, H = 50 inner AdamW
steps, ``ROUNDS`` rounds from the same warm start as ``bench/diloco.py`` (whose
harness it uses), each worker on its own shard with its own AdamW state kept
across rounds. Arms, each the same tokens:

- ``dp``: synchronous data parallel (batch 4·B), the baseline;
- ``sync``: DiLoCo as PCP runs it: round r trains from θ_r, θ_{r+1} =
  Nesterov(θ_r, Δ̄_r), η = 0.7, μ = 0.9;
- ``delayed_<η>_<μ>``: the one-step-delayed outer update: round r trains from
  θ_{r−1}; its Δ̄ (measured from θ_{r−1}) is applied to θ_r;
- ``rebased_<η>_<μ>``: the same training, but the shepherd rebases each Δ to
  the θ it is applied to (Δ' = Δ + θ_r − θ_{r−1}, i.e. it steps from θ_r
  toward the workers' end points, so round r−1's update is not counted twice);
  the shepherd holds both θs, so this needs no new message;
- ``eager_<η>_<μ>``: each worker stands in for the update it has not seen
  with its own: round r starts from θ_{r−1} − Δ^m_{r−1} (the newest θ it
  holds, moved by its own last Δ), its Δ is measured from there, and the
  shepherd steps from θ_r with the mean (the "eager updates" idea for
  overlapped DiLoCo). Auditable in principle (θ_{r−1} and the worker's
  signed Δ are public) but each worker's start differs, so it needs new
  base rules in the protocol.
- ``corrected_<τ>``: eager until θ_r arrives, then corrected. Round r starts
  from the worker's own end point of round r−1 (θ_{r−1} − Δ^m_{r−1}, as
  eager); after the fraction τ of its H steps (the time the exchange takes)
  θ_r has arrived, and the worker shifts its current parameters by
  θ_r − (that start), i.e. swaps its stand-in for the real update and keeps
  the progress of its τ·H steps; it trains the rest of the round and
  measures its Δ from θ_r, so the shepherd's step is sync's (η = 0.7,
  μ = 0.9). Staleness τ of a round instead of one (Streaming DiLoCo's
  overlap of τ inner steps, with its merge replaced by the shift). Every
  input is public (θ_{r−1}, θ_r, the worker's signed Δ, τ), so a round
  replays exactly; the exchange hides behind compute as long as it takes
  less than τ of the round.
- ``corrected-nesterov_<τ>`` and ``corrected-base_<τ>``: the same, from a
  better guess of θ_r than the worker's own end point: the shepherd's Nesterov
  step with the worker's own Δ for the mean (θ_{r−1} − η·(μ·v̂ + Δ^m), v̂ = μ·v_{r−1}
  + Δ^m, with the momentum v_{r−1} that the checkpoint of θ_{r−1} holds), or
  θ_{r−1} itself. In steady state the outer step is several times one Δ
  (momentum 0.9), so the own end point lies far short of θ_r.

Headline: the best overlapped arm's final validation loss over DP's (lower is
better); target 1.05, issue #15's bound on the val-loss ratio against DP for
its bandwidth work (sync DiLoCo's own ratio is in the line too, as
``sync_ratio``). Knobs: ``PCP_BENCH_ROUNDS`` (10), ``PCP_BENCH_WARMUP`` (200),
``PCP_BENCH_OVERLAP_ARMS`` (comma-separated arm names; default all; ``sync``
always runs).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import diloco as harness  # bench/diloco.py: the spec, the JAX trainer, the warm start, the DP arm
import numpy as np

from pcp_p2p.diloco.algorithm.data import batches_for
from pcp_p2p.diloco.algorithm.outer import OuterState, nesterov_step
from pcp_p2p.diloco.algorithm.params import Params
from pcp_p2p.diloco.protocol.spec import parse_spec
from pcp_p2p.testing.inprocess import AdamState, JaxTrainer

TARGET = 1.05
ARMS: dict[str, tuple[str, float, float, float]] = {  # rule, outer lr, momentum, τ (corrected)
    "sync": ("sync", 0.7, 0.9, 0.0),
    "delayed_0.7_0.9": ("delayed", 0.7, 0.9, 1.0),
    "delayed_0.7_0.5": ("delayed", 0.7, 0.5, 1.0),
    "delayed_1.0_0.0": ("delayed", 1.0, 0.0, 1.0),
    "rebased_0.7_0.9": ("rebased", 0.7, 0.9, 1.0),
    "rebased_1.0_0.9": ("rebased", 1.0, 0.9, 1.0),
    "rebased_1.0_0.0": ("rebased", 1.0, 0.0, 1.0),
    "eager_0.7_0.9": ("eager", 0.7, 0.9, 1.0),
    "eager_0.7_0.5": ("eager", 0.7, 0.5, 1.0),
    **{f"corrected_{tau:g}": ("corrected", 0.7, 0.9, tau) for tau in (0.1, 0.25, 0.5, 0.75)},
    **{f"corrected-{start}_{tau:g}": (f"corrected-{start}", 0.7, 0.9, tau)
       for start in ("nesterov", "base") for tau in (0.25, 0.5)},
}


def run_arm(trainer: JaxTrainer, theta0: Params, rule: str, lr: float, mu: float, tau: float) -> list[float]:
    """Val loss after each commit of one arm (``rule``: sync, delayed, rebased, eager or corrected)."""
    seq = trainer.spec.inner.seq_len
    state = OuterState.initial(theta0)
    before: Params | None = None  # θ_{r−1}: an overlapped round's base
    inner: list[AdamState | None] = [None] * harness.WORKERS
    own: list[Params | None] = [None] * harness.WORKERS  # each worker's last Δ (eager)
    momentum_before: Params | None = None  # v_{r−1}: the momentum the checkpoint of θ_{r−1} holds
    curve = []
    for r in range(harness.ROUNDS):
        base = state.theta if rule == "sync" or before is None else before
        deltas = []
        for i in range(harness.WORKERS):
            last = own[i]
            if rule == "eager" and last is not None and before is not None:
                base = {k: before[k] - last[k] for k in last}
            xs, ys = batches_for(trainer.ds.train, shard=i, num_shards=harness.WORKERS, seed=1000 * r + i,
                                 steps=harness.H, batch_size=harness.B, seq_len=seq)
            if rule.startswith("corrected") and last is not None and before is not None:
                if rule == "corrected-nesterov" and momentum_before is not None:
                    v = {k: mu * momentum_before[k] + last[k] for k in last}
                    start = {k: before[k] - lr * (mu * v[k] + last[k]) for k in last}
                elif rule == "corrected-base":
                    start = dict(before)
                else:
                    start = {k: before[k] - last[k] for k in last}  # its own end point of round r−1
                cut = round(tau * harness.H)
                early, inner[i], _ = trainer.train(start, inner[i], xs[:cut], ys[:cut])
                base = state.theta  # θ_r has arrived: swap the stand-in for it, keep the τ·H steps' progress
                shifted = {k: early[k] + (base[k] - start[k]) for k in base}
                local, inner[i], _ = trainer.train(shifted, inner[i], xs[cut:], ys[cut:])
            else:
                local, inner[i], _ = trainer.train(base, inner[i], xs, ys)
            d = {k: base[k] - local[k] for k in base}
            own[i] = d
            if rule == "rebased":
                d = {k: d[k] + (state.theta[k] - base[k]) for k in d}
            deltas.append(d)
        mean = {k: np.mean([d[k] for d in deltas], axis=0) for k in state.theta}
        before, momentum_before = state.theta, state.momentum
        state = nesterov_step(state, mean, lr=lr, momentum=mu)
        curve.append(round(trainer.val_loss(state.theta), 4))
    return curve


def main() -> None:
    t0 = time.perf_counter()
    spec = parse_spec(harness.SPEC)
    trainer, _, theta0 = harness.setup(spec)
    dp_curve, _ = harness.run_dp(trainer, theta0, harness.ROUNDS)
    wanted = os.environ.get("PCP_BENCH_OVERLAP_ARMS")
    names = [n for n in ARMS if wanted is None or n in wanted.split(",") or n == "sync"]
    curves = {}
    for name in names:
        curves[name] = run_arm(trainer, theta0, *ARMS[name])
        print(f"{name}: {curves[name]} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    ratios = {n: round(c[-1] / dp_curve[-1], 4) for n, c in curves.items()}
    overlapped = {n: x for n, x in ratios.items() if n != "sync"}
    best = min(overlapped, key=lambda n: overlapped[n]) if overlapped else None
    print(json.dumps({
        "headline": overlapped[best] if best else None,
        "target": TARGET,
        "better": "lower",
        "unit": "final val loss, best overlapped arm / synchronous DP (same tokens)",
        "best_arm": best,
        "sync_ratio": ratios["sync"],
        "ratios": ratios,
        "dp_val_curve": dp_curve,
        "val_curves": curves,
        "rounds": harness.ROUNDS,
        "inner_steps": harness.H,
        "workers": harness.WORKERS,
        "warm_start_steps": harness.WARMUP,
        "seconds_total": round(time.perf_counter() - t0, 1),
    }))


if __name__ == "__main__":
    main()

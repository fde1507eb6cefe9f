"""Bytes per token of DiLoCo with the sparse codec against synchronous data-parallel training.

Run: ``.venv/bin/python bench/bandwidth.py`` (a few minutes on 2 CPU cores).

The arms of ``bench/diloco.py`` (its machinery, imported, not copied): the
``tiny`` GPT on Shakespeare, a shared warm start of ``WARMUP`` synchronous
steps, then ``ROUNDS`` rounds of 4 workers x H = 50 inner AdamW steps through
the real sans-IO round protocol (Shepherd and Worker machines, signed
messages, the aggregator's admission checks, the spec's robust rule, outer
Nesterov, θ hash-checked by every worker), pumped in one process:

- ``topk2`` (``PCP_BENCH_CODEC``): sparse Δ, the largest of every group of 16
  values (256 of every 4096, 4-bit offsets, 3-bit values) with error feedback
  on each worker (:mod:`pcp_p2p.diloco.algorithm.sparse`), audits off (not auditable
  yet), and SparseLoCo's outer step, plain SGD without momentum, here at lr 4
  (``PCP_BENCH_SPARSE_OUTER_LR``, ``PCP_BENCH_SPARSE_MOMENTUM``): error
  feedback already delays and carries updates like a momentum, and with 4
  workers whose kept coordinates mostly differ the mean applies each at about
  a quarter. Measured outside this script (same model, data, warm start, 10
  rounds, plain mean, the earlier free top-64 of 4096 with 2-bit values and
  12-bit indices): val loss 2.378 at round 1, then 2.333 at round 10 with lr
  1, 2.249 with lr 2.5, and with DiLoCo's Nesterov (0.7, 0.9) 2.334 at round 5
  turning up to 2.378 by round 10. Ranked at 4 rounds (val-loss ratio against
  DP's 2.142, bytes ratio): free top-64, 2-bit, lr 2.5: 1.0898 at 5,889x
  (10 rounds: 1.177); grouped 128 of 4096 (one of 32, 5-bit offsets), 2-bit,
  lr 2.5: 1.0785 at 5,889x (the same bytes); grouped 256 (one of 16), 2-bit:
  lr 2.5 1.0597, lr 4 1.0445, lr 6 1.0914, at 3,751x; grouped 256, 3-bit,
  lr 4: 1.0398 at 3,183x (the default; 10 rounds, this script: 1.0358 at
  3,181x, against 1.177 at 5,889x for the free top-64). The robust rule is ``centered_clip``
  (``PCP_BENCH_SPARSE_RULE``): the default trimmed mean zeroes a coordinate
  that fewer than a quarter of the weight sent, and the worker that sent it
  has let it go from its residual, so it is lost — measured in this script,
  the trimmed-mean arm hardly learned (val loss 2.383 → 2.376 in 10 rounds,
  ratio 1.236); the centered clip starts from the coordinate-wise median but
  moves to the honest workers' mean;
- ``int8``: today's default codec, measured in the same run as the baseline;
- synchronous data parallel: one AdamW trajectory with a 4x batch for the same
  ``ROUNDS·H`` steps (4 DP workers all-reducing a gradient every step).

Bytes per token, per worker, upstream: DP sends a full fp32 gradient (4·P
bytes) every step of B·T tokens; a DiLoCo worker sends one encoded
``Submission`` (payload, header fields, per-step losses, signature, measured as
encoded on the wire) every H steps. Headline: the ratio DP / DiLoCo with the
sparse codec (goal ≥ 3000x), with ``val_loss_ratio`` = its final validation
loss / DP's (goal ≤ 1.05) in the same line.

``shepherd_bytes_per_model`` (issue #15, item 3) is *measured* by
``bench/shepherd_bytes.py`` (run from here, merged into this line; skip it
with ``PCP_BENCH_SHEPHERD=0``): the shepherd's bytes in + out per round with
16 ``pcp`` worker processes training the tiny GPT with ``topk2``, over the
fp32 θ bundle, and the same at 4 workers (``shepherd_bytes_flat_in_n``).
Before θ travelled by swarming it was computed here as N·(submission + θ +
announcement + commit) / θ = 16.28 at N = 16, growing as N.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/diloco.py's machinery

import diloco as base
import shepherd_bytes

from pcp_p2p.diloco.protocol.spec import FEEDBACK_CODECS, OuterOptimizer, RunSpec, parse_spec

CODEC = os.environ.get("PCP_BENCH_CODEC", "topk2")
SPARSE_RULE = os.environ.get("PCP_BENCH_SPARSE_RULE", "centered_clip")  # not trimmed_mean: see the docstring
# SparseLoCo's outer step: error feedback already carries the momentum, so plain SGD (see above).
SPARSE_OUTER_LR = float(os.environ.get("PCP_BENCH_SPARSE_OUTER_LR", "4.0"))
SPARSE_MOMENTUM = float(os.environ.get("PCP_BENCH_SPARSE_MOMENTUM", "0.0"))
TARGET = 3000


def with_codec(spec: RunSpec, codec: str, rule: str = "", outer: OuterOptimizer | None = None) -> RunSpec:
    """``spec`` with another Δ codec (and aggregation rule and outer optimiser, if given), validated.

    An error-feedback codec cannot be audited yet (the spec refuses it with
    ``audit_rate > 0``), so its arm runs with audits off.
    """
    agg = spec.aggregation if not rule else dataclasses.replace(spec.aggregation, rule=rule)
    if codec in FEEDBACK_CODECS:
        agg = dataclasses.replace(agg, audit_rate=0.0)
    return dataclasses.replace(spec, round=dataclasses.replace(spec.round, delta_codec=codec),
                               aggregation=agg, outer=outer or spec.outer).validate()


def bytes_ratio(n_params: int, submission_bytes: float) -> float:
    """DP's upstream bytes per token over a DiLoCo worker's (see the module docstring)."""
    return (4 * n_params / (base.B * base.T)) / (submission_bytes / (base.H * base.B * base.T))


def main() -> None:
    t_start = time.perf_counter()
    int8_spec = parse_spec(base.SPEC)
    sparse_spec = with_codec(int8_spec, CODEC, SPARSE_RULE, OuterOptimizer(SPARSE_OUTER_LR, SPARSE_MOMENTUM))
    trainer, _, theta0 = base.setup(int8_spec)
    n_params = int(sum(v.size for v in theta0.values()))

    sparse = base.run_diloco(sparse_spec, trainer, theta0)
    int8 = base.run_diloco(int8_spec, trainer, theta0)
    dp_curve, t_dp = base.run_dp(trainer, theta0, base.ROUNDS)
    dp_val = dp_curve[-1]

    def summary(arm: base.DilocoArm) -> dict:
        sub = sum(arm.log.submission_bytes) / len(arm.log.submission_bytes)
        return {
            "bytes_ratio": round(bytes_ratio(n_params, sub), 1),
            "val_loss": round(arm.val_loss, 4),
            "val_loss_ratio": round(arm.val_loss / dp_val, 4),
            "submission_bytes": int(sub),
            "val_curve": [round(c.val_loss, 4) for c in arm.log.commits if c.val_loss is not None],
            "rejected": len(arm.log.rejected),
            "workers_agree_on_theta": arm.workers_agree,
            "seconds": round(arm.seconds, 1),
        }

    s, i = summary(sparse), summary(int8)
    # The shepherd's traffic per round, measured with real worker processes (bench/shepherd_bytes.py).
    shepherd: dict = {"shepherd_bytes_per_model": None, "shepherd_bytes_per_model_target": shepherd_bytes.TARGET,
                      "shepherd_bytes_note": "not measured (PCP_BENCH_SHEPHERD=0)"}
    if os.environ.get("PCP_BENCH_SHEPHERD", "1") != "0":
        shepherd = shepherd_bytes.measure()
    result = {
        "headline": s["bytes_ratio"],
        "target": TARGET,
        "better": "higher",
        "unit": "x fewer bytes per token than synchronous data parallel (H=50, per worker, upstream)",
        "metric": f"DP bytes/token / DiLoCo bytes/token, {CODEC} Δ with error feedback, 4 workers, H=50",
        "codec": CODEC,
        "val_loss_ratio": s["val_loss_ratio"],
        "val_loss_ratio_target": 1.05,
        "int8_bytes_ratio": i["bytes_ratio"],
        "int8_val_loss_ratio": i["val_loss_ratio"],
        "dp_val_loss": dp_val,
        "dp_val_curve": dp_curve,
        "sparse": s,
        "int8": i,
        "sparse_aggregation_rule": sparse_spec.aggregation.rule,
        "sparse_outer": {"lr": sparse_spec.outer.lr, "momentum": sparse_spec.outer.momentum},
        "int8_outer": {"lr": int8_spec.outer.lr, "momentum": int8_spec.outer.momentum},
        **shepherd,
        "params": n_params,
        "rounds": base.ROUNDS,
        "inner_steps": base.H,
        "workers": base.WORKERS,
        "warm_start_steps": base.WARMUP,
        "seconds_dp": round(t_dp, 1),
        "seconds_total": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

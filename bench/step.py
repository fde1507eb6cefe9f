"""Per-step time of the ``train`` program: IREE executor versus ``jax.jit``, same machine.

For each model (tiny, medium) and each H (1 = a single step, 10 = a round
chunk of ten inner steps in one call) this compiles the train program for the
CPU variant the executor picks on this machine, then times the same call with
the same state and batches both ways, *interleaved* (JAX, IREE, JAX, IREE...)
so that load from other processes hits both alike, and reports the median
time per inner step. Both sides keep state on their device between calls and
read back only the losses, as a worker does during a round.

The ratio is the median over pairs of (IREE call / the JAX call just before
it), so that slowly varying load from other processes cancels.

The last line printed is JSON: the headline ``value`` is the IREE/JAX ratio
for medium at H=10 (lower is better; the target is 0.8), with every ratio and
timing beside it.

    .venv/bin/python bench/step.py                 # tiny + medium, H = 1 and 10
    .venv/bin/python bench/step.py --models tiny --reps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pcp_p2p.compile.cache import ArtifactCache  # noqa: E402
from pcp_p2p.compile.model import init_params, param_names, preset  # noqa: E402
from pcp_p2p.compile.pipeline import compile_lowered, lower_program, write_artifact  # noqa: E402
from pcp_p2p.compile.programs import ProgramOptions  # noqa: E402
from pcp_p2p.compile.targets import get_target  # noqa: E402
from pcp_p2p.node.cpu import best_cpu_target  # noqa: E402
from pcp_p2p.node.executor import Executor  # noqa: E402
from pcp_p2p.node.identity import Identity, default_data_dir  # noqa: E402

# (batch, seq) per model: big enough to be a real step, small enough for a 2-core machine.
SHAPES = {"tiny": (8, 64), "small": (8, 128), "medium": (4, 128)}
LR = 3e-4


def bench_one(model: str, H: int, target_name: str, reps: int, workdir: Path,
              cache: ArtifactCache, log) -> dict:
    import jax

    cfg = preset(model)
    B, T = SHAPES[model]
    opts = ProgramOptions(inner_steps=H, batch=B, seq=T)
    t0 = time.perf_counter()
    lowered = lower_program("train", cfg, opts)
    art = compile_lowered(lowered, get_target(target_name), Identity.generate(), model, cache)
    vmfb, _ = write_artifact(workdir / f"{model}-H{H}", art)
    log(f"{model} H={H}: lowered + compiled for {target_name} in {time.perf_counter() - t0:.1f} s "
        f"({'cached' if art.cached else 'fresh'}, {art.manifest.artifact_size:,} B)")

    rng = np.random.default_rng(0)
    seqs = rng.integers(0, cfg.vocab_size, size=(H, B, T + 1), dtype=np.int32)
    xs, ys = seqs[..., :-1].copy(), seqs[..., 1:].copy()
    params = init_params(cfg, seed=0)
    names = param_names(cfg)
    zeros = [np.zeros_like(params[n]) for n in names]

    # JAX: the same program, state kept as device arrays and fed back.
    fn = jax.jit(lowered.program.fn)
    jstate = [jax.device_put(a) for a in [params[n] for n in names] + zeros + zeros]
    jstate.append(jax.device_put(np.int32(0)))
    lr, jxs, jys = jax.device_put(np.float32(LR)), jax.device_put(xs), jax.device_put(ys)

    def jax_call():
        nonlocal jstate
        out = fn(*jstate, lr, jxs, jys)
        jstate = list(out[:-1])
        return np.asarray(out[-1])  # losses to the host, like the executor

    t0 = time.perf_counter()
    jax_call()
    log(f"{model} H={H}: jax.jit compile + first call {time.perf_counter() - t0:.1f} s")

    with Executor.start(vmfb, art.manifest) as ex:
        ex.load_state(params)
        ex.train(LR, xs, ys)  # warm-up
        jax_t, iree_t = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax_call()
            jax_t.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ex.train(LR, xs, ys)
            iree_t.append(time.perf_counter() - t0)
    jax_ms = statistics.median(jax_t) / H * 1e3
    iree_ms = statistics.median(iree_t) / H * 1e3
    # each IREE call is compared with the JAX call just before it (same load on
    # a shared machine); the median of those ratios resists load that drifts
    ratio = statistics.median(i / j for i, j in zip(iree_t, jax_t))
    log(f"{model} H={H}: per step  jax {jax_ms:8.2f} ms   iree {iree_ms:8.2f} ms   "
        f"ratio {ratio:.3f}  (median of {reps} interleaved pairs)")
    return {"jax_ms": round(jax_ms, 3), "iree_ms": round(iree_ms, 3), "ratio": round(ratio, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,medium")
    ap.add_argument("--steps", default="1,10", help="values of H to time")
    ap.add_argument("--reps", type=int, default=5, help="interleaved timed calls per engine")
    ap.add_argument("--target", default=None, help="CPU target (default: the executor's pick)")
    ap.add_argument("--data-dir", type=Path, default=None, help="where the compile cache lives")
    args = ap.parse_args()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    picked = best_cpu_target()
    target = args.target or picked.name
    log(f"CPU variant picked by the executor on this machine: {picked.name}; timing {target}")
    cache = ArtifactCache.in_data_dir(args.data_dir or default_data_dir())
    workdir = Path(__import__("tempfile").mkdtemp(prefix="pcp-bench-step-"))
    results: dict[str, dict] = {}
    for model in args.models.split(","):
        for H in (int(h) for h in args.steps.split(",")):
            results[f"{model}_h{H}"] = bench_one(model, H, target, args.reps, workdir, cache, log)
    headline = results.get("medium_h10") or next(reversed(results.values()))
    print(json.dumps({
        "metric": "iree_over_jax_step_time_medium_h10",
        "headline": headline["ratio"],
        "unit": "ratio",
        "better": "lower",
        "target": 0.8,
        "cpu_target": target,
        "picked": picked.name,
        "ratios": {k: v["ratio"] for k, v in results.items()},
        "ms_per_step": {k: {"jax": v["jax_ms"], "iree": v["iree_ms"]} for k, v in results.items()},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())

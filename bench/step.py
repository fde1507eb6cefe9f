"""Per-step time of the ``train`` program: IREE executor versus ``jax.jit``, same machine.

For each case (model, B, T, H) this compiles the train program for the CPU
variant the executor picks on this machine, then times the same call with the
same state and batches both ways, *interleaved* (JAX, IREE, JAX, IREE...) so
that load from other processes hits both alike, and reports the median time
per inner step. Both sides keep state on their device between calls and read
back only the losses, as a worker does during a round.

Cases: ``<model>_runtime`` uses the shapes a DiLoCo worker really runs: the
run spec's default ``inner.batch_size`` x ``inner.seq_len`` (16 x 64) and
the engine's chunk of ``CHUNK_STEPS`` (5) inner steps per call, read from
:mod:`pcp_p2p.diloco`; ``medium_runtime_h1`` / ``_h10`` are the same batch
shape with the issue's one step and ten steps per call. ``<model>_h1`` /
``_h10`` are the older fixed shapes
(tiny 8 x 64, medium 4 x 128) with one step or ten steps per call, kept for
comparison with earlier runs.

The ratio is the median over pairs of (IREE call / the JAX call just before
it), so that slowly varying load from other processes cancels. Beside it the
CPU time of each call (the executor child's, and this process's for JAX)
gives a ratio that load on the machine disturbs less.

The last line printed is JSON: the headline is the IREE/JAX ratio for medium
at the runtime shapes (lower is better; the target is 0.6, issue #20), with every
ratio, timing, the flags each artifact was compiled with and the thread
counts beside it.

    .venv/bin/python bench/step.py                 # every case
    .venv/bin/python bench/step.py --cases medium_runtime,medium_h10 --reps 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pcp_p2p.compile.cache import ArtifactCache
from pcp_p2p.compile.model import init_params, param_names, preset
from pcp_p2p.compile.pipeline import compile_lowered, lower_program, write_artifact
from pcp_p2p.compile.programs import ProgramOptions
from pcp_p2p.compile.targets import compile_flags, get_target
from pcp_p2p.core.identity import Identity, default_data_dir
from pcp_p2p.diloco.protocol.spec import InnerOptimizer
from pcp_p2p.diloco.run.engine import CHUNK_STEPS
from pcp_p2p.executor.cpu import best_cpu_target
from pcp_p2p.executor.executor import Executor

LR = 3e-4
_RT = InnerOptimizer()  # the run spec's defaults: what a worker runs unless a spec says otherwise
# name -> (model, B, T, H)
CASES: dict[str, tuple[str, int, int, int]] = {
    "tiny_runtime": ("tiny", _RT.batch_size, _RT.seq_len, CHUNK_STEPS),
    "tiny_h1": ("tiny", 8, 64, 1),
    "tiny_h10": ("tiny", 8, 64, 10),
    "medium_runtime": ("medium", _RT.batch_size, _RT.seq_len, CHUNK_STEPS),
    "medium_runtime_h1": ("medium", _RT.batch_size, _RT.seq_len, 1),
    "medium_runtime_h10": ("medium", _RT.batch_size, _RT.seq_len, 10),
    "medium_h1": ("medium", 4, 128, 1),
    "medium_h10": ("medium", 4, 128, 10),
}
HEADLINE = "medium_runtime"
_TCK = os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TCK


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def bench_one(model: str, B: int, T: int, H: int, target_name: str, reps: int, workdir: Path,
              cache: ArtifactCache, log) -> dict:
    import jax

    cfg = preset(model)
    opts = ProgramOptions(inner_steps=H, batch=B, seq=T)
    t0 = time.perf_counter()
    lowered = lower_program("train", cfg, opts)
    target = get_target(target_name)
    art = compile_lowered(lowered, target, Identity.generate(), model, cache)
    vmfb, _ = write_artifact(workdir / f"{model}-B{B}-T{T}-H{H}", art)
    extra = list(art.manifest.flags[len(compile_flags(target)):])  # e.g. data tiling
    label = f"{model} B={B} T={T} H={H}"
    log(f"{label}: lowered + compiled for {target_name} in {time.perf_counter() - t0:.1f} s "
        f"({'cached' if art.cached else 'fresh'}, {art.manifest.artifact_size:,} B, "
        f"extra flags: {' '.join(extra) or 'none'})")

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
    log(f"{label}: jax.jit compile + first call {time.perf_counter() - t0:.1f} s")

    me = os.getpid()
    with Executor.start(vmfb, art.manifest) as ex:
        ex.load_state(params)
        ex.train(LR, xs, ys)  # warm-up
        jax_t, iree_t, jax_c, iree_c = [], [], [], []
        for _ in range(reps):
            c0, t0 = _proc_cpu_s(me), time.perf_counter()
            jax_call()
            jax_t.append(time.perf_counter() - t0)
            jax_c.append(_proc_cpu_s(me) - c0)
            c0, t0 = _proc_cpu_s(ex.pid), time.perf_counter()
            ex.train(LR, xs, ys)
            iree_t.append(time.perf_counter() - t0)
            iree_c.append(_proc_cpu_s(ex.pid) - c0)
        threads = {"iree_child": _threads(ex.pid), "jax_process": _threads(me)}
    jax_ms = statistics.median(jax_t) / H * 1e3
    iree_ms = statistics.median(iree_t) / H * 1e3
    # each IREE call is compared with the JAX call just before it (same load on
    # a shared machine); the median of those ratios resists load that drifts
    ratio = statistics.median(i / j for i, j in zip(iree_t, jax_t))
    cpu_ratio = statistics.median(i / j for i, j in zip(iree_c, jax_c) if j > 0)
    log(f"{label}: per step  jax {jax_ms:8.2f} ms   iree {iree_ms:8.2f} ms   "
        f"ratio {ratio:.3f}  cpu-time ratio {cpu_ratio:.3f}  (median of {reps} interleaved pairs)")
    return {
        "shape": {"B": B, "T": T, "H": H}, "jax_ms": round(jax_ms, 3), "iree_ms": round(iree_ms, 3),
        "ratio": round(ratio, 3), "cpu_ratio": round(cpu_ratio, 3),
        "ratio_spread": [round(min(i / j for i, j in zip(iree_t, jax_t)), 3),
                         round(max(i / j for i, j in zip(iree_t, jax_t)), 3)],
        "extra_flags": extra, "threads": threads,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated: {', '.join(CASES)}")
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
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        ap.error(f"unknown case {unknown[0]!r}; known: {', '.join(CASES)}")
    results: dict[str, dict] = {}
    for name in names:
        results[name] = bench_one(*CASES[name], target, args.reps, workdir, cache, log)
    headline_case = HEADLINE if HEADLINE in results else names[-1]
    print(json.dumps({
        "metric": f"iree_over_jax_step_time_{headline_case}",
        "headline": results[headline_case]["ratio"],
        "unit": "ratio",
        "better": "lower",
        "target": 0.6,  # issue #20 item 5
        "headline_case": headline_case,
        "cpu_target": target,
        "picked": picked.name,
        "ratios": {k: v["ratio"] for k, v in results.items()},
        "cpu_time_ratios": {k: v["cpu_ratio"] for k, v in results.items()},
        "ratio_spread": {k: v["ratio_spread"] for k, v in results.items()},
        "ms_per_step": {k: {"jax": v["jax_ms"], "iree": v["iree_ms"]} for k, v in results.items()},
        "shapes": {k: v["shape"] for k, v in results.items()},
        "extra_flags": {k: v["extra_flags"] for k, v in results.items()},
        "threads": {k: v["threads"] for k, v in results.items()},
        "reps": args.reps,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())

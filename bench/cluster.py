"""A 2-rank MPI worker group against one process doing the same total work: round time and tokens/s.

Compiles the tiny model's train program once (the run spec's chunk shapes,
B x T = 4 x 32), then starts ``mpiexec -n K python -m pcp_p2p.testing.mpi_group``
(the mpich wheel's mpiexec from this environment) in ``bench`` mode. Rank 0
runs ``--rounds`` group rounds of ``--steps`` inner steps each (split over the
ranks by measured throughput, then one token-weighted allreduce of Δ), and
then, in the same process and the same run, the SAME sub-shards one after the
other on its own executor (the baseline: one process doing the same total
work). Rounds are bounded by steps, not time, so both sides do identical work.

Per-step gradient allreduce inside the group is not offered: the compiled
``train`` program fuses five AdamW steps (gradient and update) in one IREE
call, so there is no point between a gradient and its update to reduce at;
it would need a separate gradient program and an optimiser step outside it.

The last line printed is JSON: headline = group tokens/s / single-process
tokens/s (median over rounds), higher is better; the target is > 1 (the group
must beat one process doing the same work; the ideal is K on K free cores).

    .venv/bin/python bench/cluster.py --ranks 2 --steps 200 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200, help="inner steps per group round (all ranks together)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from pcp_p2p.core.launch import without_launch
    from pcp_p2p.testing.mpi_group import prepare

    out = Path(tempfile.mkdtemp(prefix="pcp-bench-cluster-"))
    t0 = time.monotonic()
    cfg_path = prepare(out, steps=args.steps, mode="bench", rounds=args.rounds)
    compile_s = time.monotonic() - t0
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = {**without_launch(os.environ), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([str(mpiexec), "-disable-auto-cleanup", "-n", str(args.ranks), sys.executable, "-m",
                           "pcp_p2p.testing.mpi_group", str(cfg_path)], env=env, capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        return 1
    res = json.loads(Path(json.loads(cfg_path.read_text())["result"]).read_text())
    g_rate = [t / s for t, s in zip(res["group_tokens"], res["group_round_s"])]
    s_rate = [t / s for t, s in zip(res["single_tokens"], res["single_round_s"])]
    speedup = statistics.median(g_rate) / statistics.median(s_rate)
    for i, (gs, ss) in enumerate(zip(res["group_round_s"], res["single_round_s"])):
        print(f"round {i + 1}: group {gs:.2f} s ({g_rate[i]:.0f} tok/s), "
              f"one process {ss:.2f} s ({s_rate[i]:.0f} tok/s)")
    print(json.dumps({
        "headline": round(speedup, 3),
        "unit": "x (group tokens/s over one process's, same total work)",
        "better": "higher",
        "target": 1.0,
        "ranks": args.ranks,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "group_round_s": [round(x, 3) for x in res["group_round_s"]],
        "single_round_s": [round(x, 3) for x in res["single_round_s"]],
        "group_tokens_per_s": round(statistics.median(g_rate), 1),
        "single_tokens_per_s": round(statistics.median(s_rate), 1),
        "tokens_per_round": res["group_tokens"][0],
        "allreduce_s": res["allreduce_s"],
        "rank_gflops": [r["gflops"] for r in res["group"]["ranks"]],
        "cpus": os.cpu_count(),
        "compile_s": round(compile_s, 1),
        "per_step_allreduce": "not offered: the train program fuses gradient and AdamW update (5 steps per call)",
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
